"""Layers built on ELSA attention, with timm's parameter names."""

from .attention import ElsaAttention, mask_to_bias
from .attention_pool import ElsaAttentionPoolLatent

__all__ = ["ElsaAttention", "ElsaAttentionPoolLatent", "mask_to_bias"]
