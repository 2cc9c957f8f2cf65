"""Tasks: LightningModules per task and evaluation pipelines."""

from .hsi import HSIClassificationModule, MaskedAutoencoderModule

__all__ = ["HSIClassificationModule", "MaskedAutoencoderModule"]
