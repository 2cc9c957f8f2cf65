"""Host-side helpers shared by every kernel family's planner and launcher: integer tile arithmetic, the
device facts a plan depends on, and the float dtypes the kernels take.

They are plain Python on purpose: ``triton.cdiv`` / ``triton.next_power_of_2`` are slow when called from
Python (docs/kernel_notes.md, "Compiler and hardware behaviour"), and a planner calls them on every new
signature. Nothing here imports Triton, so the package validates options and plans without it.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["FLOAT_DTYPES", "LOG2E", "canonical_device", "cdiv", "device_info", "next_pow2", "tile_size",
           "version_state"]

# The dtypes every Triton kernel takes (float64 runs on the torch reference).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# log2(e): the kernels work in the base-2 domain (``exp2``), so logits are scaled by it once.
LOG2E = 1.4426950408889634


def version_state(*tensors: torch.Tensor) -> tuple | None:
    """``((address, version), ...)`` of ``tensors``' values, the key of a result kept from one call to the
    next (the GEMM's weight splits, Swin-v2's position and qkv biases): the version counter advances at
    every in-place change through a tensor or a view of it (writes through ``t.data`` bypass it). None where
    nothing computed from them may be kept: an inference tensor (made under ``torch.inference_mode``) has no
    version counter, and while a CUDA graph is captured a kept result would be baked into the graph, which
    must read its inputs as they are at each replay."""
    if any(t.is_inference() for t in tensors) or (
            tensors[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return tuple((t.data_ptr(), t._version) for t in tensors)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def tile_size(n: int, lo: int = 16) -> int:
    """The tile side that covers ``n`` elements: ``next_pow2(n)``, at least ``lo`` (``tl.dot`` needs every
    side of a tile to be a power of two of at least 16)."""
    return max(lo, next_pow2(n))


def canonical_device(device) -> torch.device:
    """``device`` as a ``torch.device`` with its CUDA index filled in (the current device for ``"cuda"``), so
    that plans cached by device are keyed by the card they run on."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_info(device) -> tuple[int, tuple[int, int], int]:
    """(SM count, compute capability, shared memory per block) of a CUDA device; CPU (the Triton
    interpreter) or None: ``(4, (0, 0), 1 GiB)``."""
    return _device_info(None if device is None else canonical_device(device))


@functools.lru_cache(maxsize=64)
def _device_info(device) -> tuple[int, tuple[int, int], int]:
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        smem = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024
        return props.multi_processor_count, (props.major, props.minor), int(smem)
    return 4, (0, 0), 1 << 30
