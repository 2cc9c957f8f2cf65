"""Models on ELSA attention; importing this registers the ``elsa_*`` names with timm."""

from .clip_vision import ElsaCLIPVision, create_elsa_clip_vision, from_open_clip
from .vit import ElsaViT

__all__ = ["ElsaViT", "ElsaCLIPVision", "create_elsa_clip_vision", "from_open_clip"]
