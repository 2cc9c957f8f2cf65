"""``scaled_dot_product_attention`` computed by ELSA, and the timm modules that reach ELSA through it.

:func:`sdpa_override` routes ``torch.nn.functional.scaled_dot_product_attention`` to
:func:`elsa_vision.elsa_attention` inside a ``with`` block (SDPA's semantics, except that rows with no visible
key give 0 instead of NaN). :class:`ElsaEvaAttention` and :class:`ElsaAttentionRope` are timm's
``EvaAttention`` and ``AttentionRope`` (RoPE, q/k/v bias layouts, ``num_kv_heads`` kept verbatim) whose fused
SDPA call runs inside that override; they are converted in place from timm's modules
(:meth:`~elsa_vision.layers.ElsaModule.convert`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import AttentionRope
from timm.models import register_notrace_module
from timm.models.eva import EvaAttention
from torch import Tensor

from ..ops.attention import check_options, elsa_attention
from .attention import mask_to_bias
from .elsa_module import ElsaAttentionModule

__all__ = ["ElsaAttentionRope", "ElsaEvaAttention", "elsa_sdpa", "sdpa_override"]


@functools.cache
def elsa_sdpa(backend: str = "auto", precision: str = "auto"):
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` that calls ``elsa_attention`` with
    ``backend`` and ``precision`` (checked here; one function per pair, built once: routed modules enter
    :func:`sdpa_override` at every forward)."""
    check_options("elsa_sdpa", backend, precision)

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
    F.scaled_dot_product_attention = elsa_sdpa(backend, precision)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous


class _SdpaRouted(ElsaAttentionModule):
    """A timm module kept as it is, its fused SDPA call run inside :func:`sdpa_override`."""

    def __init__(self, *args: Any, backend: str = "auto", precision: str = "auto", **kwargs: Any) -> None:
        """Built directly: timm's constructor arguments, then the ELSA options (as :meth:`convert` sets)."""
        self.check_options(backend, precision)
        super().__init__(*args, **kwargs)
        self.backend, self.precision = backend, precision
        self._converted()

    def _converted(self) -> None:
        self.fused_attn = True  # the SDPA call is what runs on ELSA

    def forward(self, *args, **kwargs):
        # sdpa_override's switch without its per-call option check and context manager (about 1.2 us a
        # call on the host): the options were checked when set, and elsa_sdpa checks a new pair once.
        previous = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = elsa_sdpa(self.backend, self.precision)
        try:
            return self._converts.forward(self, *args, **kwargs)
        finally:
            F.scaled_dot_product_attention = previous


@register_notrace_module  # FX leaves, as ElsaAttention
class ElsaEvaAttention(_SdpaRouted, EvaAttention):
    """timm ``EvaAttention`` whose fused SDPA call runs ``elsa_attention``."""

    _converts = EvaAttention


@register_notrace_module
class ElsaAttentionRope(_SdpaRouted, AttentionRope):
    """timm ``AttentionRope`` whose fused SDPA call runs ``elsa_attention``."""

    _converts = AttentionRope
