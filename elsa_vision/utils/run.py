"""Helpers shared by ``train.py`` and ``evaluate.py``: instantiation, checkpoints, run-directory artefacts."""

from __future__ import annotations

import csv
import glob
import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

__all__ = [
    "extras",
    "find_last_checkpoint",
    "instantiate_callbacks",
    "instantiate_loggers",
    "plot_curves",
    "print_json_line",
    "save_resolved_config",
]

log = logging.getLogger(__name__)


def extras(cfg: DictConfig) -> None:
    """Optional run-wide settings from ``cfg.extras``: warning filters, float32 matmul precision and the
    number of CPU threads torch uses for this process."""
    import torch

    ex = cfg.get("extras") or {}
    if ex.get("ignore_warnings"):
        warnings.filterwarnings("ignore")
    if ex.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(ex.float32_matmul_precision)
    threads = ex.get("num_threads")
    if threads is not None:
        if int(threads) < 1:
            raise ValueError(f"extras.num_threads must be >= 1 or null, got {threads}")
        torch.set_num_threads(int(threads))


def _instantiate_group(group: DictConfig | None, kind: str, base: type) -> list:
    out = []
    if not group:
        return out
    if not isinstance(group, DictConfig):
        raise TypeError(
            f"{kind} config must be a mapping of name -> {{_target_: ...}}, got {type(group).__name__}"
        )
    for name, conf in group.items():
        if isinstance(conf, DictConfig) and "_target_" in conf:
            obj = hydra.utils.instantiate(conf)
            if not isinstance(obj, base):
                raise TypeError(
                    f"{kind} {name!r} instantiated {type(obj).__name__}, expected a {base.__name__}"
                )
            out.append(obj)
    return out


def instantiate_callbacks(cfg: DictConfig | None) -> list[Callback]:
    """Every entry of ``cfg.callbacks`` that has a ``_target_``."""
    return _instantiate_group(cfg, "callback", Callback)


def instantiate_loggers(cfg: DictConfig | None) -> list[Logger]:
    """Every entry of ``cfg.logger`` that has a ``_target_``."""
    return _instantiate_group(cfg, "logger", Logger)


def save_resolved_config(cfg: DictConfig, output_dir: str | os.PathLike) -> Path:
    """Write ``config_resolved.yaml`` (all interpolations resolved) into the run directory."""
    path = Path(output_dir) / "config_resolved.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return path


def find_last_checkpoint(output_dir: str | os.PathLike, search_glob: str) -> str:
    """Resolve ``ckpt_path=last``: this run's ``checkpoints/last.ckpt``, else the newest match of the glob.

    Raises:
        FileNotFoundError: naming both places when no ``last.ckpt`` exists.
    """
    own = Path(output_dir) / "checkpoints" / "last.ckpt"
    if own.is_file():
        return str(own)
    found = [p for p in glob.glob(search_glob) if os.path.isfile(p)]
    if not found:
        raise FileNotFoundError(
            f"ckpt_path=last: no last.ckpt in {str(own.parent)!r} nor any matching {search_glob!r}; "
            "pass ckpt_path=/path/to/last.ckpt"
        )
    return max(found, key=os.path.getmtime)


def _read_epoch_metrics(metrics_csv: str | os.PathLike) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("epoch"):
                continue
            epoch = int(float(row["epoch"]))
            for key, value in row.items():
                if key in ("epoch", "step") or value in ("", None):
                    continue
                series.setdefault(key, {})[epoch] = float(value)
    return series


def plot_curves(metrics_csv: str | os.PathLike, png_path: str | os.PathLike) -> Path | None:
    """Plot per-epoch loss and accuracy (train/val) from a CSVLogger ``metrics.csv`` into ``png_path``."""
    if not os.path.isfile(metrics_csv):
        log.warning("no %s: learning curves not plotted", metrics_csv)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _read_epoch_metrics(metrics_csv)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ("loss", "acc")):
        for stage in ("train", "val"):
            points = series.get(f"{stage}/{kind}")
            if points:
                epochs = sorted(points)
                ax.plot(
                    epochs, [points[e] for e in epochs], marker="o", markersize=3, label=f"{stage}/{kind}"
                )
        ax.set_xlabel("epoch")
        ax.set_title("loss" if kind == "loss" else "top-1 accuracy")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return v


def print_json_line(payload: Mapping[str, Any]) -> str:
    """Print ``payload`` as one JSON line on stdout (flushed) and return it."""
    line = json.dumps(_plain(payload), sort_keys=True)
    print(line, flush=True)
    return line
