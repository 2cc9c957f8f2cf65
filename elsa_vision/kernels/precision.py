"""The float32 precision vocabulary of every ELSA kernel and the one function that resolves it.

``precision`` is a user option for float32 inputs (ignored for float16/bfloat16, which always multiply on
tensor cores with float32 accumulation):

* ``"auto"``: the fastest FP32-accurate choice (relative error <= 1e-6 against float64) for the device and
  kernel: ``"fp16x3"`` where the kernel has it on sm90, ``"tf32x3"`` on other tensor-core GPUs (sm80+),
  ``"ieee"`` elsewhere (older GPUs, the CPU interpreter);
* ``"ieee"``: plain FP32 FMA, no tensor cores;
* ``"tf32x3"``: three TF32 tensor-core products per dot (Triton's split): FP32-accurate;
* ``"fp16x3"``: three float16 tensor-core products of power-of-two-scaled two-part splits
  (``dots.split_f16``): FP32-accurate at twice the TF32 rate; the dense forward and backward have it for
  padded head dims up to 128;
* ``"tf32"``: one TF32 pass (~1e-3).

:func:`resolve_precision` turns the option into the ``PRECISION`` constexpr of one kernel. It imports neither
Triton nor any kernel, so the package validates options without Triton.
"""

from __future__ import annotations

import torch

from .host import device_info, next_pow2

__all__ = ["PRECISIONS", "FP16X3_TILES", "accumulation_dtype", "resolve_precision"]

PRECISIONS = ("auto", "ieee", "tf32x3", "fp16x3", "tf32")
# The kernels a precision is resolved for, and the widest tile side (padded to a power of two) that each one's
# "fp16x3" path splits in registers; 0: the kernel has no "fp16x3" path. The attention kernels split whole
# head-dim rows of Q, K and V (``width`` = the padded head dim); the GEMM splits BLOCK_K-wide tiles whatever K
# is (``width`` = None).
FP16X3_TILES = {"fwd": 128, "bwd": 128, "decode": 0, "window": 0, "gemm": 128}


def resolve_precision(precision: str, dtype: torch.dtype, device, kernel: str, width: int | None = None,
                      ) -> str:
    """The ``PRECISION`` constexpr of one launch of ``kernel`` (a key of ``FP16X3_TILES``).

    ``"none"`` for float16/bfloat16 inputs. For float32: ``"auto"`` becomes ``"fp16x3"`` on sm90 where the
    kernel has it for a split tile of side ``width`` (padded to a power of two; None: the kernel's tiles do
    not depend on the call), ``"tf32x3"`` on other sm80+ GPUs, ``"ieee"`` elsewhere. An explicit
    ``"fp16x3"`` the kernel does not have (at this width, or at all: the window and decode kernels) runs as
    ``"tf32x3"``, the other FP32-accurate tensor-core path.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    if dtype != torch.float32:
        return "none"
    widest = FP16X3_TILES[kernel]
    f16_ok = widest > 0 and (width is None or next_pow2(width) <= widest)
    if precision == "auto":
        cc = device_info(device)[1]
        if cc < (8, 0):
            return "ieee"
        precision = "fp16x3" if f16_ok and cc[0] == 9 else "tf32x3"
    if precision == "fp16x3" and not f16_ok:
        precision = "tf32x3"
    return precision


def accumulation_dtype(t) -> torch.dtype:
    """The dtype every torch-side computation of ``t`` accumulates in (the reference scan, the torch
    backend, the window op's dense backward, context parallelism's partial results): float64 for float64
    inputs, else float32 (half precision is upcast)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
