"""``ElsaAttention``: a drop-in for timm's ``Attention`` whose attention is ``elsa_attention``.

Parameter names (``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``gate``, ``proj``) and constructor arguments are
timm's, so a timm ``VisionTransformer`` state_dict loads unchanged. The backend and precision are fixed when
the module is built (timm's convention), not chosen per call.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..ops.attention import BACKENDS, PRECISIONS, elsa_attention

__all__ = ["ElsaAttention", "mask_to_bias"]


def mask_to_bias(attn_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """SDPA's ``attn_mask`` (bool: True = attend, or additive float) as an additive float bias."""
    if attn_mask is None or attn_mask.is_floating_point():
        return attn_mask
    if attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(~attn_mask, -math.inf)


class ElsaAttention(nn.Module):
    """Multi-head self-attention with a fused ``qkv`` projection, computed by ELSA.

    Args are those of ``timm.layers.Attention``; in addition ``backend`` and ``precision`` are passed to
    :func:`elsa_vision.elsa_attention`.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        attn_head_dim: int | None = None,
        dim_out: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        gated: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
        device=None,
        dtype=None,
        *,
        backend: str = "auto",
        precision: str = "auto",
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"ElsaAttention: unknown backend {backend!r}; expected one of {BACKENDS}")
        if precision not in PRECISIONS:
            raise ValueError(f"ElsaAttention: unknown precision {precision!r}; expected one of {PRECISIONS}")
        dd = {"device": device, "dtype": dtype}
        dim_out = dim_out or dim
        head_dim = attn_head_dim
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"ElsaAttention: dim ({dim}) must be divisible by num_heads ({num_heads})")
            head_dim = dim // num_heads
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError("ElsaAttention: norm_layer must be given when qk_norm or scale_norm is True")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attn_dim = num_heads * head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.precision = precision

        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        # q, k, v stay strided views of the fused projection: the kernels read them without copies.
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        dropout_p = self.attn_drop.p if self.training else 0.0
        x = elsa_attention(
            q, k, v, attn_bias=mask_to_bias(attn_mask, q.dtype), causal=bool(is_causal), scale=self.scale,
            precision=self.precision, backend="torch" if dropout_p > 0 else self.backend, dropout_p=dropout_p,
        )
        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        x = self.proj(x)
        return self.proj_drop(x)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, backend={self.backend}, precision={self.precision}"
