"""``evaluate(cfg)``: top-1/top-5, per-class accuracy, confusion matrix, for any checkpoint or weights file.

Weights come from ``cfg.ckpt_path`` (a Lightning ``.ckpt`` of ``ClassificationModule``, or a backbone
state_dict in ``.safetensors``/``.pth``/``.bin`` with exactly the configured model's keys) or from
``cfg.model.pretrained_file`` (timm-layout weights adapted by the model's pretrained filter). Files are read
with ``torch.load(weights_only=True)`` or safetensors (:func:`elsa_vision.files.read_weights`). The run
directory receives ``confusion_matrix.png``, ``per_class_accuracy.csv`` and ``metrics.csv``.
"""

from __future__ import annotations

import csv
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import hydra
import lightning as L
import torch
from lightning import LightningModule, Trainer
from omegaconf import DictConfig

from ..files import read_weights, submodule_weights
from ..utils.accelerator import check_accelerator
from ..utils.run import extras, instantiate_loggers, save_resolved_config
from .train import instantiate_data

__all__ = [
    "TASKS",
    "evaluate",
    "evaluate_zeroshot",
    "format_table",
    "load_weights",
    "plot_confusion_matrix",
    "prepare_evaluation",
    "run_evaluation",
]

TASKS = ("classification", "zeroshot", "embed")

log = logging.getLogger(__name__)


def load_weights(model: LightningModule, path: str) -> str:
    """Load ``path`` into ``model`` (strict): a Lightning checkpoint's ``state_dict`` (the ``net.*`` keys;
    metric states beside them are not weights) or a backbone state_dict (keys of ``model.net``). Returns
    which of the two it was. Files are read by :func:`elsa_vision.files.read_weights` (weights only, wrapper
    keys and prefixes removed); its errors (``FileNotFoundError``, ``ValueError``) start with ``ckpt_path:``
    and name the file."""
    return _load_state(model, read_weights(path, arg="ckpt_path"))


def _load_state(model: LightningModule, state: dict) -> str:
    net_state = submodule_weights(state, "net")
    model.net.load_state_dict(net_state or state, strict=True)
    return "lightning" if net_state else "backbone"


def plot_confusion_matrix(
    confmat: torch.Tensor, class_names: Sequence[str], png_path: str, max_labels: int = 50
) -> str:
    """Row-normalised confusion matrix (rows: true class, columns: prediction) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cm = confmat.double()
    norm = cm / cm.sum(dim=1, keepdim=True).clamp_min(1)
    k = cm.shape[0]
    size = min(16.0, 3.0 + 0.45 * k)
    fig, ax = plt.subplots(figsize=(size, size))
    im = ax.imshow(norm.numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if k <= max_labels:
        ax.set_xticks(range(k), labels=list(class_names), rotation=90)
        ax.set_yticks(range(k), labels=list(class_names))
        if k <= 20:
            for i in range(k):
                for j in range(k):
                    if cm[i, j] > 0:
                        ax.text(
                            j,
                            i,
                            int(cm[i, j]),
                            ha="center",
                            va="center",
                            fontsize=8,
                            color="white" if norm[i, j] > 0.5 else "black",
                        )
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("confusion matrix (row-normalised)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def format_table(metrics: dict[str, float], per_class: list[tuple[str, int, float]]) -> str:
    """A plain-text table: overall metrics, then per-class support and accuracy."""
    lines = ["metric       value", "-----------  --------"]
    for key in ("test/acc", "test/acc5", "test/loss"):
        if key in metrics:
            lines.append(f"{key:<11}  {metrics[key]:.4f}")
    width = max([5] + [len(n) for n, _, _ in per_class])
    lines += ["", f"{'class':<{width}}  support  accuracy", f"{'-' * width}  -------  --------"]
    lines += [f"{name:<{width}}  {n:>7d}  {acc:.4f}" for name, n, acc in per_class]
    return "\n".join(lines)


def prepare_evaluation(cfg: DictConfig) -> dict[str, Any]:
    """Everything :func:`evaluate` does before testing: check the settings, read the weights file (a
    refused file stops here, before the data or the model is built), build the data module and the model,
    load the weights, build the trainer. Every refusal happens here; ``evaluate.py`` reports it in one line
    and leaves no run directory behind. Returns the objects :func:`run_evaluation` takes."""
    start = time.perf_counter()
    ckpt_path, pretrained = cfg.get("ckpt_path"), cfg.model.get("pretrained_file")
    if not ckpt_path and not pretrained:
        raise ValueError(
            "evaluate.py needs weights: set ckpt_path=/path/to/run.ckpt (or a backbone .safetensors/.pth) "
            "or model.pretrained_file=/path/to/timm_weights.safetensors"
        )
    check_accelerator(cfg.trainer)
    extras(cfg)
    if cfg.get("seed") is not None:  # logged once the data is built: a refusal before prints one line only
        L.seed_everything(cfg.seed, workers=True, verbose=False)
    run_dir = str(cfg.paths.output_dir)
    state = read_weights(str(ckpt_path), arg="ckpt_path") if ckpt_path else None

    datamodule = instantiate_data(cfg)
    if cfg.get("seed") is not None:
        log.info("Seed set to %d", cfg.seed)
    save_resolved_config(cfg, run_dir)
    model: LightningModule = hydra.utils.instantiate(cfg.model, _convert_="partial")
    source = f"pretrained_file {pretrained}"
    if state is not None:
        kind = _load_state(model, state)
        del state
        source = f"{kind} checkpoint {ckpt_path}"
    log.info("Evaluating %s", source)

    loggers = instantiate_loggers(cfg.get("logger"))
    trainer: Trainer = hydra.utils.instantiate(cfg.trainer, logger=loggers or False, callbacks=[])
    return dict(cfg=cfg, datamodule=datamodule, model=model, trainer=trainer, run_dir=run_dir, weights=source,
                start=start)


def run_evaluation(prepared: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Test the prepared model, write the confusion matrix and the per-class table: the work of
    :func:`evaluate` after :func:`prepare_evaluation`."""
    cfg, datamodule, model, trainer = (prepared[k] for k in ("cfg", "datamodule", "model", "trainer"))
    run_dir = prepared["run_dir"]
    trainer.test(model=model, datamodule=datamodule, verbose=False)

    metrics: dict[str, Any] = {
        k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")
    }
    confmat = model.confusion_matrix
    names = list(getattr(datamodule, "class_names", ()) or [str(i) for i in range(confmat.shape[0])])
    support = confmat.sum(dim=1)
    correct = confmat.diagonal()
    per_class = [
        (names[i], int(support[i]), float(correct[i] / support[i]) if support[i] > 0 else float("nan"))
        for i in range(confmat.shape[0])
    ]
    metrics["per_class_acc"] = {n: a for n, _, a in per_class}
    metrics["num_samples"] = int(support.sum())
    metrics["time_s"] = round(time.perf_counter() - prepared["start"], 2)

    png = None
    if trainer.is_global_zero:
        os.makedirs(run_dir, exist_ok=True)
        png = plot_confusion_matrix(
            confmat,
            names,
            os.path.join(run_dir, "confusion_matrix.png"),
            int(cfg.get("confusion_matrix_max_labels", 50)),
        )
        with open(os.path.join(run_dir, "per_class_accuracy.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["class", "support", "correct", "accuracy"])
            for i, (n, s, a) in enumerate(per_class):
                w.writerow([n, s, int(correct[i]), a])
        torch.save(confmat, os.path.join(run_dir, "confusion_matrix.pt"))
        print(format_table(metrics, per_class), flush=True)
    objects = dict(
        cfg=cfg,
        datamodule=datamodule,
        model=model,
        trainer=trainer,
        run_dir=run_dir,
        confusion_matrix=confmat,
        confusion_matrix_png=png,
        weights=prepared["weights"],
    )
    return metrics, objects


def evaluate(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Evaluate ``cfg.model`` with weights from ``cfg.ckpt_path`` or ``cfg.model.pretrained_file`` on the
    test split of ``cfg.data`` (FP32 unless ``trainer.precision`` says otherwise):
    :func:`prepare_evaluation` then :func:`run_evaluation`.

    Returns:
        ``(metrics, objects)``; ``metrics`` holds ``test/acc``, ``test/acc5``, ``test/loss``,
        ``per_class_acc`` (class name -> accuracy), ``num_samples``, ``time_s``.
    """
    return run_evaluation(prepare_evaluation(cfg))


def evaluate_zeroshot(cfg: DictConfig) -> dict[str, Any]:
    """``task=zeroshot`` (top-1/top-5 from class-name prompts) or ``task=embed`` (image-embedding export).

    Runs :func:`elsa_vision.tasks.zeroshot.run` with the ``cfg.zeroshot`` block; needs open-clip-torch
    (``pip install elsa_vision[clip]``).
    """
    from omegaconf import OmegaConf

    from .zeroshot import run

    task = cfg.get("task", "classification")
    if task not in ("zeroshot", "embed"):
        raise ValueError(f"evaluate_zeroshot: task must be 'zeroshot' or 'embed', got {task!r}")
    options = OmegaConf.to_container(cfg.zeroshot, resolve=True)
    if not options.get("data"):
        raise ValueError(f"task={task} needs zeroshot.data=/path/to/imagefolder (one sub-folder per class)")
    return run(task=task, **options)
