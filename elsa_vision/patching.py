"""Drop-in ELSA layers for existing models: ``patch_model``, ``patch_attention`` and ``sdpa_override``.

``patch_model(model)`` walks a model and swaps every module it knows for its ELSA layer
(:mod:`elsa_vision.layers`), in place and keeping every parameter, buffer and state-dict key: its attention
and its linear layers, so that a float32 model on the GPU runs FP32-accurate on tensor cores throughout.
``patch_attention(model)`` swaps the attention modules alone:

===============================================  ==========================================================
module                                           how
===============================================  ==========================================================
``timm.layers.Attention`` (ViT, DeiT, CLIP ...)  replaced by :class:`~elsa_vision.layers.ElsaAttention`
``timm.layers.AttentionPoolLatent`` (MAP head)   becomes :class:`~elsa_vision.layers.ElsaAttentionPoolLatent`
timm Swin v1 ``WindowAttention``                 becomes :class:`ElsaSwinWindowAttention`: the W-ELSA window
                                                 op, relative position bias and shift mask read by stride
timm Swin v2 ``WindowAttention``                 becomes :class:`ElsaSwinV2WindowAttention`: the W-ELSA
                                                 window op (cosine attention, ``16 sigmoid(cpb)`` bias, shift
                                                 mask)
``torch.nn.MultiheadAttention`` (open_clip,      becomes :class:`ElsaMultiheadAttention` (``batch_first`` or
torch ``TransformerEncoderLayer``)               not, ``key_padding_mask``, ``attn_mask``; no
                                                 ``add_bias_kv`` / ``add_zero_attn``); torch's fused
                                                 encoder fast path is switched off for patched layers
timm ``EvaAttention``, ``AttentionRope``          become :class:`~elsa_vision.layers.sdpa.ElsaEvaAttention` /
                                                 ``ElsaAttentionRope``: kept as they are (RoPE, q/k/v bias
                                                 layout, ``num_kv_heads``), their fused SDPA call routed to
                                                 ELSA (:func:`sdpa_override`)
``nn.Linear`` (and timm's ``Linear``, the        become :class:`~elsa_vision.layers.ElsaLinear` (kind
``out_proj`` of ``nn.MultiheadAttention``)       ``"linear"``): ``elsa_linear``, FP32-accurate split GEMMs
                                                 for float32 on CUDA, ``F.linear`` otherwise
patch-embedding ``nn.Conv2d`` (kernel = stride,  becomes :class:`~elsa_vision.layers.ElsaPatchConv2d` (kind
no padding); other convolutions are left alone   ``"linear"``): one ``elsa_linear`` over the patches
===============================================  ==========================================================

"Becomes" means the module object stays (same parameters, same hooks, same name) and only its class changes
to a subclass whose ``forward`` calls ELSA (:meth:`elsa_vision.layers.ElsaModule.convert`, which also sets
the swapped layer's options). ``sdpa_override()`` is
the catch-all for code that calls ``torch.nn.functional.scaled_dot_product_attention`` (HuggingFace
transformers, timm fused paths).

The walk knows nothing of attention: it reads the table ``SWAPS`` (source class -> kind, ELSA layer) and asks
the layer for the module to put in place (:meth:`~elsa_vision.layers.ElsaModule.from_module`) and for what
to adjust in the model afterwards (:meth:`~elsa_vision.layers.ElsaModule.after_patching`). A new kind of ELSA
layer is one entry of the table; ``patch_model(model, kinds=...)`` swaps any kinds, ``patch_attention`` the
attention kinds.
"""

from __future__ import annotations

from timm.layers import Attention, AttentionPoolLatent
from torch import nn

from .layers import (
    LINEAR_SWAPS,
    ElsaAttention,
    ElsaAttentionModule,
    ElsaAttentionPoolLatent,
    ElsaModule,
    ElsaMultiheadAttention,
    ElsaSwinV2WindowAttention,
    ElsaSwinWindowAttention,
    PatchReport,
    swap_layers,
)
from .layers.sdpa import ElsaAttentionRope, ElsaEvaAttention, sdpa_override

__all__ = [
    "PatchReport",
    "patch_attention",
    "patch_model",
    "patch_vit_attention",
    "patch_swin_attention",
    "sdpa_override",
    "ElsaSwinWindowAttention",
    "ElsaSwinV2WindowAttention",
    "ElsaMultiheadAttention",
]

# The walk's table: source class (matched exactly, so subclasses with their own forward are left alone) ->
# (kind, ELSA layer). The layer says what takes the module's place (``from_module``): ElsaAttention a
# weight-preserving copy (it is not a subclass of timm's Attention), every other layer the module itself,
# converted in place.
SWAPS: dict[type, tuple[str, type]] = {
    Attention: ("vit", ElsaAttention),
    AttentionPoolLatent: ("vit", ElsaAttentionPoolLatent),
    ElsaSwinWindowAttention._converts: ("swin", ElsaSwinWindowAttention),
    ElsaSwinV2WindowAttention._converts: ("swin", ElsaSwinV2WindowAttention),
    nn.MultiheadAttention: ("mha", ElsaMultiheadAttention),
    ElsaEvaAttention._converts: ("sdpa_routed", ElsaEvaAttention),
    ElsaAttentionRope._converts: ("sdpa_routed", ElsaAttentionRope),
    **{source: ("linear", layer) for source, layer in LINEAR_SWAPS.items()},
}


def kinds_of(layers: type = ElsaModule) -> tuple[str, ...]:
    """The kinds of ``SWAPS`` whose layer is a subclass of ``layers`` (every kind by default), in table
    order."""
    return tuple(dict.fromkeys(kind for kind, layer in SWAPS.values() if issubclass(layer, layers)))


KINDS = kinds_of()  # every kind of the table
ATTENTION_KINDS = kinds_of(ElsaAttentionModule)  # patch_attention's: ("vit", "swin", "mha", "sdpa_routed")


def patch_model(
    model: nn.Module,
    *,
    backend: str = "auto",
    precision: str = "auto",
    kinds: tuple[str, ...] | None = None,
) -> PatchReport:
    """Make every module of ``model`` that ``SWAPS`` knows (of ``kinds``; None: every kind) compute with
    ELSA, in place, weights kept.

    Args:
        model: any ``nn.Module``. It is modified in place; parameters, buffers, hooks and train/eval mode are
            kept.
        backend, precision: the options of every swapped layer; ELSA layers the model already had keep
            theirs. ``backend`` must be one that every layer of ``kinds`` accepts.
        kinds: a subset of the table's kinds (:data:`KINDS`).

    Returns:
        :class:`PatchReport` with counts per source module type and ``.total``.

    Raises:
        ValueError: nothing was patched (the report says what was skipped), unknown kinds, or bad options.
    """
    return _walk(model, backend, precision, kinds_of() if kinds is None else kinds, kinds_of(), "patch_model")


def patch_attention(
    model: nn.Module,
    *,
    backend: str = "auto",
    precision: str = "auto",
    kinds: tuple[str, ...] = ATTENTION_KINDS,
) -> PatchReport:
    """Make every known attention module of ``model`` compute with ELSA, in place, weights kept.

    Args:
        model: any ``nn.Module`` (timm ViT/DeiT/CLIP/DINOv2/EVA/Swin v1/Swin v2, open_clip, torch
            ``TransformerEncoder`` ...). It is modified in place; parameters, buffers, hooks and
            train/eval mode are kept.
        backend, precision: the options of every swapped layer (as :func:`elsa_vision.layers.set_attention`);
            ELSA layers the model already had keep theirs.
        kinds: subset of ``("vit", "swin", "mha", "sdpa_routed")``: timm ``Attention`` + MAP head, Swin
            window attention, ``nn.MultiheadAttention``, SDPA-routed timm modules (EVA, RoPE).

    Returns:
        :class:`PatchReport` with counts per source module type and ``.total``.

    Raises:
        ValueError: nothing was patched (the report says what was skipped), or bad options.
    """
    return _walk(model, backend, precision, kinds, kinds_of(ElsaAttentionModule), "patch_attention")


def _walk(model: nn.Module, backend: str, precision: str, kinds: tuple[str, ...], known: tuple[str, ...],
          who: str) -> PatchReport:
    """``swap_layers`` over the ``SWAPS`` entries of ``kinds``; refuses unknown kinds and a model in which
    nothing was swapped."""
    bad = [k for k in kinds if k not in known]
    if bad or not kinds:
        raise ValueError(f"{who}: unknown kinds {bad or kinds!r}; expected a subset of {known}")
    table = {source: layer for source, (kind, layer) in SWAPS.items() if kind in kinds}
    report = swap_layers(model, table, backend=backend, precision=precision, who=who)
    if report.total == 0:
        raise ValueError(
            f"{who}: no module of kinds {kinds} found in {type(model).__name__}"
            + (f"; skipped: {report.skipped}" if report.skipped else "")
        )
    return report


def patch_vit_attention(model: nn.Module, *, backend: str = "auto", precision: str = "auto") -> PatchReport:
    """``patch_attention`` limited to timm ``Attention`` and the MAP head (ViT, DeiT, CLIP, DINOv2 ...)."""
    return patch_attention(model, backend=backend, precision=precision, kinds=("vit",))


def patch_swin_attention(model: nn.Module, *, backend: str = "auto", precision: str = "auto") -> PatchReport:
    """``patch_attention`` limited to timm Swin v1 / v2 ``WindowAttention``."""
    return patch_attention(model, backend=backend, precision=precision, kinds=("swin",))
