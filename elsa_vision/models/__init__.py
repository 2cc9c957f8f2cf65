"""Models on ELSA attention; importing this registers the ``elsa_*`` names with timm."""

from ._builder import LoadReport, load_checkpoint, read_state_dict
from .vit import ElsaViT, elsa_checkpoint_filter_fn

__all__ = ["ElsaViT", "LoadReport", "elsa_checkpoint_filter_fn", "load_checkpoint", "read_state_dict"]
