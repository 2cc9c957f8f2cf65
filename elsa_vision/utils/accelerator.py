"""The trainer's accelerator checked against the machine before anything is built."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["check_accelerator"]

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
