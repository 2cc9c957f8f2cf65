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
from omegaconf import DictConfig, OmegaConf, open_dict

from ..files import read_checkpoint
from ..utils.accelerator import available_memory_mb, check_accelerator
from ..utils.run import (
    CheckpointPathError,
    describe_net,
    extras,
    find_last_checkpoint,
    instantiate_callbacks,
    instantiate_loggers,
    last_logged_metrics,
    plot_curves,
    save_resolved_config,
    training_checkpoint_kind,
    trim_metrics_csv,
)
from ..utils.run_dirs import run_identity, run_of_checkpoint

__all__ = [
    "CheckpointPathError",
    "check_training_memory",
    "fit_and_test",
    "instantiate_data",
    "prepare_training",
    "resolve_ckpt_path",
    "train",
]

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
    """``cfg.ckpt_path`` as a file path, checked here, before anything is built.

    ``last`` is the ``last.ckpt`` of this run's directory, else of the newest run under
    ``logs/<task_name>/runs/`` trained with this configuration (model and network, data module: compared
    with the run's saved ``config_resolved.yaml``, :func:`~elsa_vision.utils.run_dirs.run_identity`). Any
    path must be a ``torch.save`` checkpoint (not an image, a text file or a ``.safetensors`` file of
    weights: :func:`elsa_vision.utils.run.training_checkpoint_kind`, which Lightning's checkpoint I/O,
    :class:`~elsa_vision.utils.run.SafeCheckpointIO`, applies again on loading) that reads weights-only
    (:func:`elsa_vision.files.read_checkpoint`, memory-mapped: a file holding Python objects or a damaged
    one is refused now, not after data, model and trainer are built), and the task's module checks what it
    will rebuild from the checkpoint (its ``check_checkpoint``, e.g. the HSI network's constructor arguments).

    Raises:
        FileNotFoundError: no ``last.ckpt`` to resume, or ``ckpt_path`` is not a file.
        NotACheckpointError, UnsafeCheckpointError, CheckpointPathError, ValueError: the file is not a
            checkpoint, holds Python objects, is one of weights only, is damaged, is refused by the task, or
            ``last`` found only runs of another configuration.
    """
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is None or ckpt_path == "":
        return None
    if ckpt_path == "last":
        pattern = os.path.join(_runs_root(cfg), "*", "checkpoints", "last.ckpt")
        ckpt_path = find_last_checkpoint(cfg.paths.output_dir, pattern, run_identity(cfg))
    training_checkpoint_kind(ckpt_path, arg="ckpt_path")
    checkpoint = read_checkpoint(ckpt_path, arg="ckpt_path", mmap=True)
    target = cfg.get("model", {}).get("_target_") if isinstance(cfg.get("model"), DictConfig) else None
    check = getattr(hydra.utils.get_class(target), "check_checkpoint", None) if target else None
    if check is not None:
        check(checkpoint, f"ckpt_path: {str(ckpt_path)!r}")
    return str(ckpt_path)


def _check_trainer(cfg: DictConfig) -> None:
    """Trainer settings that would make ``fit`` do nothing, refused in one line (Lightning runs an empty fit
    and then talks about checkpoints)."""
    if not cfg.get("train", True):
        return
    for key in ("max_epochs", "max_steps"):
        value = cfg.trainer.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and (value == 0 or value < -1):
            raise ValueError(
                f"trainer.{key}={value}: nothing would be trained; pass trainer.{key} >= 1 (-1: no limit), "
                "or train=false to only test"
            )


def _meta_network(cfg: DictConfig) -> torch.nn.Module | None:
    """``cfg.model.net`` built on the meta device (shapes only, no memory), without reading a weights file;
    None for a network the task builds later (a ``_partial_`` factory sized by the data)."""
    net_cfg = cfg.get("model", {}).get("net") if isinstance(cfg.get("model"), DictConfig) else None
    if not isinstance(net_cfg, DictConfig) or "_target_" not in net_cfg or net_cfg.get("_partial_"):
        return None
    overrides: dict[str, Any] = {k: None for k in ("pretrained_file", "checkpoint_path") if k in net_cfg}
    if "num_classes" in net_cfg and net_cfg.num_classes is None:
        overrides["num_classes"] = 1  # counted from the data later; the head's size is negligible here
    with torch.device("meta"):
        net = hydra.utils.instantiate(net_cfg, **overrides)
    return net if isinstance(net, torch.nn.Module) else None


def _source_key(cfg: DictConfig, key: str) -> str:
    """The config key a ``model.net`` setting comes from (``data.img_size`` for ``${data.img_size}``)."""
    raw = OmegaConf.to_container(cfg.model.net, resolve=False).get(key)
    if isinstance(raw, str) and raw.startswith("${") and raw.endswith("}") and ":" not in raw:
        return raw[2:-1]
    return f"model.net.{key}"


def check_training_memory(cfg: DictConfig, available_mb: float | None = None) -> float | None:
    """Refuse, before the data or the model is built, a configuration whose training cannot fit in memory.

    The network is built on the meta device (:func:`_meta_network`). Counted, as a lower bound: its
    parameters four times (weights, gradients, AdamW's two moments; divided over the devices under FSDP),
    its buffers, one batch of input images (``data.batch_size x data.in_chans x data.img_size^2`` float32)
    and, for a ViT, the activations one batch keeps for the backward pass (``(6 + 2 mlp_ratio) N C`` floats
    per block and image, ``N`` tokens of width ``C``; with gradient checkpointing ``N C`` per block, its
    input, and one block's ``(6 + 2 mlp_ratio) N C`` while it is recomputed; under ``trainer=cp`` each rank
    keeps those of its ``1 / cp_size`` of the tokens). A configuration that fits only with gradient
    checkpointing is refused with that advice (``model.net.grad_checkpointing=true``). Compared with
    ``available_mb`` (default: the memory of the device that trains,
    :func:`elsa_vision.utils.accelerator.available_memory_mb`). Returns the
    estimate in MiB (None when the network is built later by the task, from the data).

    Raises:
        ValueError: one line naming the setting that makes it large (``data.img_size=100000``), the
            estimate and the memory available.
    """
    net = _meta_network(cfg)
    if net is None:
        return None
    params = {name: p.numel() * p.element_size() for name, p in net.named_parameters()}
    buffers = sum(b.numel() * b.element_size() for b in net.buffers())
    trainer = cfg.trainer
    shards = context = 1
    strategy = trainer.get("strategy")
    target = str(strategy.get("_target_", "")).lower() if isinstance(strategy, DictConfig) else ""
    if "fsdp" in target:
        shards = trainer.get("devices") if isinstance(trainer.get("devices"), int) else 1
    elif "contextparallel" in target and isinstance(strategy.get("cp_size"), int):
        context = max(1, strategy.cp_size)  # every rank of a group holds 1/cp_size of an image's tokens
    state = 4 * sum(params.values()) / max(1, shards) + buffers
    data = cfg.get("data") or {}
    batch = int(data.get("batch_size") or 1)
    img, chans = data.get("img_size"), data.get("in_chans")
    inputs = batch * int(chans) * int(img) ** 2 * 4 if isinstance(img, int) and isinstance(chans, int) else 0
    activations = checkpointed = 0
    blocks, embed = getattr(net, "blocks", None), getattr(net, "patch_embed", None)
    if blocks is not None and hasattr(embed, "num_patches") and hasattr(net, "embed_dim"):
        tokens = int(embed.num_patches) + int(getattr(net, "num_prefix_tokens", 0))
        width = int(net.embed_dim)
        fc1 = getattr(getattr(blocks[0], "mlp", None), "fc1", None) if len(blocks) else None
        ratio = fc1.out_features / width if fc1 is not None else 4.0
        per_block = (6 + 2 * ratio) * -(-tokens // context) * width * 4 * batch  # one block's activations
        kept = -(-tokens // context) * width * 4 * batch  # a checkpointed block's input
        activations = per_block * len(blocks)
        checkpointed = kept * len(blocks) + per_block
        if getattr(net, "grad_checkpointing", False):
            activations = checkpointed
    total_mb = (state + inputs + activations) / 2**20
    if available_mb is None:
        available_mb, where = available_memory_mb(str(trainer.get("accelerator", "cpu")))
    else:
        where = "the given limit"
    if total_mb <= available_mb:
        return total_mb
    largest = max(params, key=params.get) if params else ""
    if "pos_embed" in largest or activations + inputs > state:
        culprit = _source_key(cfg, "img_size") if "img_size" in cfg.model.net else "data.img_size"
        value = OmegaConf.select(cfg, culprit)
        hint = f"lower {culprit}" + (" or data.batch_size" if activations + inputs > state else "")
        with_ckpt = (state + inputs + checkpointed) / 2**20
        if activations > checkpointed and with_ckpt <= available_mb and "grad_checkpointing" in cfg.model.net:
            hint += f", or set model.net.grad_checkpointing=true (then about {_size(with_ckpt * 2**20)})"
    else:
        culprit, value, hint = "model.net", None, "choose a smaller model.net"
    named = f"{culprit}={value}" if value is not None else culprit
    raise ValueError(
        f"{named}: training {cfg.model.net.get('model_name', type(net).__name__)} needs at least "
        f"{_size(total_mb * 2**20)} (parameters with gradients and optimizer state {_size(state)}, the "
        f"largest {largest} {_size(params.get(largest, 0))} once; activations and input of one batch of "
        f"{batch} {_size(activations + inputs)}), more than the {_size(available_mb * 2**20)} available "
        f"({where}); {hint}"
    )


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def _resumed_run(cfg: DictConfig, ckpt_path: str) -> str | None:
    """The run directory a resume from ``ckpt_path`` continues: the run under ``logs/<task_name>/runs``
    whose ``last.ckpt`` it is, or this run's directory when it is this directory's ``last.ckpt``; None for
    a new run initialised from the checkpoint."""
    resumed = run_of_checkpoint(ckpt_path, _runs_root(cfg))
    own = os.path.join(str(cfg.paths.output_dir), "checkpoints", "last.ckpt")
    if resumed is None and os.path.abspath(ckpt_path) == os.path.abspath(own):
        resumed = str(cfg.paths.output_dir)
    return resumed


def _continue_run(cfg: DictConfig, ckpt_path: str) -> str:
    """Point ``cfg.paths.output_dir`` at the run ``ckpt_path`` continues (if any); make its ``metrics.csv``
    end where the checkpoint does; return the run directory."""
    run_dir = str(cfg.paths.output_dir)
    resumed = _resumed_run(cfg, ckpt_path)
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
            log.info("metrics.csv: dropped %d rows logged after the checkpoint (step %d) or torn by an "
                     "interruption", dropped, step)
        for conf in (cfg.get("logger") or {}).values():
            if isinstance(conf, DictConfig) and str(conf.get("_target_", "")).endswith("TensorBoardLogger"):
                with open_dict(conf):
                    conf.purge_step = step  # TensorBoard hides the events logged after the checkpoint
    return run_dir


def prepare_training(cfg: DictConfig) -> dict[str, Any]:
    """Everything :func:`train` does before fitting: check the settings and files (accelerator, trainer
    limits, ``ckpt_path``, memory), then build the data module, the model, callbacks, loggers and trainer.

    Every refusal happens here, before any epoch runs; ``train.py`` reports it in one line and removes the
    run directory it had created (:func:`elsa_vision.utils.run_dirs.discard_new_run_dir`). Returns the
    objects :func:`fit_and_test` takes (``cfg``, ``datamodule``, ``model``, ``trainer``, ``callbacks``,
    ``loggers``, ``run_dir``, ``ckpt_path``, ``resumed``, ``start``).
    """
    start = time.perf_counter()
    check_accelerator(cfg.trainer)
    _check_trainer(cfg)
    extras(cfg)
    if cfg.get("seed") is not None:  # logged once the data is built: a refusal before prints one line only
        L.seed_everything(cfg.seed, workers=True, verbose=False)
    ckpt_path = resolve_ckpt_path(cfg)
    check_training_memory(cfg)
    resumed = ckpt_path is not None and _resumed_run(cfg, ckpt_path) is not None
    datamodule = instantiate_data(cfg)
    # a resumed run's files change only once every input is accepted; a refusal above prints its one line
    run_dir = _continue_run(cfg, ckpt_path) if ckpt_path is not None else str(cfg.paths.output_dir)
    log.info("Run directory %s; command: %s", run_dir, shlex.join(sys.argv))
    if ckpt_path is not None:
        log.info("Resuming from %s", ckpt_path)
    if cfg.get("seed") is not None:
        log.info("Seed set to %d", cfg.seed)
    log.info("Instantiated datamodule <%s>", cfg.data._target_)
    save_resolved_config(cfg, run_dir)

    log.info("Instantiating model <%s>", cfg.model._target_)
    model: LightningModule = hydra.utils.instantiate(cfg.model, _convert_="partial")
    if isinstance(getattr(model, "net", None), torch.nn.Module):
        log.info("Network: %s", describe_net(cfg.model.get("net"), model.net))

    callbacks: list[Callback] = instantiate_callbacks(cfg.get("callbacks"))
    loggers: list[Logger] = instantiate_loggers(cfg.get("logger"))
    log.info("Instantiating trainer <%s>", cfg.trainer._target_)
    trainer: Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    return dict(
        cfg=cfg,
        datamodule=datamodule,
        model=model,
        trainer=trainer,
        callbacks=callbacks,
        loggers=loggers,
        run_dir=run_dir,
        ckpt_path=ckpt_path,
        resumed=resumed,
        start=start,
    )


def fit_and_test(prepared: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fit (resuming from ``ckpt_path`` if any), test the best checkpoint, plot the curves: the work of
    :func:`train` after :func:`prepare_training`."""
    cfg, datamodule, model, trainer = (prepared[k] for k in ("cfg", "datamodule", "model", "trainer"))
    run_dir, ckpt_path = prepared["run_dir"], prepared["ckpt_path"]
    metrics: dict[str, Any] = {}
    fitted = bool(cfg.get("train", True))
    if fitted:
        trainer.fit(model=model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
        if prepared["resumed"]:
            # a run resumed from its last epoch's checkpoint trains nothing more: its last train/val values
            # come from its metrics.csv (the rows after the checkpoint were dropped when it resumed)
            for key, value in last_logged_metrics(os.path.join(run_dir, "metrics.csv")).items():
                metrics.setdefault(key, value)

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
    metrics["time_s"] = round(time.perf_counter() - prepared["start"], 2)
    objects = {k: prepared[k] for k in ("cfg", "datamodule", "model", "trainer", "callbacks", "loggers")}
    objects.update(run_dir=run_dir, best_checkpoint=best or None, last_checkpoint=last or None)
    return metrics, objects


def train(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fit ``cfg.model`` on ``cfg.data`` and test the best checkpoint: :func:`prepare_training` then
    :func:`fit_and_test`.

    Returns:
        ``(metrics, objects)``: ``metrics`` holds the final ``train/*``, ``val/*`` and ``test/*`` values plus
        ``epochs``, ``time_s``; ``objects`` holds ``cfg``, ``datamodule``, ``model``, ``trainer``,
        ``callbacks``, ``loggers``, ``run_dir``, ``best_checkpoint``, ``last_checkpoint``.
    """
    return fit_and_test(prepare_training(cfg))
