"""scikit-learn's handwritten digits as a LightningDataModule: the embedded, offline default dataset.

``sklearn.datasets.load_digits`` ships 1797 real 8×8 grey-level scans (values 0..16) of the digits 0-9 inside
the scikit-learn wheel. They are split once, stratified by class and seeded, into train/val/test, bilinearly
upsampled to ``img_size``×``img_size`` single-channel images and standardised with the training split's mean
and standard deviation. Training images get a small random affine jitter (shift, rotation, scale).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from .samplers import epoch_loader

__all__ = ["DigitsDataModule", "DigitsDataset", "load_digits_splits"]


def load_digits_splits(
    val_fraction: float = 0.1, test_fraction: float = 0.2, seed: int = 0, img_size: int = 32
) -> dict[str, tuple[Tensor, Tensor]]:
    """The stratified train/val/test split of scikit-learn's digits.

    Returns:
        ``{"train"|"val"|"test": (images [n, 1, img_size, img_size] float32 in [0, 1], labels [n] int64)}``;
        the split depends only on the fractions and ``seed``.
    """
    if not 0.0 < val_fraction < 1.0 or not 0.0 < test_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
        raise ValueError(
            "load_digits_splits: expected 0 < val_fraction, 0 < test_fraction and a sum below 1, "
            f"got val_fraction={val_fraction}, test_fraction={test_fraction}"
        )
    if img_size < 8:
        raise ValueError(f"load_digits_splits: img_size must be >= 8 (the native size), got {img_size}")
    bunch = load_digits()
    x = torch.from_numpy(bunch.images).float().div_(16.0).unsqueeze(1)  # [1797, 1, 8, 8]
    y = torch.from_numpy(bunch.target).long()
    idx = torch.arange(len(y)).numpy()
    idx_trval, idx_test = train_test_split(
        idx, test_size=test_fraction, stratify=y.numpy(), random_state=seed
    )
    idx_train, idx_val = train_test_split(
        idx_trval,
        test_size=val_fraction / (1.0 - test_fraction),
        stratify=y.numpy()[idx_trval],
        random_state=seed,
    )
    if img_size != 8:
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False).clamp_(0.0, 1.0)
    return {
        name: (x[torch.as_tensor(i)], y[torch.as_tensor(i)])
        for name, i in (("train", idx_train), ("val", idx_val), ("test", idx_test))
    }


class DigitsDataset(Dataset):
    """In-memory images ``[n, 1, H, W]`` standardised by ``(mean, std)``; optional random affine jitter."""

    def __init__(self, images: Tensor, labels: Tensor, mean: float, std: float, augment: bool = False):
        self.images, self.labels = images, labels
        self.mean, self.std = mean, std
        self.augment = (
            v2.RandomAffine(degrees=10.0, translate=(0.1, 0.1), scale=(0.9, 1.1)) if augment else None
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x = self.images[i]
        if self.augment is not None:
            x = self.augment(x)
        return (x - self.mean) / self.std, self.labels[i]


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn digits: 10 classes, ``in_chans=1``, images upsampled to ``img_size``.

    Args:
        img_size: side of the upsampled square images.
        in_chans: 1 (grey) or 3 (the grey channel repeated, for RGB-pretrained backbones).
        num_classes: must be 10 (present so model configs can read ``${data.num_classes}``).
        batch_size: per-device batch size.
        val_fraction, test_fraction: stratified split fractions of the 1797 images.
        split_seed: seed of the split (fixed: the same images are in test for every run).
        augment: random affine jitter of training images.
        seed: training-order seed (the train config passes ``${seed}``); order = f(seed, epoch).
        num_workers: DataLoader workers (the data is in memory; 0 is fastest on CPU).
    """

    class_names = tuple(str(d) for d in range(10))

    def __init__(
        self,
        img_size: int = 32,
        in_chans: int = 1,
        num_classes: int = 10,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        augment: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"DigitsDataModule: batch_size must be >= 1, got {batch_size}")
        if img_size < 8:
            raise ValueError(f"DigitsDataModule: img_size must be >= 8 (the scans are 8x8), got {img_size}")
        if in_chans not in (1, 3):
            raise ValueError(f"DigitsDataModule: in_chans must be 1 or 3, got {in_chans}")
        if num_classes != 10:
            raise ValueError(f"DigitsDataModule: the digits have 10 classes, got num_classes={num_classes}")
        self.num_classes, self.in_chans = num_classes, in_chans
        self.save_hyperparameters(logger=False)
        self.data_train: DigitsDataset | None = None
        self.data_val: DigitsDataset | None = None
        self.data_test: DigitsDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.data_train is not None:
            return
        hp = self.hparams
        splits = load_digits_splits(hp.val_fraction, hp.test_fraction, hp.split_seed, hp.img_size)
        if hp.in_chans == 3:
            splits = {k: (x.expand(-1, 3, -1, -1).contiguous(), y) for k, (x, y) in splits.items()}
        x_train = splits["train"][0]
        mean, std = float(x_train.mean()), float(x_train.std())
        self.data_train = DigitsDataset(*splits["train"], mean, std, augment=hp.augment)
        self.data_val = DigitsDataset(*splits["val"], mean, std)
        self.data_test = DigitsDataset(*splits["test"], mean, std)

    def _loader(self, ds: Dataset, train: bool) -> DataLoader:
        hp = self.hparams
        return epoch_loader(ds, train, batch_size=hp.batch_size, seed=hp.seed, num_workers=hp.num_workers,
                            pin_memory=hp.pin_memory)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.data_train, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.data_val, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.data_test, train=False)
