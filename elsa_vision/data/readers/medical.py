"""Image readers for high-resolution and medical inference: DICOM, NIfTI, TIFF/OME-TIFF, PNG/JPEG.

Every reader returns float32 arrays ``[C, H, W]`` holding the stored values after the file's own value
mapping (DICOM rescale slope/intercept, NIfTI ``scl_slope``/``scl_inter``): 16-bit data is never squeezed to
8 bits. Volumes and multi-frame files are cut into 2-D images along a chosen axis; ``read_image`` returns one
of them, ``iter_images`` all of them.

Value pipeline of :func:`load_image` (each step optional):

1. read (float32, rescaled) -> 2. DICOM windowing to ``[0, 1]`` -> 3. MONOCHROME1 inversion ->
4. non-finite policy (error / zero / mean) -> 5. normalisation -> 6. channel mapping to ``in_chans``.

Bad input raises ``ValueError`` (unreadable or corrupt file, wrong index, image too small, NaN without a
policy, more pixels or bytes declared than the limits allow: ``FileTooLargeError``, before decoding) or
``TypeError`` (unsupported dtype: complex, bool, structured), always naming the file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import warnings
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ...files.limits import (
    DEFAULT_MAX_ARRAY_BYTES,
    FileTooLargeError,
    SizedReader,
    check_array_bytes,
    check_regular_file,
)
from ._common import check_dtype, pick, to_float32
from .tiff import read_tiff

__all__ = [
    "MedicalImage",
    "FORMATS",
    "NORMALIZATIONS",
    "NAN_POLICIES",
    "detect_format",
    "read_image",
    "iter_images",
    "apply_window",
    "apply_nan_policy",
    "normalize",
    "map_channels",
    "load_image",
]

FORMATS = ("dicom", "nifti", "tiff", "png", "jpeg")
NORMALIZATIONS = ("none", "minmax", "percentile", "zscore", "pretrained")
NAN_POLICIES = ("error", "zero", "mean")
_EXTENSIONS = {
    ".dcm": "dicom",
    ".dicom": "dicom",
    ".ima": "dicom",
    ".nii": "nifti",
    ".nii.gz": "nifti",
    ".tif": "tiff",
    ".tiff": "tiff",
    ".ome.tif": "tiff",
    ".ome.tiff": "tiff",
    ".btf": "tiff",
    ".svs": "tiff",
    ".png": "png",
    ".jpg": "jpeg",
    ".jpeg": "jpeg",
}
# ITU-R BT.601 luma weights: RGB -> one channel.
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


@dataclasses.dataclass
class MedicalImage:
    """One 2-D image.

    Attributes:
        data: float32 ``[C, H, W]``.
        path: source file.
        format: one of :data:`FORMATS`.
        index: which 2-D image of the file this is (slice / frame / page index; 0 for plain 2-D files).
        count: how many 2-D images the file holds along the chosen axis.
        meta: reader facts (source dtype, rescale, photometric interpretation, memmap, pyramid level...).
    """

    data: np.ndarray
    path: str
    format: str
    index: int = 0
    count: int = 1
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def detect_format(path: str | os.PathLike) -> str:
    """The reader for ``path``: from the extension, else from the file's magic bytes."""
    path = os.fspath(path)
    low = path.lower()
    for ext in sorted(_EXTENSIONS, key=len, reverse=True):
        if low.endswith(ext):
            return _EXTENSIONS[ext]
    try:
        check_regular_file(path)
        with open(path, "rb") as f:
            head = f.read(352)
    except OSError as e:
        raise ValueError(f"input file {path!r} cannot be opened: {e}") from e
    if len(head) >= 132 and head[128:132] == b"DICM":
        return "dicom"
    if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return "tiff"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if len(head) >= 348 and head[344:348] in (b"n+1\x00", b"ni1\x00"):
        return "nifti"
    raise ValueError(
        f"input file {path!r}: unknown format; expected one of the extensions {sorted(_EXTENSIONS)} "
        "or a DICOM/TIFF/PNG/JPEG/NIfTI signature"
    )


# ----------------------------------------------------------------------------------------------- DICOM


def _dicom_number(ds: Any, key: str, default: float, path: str, kind: type = int) -> Any:
    """The DICOM attribute ``key`` as a number of ``kind`` (the first of a multi-valued one; ``default`` when
    absent, empty or, for a count, 0); a value that is not one (``NumberOfFrames = "abc"``) is one
    ``ValueError`` naming the file and the attribute. Counts and sizes (``int``) must be positive, other
    values finite."""
    import pydicom

    raw: Any = "<unreadable>"
    try:
        raw = getattr(ds, key, None)
        if isinstance(raw, pydicom.multival.MultiValue):
            raw = raw[0] if len(raw) else None
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return default
        value = kind(float(raw)) if kind is int and not isinstance(raw, int) else kind(raw)
        if kind is int and float(raw) != value:
            raise ValueError("not an integer")
    except (ValueError, TypeError, OverflowError, KeyError):
        raise ValueError(
            f"input file {path!r}: DICOM {key} = {str(raw)[:40]!r} is not "
            f"{'an integer' if kind is int else 'a number'}"
        ) from None
    if kind is int and value == 0:
        return default
    if (kind is int and value < 0) or not math.isfinite(value):
        raise ValueError(f"input file {path!r}: DICOM {key} = {str(raw)[:40]!r} is out of range")
    return value


def _dicom_images(path: str, frame: int | None, max_bytes: int | None) -> Iterator[MedicalImage]:
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        with SizedReader(check_regular_file(path)) as fp:  # pydicom reads values at their declared length
            ds = pydicom.dcmread(fp)
    except (InvalidDicomError, OSError, EOFError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"input file {path!r} is not a readable DICOM file: {e}") from e
    if "PixelData" not in ds and "FloatPixelData" not in ds and "DoubleFloatPixelData" not in ds:
        raise ValueError(f"input file {path!r}: DICOM dataset has no pixel data")
    counts = ("NumberOfFrames", "Rows", "Columns", "SamplesPerPixel")
    declared = [_dicom_number(ds, k, 1, path) for k in counts]
    nbytes = -(-_dicom_number(ds, "BitsAllocated", 8, path) // 8)
    # the decoded pixels (compressed pixel data can declare far more than the file holds), and one frame in
    # float32 beside them, are checked before pydicom decodes anything
    decoded = check_array_bytes(path, declared + [nbytes], np.uint8, max_bytes, "DICOM pixel data")
    check_array_bytes(path, declared[1:], np.float32, max_bytes, "one DICOM frame in float32", held=decoded)
    try:
        pixels = ds.pixel_array
    except Exception as e:  # pixel decoding raises many types (missing codec, truncated data, bad tags)
        raise ValueError(f"input file {path!r}: DICOM pixel data cannot be decoded: {e}") from e
    check_dtype(pixels.dtype, path)
    samples, frames = declared[3], declared[0]
    if frames == 1:
        pixels = pixels[None]
    # pixels: [F, H, W] (grayscale) or [F, H, W, S] (colour)
    if samples > 1 and pixels.ndim == 4:
        pixels = np.moveaxis(pixels, -1, 1)
    else:
        pixels = pixels[:, None]
    slope = _dicom_number(ds, "RescaleSlope", 1.0, path, float) or 1.0
    intercept = _dicom_number(ds, "RescaleIntercept", 0.0, path, float)
    photometric = str(getattr(ds, "PhotometricInterpretation", "MONOCHROME2"))
    window = None
    if "WindowCenter" in ds and "WindowWidth" in ds:
        window = (
            _dicom_number(ds, "WindowCenter", 0.0, path, float),
            _dicom_number(ds, "WindowWidth", 1.0, path, float),
        )
    meta = {
        "source_dtype": str(pixels.dtype),
        "rescale_slope": slope,
        "rescale_intercept": intercept,
        "photometric": photometric,
        "file_window": window,
        "modality": str(getattr(ds, "Modality", "")),
        "frames": frames,
    }
    for i in pick(frame, frames, "frame", path):
        # rescaled in float64, a slice at a time, into the frame's float32 copy
        data = to_float32(pixels[i], path, slope, intercept)
        yield MedicalImage(data, path, "dicom", i, frames, dict(meta))


# ----------------------------------------------------------------------------------------------- NIfTI


def _nifti_images(
    path: str, slice_index: int | None, slice_axis: int, frame: int | None, max_bytes: int | None
) -> Iterator[MedicalImage]:
    from nibabel.filebasedimages import ImageFileError
    from nibabel.spatialimages import HeaderDataError

    klass, file_map = _nifti_file_map(path, max_bytes)
    try:
        img = klass.from_file_map(file_map)
    except (ImageFileError, HeaderDataError, OSError, EOFError, ValueError) as e:
        raise ValueError(f"input file {path!r} is not a readable NIfTI file: {e}") from e
    dataobj = img.dataobj
    dtype = img.get_data_dtype()
    check_dtype(dtype, path)
    shape = tuple(int(s) for s in dataobj.shape)
    if len(shape) < 2 or len(shape) > 4:
        raise ValueError(f"input file {path!r}: NIfTI image of shape {shape}; expected 2-D, 3-D or 4-D data")
    if len(shape) == 4:
        frames = pick(0 if frame is None else frame, shape[3], "frame (4th NIfTI axis)", path)
    elif frame not in (None, 0):
        raise ValueError(f"input file {path!r}: frame={frame} given, but the NIfTI image is {len(shape)}-D")
    else:
        frames = [None]
    meta = {
        "source_dtype": str(dtype),
        "shape": shape,
        "slice_axis": slice_axis,
        "scl_slope": _finite_or_none(img.header.get("scl_slope")),
        "scl_inter": _finite_or_none(img.header.get("scl_inter")),
    }
    if len(shape) == 2:
        slices, count = [None], 1
    else:
        if slice_axis not in (0, 1, 2):
            raise ValueError(f"slice_axis must be 0, 1 or 2 for a volume, got {slice_axis}")
        count = shape[slice_axis]
        if slice_index == "all":
            slices = list(range(count))
        else:
            slices = pick(count // 2 if slice_index is None else slice_index, count, "slice_index", path)
    plane = [n for i, n in enumerate(shape[:3]) if len(shape) == 2 or i != slice_axis]
    # a slice is read in its stored type, scaled (scl_slope / scl_inter) in up to float64, copied to float32
    stored = check_array_bytes(path, plane, dtype, max_bytes, "one NIfTI slice")
    copies = stored // np.dtype(dtype).itemsize * 4
    copies += check_array_bytes(path, plane, np.float64, max_bytes, "one NIfTI slice in float64",
                                held=stored + copies)
    _check_nifti_data(path, file_map["image"].filename, dataobj.offset, shape, dtype)
    for t in frames:
        for s in slices:
            idx: list[Any] = [slice(None)] * len(shape)
            if s is not None:
                idx[slice_axis] = s
            if t is not None:
                idx[3] = t
            try:
                # array proxies read only the requested slab from disk (and apply scl_slope / scl_inter)
                plane = _read_nifti_slice(dataobj, tuple(idx), path, max_bytes, held=copies)
            except (OSError, EOFError, ValueError) as e:
                if isinstance(e, FileTooLargeError):
                    raise
                raise ValueError(f"input file {path!r}: NIfTI data cannot be read (truncated?): {e}") from e
            data = to_float32(plane, path)[None]
            yield MedicalImage(data, path, "nifti", 0 if s is None else s, count, dict(meta, frame=t))


def _nifti_compressed(name: str) -> bool:
    """nibabel opens ``name`` decompressing (its ``ImageOpener``: ``.gz``, ``.bz2``, ``.zst``, ``.mgz``)."""
    from nibabel.openers import ImageOpener

    return os.path.splitext(name)[1].lower() in {str(k).lower() for k in ImageOpener.compress_ext_map if k}


def _nifti_file_map(path: str, max_bytes: int | None) -> tuple[type, dict]:
    """The nibabel class (``Nifti1Image`` / ``Nifti2Image``, or the ``Nifti1Pair`` / ``Nifti2Pair`` of a
    ``.hdr`` header) and file map that read ``path``, chosen from its header and not, as ``nib.load`` does,
    from its extension (a file sniffed as NIfTI but named ``.mnc`` would be read as MINC2 through h5py, one
    named ``.mgz`` as MGH...): anything else is refused. Before nibabel reads them, ``vox_offset`` and the
    header extensions (each read whole at its declared size) must lie in the file, or within the size limit
    for a compressed one (whose extensions must also be there: skipped over, not read into memory)."""
    import nibabel as nib
    from nibabel.fileholders import FileHolder
    from nibabel.openers import ImageOpener

    single = os.path.splitext(path)[1].lower() not in nib.Nifti1Pair.valid_exts  # any name but .hdr / .img
    if not single:  # a NIfTI pair: the header and its .img beside it
        try:
            file_map = nib.Nifti1Pair.filespec_to_file_map(path)
        except Exception as e:  # nibabel raises several types for names it cannot pair
            raise ValueError(f"input file {path!r} is not a readable NIfTI file: {e}") from e
        image_file = file_map["image"].filename
        if os.path.lexists(image_file):
            check_regular_file(image_file, "NIfTI image file")
    header_file = path if single else file_map["header"].filename
    try:
        end = None if _nifti_compressed(header_file) else os.path.getsize(check_regular_file(header_file))
        with ImageOpener(header_file, "rb") as f:
            head = f.read(nib.Nifti2Header.sizeof_hdr + 4)
            # sizeof_hdr, in either byte order, and the magic (which is all nibabel's NIfTI-1 test looks at)
            sizes = struct.unpack("<i", head[:4]) + struct.unpack(">i", head[:4]) if len(head) >= 4 else ()
            if 348 in sizes and nib.Nifti1Header.may_contain_header(head):
                header_class, klass = nib.Nifti1Header, (nib.Nifti1Image if single else nib.Nifti1Pair)
            elif 540 in sizes and nib.Nifti2Header.may_contain_header(head):
                header_class, klass = nib.Nifti2Header, (nib.Nifti2Image if single else nib.Nifti2Pair)
            else:
                raise ValueError(
                    f"input file {path!r} is not a readable NIfTI file: no NIfTI-1 or NIfTI-2 header"
                )
            n = header_class.sizeof_hdr
            hdr = header_class(head[:n], check=False)
            vox_offset = float(hdr["vox_offset"])
            if single and math.isfinite(vox_offset):
                if end is not None and vox_offset > end:
                    raise ValueError(
                        f"input file {path!r}: NIfTI vox_offset {vox_offset:,.0f} lies past the end of the "
                        f"{end:,}-byte file (truncated or forged header)"
                    )
                if end is None and vox_offset > 0:
                    check_array_bytes(path, [int(vox_offset)], np.uint8, max_bytes, "NIfTI vox_offset")
            if len(head) >= n + 4 and head[n:n + 1] != b"\0":  # the extension flag
                # nibabel reads extensions up to vox_offset (a single file) or to the end (a pair's header)
                extsize = vox_offset - (n + 4) if single else -1.0
                _check_nifti_extensions(path, f, n + 4, extsize, end, hdr.endianness, max_bytes)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"input file {path!r} is not a readable NIfTI file: {e}") from e
    if single:
        file_map = {"image": FileHolder(filename=path), "header": FileHolder(filename=path)}
    return klass, file_map


def _check_nifti_extensions(
    path: str, f, pos: int, size: float, end: int | None, endianness: str, max_bytes: int | None
) -> None:
    """Walk the header extensions from ``pos`` as nibabel's ``Nifti1Extensions.from_fileobj`` will (``size``
    bytes of them; to the end when negative), refusing one whose declared size (nibabel reads it with one
    ``read(esize - 8)``) is below its own 8-byte header or reaches past ``end`` (the file's size; ``None``
    for a compressed file: then the size limit, and the extension must be in the stream)."""
    while size >= 16 or size < 0:
        f.seek(pos)
        ext = f.read(8)
        if len(ext) < 8:  # the end of a pair's header; else nibabel's HeaderDataError says it
            return
        esize = struct.unpack(endianness + "i", ext[:4])[0]
        if esize < 8 or (end is not None and pos + esize > end):
            beyond = (
                "less than its own 8-byte header" if esize < 8 else f"past the end of the {end:,}-byte file"
            )
            raise ValueError(
                f"input file {path!r}: NIfTI header extension at byte {pos:,} declares {esize:,} bytes, "
                f"{beyond} (truncated or forged)"
            )
        if end is None:
            check_array_bytes(path, [pos + esize], np.uint8, max_bytes, "NIfTI header with its extensions")
            if f.seek(pos + esize) != pos + esize or f.tell() != pos + esize:
                raise ValueError(
                    f"input file {path!r}: NIfTI header extension at byte {pos:,} declares {esize:,} bytes, "
                    "past the end of the decompressed data (truncated or forged)"
                )
        pos += esize
        size -= esize


def _check_nifti_data(path: str, data_file: str, offset: int, shape: tuple[int, ...], dtype) -> None:
    """An uncompressed data file must hold the ``shape`` x ``dtype`` voxels declared from ``offset`` on:
    nibabel reads a slice with one ``read()`` of the span it covers, allocated before it comes back short."""
    if _nifti_compressed(data_file):
        return
    nbytes = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    try:
        size = os.path.getsize(data_file)
    except OSError as e:
        raise ValueError(f"input file {path!r}: NIfTI image file {data_file!r} cannot be read: {e}") from e
    if int(offset) + nbytes > size:
        held = "the file" if data_file == path else repr(data_file)
        raise ValueError(
            f"input file {path!r}: NIfTI header declares {shape} {np.dtype(dtype)} data ({nbytes:,} bytes) "
            f"from byte {int(offset):,}, but {held} holds {size:,} bytes (truncated or forged header)"
        )


def _read_nifti_slice(dataobj, idx: tuple, path: str, max_bytes: int | None, held: int) -> np.ndarray:
    """``dataobj[idx]``, read so that the file bytes read at once, beside ``held``, fit the size limit.

    nibabel reads the bytes from the first to the last voxel a request covers in one ``read()`` when the
    voxels lie close together: a slice across axis 0 of a volume spans (nearly) the whole volume. A request
    spanning more than the limit allows is read in slabs along its outermost axis; others in one piece, as
    before."""
    shape = tuple(int(n) for n in dataobj.shape)
    itemsize = np.dtype(dataobj.dtype).itemsize
    order = range(len(shape)) if getattr(dataobj, "order", "F") == "F" else range(len(shape) - 1, -1, -1)
    strides, step = [0] * len(shape), itemsize
    for k in order:
        strides[k], step = step, step * shape[k]
    free = [k for k, i in enumerate(idx) if isinstance(i, slice)]
    if not free or 0 in shape:
        return np.asarray(dataobj[idx])
    outer = max(free, key=lambda k: strides[k])
    inner = itemsize + sum((shape[k] - 1) * strides[k] for k in free if k != outer)
    budget = (DEFAULT_MAX_ARRAY_BYTES if max_bytes is None else int(max_bytes)) - held
    if inner + (shape[outer] - 1) * strides[outer] <= budget:
        return np.asarray(dataobj[idx])
    check_array_bytes(path, [inner], np.uint8, max_bytes, "the file span one row of a NIfTI slice covers",
                      held=held)
    rows = (budget - inner) // strides[outer] + 1
    at = free.index(outer)
    out = None
    for k0 in range(0, shape[outer], rows):
        sub = list(idx)
        sub[outer] = slice(k0, min(k0 + rows, shape[outer]))
        part = np.asarray(dataobj[tuple(sub)])
        if out is None:
            out = np.empty(tuple(shape[k] for k in free), part.dtype)
        out[(slice(None),) * at + (sub[outer],)] = part
    return out


def _finite_or_none(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if np.isfinite(f) else None


# ------------------------------------------------------------------------------------------------ TIFF


def _tiff_images(
    path: str, series: int, level: int, slice_index: int | None, max_bytes: int | None
) -> Iterator[MedicalImage]:
    def check(shape: tuple[int, ...], axes: str, dtype: np.dtype, decoded: int) -> None:
        # before anything is decoded: the pixel type, and one image in float32 beside the decoded series
        check_dtype(dtype, path)
        image = [n for n, a in zip(shape, axes) if a in "YXCS"]
        check_array_bytes(path, image, np.float32, max_bytes, "one TIFF image (float32)", held=decoded)

    tif = read_tiff(path, series=series, level=level, max_bytes=max_bytes, check=check)
    arr, axes = tif.data, tif.axes
    shape, dtype = arr.shape, arr.dtype
    if "Y" not in axes or "X" not in axes:
        raise ValueError(f"input file {path!r}: TIFF series axes {axes!r} lack Y and X")
    chan = [a for a in axes if a in "CS"]
    if len(chan) > 1:
        raise ValueError(f"input file {path!r}: TIFF axes {axes!r} have two channel axes (C and S)")
    stack = [a for a in axes if a not in "YXCS"]
    order = stack + chan + ["Y", "X"]
    arr = np.moveaxis(arr, [axes.index(a) for a in order], list(range(len(order))))  # a view
    stack_shape = arr.shape[: len(stack)]
    n_stack = int(np.prod(stack_shape)) if stack else 1
    meta = {
        "source_dtype": str(dtype),
        "axes": axes,
        "shape": shape,
        "series": tif.series,
        "level": tif.level,
        "levels": tif.levels,
        "memmap": tif.memmap,
    }
    for i in pick(slice_index, n_stack, "slice_index", path) if slice_index != "all" else range(n_stack):
        image = arr[np.unravel_index(i, stack_shape)] if stack else arr  # one image, a view of the series
        image = image if chan else image[None]
        yield MedicalImage(to_float32(image, path), path, "tiff", i, n_stack, dict(meta))


# -------------------------------------------------------------------------------------------- PNG/JPEG


def _png_colour_depth(path: str) -> tuple[int, int] | None:
    """(bit depth, colour type) from a PNG IHDR chunk, or None if it is not a PNG."""
    with open(path, "rb") as f:
        head = f.read(26)
    if len(head) < 26 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return head[24], head[25]


def _pillow_images(path: str, fmt: str) -> Iterator[MedicalImage]:
    from PIL import ImageOps, UnidentifiedImageError

    from ...files import FileTooLargeError, open_image

    if fmt == "png":
        depth = _png_colour_depth(path)
        if depth is not None and depth[0] == 16 and depth[1] in (2, 4, 6):
            raise ValueError(
                f"input file {path!r}: 16-bit colour PNG (colour type {depth[1]}) would be cut to 8 bits by "
                "Pillow; save it as 16-bit TIFF instead"
            )
    try:
        with open_image(path) as im:  # the declared size is checked before decoding
            im.load()
            im = ImageOps.exif_transpose(im) if fmt == "jpeg" else im
            mode = im.mode
            if mode == "1":
                raise TypeError(f"input file {path!r}: unsupported pixel dtype bool (1-bit image)")
            if mode == "P":
                im = im.convert("RGBA" if "transparency" in im.info else "RGB")
            elif mode in ("CMYK", "YCbCr", "LAB", "HSV"):
                im = im.convert("RGB")
            arr = np.asarray(im)
            mode = im.mode
    except FileTooLargeError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"input file {path!r} is not a readable {fmt.upper()} image: {e}") from e
    meta = {"source_dtype": str(arr.dtype), "mode": mode}
    if arr.ndim == 3:
        if arr.shape[-1] in (2, 4):  # LA / RGBA: drop alpha
            meta["dropped_alpha"] = True
            arr = arr[..., :-1]
        arr = np.moveaxis(arr, -1, 0)
    else:
        arr = arr[None]
    yield MedicalImage(to_float32(arr, path), path, fmt, 0, 1, meta)


# ----------------------------------------------------------------------------------------------- API


def iter_images(
    path: str | os.PathLike,
    *,
    slice_index: int | str | None = None,
    slice_axis: int = 2,
    frame: int | str | None = None,
    series: int = 0,
    level: int = 0,
    max_bytes: int | None = None,
) -> Iterator[MedicalImage]:
    """Every 2-D image selected from ``path``, as raw float32 ``[C, H, W]`` (after rescale).

    Args:
        slice_index: NIfTI slice along ``slice_axis`` (default: the middle one) or TIFF stack index
            (default 0; non-YX, non-channel TIFF axes are flattened into one stack); ``"all"`` for every one.
        slice_axis: NIfTI voxel axis (0, 1, 2) the slices are cut across.
        frame: DICOM multi-frame index (default: all frames) or NIfTI 4th-axis index (default 0);
            ``"all"`` for every one.
        series, level: TIFF series and pyramid level (0 = full resolution).
        max_bytes: the largest decoded size (the pixels a file declares, and one image in float32) read
            (default :data:`elsa_vision.files.DEFAULT_MAX_ARRAY_BYTES`); more raises ``FileTooLargeError``
            before decoding. PNG/JPEG are limited by pixel count (``PIL.Image.MAX_IMAGE_PIXELS``).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"input file {path!r} does not exist or is not a file")
    if os.path.getsize(path) == 0:
        raise ValueError(f"input file {path!r} is empty (0 bytes)")
    fmt = detect_format(path)
    frame_i = None if frame == "all" else frame
    if fmt == "dicom":
        yield from _dicom_images(path, frame_i, max_bytes)
    elif fmt == "nifti":
        if slice_index == "all" and frame == "all":
            raise ValueError("slice_index='all' and frame='all' cannot be combined; pick one of them")
        yield from _nifti_images(path, slice_index, slice_axis, None if frame == "all" else frame, max_bytes)
    elif fmt == "tiff":
        yield from _tiff_images(path, series, level, 0 if slice_index is None else slice_index, max_bytes)
    else:
        yield from _pillow_images(path, fmt)


def read_image(path: str | os.PathLike, **kwargs) -> MedicalImage:
    """The one 2-D image :func:`iter_images` selects; a file holding several needs an index.

    DICOM multi-frame files default to frame 0 here; NIfTI volumes to the middle slice.
    """
    if kwargs.get("slice_index") == "all" or kwargs.get("frame") == "all":
        raise ValueError("read_image returns one image; use iter_images for slice_index/frame='all'")
    if detect_format(path) == "dicom" and kwargs.get("frame") is None:
        kwargs["frame"] = 0
    return next(iter_images(path, **kwargs))


def apply_window(data: np.ndarray, center: float, width: float) -> np.ndarray:
    """Linear window: ``[center - width/2, center + width/2]`` -> ``[0, 1]``, clipped."""
    if not (np.isfinite(center) and np.isfinite(width)) or width <= 0:
        raise ValueError(
            f"window width must be a finite value > 0 and center finite, got center={center}, width={width}"
        )
    lo = center - width / 2.0
    return np.clip((data - np.float32(lo)) / np.float32(width), 0.0, 1.0).astype(np.float32)


def apply_nan_policy(data: np.ndarray, policy: str, path: str = "<array>") -> tuple[np.ndarray, int]:
    """Handle non-finite values: ``"error"`` raises, ``"zero"`` / ``"mean"`` replace them (count returned)."""
    if policy not in NAN_POLICIES:
        raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, got {policy!r}")
    bad = ~np.isfinite(data)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return data, 0
    if policy == "error":
        raise ValueError(
            f"input file {path!r}: {n_bad} of {data.size} values are NaN or infinite; pass nan_policy "
            "'zero' or 'mean' (CLI: --nan-policy zero|mean) to replace them"
        )
    if policy == "zero":
        fill = 0.0
    else:
        if n_bad == data.size:
            raise ValueError(
                f"input file {path!r}: every value is NaN or infinite; nan_policy='mean' has no mean"
            )
        fill = float(data[~bad].mean(dtype=np.float64))
    out = data.copy()
    out[bad] = fill
    return out, n_bad


def normalize(
    data: np.ndarray,
    method: str,
    *,
    percentiles: tuple[float, float] = (0.5, 99.5),
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    unit_range: bool = False,
) -> np.ndarray:
    """Normalise float32 ``[C, H, W]`` values (statistics over the whole image, all channels).

    Args:
        method: ``"none"``; ``"minmax"`` -> [0, 1]; ``"percentile"`` clips to the given percentiles and maps
            them to [0, 1]; ``"zscore"`` -> zero mean, unit std; ``"pretrained"`` maps to [0, 1] (min-max, or
            as is when ``unit_range``, e.g. after windowing) then applies the per-channel ``mean``/``std``
            (of the model's pretrained config) after channel mapping: see :func:`load_image`.
        unit_range: the data is already in [0, 1] (windowed), so min-max/percentile stretching is skipped.
    """
    if method not in NORMALIZATIONS:
        raise ValueError(f"normalisation must be one of {NORMALIZATIONS}, got {method!r}")
    if method == "none":
        return data
    if method == "zscore":
        mu, sd = float(data.mean(dtype=np.float64)), float(data.std(dtype=np.float64))
        return ((data - mu) / (sd if sd > 0 else 1.0)).astype(np.float32)
    if method in ("minmax", "pretrained"):
        if unit_range and method == "pretrained":
            return data
        lo, hi = float(data.min()), float(data.max())
    else:
        p_lo, p_hi = percentiles
        if not 0.0 <= p_lo < p_hi <= 100.0:
            raise ValueError(f"percentiles must satisfy 0 <= low < high <= 100, got {percentiles}")
        lo, hi = (float(v) for v in np.percentile(data, [p_lo, p_hi]))
        data = np.clip(data, lo, hi)
    span = hi - lo
    if span <= 0:
        return np.zeros_like(data, dtype=np.float32)
    return ((data - lo) / span).astype(np.float32)


def map_channels(data: np.ndarray, in_chans: int, mode: str = "replicate") -> np.ndarray:
    """Map ``[C, H, W]`` to ``[in_chans, H, W]``.

    ``C == in_chans``: unchanged. One channel -> ``in_chans``: replicated (``mode="replicate"``). Three (RGB)
    channels -> one: ITU-R BT.601 luma. Anything else raises.
    """
    c = data.shape[0]
    if c == in_chans:
        return data
    if c == 1:
        if mode != "replicate":
            raise ValueError(f"channel mode must be 'replicate' to map 1 channel to {in_chans}, got {mode!r}")
        return np.ascontiguousarray(np.broadcast_to(data, (in_chans,) + data.shape[1:]))
    if c == 3 and in_chans == 1:
        return np.tensordot(_LUMA, data, axes=(0, 0))[None].astype(np.float32)
    raise ValueError(f"cannot map a {c}-channel image to the model's in_chans={in_chans}")


def load_image(
    image: MedicalImage,
    *,
    in_chans: int,
    window: str | tuple[float, float] | None = None,
    invert_monochrome1: bool = True,
    nan_policy: str = "error",
    norm: str = "minmax",
    percentiles: tuple[float, float] = (0.5, 99.5),
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    min_size: int = 1,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Apply the value pipeline (module docstring) to one image; returns ``([in_chans, H, W], facts)``.

    Args:
        window: ``None``; ``"file"`` (the DICOM's first WindowCenter/WindowWidth); or ``(center, width)`` in
            rescaled units (e.g. Hounsfield). Windowed values lie in [0, 1].
        invert_monochrome1: invert DICOM MONOCHROME1 images so that high values are bright.
        nan_policy: see :func:`apply_nan_policy`.
        norm, percentiles: see :func:`normalize`. ``mean``/``std`` (length ``in_chans``) are required for
            ``"pretrained"`` and applied after channel mapping.
        min_size: the smallest allowed height/width (the model's patch size).
    """
    data, path = image.data, image.path
    facts: dict[str, Any] = {"raw_min": None, "raw_max": None}
    c, h, w = data.shape
    if h < min_size or w < min_size:
        raise ValueError(
            f"input file {path!r}: image of {h}x{w} pixels is smaller than one {min_size}x{min_size} patch"
        )
    data, n_bad = apply_nan_policy(data, nan_policy, path)
    facts["non_finite_replaced"] = n_bad
    facts["raw_min"], facts["raw_max"] = float(data.min()), float(data.max())
    windowed = False
    if window is not None:
        if window == "file":
            win = image.meta.get("file_window")
            if win is None:
                raise ValueError(
                    f"input file {path!r}: window='file' but the file has no WindowCenter/WindowWidth"
                )
        elif isinstance(window, (tuple, list)) and len(window) == 2:
            win = (float(window[0]), float(window[1]))
        else:
            raise ValueError(f"window must be None, 'file' or (center, width), got {window!r}")
        data = apply_window(data, *win)
        windowed = True
        facts["window"] = list(win)
    if invert_monochrome1 and image.meta.get("photometric") == "MONOCHROME1":
        data = (1.0 - data) if windowed else (np.float32(data.min() + data.max()) - data)
        facts["inverted_monochrome1"] = True
    data = normalize(data, norm, percentiles=percentiles, unit_range=windowed).astype(np.float32, copy=False)
    data = map_channels(data, in_chans)
    if norm == "pretrained":
        if mean is None or std is None:
            raise ValueError("norm='pretrained' needs the model's mean and std")
        m = np.asarray(mean, dtype=np.float32)
        s = np.asarray(std, dtype=np.float32)
        if m.size == 1 or s.size == 1:
            m, s = np.full(in_chans, m.ravel()[0], np.float32), np.full(in_chans, s.ravel()[0], np.float32)
        if m.size != in_chans or s.size != in_chans:
            if m.size == 3 and in_chans == 1:
                # a colour-pretrained model fed one channel: the luma of its mean/std
                m, s = np.array([_LUMA @ m]), np.array([_LUMA @ s])
            else:
                raise ValueError(
                    f"pretrained mean/std have {m.size} entries, the model has in_chans={in_chans}"
                )
        data = (data - m[:, None, None]) / s[:, None, None]
    facts["norm"] = norm
    if not np.isfinite(data).all():
        raise ValueError(f"input file {path!r}: non-finite values after normalisation (value range overflow)")
    if window is None and image.meta.get("file_window") is not None:
        warnings.warn(
            f"input file {path!r} has a DICOM window {image.meta['file_window']} that is not applied; pass "
            "window='file' (CLI: --window file) to use it",
            stacklevel=2,
        )
    return np.ascontiguousarray(data, dtype=np.float32), facts
