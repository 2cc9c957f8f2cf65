"""Drop-in ELSA layers for existing models: ``patch_model``, ``patch_attention`` and ``sdpa_override``.

``patch_attention(model)`` walks a model and swaps every attention module it knows for its ELSA layer
(:mod:`elsa_vision.layers`), in place and keeping every parameter and buffer:

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

from collections import Counter
from dataclasses import dataclass, field

from timm.layers import Attention, AttentionPoolLatent
from torch import nn

from .layers import (
    ElsaAttention,
    ElsaAttentionModule,
    ElsaAttentionPoolLatent,
    ElsaModule,
    ElsaMultiheadAttention,
    ElsaSwinV2WindowAttention,
    ElsaSwinWindowAttention,
    check_layer_options,
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
}


def kinds_of(layers: type = ElsaModule) -> tuple[str, ...]:
    """The kinds of ``SWAPS`` whose layer is a subclass of ``layers`` (every kind by default), in table
    order."""
    return tuple(dict.fromkeys(kind for kind, layer in SWAPS.values() if issubclass(layer, layers)))


KINDS = kinds_of()  # every kind of the table
ATTENTION_KINDS = kinds_of(ElsaAttentionModule)  # patch_attention's: ("vit", "swin", "mha", "sdpa_routed")


@dataclass
class PatchReport:
    """What a patch walk did: modules swapped per source type, and known modules it had to skip."""

    counts: Counter = field(default_factory=Counter)
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> reason

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __str__(self) -> str:
        parts = [f"{n} x {t}" for t, n in sorted(self.counts.items())]
        s = f"patched {self.total} modules" + (f" ({', '.join(parts)})" if parts else "")
        if self.skipped:
            s += "; skipped " + ", ".join(f"{k} ({v})" for k, v in self.skipped.items())
        return s


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
    """The one walk: every module whose exact class is in ``SWAPS`` with a kind of ``kinds`` is replaced by
    what its layer's ``from_module`` returns."""
    bad = [k for k in kinds if k not in known]
    if bad or not kinds:
        raise ValueError(f"{who}: unknown kinds {bad or kinds!r}; expected a subset of {known}")
    layers = tuple(dict.fromkeys(layer for kind, layer in SWAPS.values() if kind in kinds))
    accepted = tuple(b for b in layers[0].backends if all(b in layer.backends for layer in layers))
    check_layer_options(who, backend, precision, accepted)
    report = PatchReport()
    # Materialise the list first: replacing children while iterating named_modules would skip some.
    for name, module in list(model.named_modules()):
        source = type(module)
        kind, layer = SWAPS.get(source, (None, None))
        if kind not in kinds:
            continue
        reason = layer.unsupported(module)
        if reason is not None:
            report.skipped[name] = f"{source.__name__} with {reason}"
            continue
        new = layer.from_module(module, backend=backend, precision=precision)
        if new is not module:
            if not name:
                raise ValueError(f"{who}: the model itself is a {source.__name__}, which {layer.__name__} "
                                 f"replaces; wrap it or use {layer.__name__}.from_module(model)")
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, new)
        report.counts[source.__name__] += 1
    if report.total == 0:
        raise ValueError(
            f"{who}: no module of kinds {kinds} found in {type(model).__name__}"
            + (f"; skipped: {report.skipped}" if report.skipped else "")
        )
    for layer in layers:
        layer.after_patching(model)
    return report


def patch_vit_attention(model: nn.Module, *, backend: str = "auto", precision: str = "auto") -> PatchReport:
    """``patch_attention`` limited to timm ``Attention`` and the MAP head (ViT, DeiT, CLIP, DINOv2 ...)."""
    return patch_attention(model, backend=backend, precision=precision, kinds=("vit",))


def patch_swin_attention(model: nn.Module, *, backend: str = "auto", precision: str = "auto") -> PatchReport:
    """``patch_attention`` limited to timm Swin v1 / v2 ``WindowAttention``."""
    return patch_attention(model, backend=backend, precision=precision, kinds=("swin",))
