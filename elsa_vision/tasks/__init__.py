"""Tasks: LightningModules per task and evaluation pipelines."""

from .classification import ClassificationModule, cosine_warmup_schedule, create_backbone
from .hsi import HSIClassificationModule, MaskedAutoencoderModule

__all__ = [
    "ClassificationModule",
    "HSIClassificationModule",
    "MaskedAutoencoderModule",
    "cosine_warmup_schedule",
    "create_backbone",
]
