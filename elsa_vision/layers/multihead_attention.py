"""``ElsaMultiheadAttention``: ``torch.nn.MultiheadAttention`` computed by ELSA.

One class serves both ways in: built directly (the CLIP image tower, its attentional pooler) or converted in
place from an existing ``nn.MultiheadAttention`` (``patch_attention``, ``elsa_clip``). It *is* an
``nn.MultiheadAttention`` (same parameters: ``in_proj_weight``/``in_proj_bias``/``out_proj``, or
``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ from ``embed_dim``), so state dicts of torch, open_clip
and OpenAI CLIP load unchanged and ``isinstance(m, nn.MultiheadAttention)`` stays true.
"""

from __future__ import annotations

import torch
from timm.models import register_notrace_module
from torch import Tensor, nn

from ..ops.attention import elsa_attention
from .attention import mask_to_bias
from .elsa_module import ElsaAttentionModule
from .linear import linear_of

__all__ = ["ElsaMultiheadAttention"]


@register_notrace_module  # an FX leaf, as ElsaAttention
class ElsaMultiheadAttention(ElsaAttentionModule, nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` whose attention is ``elsa_attention``.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None, ...)`` with torch's
    conventions: ``[L, B, E]`` (``[B, L, E]`` when ``batch_first``) or unbatched ``[L, E]``;
    ``key_padding_mask [B, S]`` bool (True = ignore) or float; ``attn_mask [L, S]`` or ``[B*H, L, S]`` bool
    (True = not allowed) or float. Attention weights are never formed: ``need_weights=True`` (torch's default)
    raises, so callers pass ``need_weights=False``; the second output is ``None``. Self-attention projects
    q, k, v with one GEMM and hands ELSA strided views. Dropout (training only) runs on the torch backend.

    Args:
        embed_dim, num_heads, dropout, bias, kdim, vdim, batch_first, device, dtype: as
            ``nn.MultiheadAttention`` (``add_bias_kv`` / ``add_zero_attn`` are not supported).
        backend, precision: ``elsa_attention`` settings (attributes of the same names).

    ``ElsaMultiheadAttention.convert(mha)`` turns an ``nn.MultiheadAttention`` into one in place
    (:meth:`ElsaModule.convert`).
    """

    _converts = nn.MultiheadAttention

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        backend: str = "auto",
        precision: str = "auto",
    ) -> None:
        self.check_options(backend, precision)
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim,
                         batch_first=batch_first, device=device, dtype=dtype)
        self.backend = backend
        self.precision = precision

    @classmethod
    def unsupported(cls, module: nn.MultiheadAttention) -> str | None:
        if module.bias_k is not None or module.bias_v is not None:
            return "add_bias_kv"
        if module.add_zero_attn:
            return "add_zero_attn"
        return None  # kdim/vdim != embed_dim use q/k/v_proj_weight, which forward reads

    @classmethod
    def after_patching(cls, model: nn.Module) -> None:
        """Keep ELSA on in torch's encoders: ``TransformerEncoder(Layer)`` has an eval-mode fused kernel that
        reads the MHA weights directly instead of calling ``self_attn``; both flags cleared here only select
        that kernel."""
        for module in model.modules():
            if isinstance(module, nn.TransformerEncoderLayer) and isinstance(module.self_attn, cls):
                module.activation_relu_or_gelu = 0
            elif isinstance(module, nn.TransformerEncoder) and any(
                    isinstance(m, cls) for m in module.modules()):
                module.use_nested_tensor = False

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, None]:
        if need_weights:
            raise ValueError(
                "ElsaMultiheadAttention: need_weights=True asks for the attention matrix, which ELSA never "
                "forms; call with need_weights=False"
            )
        if is_causal and attn_mask is None:
            raise ValueError(
                "ElsaMultiheadAttention: is_causal=True is a hint and needs attn_mask (as torch)")
        self_attn = query is key and key is value and self._qkv_same_embed_dim
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        L, B, E = query.shape
        S = key.shape[0]
        H, hd = self.num_heads, self.head_dim
        if self_attn:
            # One GEMM; q, k, v are strided views [B, H, L, hd] of it (the kernels take any strides).
            qkv = linear_of(self.out_proj, query, self.in_proj_weight, self.in_proj_bias).view(L, B, 3, H, hd)
            q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)
        else:
            if self._qkv_same_embed_dim:
                w_q, w_k, w_v = self.in_proj_weight.chunk(3)
            else:
                w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
            b_q = b_k = b_v = None
            if self.in_proj_bias is not None:
                b_q, b_k, b_v = self.in_proj_bias.chunk(3)
            # [L, B, E] -> [B, H, L, hd]
            # (the input projections follow out_proj: FP32-accurate GEMMs once it is an ElsaLinear)
            q = linear_of(self.out_proj, query, w_q, b_q).view(L, B, H, hd).permute(1, 2, 0, 3)
            k = linear_of(self.out_proj, key, w_k, b_k).view(S, B, H, hd).permute(1, 2, 0, 3)
            v = linear_of(self.out_proj, value, w_v, b_v).view(S, B, H, hd).permute(1, 2, 0, 3)

        bias, keep = None, None
        if attn_mask is not None:
            if attn_mask.dim() == 3:
                if attn_mask.shape != (B * H, L, S):
                    raise ValueError(f"ElsaMultiheadAttention: 3-D attn_mask must be {(B * H, L, S)}, "
                                     f"got {tuple(attn_mask.shape)}")
                attn_mask = attn_mask.view(B, H, L, S)
            elif attn_mask.shape != (L, S):
                raise ValueError(
                    f"ElsaMultiheadAttention: 2-D attn_mask must be {(L, S)}, got {tuple(attn_mask.shape)}")
            # torch's MHA bool mask marks the *forbidden* positions (SDPA's is the opposite).
            if attn_mask.dtype == torch.bool:
                bias = mask_to_bias(~attn_mask, q.dtype)
            else:
                bias = attn_mask.to(q.dtype)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, S):
                raise ValueError(f"ElsaMultiheadAttention: key_padding_mask must be {(B, S)}, "
                                 f"got {tuple(key_padding_mask.shape)}")
            if key_padding_mask.dtype == torch.bool:
                keep = ~key_padding_mask
            else:
                kp = key_padding_mask.to(q.dtype).view(B, 1, 1, S)
                bias = kp if bias is None else bias + kp
        dropout_p = self.dropout if self.training else 0.0
        x = elsa_attention(q, k, v, attn_bias=bias, key_padding_mask=keep, precision=self.precision,
                           backend="torch" if dropout_p > 0 else self.backend, dropout_p=dropout_p)
        x = x.permute(2, 0, 1, 3).reshape(L, B, E)
        x = self.out_proj(x)
        if unbatched:
            x = x.squeeze(1)
        elif self.batch_first:
            x = x.transpose(0, 1)
        return x, None

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, "
                f"vdim={self.vdim}, batch_first={self.batch_first}, backend={self.backend}, "
                f"precision={self.precision}")
