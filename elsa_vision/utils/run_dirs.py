"""Run directories: where a training or evaluation run writes, and which run a resume continues.

Hydra's ``hydra.run.dir`` resolves through :func:`run_dir_for` (the ``run_dir`` resolver that
:func:`register_resolvers` installs; ``train.py`` and ``evaluate.py`` call it before Hydra starts). This
module does not import Lightning: it runs before Hydra configures logging, and Lightning imported that early
would keep its log records out of the run's ``train.log``.
"""

from __future__ import annotations

import glob
import itertools
import os
import time
from pathlib import Path

from omegaconf import OmegaConf

__all__ = ["newest_last_checkpoint", "register_resolvers", "run_dir_for", "run_of_checkpoint"]


def newest_last_checkpoint(search_glob: str) -> str | None:
    """The most recently modified file matching ``search_glob`` (a ``*/checkpoints/last.ckpt`` pattern)."""
    found = [p for p in glob.glob(search_glob) if os.path.isfile(p)]
    return max(found, key=os.path.getmtime) if found else None


def run_of_checkpoint(ckpt_path: str | os.PathLike, runs_root: str | os.PathLike) -> str | None:
    """The run directory a resume from ``ckpt_path`` continues, or None for a new one.

    Only a run's own ``<runs_root>/<run>/checkpoints/last.ckpt`` continues that run; any other checkpoint
    (a best ``epoch_NNN.ckpt``, a file from elsewhere, a checkpoint evaluated by another task) starts a new
    run directory, so no run's later history is overwritten.
    """
    p = Path(os.path.abspath(ckpt_path))
    if p.name != "last.ckpt" or p.parent.name != "checkpoints":
        return None
    run = p.parent.parent
    return str(run) if run.parent == Path(os.path.abspath(runs_root)) else None


_RUN_DIRS: dict[tuple[str, str | None], str] = {}


def run_dir_for(runs_root: str, ckpt_path: str | None = None) -> str:
    """The directory of a run under ``runs_root`` (the ``run_dir`` resolver of ``configs/hydra``).

    ``ckpt_path=last`` (the newest ``<runs_root>/*/checkpoints/last.ckpt``) or a run's own ``last.ckpt``
    continues that run's directory (:func:`run_of_checkpoint`). Anything else gets a new directory named
    by the start time, ``YYYY-MM-DD_HH-MM-SS``; it is created here with an exclusive ``mkdir``, so two jobs
    started in the same second get two directories (the later one with a suffix ``_1``, ``_2``, ...). The
    answer is fixed for the process: resolving it again returns the same directory.
    """
    key = (os.path.abspath(runs_root), None if ckpt_path in (None, "") else str(ckpt_path))
    if key in _RUN_DIRS:
        return _RUN_DIRS[key]
    root, ckpt = key
    resumed = None
    if ckpt == "last":
        last = newest_last_checkpoint(os.path.join(root, "*", "checkpoints", "last.ckpt"))
        resumed = run_of_checkpoint(last, root) if last else None
    elif ckpt is not None:
        resumed = run_of_checkpoint(ckpt, root)
    if resumed is None:
        os.makedirs(root, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
        for n in itertools.count():
            candidate = os.path.join(root, stamp if n == 0 else f"{stamp}_{n}")
            try:
                os.mkdir(candidate)
            except FileExistsError:
                continue
            resumed = candidate
            break
    _RUN_DIRS[key] = resumed
    return resumed


def register_resolvers() -> None:
    """Register the OmegaConf resolvers the configs use (``run_dir``); call before Hydra composes."""
    OmegaConf.register_new_resolver("run_dir", run_dir_for, use_cache=True, replace=True)
