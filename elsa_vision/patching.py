"""Drop-in ELSA attention for existing models: ``patch_attention`` and ``sdpa_override``.

``patch_attention(model)`` walks a model and makes every attention module it knows compute with
:func:`elsa_vision.elsa_attention`, in place and keeping every parameter and buffer:

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
timm ``EvaAttention``, ``AttentionRope``          kept as is (RoPE, q/k/v bias layout, ``num_kv_heads``),
                                                 their fused SDPA call routed to ELSA (:func:`sdpa_override`)
===============================================  ==========================================================

"Becomes" means the module object stays (same parameters, same hooks, same name) and only its class changes
to a subclass whose ``forward`` calls ELSA. ``sdpa_override()`` is the catch-all for code that calls
``torch.nn.functional.scaled_dot_product_attention`` (HuggingFace transformers, timm fused paths).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from timm.models import register_notrace_module
from torch import Tensor, nn

from .layers.attention import ElsaAttention, mask_to_bias, refuse_torchscript
from .layers.attention_pool import ElsaAttentionPoolLatent
from .layers.multihead_attention import ElsaMultiheadAttention
from .layers.window_attention import ElsaSwinV2WindowAttention, ElsaSwinWindowAttention
from .ops.attention import check_options, elsa_attention

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


# ----------------------------------------------------------------------------------------------------------
# sdpa_override
# ----------------------------------------------------------------------------------------------------------


def _elsa_sdpa(backend: str, precision: str):
    def scaled_dot_product_attention(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        """``torch.nn.functional.scaled_dot_product_attention`` computed by ``elsa_attention``.

        ``query [..., L, E]``, ``key [..., S, E]``, ``value [..., S, Ev]`` with equal leading dims (rank 4 is
        ``[B, H, N, D]``; other ranks are reshaped to it). ``attn_mask``: bool (True = attend) or additive
        float, broadcastable to ``[..., L, S]``. ``is_causal``: top-left aligned lower triangle, as SDPA.
        ``enable_gqa``: fewer key/value heads (dim -3) are repeated. Rows with no visible key give 0.
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor) or t.dim() < 2:
                raise ValueError(
                    f"sdpa_override: `{name}` must be a tensor of rank >= 2 [..., N, D], got {t!r:.60}")
        if is_causal and attn_mask is not None:
            raise ValueError("sdpa_override: pass either `attn_mask` or `is_causal=True`, not both (as SDPA)")
        if query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
            hq, hk = query.shape[-3], key.shape[-3]
            if not enable_gqa or hq % hk or value.shape[-3] != hk:
                raise ValueError(
                    f"sdpa_override: query has {hq} heads, key {hk} and value {value.shape[-3]}; differing "
                    f"head counts need enable_gqa=True and num query heads divisible by num key/value heads"
                )
            key = key.repeat_interleave(hq // hk, dim=-3)
            value = value.repeat_interleave(hq // hk, dim=-3)
        lead = query.shape[:-2]
        if key.shape[:-2] != lead or value.shape[:-2] != lead:
            raise ValueError(
                f"sdpa_override: query, key, value must share leading dims, got {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}"
            )
        L, S = query.shape[-2], key.shape[-2]
        bias = mask_to_bias(attn_mask, query.dtype) if attn_mask is not None else None
        if bias is not None:
            bias = bias.to(query.dtype)
        causal = False
        if is_causal:
            if L == S:
                causal = True
            else:  # SDPA's is_causal is top-left aligned; elsa_attention's causal is bottom-right.
                keep = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
                bias = mask_to_bias(keep, query.dtype)
        if query.dim() != 4:
            n = math.prod(lead)
            query, key, value = (t.reshape(n, 1, t.shape[-2], t.shape[-1]) for t in (query, key, value))
            if bias is not None:
                bias = bias.expand(*lead, L, S).reshape(n, 1, L, S)
        out = elsa_attention(
            query, key, value, attn_bias=bias, causal=causal, scale=scale, precision=precision,
            backend="torch" if dropout_p > 0 else backend, dropout_p=float(dropout_p),
        )
        return out.reshape(*lead, L, out.shape[-1])

    return scaled_dot_product_attention


@contextlib.contextmanager
def sdpa_override(*, backend: str = "auto", precision: str = "auto") -> Iterator[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to ``elsa_attention`` inside the block.

    Every caller that looks the function up on ``torch.nn.functional`` at call time (timm's fused paths,
    HuggingFace ``sdpa`` attention, ``nn.MultiheadAttention``) runs ELSA; the original is restored on exit,
    also when an exception is raised. Nested overrides restore the enclosing one. The switch is process-wide
    (other threads calling SDPA meanwhile are routed too). Semantics are SDPA's except that rows with no
    visible key return 0 instead of NaN.

    Example::

        with elsa_vision.sdpa_override(precision="ieee"):
            logits = hf_model(pixel_values=x).logits
    """
    check_options("sdpa_override", backend, precision)
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _elsa_sdpa(backend, precision)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous


class _ElsaConverted:
    """Mixin of the class-swapped SDPA-routed modules: where the ELSA options live and how a module is
    converted."""

    elsa_backend: str = "auto"
    elsa_precision: str = "auto"
    _timm_base: type = nn.Module
    __prepare_scriptable__ = refuse_torchscript

    @classmethod
    def convert(cls, module: nn.Module, *, backend: str = "auto", precision: str = "auto") -> nn.Module:
        """Turn ``module`` (an instance of the timm/torch base class) into ``cls`` in place; weights kept."""
        check_options(cls.__name__, backend, precision)
        base = cls._timm_base
        if not isinstance(module, base):
            raise TypeError(f"{cls.__name__}.convert: expected {base.__name__}, got {type(module).__name__}")
        module.__class__ = cls
        module.elsa_backend = backend
        module.elsa_precision = precision
        return module


# ----------------------------------------------------------------------------------------------------------
# nn.MultiheadAttention
# ----------------------------------------------------------------------------------------------------------


def _mha_compatible(m: nn.MultiheadAttention) -> str | None:
    if m.bias_k is not None or m.bias_v is not None:
        return "add_bias_kv"
    if m.add_zero_attn:
        return "add_zero_attn"
    return None  # kdim/vdim != embed_dim use q/k/v_proj_weight, which ElsaMultiheadAttention reads


# ----------------------------------------------------------------------------------------------------------
# SDPA-routed timm modules (RoPE / GQA / EVA bias layouts kept verbatim)
# ----------------------------------------------------------------------------------------------------------

_ROUTED: dict[type, type] = {}


def _sdpa_routed_class(base: type) -> type:
    if base not in _ROUTED:

        def forward(self, *args, **kwargs):
            with sdpa_override(backend=self.elsa_backend, precision=self.elsa_precision):
                return base.forward(self, *args, **kwargs)

        _ROUTED[base] = register_notrace_module(type(
            f"Elsa{base.__name__}", (_ElsaConverted, base),
            {"forward": forward, "__module__": __name__, "_timm_base": base,
             "__doc__": f"timm ``{base.__name__}`` whose fused SDPA call runs ``elsa_attention``."},
        ))
    return _ROUTED[base]


def _sdpa_routed_bases() -> tuple[type, ...]:
    from timm.layers import AttentionRope
    from timm.models.eva import EvaAttention

    return EvaAttention, AttentionRope


# ----------------------------------------------------------------------------------------------------------
# patch_attention
# ----------------------------------------------------------------------------------------------------------


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
        backend, precision: passed to :func:`elsa_vision.elsa_attention` by every patched module.
        kinds: subset of ``("vit", "swin", "mha", "sdpa_routed")``: timm ``Attention`` + MAP head, Swin
            window attention, ``nn.MultiheadAttention``, SDPA-routed timm modules (EVA, RoPE).

    Returns:
        :class:`PatchReport` with counts per source module type and ``.total``.

    Raises:
        ValueError: nothing was patched (the report says what was skipped), or bad options.
    """
    check_options("patch_attention", backend, precision)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"patch_attention: unknown kinds {bad or kinds!r}; expected a subset of {KINDS}")
    from timm.layers import Attention, AttentionPoolLatent

    routed_bases = _sdpa_routed_bases()
    report = PatchReport()
    opts = dict(backend=backend, precision=precision)
    # Materialise the list first: replacing children while iterating named_modules would skip some.
    for name, module in list(model.named_modules()):
        t = type(module)
        if "vit" in kinds and t is Attention:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if name else None
            if parent is None:
                raise ValueError("patch_attention: the model itself is an Attention; wrap it or use "
                                 "ElsaAttention.from_timm(model)")
            setattr(parent, attr, ElsaAttention.from_timm(module, **opts))
        elif "vit" in kinds and t is AttentionPoolLatent:
            ElsaAttentionPoolLatent.convert(module, **opts)
        elif "swin" in kinds and t is ElsaSwinWindowAttention._timm_base:
            ElsaSwinWindowAttention.convert(module, **opts)
        elif "swin" in kinds and t is ElsaSwinV2WindowAttention._timm_base:
            ElsaSwinV2WindowAttention.convert(module, **opts)
        elif "mha" in kinds and t is nn.MultiheadAttention:
            reason = _mha_compatible(module)
            if reason is not None:
                report.skipped[name] = f"nn.MultiheadAttention with {reason}"
                continue
            ElsaMultiheadAttention.convert(module, **opts)
        elif "sdpa_routed" in kinds and t in routed_bases:
            _sdpa_routed_class(t).convert(module, **opts)
            module.fused_attn = True
        else:
            continue
        report.counts[t.__name__] += 1
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
    if report.total == 0:
        raise ValueError(
            f"patch_attention: no attention module of kinds {kinds} found in {type(model).__name__}"
            + (f"; skipped: {report.skipped}" if report.skipped else "")
        )
    return report


def patch_vit_attention(model: nn.Module, *, backend: str = "auto", precision: str = "auto") -> PatchReport:
    """``patch_attention`` limited to timm ``Attention`` and the MAP head (ViT, DeiT, CLIP, DINOv2 ...)."""
    return patch_attention(model, backend=backend, precision=precision, kinds=("vit",))


def patch_swin_attention(model: nn.Module, *, backend: str = "auto", precision: str = "auto") -> PatchReport:
    """``patch_attention`` limited to timm Swin v1 / v2 ``WindowAttention``."""
    return patch_attention(model, backend=backend, precision=precision, kinds=("swin",))
