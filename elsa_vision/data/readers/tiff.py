"""The TIFF reader (tifffile) of every TIFF input: medical and large images, hyperspectral cubes."""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Callable

import numpy as np

from ...files import check_array_bytes, check_regular_file
from ._common import pick

__all__ = ["TiffSeries", "read_tiff"]


@dataclasses.dataclass
class TiffSeries:
    """One image series of a TIFF file at one pyramid level.

    Attributes:
        data: the pixels as stored (a read-only ``numpy.memmap`` when ``memmap``), axes in ``axes`` order.
        axes: tifffile's axes string, e.g. ``"YX"``, ``"ZYX"``, ``"YXS"`` (interleaved samples), ``"CYX"``.
        series, level: which series and pyramid level (0 = full resolution) were read.
        levels: how many pyramid levels the series has.
        memmap: the data is memory-mapped from the file (uncompressed, contiguous), not decoded.
    """

    data: np.ndarray
    axes: str
    series: int
    level: int
    levels: int
    memmap: bool


# tifffile reads some formats from several files: a multi-file OME-TIFF names the others in its XML,
# Micro-Manager stacks and NDTiff datasets take every sibling matching a pattern. Every TIFF input is read
# from its own file only (such series fall back to the pages of that file).
_ONE_FILE = {"_multifile": False, "is_mmstack": False, "is_ndtiff": False}


def read_tiff(
    path: str | os.PathLike,
    *,
    series: int = 0,
    level: int = 0,
    max_bytes: int | None = None,
    memmap: bool = True,
    check: Callable[[tuple[int, ...], str, np.dtype, int], None] | None = None,
) -> TiffSeries:
    """Read one series of a TIFF / OME-TIFF file (``tifffile``), from that file only.

    With ``memmap`` an uncompressed, contiguous series is memory-mapped (nothing is read until it is used);
    otherwise, and for compressed data, the shape the pages declare is checked against ``max_bytes``
    (default :data:`elsa_vision.files.DEFAULT_MAX_ARRAY_BYTES`) before anything is decoded: a few KB of
    compressed strips can declare gigabytes. ``check(shape, axes, dtype, decoded_bytes)`` (raising for what
    the caller refuses: a pixel type, the size of its own copies beside the ``decoded_bytes`` the series will
    take, 0 when mapped) is called before anything is decoded.

    Raises:
        ValueError: naming the file: not a regular file, not a TIFF, no image series, a series or level out of
            range, strips or tiles declared past the end of the file, pixel data that cannot be decoded.
            ``FileTooLargeError`` (a ``ValueError``) for a series over the limit.
    """
    import tifffile

    try:
        path = check_regular_file(path)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    try:
        tf = tifffile.TiffFile(path, **_ONE_FILE)
    except (tifffile.TiffFileError, OSError, EOFError, ValueError, struct.error) as e:
        raise ValueError(f"input file {path!r} is not a readable TIFF file: {e}") from e
    with tf:
        if not tf.series:
            raise ValueError(f"input file {path!r}: TIFF has no image series")
        s = pick(series, len(tf.series), "series", path)[0]
        levels = tf.series[s].levels
        lv = pick(level, len(levels), "pyramid level", path)[0]
        page_series = levels[lv]
        arr = None
        if memmap and page_series.dataoffset is not None:
            try:
                arr = tifffile.memmap(path, series=s, level=lv, mode="r", **_ONE_FILE)
            except (ValueError, OSError):
                arr = None
        mapped = arr is not None
        decoded = 0
        if not mapped:
            decoded = check_array_bytes(
                path, page_series.shape, page_series.dtype, max_bytes, "the TIFF image series"
            )
        if check is not None:
            check(tuple(page_series.shape), page_series.axes, np.dtype(page_series.dtype), decoded)
        if not mapped:
            if page_series.dataoffset is None:  # read strip by strip / tile by tile, not in one piece
                _check_segments(path, page_series)
            try:
                arr = page_series.asarray()
            except Exception as e:  # tifffile and its codecs raise many types on corrupt data
                raise ValueError(f"input file {path!r}: TIFF pixel data cannot be decoded: {e}") from e
    return TiffSeries(arr, page_series.axes, s, lv, len(levels), mapped)


def _check_segments(path: str, page_series) -> None:
    """Refuse strips / tiles that reach past the end of the file, before any is read: tifffile reads each one
    with its declared StripByteCounts / TileByteCounts in one go (a 130-byte file declaring a 4 GiB strip
    allocates 4 GiB), whatever the image shape. Only offsets and byte counts already parsed are compared."""
    size = os.path.getsize(path)
    for i, page in enumerate(page_series):
        n = 0 if page is None else min(len(page.dataoffsets), len(page.databytecounts))
        if n == 0:
            continue
        offsets = np.asarray(page.dataoffsets[:n], dtype=np.uint64)
        counts = np.asarray(page.databytecounts[:n], dtype=np.uint64)
        # offset + count <= size, without wrapping around: count <= size - offset
        bad = (counts > 0) & ((offsets > size) | (counts > size - np.minimum(offsets, size)))
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(
                f"input file {path!r}: TIFF page {i} declares {int(counts[j]):,} bytes of pixel data at byte "
                f"{int(offsets[j]):,} (strip/tile {j}), past the end of the {size:,}-byte file (truncated or "
                "forged)"
            )
