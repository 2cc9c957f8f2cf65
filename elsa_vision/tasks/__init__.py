"""LightningModules per task."""

from .hsi import HSIClassificationModule, MaskedAutoencoderModule

__all__ = ["HSIClassificationModule", "MaskedAutoencoderModule"]
