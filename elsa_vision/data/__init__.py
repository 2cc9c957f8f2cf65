"""LightningDataModules and readers per domain."""

from .hyperspectral import HSIDataModule

__all__ = ["HSIDataModule"]
