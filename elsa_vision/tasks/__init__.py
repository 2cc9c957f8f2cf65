"""LightningModules for the tasks the models are trained on."""

from .classification import ClassificationModule, create_backbone, cosine_warmup_schedule

__all__ = ["ClassificationModule", "create_backbone", "cosine_warmup_schedule"]
