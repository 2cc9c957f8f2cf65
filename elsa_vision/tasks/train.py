"""``train(cfg)``: instantiate data, model, callbacks, loggers and trainer from a Hydra config; fit; test.

The repository's ``train.py`` is a thin ``@hydra.main`` around this function (lightning-hydra-template's
layout). Everything a run produces lands in ``cfg.paths.output_dir``: ``checkpoints/{last,epoch_NNN}.ckpt``,
``metrics.csv``, ``tensorboard/``, ``curves.png``, ``config_resolved.yaml`` (and Hydra's ``.hydra/``).

A resume from a run's own ``last.ckpt`` (``ckpt_path=last``) continues that run: same directory, the
checkpoint callback's best record, one ``metrics.csv`` (rows logged after the checkpoint are dropped, the
resumed epochs append), and the same final test as an uninterrupted run.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from typing import Any

import hydra
import lightning as L
import torch
from lightning import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, open_dict

from ..files import read_checkpoint
from ..utils.accelerator import check_accelerator
from ..utils.run import (
    CheckpointPathError,
    describe_net,
    extras,
    find_last_checkpoint,
    instantiate_callbacks,
    instantiate_loggers,
    plot_curves,
    save_resolved_config,
    training_checkpoint_kind,
    trim_metrics_csv,
)
from ..utils.run_dirs import run_of_checkpoint

__all__ = ["CheckpointPathError", "instantiate_data", "resolve_ckpt_path", "train"]

log = logging.getLogger(__name__)


def instantiate_data(cfg: DictConfig) -> LightningDataModule:
    """Build ``cfg.data``; when the data config has ``num_classes: null``, count the classes and write the
    count back into ``cfg`` (model configs read ``${data.num_classes}``)."""
    datamodule: LightningDataModule = hydra.utils.instantiate(cfg.data, _convert_="partial")
    if "num_classes" in cfg.data and cfg.data.num_classes is None and hasattr(datamodule, "num_classes"):
        datamodule.setup("fit")
        with open_dict(cfg):
            cfg.data.num_classes = int(datamodule.num_classes)
        log.info("data.num_classes = %d (counted from the data)", cfg.data.num_classes)
    return datamodule


def _runs_root(cfg: DictConfig) -> str:
    return os.path.join(cfg.paths.log_dir, cfg.task_name, "runs")


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """``cfg.ckpt_path`` as a file path: ``last`` is looked up, other paths must exist and be a
    ``torch.save`` checkpoint (not an image, a text file or a ``.safetensors`` file of weights), checked
    here, before anything is built, by :func:`elsa_vision.utils.run.training_checkpoint_kind` (which
    Lightning's checkpoint I/O, :class:`~elsa_vision.utils.run.SafeCheckpointIO`, applies again on loading).

    Raises:
        FileNotFoundError: no ``last.ckpt`` to resume, or ``ckpt_path`` is not a file.
        NotACheckpointError, CheckpointPathError: the file is not a checkpoint, or one of weights only.
    """
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is None or ckpt_path == "":
        return None
    if ckpt_path == "last":
        pattern = os.path.join(_runs_root(cfg), "*", "checkpoints", "last.ckpt")
        ckpt_path = find_last_checkpoint(cfg.paths.output_dir, pattern)
    training_checkpoint_kind(ckpt_path, arg="ckpt_path")
    return str(ckpt_path)


def _continue_run(cfg: DictConfig, ckpt_path: str) -> str:
    """Point ``cfg.paths.output_dir`` at the run ``ckpt_path`` continues (if any); make its ``metrics.csv``
    end where the checkpoint does; return the run directory."""
    run_dir = str(cfg.paths.output_dir)
    resumed = run_of_checkpoint(ckpt_path, _runs_root(cfg))
    if resumed is not None and os.path.abspath(resumed) != os.path.abspath(run_dir):
        log.info("Continuing run %s (resumed from its last.ckpt)", resumed)
        with open_dict(cfg):
            cfg.paths.output_dir = resumed
        run_dir = resumed
    if resumed is not None:
        # the step decides, before the loggers are built, where the run's logs end; Lightning reads the
        # checkpoint again in fit (here memory-mapped: its tensors are not copied)
        step = int(read_checkpoint(ckpt_path, arg="ckpt_path", mmap=True).get("global_step", 0))
        # the CSV logger writes on rank 0 only; other processes (DDP re-launches this script) leave it alone
        dropped = 0
        if rank_zero_only.rank == 0:
            dropped = trim_metrics_csv(os.path.join(run_dir, "metrics.csv"), step)
        if dropped:
            log.info("metrics.csv: dropped %d rows logged after the checkpoint (step %d)", dropped, step)
        for conf in (cfg.get("logger") or {}).values():
            if isinstance(conf, DictConfig) and str(conf.get("_target_", "")).endswith("TensorBoardLogger"):
                with open_dict(conf):
                    conf.purge_step = step  # TensorBoard hides the events logged after the checkpoint
    return run_dir


def train(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fit ``cfg.model`` on ``cfg.data`` and test the best checkpoint.

    Returns:
        ``(metrics, objects)``: ``metrics`` holds the final ``train/*``, ``val/*`` and ``test/*`` values plus
        ``epochs``, ``time_s``; ``objects`` holds ``cfg``, ``datamodule``, ``model``, ``trainer``,
        ``callbacks``, ``loggers``, ``run_dir``, ``best_checkpoint``, ``last_checkpoint``.
    """
    start = time.perf_counter()
    check_accelerator(cfg.trainer)
    extras(cfg)
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    ckpt_path = resolve_ckpt_path(cfg)
    run_dir = _continue_run(cfg, ckpt_path) if ckpt_path is not None else str(cfg.paths.output_dir)
    log.info("Run directory %s; command: %s", run_dir, shlex.join(sys.argv))
    if ckpt_path is not None:
        log.info("Resuming from %s", ckpt_path)

    log.info("Instantiating datamodule <%s>", cfg.data._target_)
    datamodule = instantiate_data(cfg)
    save_resolved_config(cfg, run_dir)

    log.info("Instantiating model <%s>", cfg.model._target_)
    model: LightningModule = hydra.utils.instantiate(cfg.model, _convert_="partial")
    if isinstance(getattr(model, "net", None), torch.nn.Module):
        log.info("Network: %s", describe_net(cfg.model.get("net"), model.net))

    callbacks: list[Callback] = instantiate_callbacks(cfg.get("callbacks"))
    loggers: list[Logger] = instantiate_loggers(cfg.get("logger"))
    log.info("Instantiating trainer <%s>", cfg.trainer._target_)
    trainer: Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)

    metrics: dict[str, Any] = {}
    fitted = bool(cfg.get("train", True))
    if fitted:
        trainer.fit(model=model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})

    ckpt_cb = trainer.checkpoint_callback
    best = getattr(ckpt_cb, "best_model_path", "") or ""
    last = getattr(ckpt_cb, "last_model_path", "") or ""
    best, last = (p if p and os.path.isfile(p) else "" for p in (best, last))
    if cfg.get("test", False):
        test_ckpt = best or None
        if test_ckpt is None:
            log.warning(
                "No best checkpoint (no ModelCheckpoint or fast_dev_run): testing the current weights"
            )
        test_model = model
        if fitted and test_ckpt is not None:
            # The best checkpoint goes into a freshly built module: under FSDP the module passed to fit now
            # holds flattened shards (the full state dict does not load into them, and the trainer's own
            # wrapped model fails the same way); a fresh module loads it and is wrapped again for the test.
            test_model = hydra.utils.instantiate(cfg.model, _convert_="partial")
        elif fitted:
            test_model = None  # no checkpoint (fast_dev_run): the trainer's current weights
        trainer.test(model=test_model, datamodule=datamodule, ckpt_path=test_ckpt, weights_only=True)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")})

    if trainer.is_global_zero and fitted:
        plot_curves(os.path.join(run_dir, "metrics.csv"), os.path.join(run_dir, "curves.png"),
                    getattr(model, "curves", None))  # the task's own metrics

    metrics["epochs"] = int(trainer.current_epoch)
    metrics["time_s"] = round(time.perf_counter() - start, 2)
    objects = dict(
        cfg=cfg,
        datamodule=datamodule,
        model=model,
        trainer=trainer,
        callbacks=callbacks,
        loggers=loggers,
        run_dir=run_dir,
        best_checkpoint=best or None,
        last_checkpoint=last or None,
    )
    return metrics, objects
