"""The float32 precision vocabulary of every ELSA kernel and the one function that resolves it.

``precision`` is a user option for float32 inputs (ignored for float16/bfloat16, which always multiply on
tensor cores with float32 accumulation):

* ``"auto"``: the fastest FP32-accurate choice (relative error <= 1e-6 against float64) for the device and
  kernel: ``"fp16x3"`` where the kernel has it on sm90, ``"tf32x3"`` on other tensor-core GPUs (sm80+),
  ``"ieee"`` elsewhere (older GPUs, the CPU interpreter);
* ``"ieee"``: plain FP32 FMA, no tensor cores;
* ``"tf32x3"``: three TF32 tensor-core products per dot (Triton's split): FP32-accurate;
* ``"fp16x3"``: three float16 tensor-core products of power-of-two-scaled two-part splits
  (``monoid.split_f16``): FP32-accurate at twice the TF32 rate; the dense forward and backward have it for
  padded head dims up to 128;
* ``"tf32"``: one TF32 pass (~1e-3).

:func:`resolve_precision` turns the option into the ``PRECISION`` constexpr of one kernel. It imports neither
Triton nor any kernel, so the package validates options without Triton.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["PRECISIONS", "KERNELS", "resolve_precision", "device_info"]

PRECISIONS = ("auto", "ieee", "tf32x3", "fp16x3", "tf32")
# The kernels a precision is resolved for, and the widest padded head dim each runs "fp16x3" at (0: never).
KERNELS = {"fwd": 128, "bwd": 128, "decode": 0, "window": 0}


def device_info(device) -> tuple[int, tuple[int, int], int]:
    """(SM count, compute capability, shared memory per block) of a CUDA device; CPU (the Triton
    interpreter): ``(4, (0, 0), 1 GiB)``."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return _device_info(device)


@functools.lru_cache(maxsize=64)
def _device_info(device) -> tuple[int, tuple[int, int], int]:
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        smem = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024
        return props.multi_processor_count, (props.major, props.minor), int(smem)
    return 4, (0, 0), 1 << 30


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def resolve_precision(precision: str, dtype: torch.dtype, device, kernel: str, head_dim: int | None = None,
                      ) -> str:
    """The ``PRECISION`` constexpr of one launch of ``kernel`` (a key of ``KERNELS``).

    ``"none"`` for float16/bfloat16 inputs. For float32: ``"auto"`` becomes ``"fp16x3"`` on sm90 where the
    kernel has it for ``head_dim`` (padded to a power of two), ``"tf32x3"`` on other sm80+ GPUs, ``"ieee"``
    elsewhere. An explicit ``"fp16x3"`` the kernel does not have (at this head dim, or at all: the window and
    decode kernels) runs as ``"tf32x3"``, the other FP32-accurate tensor-core path.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    if dtype != torch.float32:
        return "none"
    widest = KERNELS[kernel]
    f16_ok = widest > 0 and head_dim is not None and _pow2(head_dim) <= widest
    if precision == "auto":
        cc = device_info(device)[1]
        if cc < (8, 0):
            return "ieee"
        precision = "fp16x3" if f16_ok and cc[0] == 9 else "tf32x3"
    if precision == "fp16x3" and not f16_ok:
        precision = "tf32x3"
    return precision
