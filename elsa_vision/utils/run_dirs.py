"""Run directories: where a training or evaluation run writes, and which run a resume continues.

Hydra's ``hydra.run.dir`` resolves through :func:`run_dir_for` (the ``run_dir`` resolver that
:func:`register_resolvers` installs; ``train.py`` and ``evaluate.py`` call it before Hydra starts). This
module does not import Lightning: it runs before Hydra configures logging, and Lightning imported that early
would keep its log records out of the run's ``train.log``.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

__all__ = [
    "config_mismatch",
    "discard_new_run_dir",
    "newest_last_checkpoint",
    "register_resolvers",
    "run_dir_for",
    "run_identity",
    "run_of_checkpoint",
]

# model.net settings that do not change the network's parameters: a resume may change them
_RUNTIME_NET_KEYS = ("attn_backend", "attn_precision", "linear_backend", "drop_rate", "drop_path_rate",
                     "pretrained_file")


def _flat(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out
    return {prefix: tree}


def run_identity(cfg: Mapping) -> dict[str, Any] | None:
    """What a run's checkpoints depend on, as flat ``{dotted key: value}``: ``model._target_``, the network
    (``model.net``, without settings that leave its parameters alone: attention backend and precision, the
    linear layers' backend, dropout rates, the initial weights file) and ``data._target_``.
    ``ckpt_path=last`` resumes only a run whose saved ``config_resolved.yaml`` has the same identity. None
    when ``cfg`` has no model config or its values cannot be resolved here."""
    try:
        model, data = cfg.get("model"), cfg.get("data")
        if model is None:
            return None
        if isinstance(cfg, DictConfig):
            model = OmegaConf.to_container(model, resolve=True)
            data = OmegaConf.to_container(data, resolve=True) if data is not None else None
    except Exception:  # an interpolation only Hydra's runtime can resolve, a missing value (???)
        return None
    if not isinstance(model, Mapping):
        return None
    net = model.get("net")
    identity = {"model._target_": model.get("_target_"), "data._target_": (data or {}).get("_target_")}
    if isinstance(net, Mapping):
        identity.update(_flat({k: v for k, v in net.items() if k not in _RUNTIME_NET_KEYS}, "model.net"))
    else:
        identity["model.net"] = net
    return identity


def config_mismatch(identity: Mapping[str, Any] | None, run_dir: str | os.PathLike) -> str | None:
    """None when the run in ``run_dir`` was trained with ``identity`` (:func:`run_identity`) or no identity
    is given; else the first difference, in a few words. A setting that is null in ``identity`` (taken from
    the data, such as ``num_classes``) matches any saved value."""
    if identity is None:
        return None
    saved_path = Path(run_dir) / "config_resolved.yaml"
    try:
        saved = run_identity(yaml.safe_load(saved_path.read_text()) or {})
    except (OSError, yaml.YAMLError, AttributeError):
        saved = None
    if saved is None:
        return f"it has no readable {saved_path.name}"
    for key in sorted(identity.keys() | saved.keys()):
        if key in identity and identity[key] is None:
            continue
        if key not in saved or key not in identity or saved[key] != identity[key]:
            return f"{key}: {saved.get(key)!r} there, {identity.get(key)!r} here"
    return None


def newest_last_checkpoint(search_glob: str, identity: Mapping[str, Any] | None = None) -> str | None:
    """The most recently modified file matching ``search_glob`` (a ``*/checkpoints/last.ckpt`` pattern);
    with ``identity``, of a run trained with that configuration (:func:`config_mismatch`)."""
    found = [p for p in glob.glob(search_glob) if os.path.isfile(p)]
    for path in sorted(found, key=os.path.getmtime, reverse=True):
        if config_mismatch(identity, Path(path).parent.parent) is None:
            return path
    return None


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


_RUN_DIRS: dict[tuple[str, str | None, str], str] = {}
_CREATED: dict[str, list[str]] = {}  # run directory this process created -> the parents it created for it


def run_dir_for(runs_root: str, ckpt_path: str | None = None, *, _root_: Any = None) -> str:
    """The directory of a run under ``runs_root`` (the ``run_dir`` resolver of ``configs/hydra``).

    ``ckpt_path=last`` (the newest ``<runs_root>/*/checkpoints/last.ckpt`` of a run trained with the
    configuration being composed, ``_root_``: :func:`run_identity`) or a run's own ``last.ckpt`` continues
    that run's directory (:func:`run_of_checkpoint`). Anything else gets a new directory named by the start
    time, ``YYYY-MM-DD_HH-MM-SS``; it is created here with an exclusive ``mkdir``, so two jobs started in the
    same second get two directories (the later one with a suffix ``_1``, ``_2``, ...). The answer is fixed
    for the process: resolving it again returns the same directory.
    """
    identity = run_identity(_root_) if ckpt_path == "last" and _root_ is not None else None
    key = (
        os.path.abspath(runs_root),
        None if ckpt_path in (None, "") else str(ckpt_path),
        repr(sorted(identity.items())) if identity else "",
    )
    if key in _RUN_DIRS:
        return _RUN_DIRS[key]
    root, ckpt, _ = key
    resumed = None
    if ckpt == "last":
        last = newest_last_checkpoint(os.path.join(root, "*", "checkpoints", "last.ckpt"), identity)
        resumed = run_of_checkpoint(last, root) if last else None
    elif ckpt is not None:
        resumed = run_of_checkpoint(ckpt, root)
    if resumed is None:
        parents, parent = [], root
        while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
            parents.append(parent)
            parent = os.path.dirname(parent)
        os.makedirs(root, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
        for n in itertools.count():
            candidate = os.path.join(root, stamp if n == 0 else f"{stamp}_{n}")
            try:
                os.mkdir(candidate)
            except FileExistsError:
                continue
            resumed = candidate
            _CREATED[os.path.abspath(candidate)] = parents
            break
    _RUN_DIRS[key] = resumed
    return resumed


def discard_new_run_dir(run_dir: str | os.PathLike) -> bool:
    """Remove ``run_dir`` if :func:`run_dir_for` created it in this process and it holds nothing a run
    produced: only Hydra's ``.hydra/``, log files (``*.log``) and ``config_resolved.yaml``; so are the
    ``logs/<task_name>/runs`` folders created for it, if empty. What a run that fails before any work (a
    refused setting or file) calls, so that it leaves no empty run directory behind; a run with
    checkpoints, metrics or outputs keeps its directory. Returns whether it was removed."""
    path = os.path.abspath(run_dir)
    if path not in _CREATED or not os.path.isdir(path):
        return False
    for entry in os.scandir(path):
        if not (entry.name in (".hydra", "config_resolved.yaml") or entry.name.endswith(".log")):
            return False
    shutil.rmtree(path, ignore_errors=True)
    for parent in _CREATED.pop(path):  # logs/<task>/runs when this run created them, if now empty
        with contextlib.suppress(OSError):
            os.rmdir(parent)
    return True


def register_resolvers() -> None:
    """Register the OmegaConf resolvers the configs use (``run_dir``); call before Hydra composes."""
    OmegaConf.register_new_resolver("run_dir", run_dir_for, replace=True)
