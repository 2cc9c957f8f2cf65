"""Callbacks used by the default training configs."""

from __future__ import annotations

import sys

from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

__all__ = ["EpochSeed", "progress_bar"]


class EpochSeed(Callback):
    """Reseed Python, NumPy and torch at the start of every training epoch from ``(seed, epoch, rank)``.

    Everything random inside epoch ``e`` (shuffling, augmentation, dropout, mixup) then depends only on the
    seed, the epoch and the process rank, not on how many random numbers earlier epochs, validation or a
    restart consumed: a run resumed from an end-of-epoch checkpoint replays exactly the epochs an
    uninterrupted run would have. (DataLoader workers derive their seeds from the reseeded torch generator.)
    """

    def __init__(self, seed: int = 12345) -> None:
        self.seed = int(seed)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch_seed = (self.seed + 1_000_003 * trainer.current_epoch + 7919 * trainer.global_rank) % (2**32)
        seed_everything(epoch_seed, workers=True, verbose=False)


def progress_bar(refresh_rate: int = 1, leave: bool = False):
    """``RichProgressBar`` on an interactive terminal, ``TQDMProgressBar`` when stdout is a file or a pipe."""
    if sys.stdout.isatty():
        return RichProgressBar(refresh_rate=refresh_rate, leave=leave)
    return TQDMProgressBar(refresh_rate=refresh_rate, leave=leave)
