"""Drop-in ELSA attention for existing models: ``patch_attention`` and ``sdpa_override``.

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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from timm.layers import Attention, AttentionPoolLatent
from torch import nn

from .layers import (
    ElsaAttention,
    ElsaAttentionPoolLatent,
    ElsaMultiheadAttention,
    ElsaSwinV2WindowAttention,
    ElsaSwinWindowAttention,
    check_attention_options,
)
from .layers.sdpa import ElsaAttentionRope, ElsaEvaAttention, sdpa_override

__all__ = [
    "PatchReport",
    "patch_attention",
    "patch_vit_attention",
    "patch_swin_attention",
    "sdpa_override",
    "ElsaSwinWindowAttention",
    "ElsaSwinV2WindowAttention",
    "ElsaMultiheadAttention",
]

KINDS = ("vit", "swin", "mha", "sdpa_routed")

# The walk's table: source class (matched exactly, so subclasses with their own forward are left alone) ->
# (kind, ELSA layer). ElsaAttention is not a subclass of timm's Attention: it replaces the module with a
# weight-preserving copy (ElsaAttention.from_timm); every other layer converts the module in place.
SWAPS: dict[type, tuple[str, type]] = {
    Attention: ("vit", ElsaAttention),
    AttentionPoolLatent: ("vit", ElsaAttentionPoolLatent),
    ElsaSwinWindowAttention._converts: ("swin", ElsaSwinWindowAttention),
    ElsaSwinV2WindowAttention._converts: ("swin", ElsaSwinV2WindowAttention),
    nn.MultiheadAttention: ("mha", ElsaMultiheadAttention),
    ElsaEvaAttention._converts: ("sdpa_routed", ElsaEvaAttention),
    ElsaAttentionRope._converts: ("sdpa_routed", ElsaAttentionRope),
}


@dataclass
class PatchReport:
    """What ``patch_attention`` did: modules converted per source type, and known modules it had to skip."""

    counts: Counter = field(default_factory=Counter)
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> reason

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __str__(self) -> str:
        parts = [f"{n} x {t}" for t, n in sorted(self.counts.items())]
        s = f"patched {self.total} attention modules" + (f" ({', '.join(parts)})" if parts else "")
        if self.skipped:
            s += "; skipped " + ", ".join(f"{k} ({v})" for k, v in self.skipped.items())
        return s


def patch_attention(
    model: nn.Module,
    *,
    backend: str = "auto",
    precision: str = "auto",
    kinds: tuple[str, ...] = KINDS,
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
    check_attention_options("patch_attention", backend, precision, prefix="")
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"patch_attention: unknown kinds {bad or kinds!r}; expected a subset of {KINDS}")
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
        if layer is ElsaAttention:
            if not name:
                raise ValueError("patch_attention: the model itself is an Attention; wrap it or use "
                                 "ElsaAttention.from_timm(model)")
            parent_name, _, attr = name.rpartition(".")
            module = ElsaAttention.from_timm(module, backend=backend, precision=precision)
            setattr(model.get_submodule(parent_name), attr, module)
        else:  # the options of the swapped layers; ELSA layers the model already had keep theirs
            layer.convert(module, backend=backend, precision=precision)
        report.counts[source.__name__] += 1
    if report.total == 0:
        raise ValueError(
            f"patch_attention: no attention module of kinds {kinds} found in {type(model).__name__}"
            + (f"; skipped: {report.skipped}" if report.skipped else "")
        )
    # torch's TransformerEncoder(Layer) has an eval-mode fused kernel that reads the MHA weights directly
    # instead of calling self_attn; both flags below only select that kernel, so clearing them keeps ELSA on.
    for module in model.modules():
        is_layer = isinstance(module, nn.TransformerEncoderLayer)
        if is_layer and isinstance(module.self_attn, ElsaMultiheadAttention):
            module.activation_relu_or_gelu = 0
        elif isinstance(module, nn.TransformerEncoder) and any(
            isinstance(m, ElsaMultiheadAttention) for m in module.modules()
        ):
            module.use_nested_tensor = False
    return report


def patch_vit_attention(model: nn.Module, *, backend: str = "auto", precision: str = "auto") -> PatchReport:
    """``patch_attention`` limited to timm ``Attention`` and the MAP head (ViT, DeiT, CLIP, DINOv2 ...)."""
    return patch_attention(model, backend=backend, precision=precision, kinds=("vit",))


def patch_swin_attention(model: nn.Module, *, backend: str = "auto", precision: str = "auto") -> PatchReport:
    """``patch_attention`` limited to timm Swin v1 / v2 ``WindowAttention``."""
    return patch_attention(model, backend=backend, precision=precision, kinds=("swin",))
