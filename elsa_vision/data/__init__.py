"""Datasets, data modules and dataset metadata: the embedded digits default, class folders, ImageNet."""

from .digits import DigitsDataModule, load_digits_splits
from .imagefolder import ImageFolderDataModule, RobustImageFolder, load_rgb, scan_class_folders
from .imagenet import ImageNetDataModule
from .samplers import EpochShuffleSampler

__all__ = [
    "DigitsDataModule",
    "EpochShuffleSampler",
    "ImageFolderDataModule",
    "ImageNetDataModule",
    "RobustImageFolder",
    "load_digits_splits",
    "load_rgb",
    "scan_class_folders",
]
