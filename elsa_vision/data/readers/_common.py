"""Checks every reader shares: an index into what a file holds, the pixel dtype, the float32 conversion, and
the slices that keep temporaries small."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["SLICE_BYTES", "check_dtype", "pick", "row_slices", "to_float32"]

# Temporaries (non-finite masks, float64 intermediates) are made over slices of at most this many bytes, so
# that what a reader allocates is the arrays it returns (counted against the input size limit) plus a few
# such slices, whatever the size of the image.
SLICE_BYTES = 16 * 2**20


def row_slices(arr: np.ndarray, itemsize: int = 8) -> Iterator[slice]:
    """Slices along the first axis of ``arr`` covering it, each at most :data:`SLICE_BYTES` when its elements
    take ``itemsize`` bytes (one row at least)."""
    if arr.ndim == 0:
        yield slice(None)
        return
    row = max(1, int(np.prod(arr.shape[1:], dtype=np.int64)) * itemsize)
    step = max(1, SLICE_BYTES // row)
    for start in range(0, arr.shape[0], step):
        yield slice(start, start + step)


def check_dtype(dtype: np.dtype, path: str) -> None:
    """Integer and floating-point pixels are read; anything else is a ``TypeError`` naming the file."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iuf":
        return
    kinds = {"b": "bool", "c": "complex", "V": "structured/void", "O": "object", "U": "string", "S": "bytes"}
    raise TypeError(
        f"input file {path!r}: unsupported pixel dtype {dtype} ({kinds.get(dtype.kind, dtype.kind)}); "
        "expected integer or floating-point pixels"
    )


def _check_float32_range(block: np.ndarray, path: str) -> None:
    if block.dtype.kind == "f" and block.dtype.itemsize > 4:
        big = np.abs(block[np.isfinite(block)]).max(initial=0.0)
        if big > np.finfo(np.float32).max:
            raise ValueError(
                f"input file {path!r}: float64 values up to {big:.3e} overflow float32 (max 3.4e38)"
            )


def to_float32(arr: np.ndarray, path: str, slope: float = 1.0, intercept: float = 0.0) -> np.ndarray:
    """``arr * slope + intercept`` (computed in float64 where a rescale is given) as a new contiguous float32
    array, or ``arr`` itself when it already is one; values beyond the float32 range are refused. The only
    full-size allocation is the result: the float64 work is done :func:`row_slices` at a time."""
    check_dtype(arr.dtype, path)
    rescale = slope != 1.0 or intercept != 0.0
    if not rescale:
        if arr.dtype == np.float32 and arr.flags.c_contiguous:
            return arr
        if arr.dtype.kind != "f" or arr.dtype.itemsize <= 4:
            return np.ascontiguousarray(arr, dtype=np.float32)
    out = np.empty(arr.shape, np.float32)
    for s in row_slices(arr):
        block = arr[s].astype(np.float64) * slope + intercept if rescale else arr[s]
        _check_float32_range(block, path)
        out[s] = block
    return out


def pick(index: int | None, count: int, what: str, path: str) -> list[int]:
    """``[index]`` checked against ``count`` (negative counts from the end), or every index for None."""
    if index is None:
        return list(range(count))
    if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
        raise TypeError(f"{what} must be an int, got {type(index).__name__}")
    i = int(index) + count if index < 0 else int(index)
    if not 0 <= i < count:
        raise ValueError(f"input file {path!r}: {what}={index} is out of range; the file has {count}")
    return [i]
