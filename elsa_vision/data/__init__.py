"""LightningDataModules, readers and dataset metadata per domain."""

from .hyperspectral import HSIDataModule

__all__ = ["HSIDataModule"]
