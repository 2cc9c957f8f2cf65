"""Class-folder image datasets (``root/{train,val[,test]}/<class>/<image>``) with robust image loading.

Every image is decoded with Pillow and converted to RGB, so grayscale (``L``, ``I;16``), palette, RGBA, LA and
CMYK files all load. Zero-byte files are dropped when the tree is scanned; an image that fails to decode
(truncated, corrupt) is skipped when it is read: the path is logged, a per-process counter is incremented, and
the next readable image of the split takes its place, so a batch is always full and ``collate`` never sees a
broken sample. ``verify=True`` decodes every image once in ``setup`` and drops the broken ones up front. An
image whose header declares more pixels than ``PIL.Image.MAX_IMAGE_PIXELS`` (a decompression bomb) is treated
the same way, before anything is decoded (training: ``extras.max_image_pixels`` changes the limit).

The data modules own no model hyperparameters: normalisation, resize interpolation and evaluation crop come
from the model being trained, as in timm's ``train.py``: under a Trainer, ``setup`` resolves the data config
of the LightningModule's ``net`` (``timm.data.resolve_data_config``) unless one was handed to
:meth:`ImageFolderDataModule.set_data_config`; values set on the data module itself take precedence.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import lightning as L
from timm.data import create_transform, resolve_data_config
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .readers.images import load_rgb
from .samplers import epoch_loader

__all__ = ["IMG_EXTENSIONS", "ImageFolderDataModule", "RobustImageFolder", "scan_class_folders"]

log = logging.getLogger(__name__)

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")


def scan_class_folders(split_dir: str | os.PathLike) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    """List ``split_dir/<class>/<image>``.

    Returns:
        ``(classes sorted by name, [(path, class_index)], [zero-byte paths that were dropped])``.

    Raises:
        FileNotFoundError: ``split_dir`` does not exist.
        ValueError: ``split_dir`` has no class folders, or a class folder holds no non-empty image file.
    """
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise FileNotFoundError(f"image folder split not found: {str(split_dir)!r} is not a directory")
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(
            f"{str(split_dir)!r} has no class folders; expected {str(split_dir)}/<class>/<image>"
        )
    samples: list[tuple[str, int]] = []
    empty_files: list[str] = []
    for ci, name in enumerate(classes):
        n_before = len(samples)
        for dirpath, _, files in sorted(os.walk(split_dir / name, followlinks=True)):
            for f in sorted(files):
                if not f.lower().endswith(IMG_EXTENSIONS):
                    continue
                p = os.path.join(dirpath, f)
                if os.path.getsize(p) == 0:
                    empty_files.append(p)
                    continue
                samples.append((p, ci))
        if len(samples) == n_before:
            raise ValueError(
                f"class folder {str(split_dir / name)!r} holds no non-empty image file "
                f"(extensions {', '.join(IMG_EXTENSIONS)}); remove the folder or add images"
            )
    for p in empty_files:
        log.warning("skipping zero-byte image %s", p)
    if empty_files:
        log.warning("%s: skipped %d zero-byte image(s)", split_dir, len(empty_files))
    return classes, samples, empty_files


class RobustImageFolder(Dataset):
    """``root/<class>/<image>`` as ``(transform(rgb_image), class_index)`` that never yields a broken sample.

    Attributes:
        classes: class folder names (sorted); ``class_to_idx`` maps them to indices.
        samples: ``[(path, class_index)]`` of the non-empty files.
        skipped: paths found unreadable *in this process* (zero-byte files and failed decodes).
    """

    max_consecutive_failures = 64

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable | None = None,
        verify: bool = False,
        mode: str = "RGB",
    ):
        if mode not in ("RGB", "L"):
            raise ValueError(f"RobustImageFolder: mode must be 'RGB' or 'L', got {mode!r}")
        self.root = str(root)
        self.mode = mode
        self.classes, self.samples, empty = scan_class_folders(root)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.transform = transform
        self.skipped: list[str] = list(empty)
        if verify:
            good = []
            for p, c in self.samples:
                try:
                    load_rgb(p, self.mode)
                    good.append((p, c))
                except (OSError, ValueError, SyntaxError) as e:
                    self._record_skip(p, e)
            if not good:
                raise ValueError(f"{self.root!r}: no readable image among {len(self.samples)} files")
            self.samples = good

    @property
    def targets(self) -> list[int]:
        return [c for _, c in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def _record_skip(self, path: str, err: Exception) -> None:
        self.skipped.append(path)
        log.warning(
            "skipping unreadable image %s (%s: %s); %d skipped so far in %s",
            path,
            type(err).__name__,
            err,
            len(self.skipped),
            self.root,
        )

    def __getitem__(self, index: int):
        n = len(self.samples)
        for attempt in range(min(n, self.max_consecutive_failures)):
            path, target = self.samples[(index + attempt) % n]
            try:
                img = load_rgb(path, self.mode)
            except (OSError, ValueError, SyntaxError) as e:  # PIL raises all three on corrupt data
                self._record_skip(path, e)
                continue
            return (self.transform(img) if self.transform is not None else img), target
        raise RuntimeError(
            f"{self.root!r}: {self.max_consecutive_failures} consecutive images after index {index} are "
            f"unreadable (last: {path!r}); the dataset is mostly corrupt"
        )


class ImageFolderDataModule(L.LightningDataModule):
    """Any ``root/{train,val[,test]}/<class>/<image>`` tree; ``test`` falls back to ``val`` when absent.

    Args:
        root: dataset root.
        img_size: training crop / evaluation size.
        in_chans: 3 (RGB) or 1 (images converted to grey).
        num_classes: expected class count (``None``: whatever the train split holds); a mismatch is an error.
        batch_size: per-device batch size.
        mean, std, crop_pct, interpolation: normalisation, evaluation resize ratio (timm's ``crop_pct``) and
            resize interpolation; ``None`` takes the model's (:meth:`set_data_config`), timm's ImageNet
            defaults until one is set.
        auto_augment: timm auto-augment string for training (e.g. ``"rand-m9-mstd0.5-inc1"``) or ``None``.
        re_prob: random-erasing probability for training.
        verify: decode every image once in ``setup`` and drop unreadable ones.
        seed: training-order seed (the train config passes ``${seed}``); order = f(seed, epoch).
        num_workers, pin_memory, persistent_workers: DataLoader settings.
    """

    def __init__(
        self,
        root: str,
        img_size: int = 224,
        in_chans: int = 3,
        num_classes: int | None = None,
        batch_size: int = 64,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        crop_pct: float | None = None,
        interpolation: str | None = None,
        auto_augment: str | None = None,
        re_prob: float = 0.0,
        hflip: float = 0.5,
        verify: bool = False,
        seed: int = 0,
        num_workers: int = 4,
        pin_memory: bool = True,
        persistent_workers: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"{type(self).__name__}: batch_size must be >= 1, got {batch_size}")
        if in_chans not in (1, 3):
            raise ValueError(f"{type(self).__name__}: in_chans must be 1 or 3, got {in_chans}")
        sizes = {len(v) for v in (mean, std) if v is not None}
        if (mean is None) != (std is None) or len(sizes) > 1 or not sizes <= {1, 3}:
            raise ValueError(
                f"{type(self).__name__}: mean/std must both have 1 or 3 values, got {mean}, {std}"
            )
        self.in_chans = in_chans
        self.save_hyperparameters(logger=False)
        self.root = Path(root)
        self.data_train: RobustImageFolder | None = None
        self.data_val: RobustImageFolder | None = None
        self.data_test: RobustImageFolder | None = None
        self.class_names: tuple[str, ...] = ()
        self.data_config: dict = {}
        self._model_config = False  # set_data_config was given a model's config
        self.set_data_config(None)

    # ----------------------------------------------------------------------------------------- transforms
    def set_data_config(self, data_config: Mapping | None) -> None:
        """Take normalisation, interpolation and evaluation crop from a model's data config (the dict of
        ``timm.data.resolve_data_config``); values given to this data module override it, ``None`` keeps
        timm's ImageNet defaults. The input size stays ``(in_chans, img_size, img_size)``. Datasets already
        built get the new transforms."""
        hp = self.hparams
        self._model_config = data_config is not None
        size = {"input_size": (hp.in_chans, hp.img_size, hp.img_size)}
        config = resolve_data_config(size, pretrained_cfg=dict(data_config or {}))
        for key in ("mean", "std", "crop_pct", "interpolation"):
            if hp.get(key) is not None:
                config[key] = tuple(hp[key]) if key in ("mean", "std") else hp[key]
        config["input_size"] = size["input_size"]
        self.data_config = config
        for ds, train in ((self.data_train, True), (self.data_val, False), (self.data_test, False)):
            if ds is not None:
                ds.transform = self.build_transform(train)

    def build_transform(self, is_training: bool) -> Callable:
        hp, dc = self.hparams, self.data_config
        mean, std = tuple(dc["mean"]), tuple(dc["std"])
        if hp.in_chans == 1 and len(mean) == 3:
            mean, std = (sum(mean) / 3,), (sum(std) / 3,)
        return create_transform(
            input_size=dc["input_size"],
            is_training=is_training,
            mean=mean,
            std=std,
            crop_pct=dc["crop_pct"],
            interpolation=dc["interpolation"],
            auto_augment=hp.auto_augment if is_training else None,
            re_prob=hp.re_prob if is_training else 0.0,
            hflip=hp.hflip if is_training else 0.0,
        )

    # ---------------------------------------------------------------------------------------------- setup
    def check_root(self) -> None:
        if not self.root.is_dir():
            raise FileNotFoundError(
                f"{type(self).__name__}: data root {str(self.root)!r} does not exist; expected "
                f"{str(self.root)}/train/<class>/<image> and {str(self.root)}/val/<class>/<image> "
                "(set data.root=...)"
            )
        for split in ("train", "val"):
            if not (self.root / split).is_dir():
                raise FileNotFoundError(
                    f"{type(self).__name__}: split folder {str(self.root / split)!r} missing under data root "
                    f"{str(self.root)!r}"
                )

    def prepare_data(self) -> None:
        self.check_root()

    def _dataset(self, split: str, train: bool) -> RobustImageFolder:
        return RobustImageFolder(
            self.root / split,
            self.build_transform(train),
            verify=self.hparams.verify,
            mode="L" if self.in_chans == 1 else "RGB",
        )

    def _config_from_trainer(self) -> None:
        """Under a Trainer, the data config of the network being fit or tested (its LightningModule's ``net``,
        as timm's train script resolves it), unless one was given: every driver that runs ``trainer.fit``
        gets the model's normalisation, interpolation and crop."""
        trainer = self.trainer
        net = getattr(trainer.lightning_module, "net", None) if trainer is not None else None
        if self._model_config or not isinstance(net, nn.Module):
            return
        self.set_data_config(resolve_data_config({}, model=net))
        log.info("data config from the model: %s", self.data_config)

    def setup(self, stage: str | None = None) -> None:
        self._config_from_trainer()
        if self.data_train is not None:
            return
        self.check_root()
        self.data_train = self._dataset("train", True)
        self.data_val = self._dataset("val", False)
        test_split = "test" if (self.root / "test").is_dir() else "val"
        self.data_test = self.data_val if test_split == "val" else self._dataset("test", False)
        classes = self.data_train.classes
        for name, ds in (("val", self.data_val), (test_split, self.data_test)):
            if ds.classes != classes:
                extra, missing = (
                    sorted(set(ds.classes) - set(classes)),
                    sorted(set(classes) - set(ds.classes)),
                )
                raise ValueError(
                    f"{type(self).__name__}: class folders of {str(self.root / name)!r} differ from "
                    f"{str(self.root / 'train')!r}: extra {extra[:10]}, missing {missing[:10]}"
                )
        expected = self.hparams.num_classes
        if expected is not None and expected != len(classes):
            raise ValueError(
                f"{type(self).__name__}: data.num_classes={expected} but {str(self.root / 'train')!r} holds "
                f"{len(classes)} class folders"
            )
        self.class_names = tuple(classes)

    @property
    def num_classes(self) -> int:
        return len(self.class_names) if self.class_names else int(self.hparams.num_classes or 0)

    # ------------------------------------------------------------------------------------------- loaders
    def _loader(self, ds: Dataset, train: bool) -> DataLoader:
        hp = self.hparams
        return epoch_loader(ds, train, batch_size=hp.batch_size, seed=hp.seed, num_workers=hp.num_workers,
                            pin_memory=hp.pin_memory, persistent_workers=hp.persistent_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.data_train, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.data_val, False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.data_test, False)
