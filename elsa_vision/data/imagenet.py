"""ILSVRC-2012 in the standard class-folder layout, with timm's transforms for the model being trained.

Expected layout (the usual ``extract_ILSVRC.sh`` result)::

    root/train/n01440764/n01440764_10026.JPEG ...   (1000 synset folders, 1,281,167 images)
    root/val/n01440764/ILSVRC2012_val_00000293.JPEG ... (1000 synset folders, 50,000 images)

Transforms come from the model's data config (``timm.data.resolve_data_config`` of the model: mean/std,
crop_pct, interpolation), which the task hands over (:meth:`ImageNetDataModule.set_data_config`), and
``timm.data.create_transform`` (RandomResizedCrop + flip + optional RandAugment/random erasing for training;
resize + centre crop for evaluation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from timm.data import create_transform

from .imagefolder import ImageFolderDataModule

__all__ = ["ImageNetDataModule", "IMAGENET_NUM_CLASSES"]

IMAGENET_NUM_CLASSES = 1000


class ImageNetDataModule(ImageFolderDataModule):
    """ILSVRC-2012 train/val (``test`` = ``val``).

    Args:
        root: folder holding ``train/`` and ``val/``.
        img_size: training crop and evaluation size.
        in_chans: must be 3.
        batch_size: per-device batch size.
        auto_augment, re_prob, hflip, scale, color_jitter: training augmentation (timm ``create_transform``).
        num_classes: 1000 unless a subset of synsets is used on purpose.

    Mean/std, crop_pct and interpolation are the model's (:meth:`set_data_config`; timm's ImageNet defaults
    until it is called).
    """

    def __init__(
        self,
        root: str,
        img_size: int = 224,
        in_chans: int = 3,
        num_classes: int | None = IMAGENET_NUM_CLASSES,
        batch_size: int = 128,
        auto_augment: str | None = "rand-m9-mstd0.5-inc1",
        re_prob: float = 0.25,
        hflip: float = 0.5,
        scale: Sequence[float] = (0.08, 1.0),
        color_jitter: float | None = 0.4,
        verify: bool = False,
        seed: int = 0,
        num_workers: int = 8,
        pin_memory: bool = True,
        persistent_workers: bool = True,
    ) -> None:
        if in_chans != 3:
            raise ValueError(f"ImageNetDataModule: ImageNet is RGB, in_chans must be 3, got {in_chans}")
        super().__init__(
            root=root,
            img_size=img_size,
            in_chans=in_chans,
            num_classes=num_classes,
            batch_size=batch_size,
            auto_augment=auto_augment,
            re_prob=re_prob,
            hflip=hflip,
            verify=verify,
            seed=seed,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
        )
        self.save_hyperparameters(logger=False)

    def build_transform(self, is_training: bool) -> Callable:
        hp, dc = self.hparams, self.data_config
        kw = dict(
            input_size=dc["input_size"], mean=dc["mean"], std=dc["std"], interpolation=dc["interpolation"]
        )
        if is_training:
            return create_transform(
                **kw,
                is_training=True,
                scale=tuple(hp.scale),
                hflip=hp.hflip,
                color_jitter=hp.color_jitter,
                auto_augment=hp.auto_augment,
                re_prob=hp.re_prob,
            )
        return create_transform(**kw, is_training=False, crop_pct=dc["crop_pct"])
