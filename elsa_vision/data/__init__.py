"""LightningDataModules per domain, the readers of every imaging format (:mod:`.readers`), metadata."""

from .digits import DigitsDataModule, load_digits_splits
from .hyperspectral import HSIDataModule
from .imagefolder import ImageFolderDataModule, RobustImageFolder, scan_class_folders
from .imagenet import ImageNetDataModule
from .readers import load_rgb
from .samplers import EpochShuffleSampler

__all__ = [
    "DigitsDataModule",
    "EpochShuffleSampler",
    "HSIDataModule",
    "ImageFolderDataModule",
    "ImageNetDataModule",
    "RobustImageFolder",
    "load_digits_splits",
    "load_rgb",
    "scan_class_folders",
]
