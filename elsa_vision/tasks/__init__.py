"""Tasks: training modules and evaluation pipelines."""

from .classification import ClassificationModule, cosine_warmup_schedule, create_backbone

__all__ = ["ClassificationModule", "create_backbone", "cosine_warmup_schedule"]
