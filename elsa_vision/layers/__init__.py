"""Layers built on ELSA attention, with timm's parameter names."""

from .attention import ElsaAttention, mask_to_bias
from .attention_pool import ElsaAttentionPoolLatent
from .multihead_attention import ElsaMultiheadAttention
from .window_attention import ElsaSwinV2WindowAttention, ElsaSwinWindowAttention

__all__ = ["ElsaAttention", "ElsaAttentionPoolLatent", "ElsaMultiheadAttention", "ElsaSwinWindowAttention",
           "ElsaSwinV2WindowAttention", "mask_to_bias"]
