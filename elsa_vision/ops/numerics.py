"""How the torch paths compute CUDA float32 matmuls: in IEEE float32 unless the caller asked for TF32. (The
dtype they accumulate in is ``kernels.precision.accumulation_dtype``.)
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["cuda_matmul_precision"]


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
