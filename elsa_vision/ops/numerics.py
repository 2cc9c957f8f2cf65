"""How the torch paths compute: the dtype they accumulate in, and the precision of CUDA float32 matmuls.

One rule for every torch-side computation of the ops (the torch backend, the window op's dense backward,
context parallelism's partial results): float64 inputs are computed in float64, everything else in float32;
float32 matmuls on CUDA run in IEEE float32 unless the caller asked for TF32.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = ["accumulation_dtype", "cuda_matmul_precision"]


@contextlib.contextmanager
def cuda_matmul_precision(tf32: bool):
    """Pin CUDA float32 matmuls to IEEE (or TF32) for the torch backend; restores the setting on exit."""
    flag = torch.backends.cuda.matmul
    old = flag.allow_tf32
    flag.allow_tf32 = tf32
    try:
        yield
    finally:
        flag.allow_tf32 = old


def accumulation_dtype(t: Tensor) -> torch.dtype:
    """The dtype a torch path computes ``t``'s results in, and partial results are kept and merged in:
    float64 for float64 inputs, else float32 (half precision is upcast)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
