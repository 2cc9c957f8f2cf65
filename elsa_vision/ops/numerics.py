"""How the torch paths compute: the dtype results accumulate in, the precision of CUDA float32 matmuls."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


@contextlib.contextmanager
def _cuda_matmul_precision(tf32: bool):
    """Pin CUDA float32 matmuls to IEEE (or TF32) for the torch backend; restores the setting on exit."""
    flag = torch.backends.cuda.matmul
    old = flag.allow_tf32
    flag.allow_tf32 = tf32
    try:
        yield
    finally:
        flag.allow_tf32 = old


def accumulation_dtype(t: Tensor) -> torch.dtype:
    """The dtype partial results are kept and merged in: float64 for float64 inputs, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
