"""The trainer's accelerator and the command-line tools' ``--device`` checked against the machine before
anything is built."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

import torch

__all__ = [
    "add_device_argument",
    "available_memory_mb",
    "check_accelerator",
    "host_available_mb",
    "resolve_device",
]

# Lightning's accelerator names that need a GPU ("gpu": CUDA or Apple MPS).
_NEEDS = {"gpu": "a GPU", "cuda": "a CUDA GPU", "mps": "an Apple MPS device"}


def _available(accelerator: str) -> bool:
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    return {"gpu": cuda or mps, "cuda": cuda, "mps": mps}[accelerator]


def check_accelerator(trainer_cfg: Mapping) -> None:
    """Raise one ``ValueError`` when ``trainer.accelerator`` asks for a device this machine lacks (Lightning
    would stop with ``No supported gpu backend found!``); GPU configs (``trainer=gpu|ddp|fsdp|cp``, the
    ImageNet and fine-tuning experiments) then say how to run on the CPU."""
    accelerator = str(trainer_cfg.get("accelerator", "auto")).lower()
    if accelerator in _NEEDS and not _available(accelerator):
        raise ValueError(
            f"trainer.accelerator={accelerator} needs {_NEEDS[accelerator]} and this machine has none: "
            f"run on a GPU machine or pass trainer.accelerator=cpu")


def resolve_device(device: str | torch.device | None, name: str = "--device") -> torch.device:
    """``device`` as a ``torch.device``; None: a CUDA GPU when the machine has one, else the CPU.

    One ``ValueError`` starting with ``name`` (the caller's name for the setting) for a string torch does not
    read as a device, or a device this machine lacks (CUDA, a CUDA index, Apple MPS), before anything is
    built or read.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} {device!r} is not a torch device (cpu, cuda, cuda:1, mps, ...)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {device}: this machine has no CUDA GPU; pass {name} cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{name} {device}: this machine has no Apple MPS device; pass {name} cpu")
    return dev


def add_device_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--device`` of a command-line tool, read by :func:`resolve_device` (default: CUDA when available)."""
    parser.add_argument(
        "--device", default=None, help="torch device: cpu, cuda, cuda:1, ... (default: cuda when available)"
    )


def host_available_mb() -> float:
    """The RAM this machine can give a new allocation now, in MiB (``MemAvailable`` of ``/proc/meminfo``;
    elsewhere the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")) / 2**20


def available_memory_mb(device: str | torch.device) -> tuple[float, str]:
    """``(MiB, where)``: the memory a run on ``device`` can hold at most. ``device``: a Lightning accelerator
    name (``cpu``, ``gpu``, ``cuda``, ``auto``) or a torch device. A CUDA device (``gpu`` / ``auto`` on a
    machine with one: device 0) gives its total memory, anything else the host's available RAM
    (:func:`host_available_mb`)."""
    name = str(device).lower()
    if (name in ("gpu", "auto") or name.startswith("cuda")) and torch.cuda.is_available():
        index = torch.device(name).index if name.startswith("cuda") else None
        index = 0 if index is None else index
        return torch.cuda.get_device_properties(index).total_memory / 2**20, f"cuda:{index}"
    return host_available_mb(), "available RAM"
