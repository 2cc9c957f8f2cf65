"""Models on ELSA attention; importing this registers the ``elsa_*`` names with timm."""

from .vggt import ElsaVGGT
from .vit import ElsaViT

__all__ = ["ElsaViT", "ElsaVGGT"]
