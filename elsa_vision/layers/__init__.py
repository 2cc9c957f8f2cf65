"""Layers built on ELSA attention, with timm's parameter names."""

from .attention import ElsaAttention, mask_to_bias
from .attention_pool import ElsaAttentionPoolLatent
from .multihead_attention import ElsaMultiheadAttention

__all__ = ["ElsaAttention", "ElsaAttentionPoolLatent", "ElsaMultiheadAttention", "mask_to_bias"]
