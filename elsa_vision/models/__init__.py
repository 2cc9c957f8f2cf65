"""Models on ELSA attention; importing this registers the ``elsa_*`` names with timm."""

from ._builder import LoadReport, load_checkpoint, read_state_dict
from .clip_vision import ElsaCLIPVision, create_elsa_clip_vision, from_open_clip
from .hsi_vit import ElsaHSIViT
from .swinv2 import ElsaSwinV2
from .vggt import ElsaVGGT
from .vit import ElsaViT, elsa_checkpoint_filter_fn

__all__ = [
    "ElsaViT",
    "ElsaCLIPVision",
    "ElsaHSIViT",
    "ElsaVGGT",
    "ElsaSwinV2",
    "create_elsa_clip_vision",
    "from_open_clip",
    "LoadReport",
    "elsa_checkpoint_filter_fn",
    "load_checkpoint",
    "read_state_dict",
]
