"""A shuffling sampler whose order depends only on ``(seed, epoch)``, and the loaders built on it."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["EpochShuffleSampler", "epoch_loader", "usable_workers"]

_logger = logging.getLogger(__name__)
_lowered: set[tuple[int, int]] = set()


def usable_workers(num_workers: int) -> int:
    """``num_workers`` data-loading processes, at most as many as this process may run on
    (``os.sched_getaffinity``): more only contend for the same cores, and torch warns about them at every
    loader it starts. A lowered count is logged once."""
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if num_workers <= cpus:
        return num_workers
    if (num_workers, cpus) not in _lowered:
        _lowered.add((num_workers, cpus))
        _logger.info("num_workers=%d lowered to %d: this process may run on %d CPUs", num_workers, cpus, cpus)
    return cpus


class EpochShuffleSampler(Sampler[int]):
    """A random permutation of ``range(num_samples)`` that is a function of ``(seed, epoch)`` only.

    Lightning calls ``set_epoch`` before every training epoch; the permutation is drawn when iteration starts,
    from a generator seeded then. ``generator`` (reseeded by ``set_epoch`` too) is meant for the DataLoader:
    its worker base seeds then come from an epoch-seeded stream instead of the global torch RNG. An epoch
    therefore replays identically after a restart, whatever the process consumed before.

    ``per_epoch_indices``: epoch ``e`` yields ``e * num_samples + i`` instead of ``i``, for a procedural
    dataset that draws new samples every epoch from the index (``SyntheticMultiViewDataset(fresh=True)``).
    """

    def __init__(self, num_samples: int, seed: int = 0, per_epoch_indices: bool = False) -> None:
        if num_samples < 1:
            raise ValueError(f"EpochShuffleSampler: num_samples must be >= 1, got {num_samples}")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.per_epoch_indices = per_epoch_indices
        self.epoch = 0
        self.generator = torch.Generator()
        self.set_epoch(0)

    def _epoch_seed(self) -> int:
        return (self.seed + 1_000_003 * self.epoch) % (2**63)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.generator.manual_seed(self._epoch_seed() ^ 0x5DEECE66D)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self._epoch_seed())
        offset = self.epoch * self.num_samples if self.per_epoch_indices else 0
        yield from (offset + i for i in torch.randperm(self.num_samples, generator=g).tolist())

    def __len__(self) -> int:
        return self.num_samples


def epoch_loader(ds: Dataset, train: bool, *, batch_size: int, seed: int, num_workers: int, pin_memory: bool,
                 persistent_workers: bool = True, drop_last: bool = True,
                 per_epoch_indices: bool = False) -> DataLoader:
    """The DataLoader of a training (``train``: shuffled by an :class:`EpochShuffleSampler`; with
    ``drop_last`` the last batch is dropped when it is not the only one) or evaluation split (in order,
    every sample): an epoch's order and its workers' seeds depend only on ``(seed, epoch)``, so that a
    resumed run replays it exactly. ``drop_last=False`` for small training sets where every sample counts
    (a few labelled pixels per class). ``num_workers`` is capped by :func:`usable_workers`.
    ``per_epoch_indices``: see :class:`EpochShuffleSampler` (training split only)."""
    sampler = EpochShuffleSampler(len(ds), seed, per_epoch_indices) if train else None
    num_workers = usable_workers(num_workers)
    return DataLoader(
        ds,
        batch_size=batch_size,
        sampler=sampler,
        generator=sampler.generator if train else None,
        drop_last=drop_last and train and len(ds) > batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        persistent_workers=persistent_workers and num_workers > 0,
    )
