"""Models on ELSA attention; importing this registers the ``elsa_*`` names with timm."""

from .hsi_vit import ElsaHSIViT
from .vit import ElsaViT

__all__ = ["ElsaViT", "ElsaHSIViT"]
