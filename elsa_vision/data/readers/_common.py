"""Checks every reader shares: an index into what a file holds, the pixel dtype, the float32 conversion."""

from __future__ import annotations

import numpy as np

__all__ = ["check_dtype", "pick", "to_float32"]


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


def to_float32(arr: np.ndarray, path: str) -> np.ndarray:
    """``arr`` as contiguous float32; float64 values beyond the float32 range are refused."""
    check_dtype(arr.dtype, path)
    if arr.dtype.kind == "f" and arr.dtype.itemsize > 4:
        finite = np.isfinite(arr)
        big = np.abs(np.where(finite, arr, 0)).max(initial=0.0)
        if big > np.finfo(np.float32).max:
            raise ValueError(
                f"input file {path!r}: float64 values up to {big:.3e} overflow float32 (max 3.4e38)"
            )
    return np.ascontiguousarray(arr, dtype=np.float32)


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
