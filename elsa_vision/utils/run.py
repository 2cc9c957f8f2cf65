"""Helpers shared by ``train.py`` and ``evaluate.py``: instantiation, checkpoints, run-directory artefacts.

A run lives in one directory from its start to its end, resumes included (:mod:`.run_dirs` picks it);
:class:`RunCSVLogger` appends to that run's ``metrics.csv``; :class:`SafeCheckpointIO` writes checkpoints
atomically and reads them weights-only.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import re
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import DictConfig, OmegaConf

from ..files import atomic_torch_save, atomic_write, checkpoint_kind, read_checkpoint
from .run_dirs import config_mismatch, discard_new_run_dir, newest_last_checkpoint

__all__ = [
    "CLASSIFICATION_CURVES",
    "CheckpointPathError",
    "REFUSALS",
    "RunCSVLogger",
    "SafeCheckpointIO",
    "describe_net",
    "extras",
    "find_last_checkpoint",
    "instantiate_callbacks",
    "instantiate_loggers",
    "last_logged_metrics",
    "no_empty_run_dir",
    "plot_curves",
    "print_json_line",
    "quiet_logs",
    "refusal_message",
    "refused_in_one_line",
    "save_resolved_config",
    "training_checkpoint_kind",
    "trim_metrics_csv",
]

log = logging.getLogger(__name__)


class _DropMessages(logging.Filter):
    """Drops the records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


_LIGHTNING_TIPS = _DropMessages("💡 Tip:")


def quiet_logs() -> None:
    """Every log line once, and none that is not about the run (called by :func:`extras`).

    * ``lightning/__init__.py`` gives the ``lightning`` logger a stderr handler of its own, and its records
      also reach the root logger's handlers (Hydra's console and the run's log file): in a terminal every
      Lightning line showed twice. Where the application configured the root logger, Lightning's own
      handler is removed and its records go through the root logger only.
    * Lightning's advertisements for its cloud packages (``💡 Tip: ... litlogger`` / ``litmodels``) are
      dropped.
    * Lightning 2.6 calls torch's deprecated ``isinstance(treespec, LeafSpec)`` on every run (torch's
      deprecation warning, nothing the run can act on): that one warning is ignored.
    """
    if logging.getLogger().handlers:
        lightning = logging.getLogger("lightning")
        for handler in list(lightning.handlers):
            if type(handler) is logging.StreamHandler:
                lightning.removeHandler(handler)
        lightning.propagate = True
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if _LIGHTNING_TIPS not in rank_zero.filters:
        rank_zero.addFilter(_LIGHTNING_TIPS)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def describe_net(net_cfg: DictConfig | Mapping[str, Any] | None, net: Any) -> str:
    """What a run's network is, for its log: the class, the parameter count and the configuration it was
    built from (the registered name and every argument that overrides it, resolved), e.g. ``ElsaViT,
    308,362 parameters: elsa_vit_tiny_patch16_224 with img_size=32, patch_size=8, embed_dim=96, depth=4``
    -- the registered name alone would name another architecture."""
    n_params = sum(p.numel() for p in net.parameters()) if hasattr(net, "parameters") else 0
    what = f"{type(net).__name__}, {n_params:,} parameters"
    if not net_cfg:
        return what
    conf = OmegaConf.to_container(net_cfg, resolve=True) if isinstance(net_cfg, DictConfig) else dict(net_cfg)
    conf.pop("_target_", None)
    name = conf.pop("model_name", None) or conf.pop("name", None)
    args = ", ".join(f"{k}={v}" for k, v in conf.items())
    if name is None:
        return f"{what}: {args}" if args else what
    return f"{what}: {name} with {args}" if args else f"{what}: {name}"


def extras(cfg: DictConfig) -> None:
    """Optional run-wide settings from ``cfg.extras``: warning filters, float32 matmul precision, the
    number of CPU threads torch uses for this process and the largest image (``PIL.Image.MAX_IMAGE_PIXELS``)
    read before decoding is refused; and :func:`quiet_logs`."""
    import torch

    quiet_logs()
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
    max_pixels = ex.get("max_image_pixels")
    if max_pixels is not None:
        from PIL import Image

        if int(max_pixels) < 1:
            raise ValueError(f"extras.max_image_pixels must be >= 1 or null, got {max_pixels}")
        Image.MAX_IMAGE_PIXELS = int(max_pixels)  # data loader workers started afterwards inherit it


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


def find_last_checkpoint(
    output_dir: str | os.PathLike, search_glob: str, identity: Mapping[str, Any] | None = None
) -> str:
    """Resolve ``ckpt_path=last``: this run's ``checkpoints/last.ckpt``, else the newest match of the glob,
    of a run trained with the configuration ``identity`` (:func:`~elsa_vision.utils.run_dirs.run_identity`;
    None: any run).

    Raises:
        FileNotFoundError: naming both places when no ``last.ckpt`` exists.
        CheckpointPathError: the run found was trained with another configuration (naming the run and the
            first difference).
    """
    own = Path(output_dir) / "checkpoints" / "last.ckpt"
    if own.is_file():
        found = str(own)
    else:
        found = newest_last_checkpoint(search_glob, identity) or newest_last_checkpoint(search_glob)
    if found is None:
        raise FileNotFoundError(
            f"ckpt_path=last: no last.ckpt in {str(own.parent)!r} nor any matching {search_glob!r}; "
            "pass ckpt_path=/path/to/last.ckpt"
        )
    run = Path(found).parent.parent
    why = config_mismatch(identity, run)
    if why is not None:
        raise CheckpointPathError(
            f"ckpt_path=last: the newest run with a last.ckpt, {str(run)!r}, was trained with another "
            f"configuration ({why}); pass ckpt_path={found} to resume it anyway, or no ckpt_path to start "
            "a new run"
        )
    return found


def trim_metrics_csv(metrics_csv: str | os.PathLike, before_step: int) -> int:
    """Drop the rows of a ``metrics.csv`` logged at ``step >= before_step`` (what a run logged after the
    checkpoint it now resumes from) and a row torn by an interruption (a last line without its newline, a
    row with more or fewer fields than the header, a step that is not a number); the file is replaced
    atomically. A file whose header itself is torn is removed (the logger starts a new one). Returns the
    number of rows dropped."""
    path = Path(metrics_csv)
    if not path.is_file():
        return 0
    with open(path, newline="") as f:
        text = f.read()
    torn = bool(text) and not text.endswith("\n")
    lines = list(csv.reader(io.StringIO(text)))
    if not lines or (torn and len(lines) == 1):
        path.unlink()
        return 0
    fields, rows = lines[0], lines[1:]
    if torn:
        rows = rows[:-1]

    def kept(row: list[str]) -> bool:
        if len(row) != len(fields):
            return False
        step = dict(zip(fields, row)).get("step")
        if not step:
            return True
        try:
            return int(float(step)) < before_step
        except ValueError:
            return False

    keep = [r for r in rows if kept(r)]
    dropped = len(lines) - 1 - len(keep)
    if dropped == 0:
        return 0
    with atomic_write(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        writer.writerows(keep)
    return dropped


def last_logged_metrics(
    metrics_csv: str | os.PathLike, prefixes: tuple[str, ...] = ("train/", "val/")
) -> dict[str, float]:
    """The last value logged for every metric of ``metrics.csv`` whose name starts with one of ``prefixes``
    (``{}`` without the file): what a run reports after ``fit`` when it resumes from the checkpoint of its
    last epoch and trains no further epoch (the trainer then holds no metrics of its own)."""
    path = Path(metrics_csv)
    if not path.is_file():
        return {}
    values: dict[str, float] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if isinstance(key, str) and key.startswith(prefixes) and value not in ("", None):
                    with contextlib.suppress(ValueError):
                        values[key] = float(value)
    return values


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` (a resumed run's) is continued: its
    header is adopted and new rows are appended. Lightning's writer deletes it (with a warning, also about
    the run's other files)."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = list(next(csv.reader(f), []))


class RunCSVLogger(CSVLogger):
    """``CSVLogger`` writing ``metrics.csv`` into the run directory and continuing it when a run resumes.

    Same arguments as ``CSVLogger``; the run directory holds other files (Hydra's, checkpoints), which is
    expected and not warned about.
    """

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


class CheckpointPathError(ValueError):
    """A file given as a training checkpoint holds weights only (``.safetensors``, a TorchScript archive):
    there is no training state to resume from."""


def training_checkpoint_kind(path: str | os.PathLike, *, arg: str | None = None) -> str:
    """The :func:`elsa_vision.files.checkpoint_kind` of a file a run resumes (or tests) from, which must be
    a ``torch.save`` checkpoint (``"torch"`` or ``"torch-legacy"``). Nothing is unpickled. ``arg``: the
    caller's name for the file (``"ckpt_path"``); errors then start with it.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        NotACheckpointError: the file is not a checkpoint at all (an image, a text file ...).
        CheckpointPathError: the file is a checkpoint of weights only.
    """
    kind = checkpoint_kind(path, arg=arg)
    if kind not in ("torch", "torch-legacy"):
        named = f"{arg}: " if arg else ""
        raise CheckpointPathError(
            f"{named}{os.fspath(path)!r} is a {kind} file of weights, not a training checkpoint; to start "
            "from weights use model.pretrained_file=... (timm weights) or evaluate.py"
        )
    return kind


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O, made safe for the files it reads and writes.

    * save: :func:`elsa_vision.files.atomic_torch_save` (a temporary file next to the target, fsync, rename):
      a crash, a kill or a full disk leaves the previous checkpoint intact, whatever filesystem ``$TMPDIR``
      is on (Lightning writes through fsspec, which stages in ``$TMPDIR`` and copies across filesystems);
    * load: :func:`elsa_vision.files.read_checkpoint`, always weights-only, with errors that name the file
      (missing, not a checkpoint, a file of weights only (:func:`training_checkpoint_kind`), holds Python
      objects, truncated).

    Remote paths (``s3://`` ...) keep Lightning's behaviour.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(
        self, path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not _is_local_file_protocol(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=True)
        training_checkpoint_kind(path)
        return read_checkpoint(path, map_location=map_location or "cpu")


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


# What a task's curves.png shows: panel title -> the metrics.csv columns drawn in it (one line per column, per
# epoch). A LightningModule names its own in a class attribute ``curves``; this is the classification default.
CLASSIFICATION_CURVES: Mapping[str, tuple[str, ...]] = {
    "loss": ("train/loss", "val/loss"),
    "top-1 accuracy": ("train/acc", "val/acc"),
}


def plot_curves(
    metrics_csv: str | os.PathLike,
    png_path: str | os.PathLike,
    panels: Mapping[str, Sequence[str]] | None = None,
) -> Path | None:
    """Plot per-epoch curves from a CSVLogger ``metrics.csv`` into ``png_path``: one panel per entry of
    ``panels`` (title -> metric columns, one line each; default :data:`CLASSIFICATION_CURVES`). A panel none
    of whose columns were logged is left out (and named in a warning), not drawn empty."""
    if not os.path.isfile(metrics_csv):
        log.warning("no %s: learning curves not plotted", metrics_csv)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _read_epoch_metrics(metrics_csv)
    panels = dict(CLASSIFICATION_CURVES if panels is None else panels)
    drawn = {title: [k for k in keys if series.get(k)] for title, keys in panels.items()}
    empty = [title for title, keys in drawn.items() if not keys]
    if empty:
        log.warning("curves.png: no logged values for %s", ", ".join(
            f"{title} ({', '.join(panels[title])})" for title in empty))
    drawn = {title: keys for title, keys in drawn.items() if keys}
    if not drawn:
        return None
    fig, axes = plt.subplots(1, len(drawn), figsize=(5 * len(drawn), 4), squeeze=False)
    for ax, (title, keys) in zip(axes[0], drawn.items()):
        for key in keys:
            points = series[key]
            epochs = sorted(points)
            ax.plot(epochs, [points[e] for e in epochs], marker="o", markersize=3, label=key)
        ax.set_xlabel("epoch")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


# What a refused setting or input raises before a run does any work (a config value, a missing or refused
# file, a device the machine lacks): reported in one line by train.py / evaluate.py.
REFUSALS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


@contextlib.contextmanager
def refused_in_one_line(run_dir: str | os.PathLike):
    """Around a command's preparation (``train.py``, ``evaluate.py``): a refused setting or file
    (:func:`refusal_message`) ends the process with one ``error: ...`` line (exit status 1) and no run
    directory left behind (``run_dirs.discard_new_run_dir``); any other error keeps its traceback."""
    try:
        yield
    except Exception as e:
        discard_new_run_dir(run_dir)
        message = refusal_message(e)
        if message is None:
            raise
        sys.exit(f"error: {message}")


@contextlib.contextmanager
def no_empty_run_dir(run_dir: str | os.PathLike):
    """Around a command's work: whatever stops it, the run directory goes if it holds nothing but Hydra's
    files (``run_dirs.discard_new_run_dir``)."""
    try:
        yield
    except BaseException:
        discard_new_run_dir(run_dir)
        raise


def refusal_message(error: BaseException) -> str | None:
    """The one line that reports ``error``, a refused setting or file, or None for any other error (a bug,
    which keeps its traceback). Hydra's ``InstantiationException`` is unwrapped to the error of the call it
    reports (prefixed with the config key it names, ``model.net: ...``); OmegaConf's missing mandatory
    value (``data.path: ???``) is a refusal too; line breaks of a message are joined."""
    from hydra.errors import InstantiationException
    from omegaconf.errors import MissingMandatoryValue

    where = ""
    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        found = re.search(r"full_key: (\S+)", str(error))
        where = found.group(1) if found else where
        error = error.__cause__
    if isinstance(error, MissingMandatoryValue):
        return str(error).splitlines()[0]
    if not isinstance(error, REFUSALS):
        return None
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{where}: {text}" if where and not text.startswith(where) else text


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
