"""Tasks: training modules and evaluation pipelines."""

from .classification import ClassificationModule, create_backbone, cosine_warmup_schedule

__all__ = ["ClassificationModule", "create_backbone", "cosine_warmup_schedule"]
