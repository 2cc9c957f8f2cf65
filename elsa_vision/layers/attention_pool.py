"""``ElsaAttentionPoolLatent``: timm's MAP head (latent-query attention pooling) computed by ELSA.

A subclass of ``timm.layers.AttentionPoolLatent``: same parameters (``latent``, ``q``, ``kv``, ``q_norm``,
``k_norm``, ``proj``, ``norm``, ``mlp``), so timm checkpoints load unchanged; only the attention call differs.
"""

from __future__ import annotations

from timm.layers import AttentionPoolLatent
from timm.models import register_notrace_module
from torch import Tensor

from ..ops.attention import elsa_attention
from .attention import mask_to_bias
from .elsa_module import ElsaAttentionModule

__all__ = ["ElsaAttentionPoolLatent"]


@register_notrace_module  # an FX leaf, as ElsaAttention
class ElsaAttentionPoolLatent(ElsaAttentionModule, AttentionPoolLatent):
    """Attention pooling with learned latent queries; ``[B, N, C] -> [B, C_out]`` (or ``[B, L, C_out]``).

    Args are those of ``timm.layers.AttentionPoolLatent``; ``backend`` and ``precision`` go to
    :func:`elsa_vision.elsa_attention`. ``ElsaAttentionPoolLatent.convert(pool)`` turns a timm
    ``AttentionPoolLatent`` into one in place (:meth:`ElsaModule.convert`).
    """

    _converts = AttentionPoolLatent

    def __init__(self, *args, backend: str = "auto", precision: str = "auto", **kwargs) -> None:
        self.check_options(backend, precision)
        super().__init__(*args, **kwargs)
        self.backend = backend
        self.precision = precision

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        B, N, C = x.shape
        if self.pos_embed is not None:
            x = x + self.pos_embed.unsqueeze(0).to(x.dtype)
        q_latent = self.latent.expand(B, -1, -1)
        q = self.q(q_latent).reshape(B, self.latent_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = elsa_attention(
            q, k, v, attn_bias=mask_to_bias(attn_mask, q.dtype), scale=self.scale, precision=self.precision,
            backend=self.backend,
        )
        x = x.transpose(1, 2).reshape(B, self.latent_len, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        if self.mlp is not None:
            x = x + self.mlp(self.norm(x))
        if self.pool == "token":
            x = x[:, 0]
        elif self.pool == "avg":
            x = x.mean(1)
        return x

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, backend={self.backend}, precision={self.precision}"
