"""Tasks: one LightningModule per task, and the drivers that run them from a Hydra config,
:func:`elsa_vision.tasks.train.train` and :func:`elsa_vision.tasks.evaluate.evaluate` (``train.py`` and
``evaluate.py`` are thin ``@hydra.main`` wrappers around them)."""

from .classification import (
    ClassificationModule,
    cosine_warmup_schedule,
    create_backbone,
    loss_mean,
    model_data_config,
    step_accuracy,
)
from .hsi import HSIClassificationModule, MaskedAutoencoderModule

__all__ = [
    "ClassificationModule",
    "HSIClassificationModule",
    "MaskedAutoencoderModule",
    "cosine_warmup_schedule",
    "create_backbone",
    "loss_mean",
    "model_data_config",
    "step_accuracy",
]
