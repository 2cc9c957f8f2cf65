"""Layers built on ELSA attention, with timm's parameter names."""

from .attention import ElsaAttention, mask_to_bias

__all__ = ["ElsaAttention", "mask_to_bias"]
