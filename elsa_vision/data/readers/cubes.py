"""Hyperspectral files: MATLAB ``.mat`` v5 / v7.3, ENVI, TIFF and NumPy, read as ``(H, W[, bands])`` arrays.

* MATLAB ``.mat`` v5 (``scipy.io.loadmat``, numeric variables only) and v7.3 (HDF5, ``h5py``; MATLAB stores
  arrays column-major, so the datasets are transposed back to ``(H, W, bands)``),
* ENVI (``.hdr`` + the data file named after it; the header is parsed by ``spectral``, the data read with
  NumPy),
* TIFF (:func:`~elsa_vision.data.readers.tiff.read_tiff`; band-first ``(bands, H, W)`` pages are detected from
  the series axes),
* NumPy ``.npy`` / ``.npz`` (``allow_pickle=False``).

When ``key`` is not given, the cube is the only 3-D numeric array of the file and the ground truth the only
2-D integer array; otherwise a ``ValueError`` lists the arrays the file holds.

Memory: ``max_bytes`` bounds what reading a file allocates, not only what it declares. The arrays a file
declares (MATLAB variable headers, HDF5 dataset shapes, the ENVI header, TIFF page shapes, ``.npy``
headers) are checked before anything is read, against the limit and, where a reader allocates what is
declared before reading it, against the bytes the file holds (HDF5 chunks, decoded whole, against their
dataset); every full-size copy made from them (the float32 cube, the int64 label map) is checked beside
them before it is made (``FileTooLargeError``); masks and other temporaries are made a slice of at most
:data:`~elsa_vision.data.readers._common.SLICE_BYTES` at a time. No file makes the reader open another path:
MATLAB cells, structs and objects are never read, HDF5 files with external storage, virtual datasets or
external links are refused, and anything but a regular file (a FIFO, a device) is refused before it is
opened.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...files import (
    FileTooLargeError,
    check_array_bytes,
    check_npy_holds,
    check_regular_file,
    npy_header,
    read_npy,
)
from ._common import SLICE_BYTES, row_slices
from .tiff import read_tiff

__all__ = [
    "CUBE_NAN_POLICIES",
    "HSIScene",
    "MAX_CLASSES",
    "MAX_LABEL",
    "list_arrays",
    "load_cube",
    "load_gt",
    "load_scene",
]

CUBE_NAN_POLICIES = ("raise", "fill")
# Ground-truth maps: labels 0..MAX_LABEL (the uint16 range of MATLAB label maps), at most MAX_CLASSES classes.
MAX_LABEL = 65535
MAX_CLASSES = 1024
_MAT_SUFFIXES = (".mat",)
_ENVI_SUFFIXES = (".hdr", ".img", ".raw", ".dat", ".bsq", ".bil", ".bip")
_TIFF_SUFFIXES = (".tif", ".tiff")
_NPY_SUFFIXES = (".npy", ".npz")

# The MATLAB classes read as arrays, with the type they are read as. Cells, structs, objects, text and
# sparse matrices are never read: their headers do not say how much they hold (a cell of 8 declared bytes
# can hold gigabytes).
_MAT_DTYPES = {"int8": "i1", "uint8": "u1", "logical": "u1", "int16": "i2", "uint16": "u2", "int32": "i4",
               "uint32": "u4", "int64": "i8", "uint64": "u8", "single": "f4", "double": "f8"}
# MATLAB v5: the class codes (mxDOUBLE_CLASS ...) of those classes, the array-flags bits read, the element
# types of numeric data (stored in the smallest type that holds the values, and read as stored, as scipy's
# loadmat does)
_MX_CLASSES = {6: "double", 7: "single", 8: "int8", 9: "uint8", 10: "int16", 11: "uint16", 12: "int32",
               13: "uint32", 14: "int64", 15: "uint64"}
_MX_COMPLEX, _MX_LOGICAL = 0x800, 0x200
_MI_TYPES = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 9: "f8", 12: "i8", 13: "u8"}
_MI_MATRIX, _MI_COMPRESSED = 14, 15
_MAT_HEADER_BYTES = 1024  # a variable's header (flags, dimensions, name, data tag) lies in its first bytes


def _scipy_mat(path: Path, read, **kwargs):
    """``read(str(path))`` (a scipy.io reader) with scipy's errors on damaged files named as such."""
    try:
        return read(str(path), **kwargs)
    except NotImplementedError as e:  # a v7.3 header on a file that is not valid HDF5
        raise ValueError(f"{path}: MATLAB v7.3 header but not a readable HDF5 file ({e})") from e
    except Exception as e:  # scipy raises ValueError/TypeError/OSError on corrupt files
        raise ValueError(f"{path}: cannot read MATLAB file: {e}") from e


@dataclass
class _MatVariable:
    """A MATLAB v5 variable as its first bytes describe it: name, shape, class, whether it is complex, where
    its (real) data starts within the variable's content and the data's stored type and size."""

    name: str
    shape: tuple[int, ...]
    cls: str
    complex: bool
    start: int  # offsets of the variable's tag in the file and of the next variable's
    stop: int
    compressed: bool
    data_at: int = 0  # offset of the data bytes in the variable's (inflated) content
    data_type: str = ""
    data_bytes: int = 0


def _mat5_element(body: bytes, at: int, order: str) -> tuple[int, int, int, int]:
    """``(type, size, data offset, next offset)`` of the MATLAB v5 data element at ``body[at:]``."""
    (first,) = struct.unpack_from(f"{order}I", body, at)
    if first >> 16:  # small element: the size in the upper 16 bits, the data in the next four bytes
        return first & 0xFFFF, first >> 16, at + 4, at + 8
    (size,) = struct.unpack_from(f"{order}I", body, at + 4)
    return first, size, at + 8, at + 8 + size + (-size % 8)


def _mat5_header(path: Path, body: bytes, order: str, start: int, stop: int, compressed: bool
                 ) -> _MatVariable:
    """The variable whose content (after its ``miMATRIX`` tag) begins with ``body``."""
    try:
        _, _, at, nxt = _mat5_element(body, 0, order)
        (flags,) = struct.unpack_from(f"{order}I", body, at)
        _, size, at, nxt = _mat5_element(body, nxt, order)
        shape = struct.unpack_from(f"{order}{size // 4}i", body, at)
        _, size, at, nxt = _mat5_element(body, nxt, order)
        name = body[at : at + size].decode("latin1")
        mx = flags & 0xFF
        cls = "logical" if mx in _MX_CLASSES and flags & _MX_LOGICAL else _MX_CLASSES.get(mx, "other")
        if min(shape, default=0) < 0:
            raise struct.error(f"negative dimensions {shape}")
        var = _MatVariable(name, tuple(shape), cls, bool(flags & _MX_COMPLEX), start, stop, compressed)
        if cls != "other" and not var.complex and nxt < len(body):
            kind, var.data_bytes, var.data_at, _ = _mat5_element(body, nxt, order)
            var.data_type = _MI_TYPES.get(kind, "")
    except struct.error as e:
        raise ValueError(f"{path}: cannot read MATLAB file: damaged variable at byte {start} ({e})") from e
    return var


def _mat5_variables(path: Path) -> tuple[str, list[_MatVariable]] | None:
    """The byte order and the variables of a MATLAB v5 file, each read from its first
    ``_MAT_HEADER_BYTES`` (a compressed one inflated that far and no further); None for a file without a v5
    header (MATLAB v4)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        order = {b"IM": "<", b"MI": ">"}.get(f.read(128)[126:128])
        if order is None:
            return None
        found, pos = [], 128
        while pos < size:
            f.seek(pos)
            tag = f.read(8)
            if len(tag) < 8:
                raise ValueError(f"{path}: cannot read MATLAB file: truncated at byte {pos}")
            kind, nbytes = struct.unpack(f"{order}II", tag)
            if kind == _MI_COMPRESSED:
                inflate = zlib.decompressobj()
                body = inflate.decompress(f.read(min(nbytes, 4 * _MAT_HEADER_BYTES)), _MAT_HEADER_BYTES)
                if len(body) < 8 or struct.unpack_from(f"{order}I", body)[0] != _MI_MATRIX:
                    raise ValueError(f"{path}: cannot read MATLAB file: damaged variable at byte {pos}")
                found.append(_mat5_header(path, body[8:], order, pos, pos + 8 + nbytes, True))
            elif kind == _MI_MATRIX:
                if pos + 8 + nbytes > size:  # read with np.fromfile, which allocates what it is asked for
                    raise ValueError(
                        f"{path}: cannot read MATLAB file: variable at byte {pos} declares {nbytes:,} bytes, "
                        f"past the end of the {size:,}-byte file"
                    )
                body = f.read(min(nbytes, _MAT_HEADER_BYTES))
                found.append(_mat5_header(path, body, order, pos, pos + 8 + nbytes, False))
            else:
                raise ValueError(f"{path}: cannot read MATLAB file: element of type {kind} at byte {pos}")
            pos += 8 + nbytes
    return order, found


def _mat5_array(path: Path, f, var: _MatVariable, order: str) -> np.ndarray:
    """The data of the real numeric variable ``var`` read from the open file ``f``: the stored bytes and
    nothing more (a compressed variable is inflated up to the end of its data and no further)."""
    count = int(np.prod(var.shape, dtype=np.int64))
    if count == 0:
        return np.zeros(var.shape, _MAT_DTYPES[var.cls])
    dtype = np.dtype(f"{order}{var.data_type}") if var.data_type else None
    if dtype is None or var.data_bytes != count * dtype.itemsize:
        raise ValueError(
            f"{path}: cannot read MATLAB file: variable {var.name!r} of shape {var.shape} holds "
            f"{var.data_bytes} bytes of data type {var.data_type or 'unknown'}"
        )
    if not var.compressed:
        if var.start + 8 + var.data_at + var.data_bytes > var.stop:  # the variable lies in the file
            raise ValueError(
                f"{path}: cannot read MATLAB file: variable {var.name!r} declares {var.data_bytes:,} bytes "
                "of data, past the end of the variable"
            )
        f.seek(var.start + 8 + var.data_at)
        data = np.fromfile(f, dtype, count)
    else:
        end = 8 + var.data_at + var.data_bytes  # the inflated content up to the end of the data
        f.seek(var.start + 8)
        inflate, buf = zlib.decompressobj(), bytearray()
        while len(buf) < end and not inflate.eof:
            chunk = inflate.unconsumed_tail or f.read(min(2**16, var.stop - f.tell()))
            if not chunk:
                break
            buf += inflate.decompress(chunk, end - len(buf))
        data = np.frombuffer(buf, dtype, count, 8 + var.data_at) if len(buf) == end else np.empty(0)
    if data.size != count:
        raise ValueError(f"{path}: cannot read MATLAB file: variable {var.name!r} is truncated")
    return data.reshape(var.shape, order="F")


# MATLAB v4: the element size of each precision code (the tens digit of a variable's type): double, single,
# int32, int16, uint16, uint8
_MAT4_ITEMSIZE = (8, 4, 4, 2, 2, 1)
_MAT4_SPARSE = 2  # the type's units digit for a sparse matrix (stored as rows of triplets, never doubled)


def _mat4_check(path: Path) -> None:
    """Refuse a MATLAB v4 file whose variable headers (type, rows, columns, imaginary flag, name length)
    declare a name or data running past the end of the file, before scipy reads it: scipy reads a name or a
    variable's data with ``read(declared size)``, which allocates that size first (2 GiB from 41 bytes)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(4)
        # the byte order as scipy guesses it: little-endian unless the first type reads out of 0..5000 so
        order = ">" if len(first) == 4 and not 0 <= struct.unpack("<i", first)[0] <= 5000 else "<"
        pos = 0
        while pos < size:
            f.seek(pos)
            head = f.read(20)
            if len(head) < 20:
                raise ValueError(f"{path}: cannot read MATLAB file: truncated at byte {pos}")
            mopt, rows, cols, imagf, namlen = struct.unpack(f"{order}5i", head)
            precision = mopt % 100 // 10
            if not 0 <= mopt <= 5000 or precision >= len(_MAT4_ITEMSIZE) or min(rows, cols, namlen) < 0:
                raise ValueError(f"{path}: cannot read MATLAB file: damaged variable header at byte {pos}")
            parts = 2 if imagf == 1 and mopt % 10 != _MAT4_SPARSE else 1  # real and imaginary parts
            data = rows * cols * _MAT4_ITEMSIZE[precision] * parts
            if pos + 20 + namlen + data > size:
                raise ValueError(
                    f"{path}: cannot read MATLAB file: variable at byte {pos} declares a {namlen}-byte name "
                    f"and {data:,} bytes of data, past the end of the {size:,}-byte file"
                )
            pos += 20 + namlen + data


def _read_mat_v5(path: Path, max_bytes: int | None) -> dict[str, np.ndarray]:
    """The real numeric variables of a MATLAB v5 (or v4) file; nothing else is read."""
    walked = _mat5_variables(path)
    if walked is None:  # MATLAB v4 (never compressed), read by scipy
        import scipy.io

        _mat4_check(path)
        declared = _scipy_mat(path, scipy.io.whosmat)
        names = [name for name, _, cls in declared if cls in _MAT_DTYPES]
        # whosmat does not say which are complex: each counted as if it were, for its real and imaginary
        # parts and scipy's two complex128 temporaries, six times its real size
        total = sum(int(np.prod(shape, dtype=object)) * np.dtype(_MAT_DTYPES[cls]).itemsize * 6
                    for _, shape, cls in declared if cls in _MAT_DTYPES)
        check_array_bytes(path, (total,), np.uint8, max_bytes, f"the MATLAB variables ({len(names)})")
        raw = _scipy_mat(path, scipy.io.loadmat, variable_names=names) if names else {}
        return {k: v for k, v in raw.items() if not k.startswith("__") and isinstance(v, np.ndarray)}
    order, variables = walked
    chosen = [v for v in variables if v.cls in _MAT_DTYPES and not v.complex]  # complex arrays are not read
    total = sum(max(v.data_bytes, int(np.prod(v.shape, dtype=object)) * np.dtype(_MAT_DTYPES[v.cls]).itemsize)
                for v in chosen)
    check_array_bytes(path, (total,), np.uint8, max_bytes, f"the MATLAB variables ({len(chosen)})")
    with open(path, "rb") as f:
        return {v.name: _mat5_array(path, f, v, order) for v in chosen}


def _refuse_other_files(f, path: Path) -> None:
    """Refuse an HDF5 file that would make h5py read another path: an external link (to an object of another
    file), a dataset whose data is stored in external files (any path: ``/etc/passwd``, a FIFO) or a
    virtual dataset (mapped from other files). Checked before any dataset is read."""
    import h5py

    found: list[str] = []

    def link(name, info):
        if isinstance(info, h5py.ExternalLink):
            found.append(f"external link {name!r} (to {info.filename!r})")
        return found[0] if found else None

    def dataset(name, obj):
        if isinstance(obj, h5py.Dataset) and (obj.external or obj.is_virtual):
            how = "virtual dataset" if obj.is_virtual else "dataset with external storage"
            found.append(f"{how} {name!r}")
        return found[0] if found else None

    f.visititems_links(link)
    if not found:
        f.visititems(dataset)
    if found:
        raise ValueError(
            f"{path}: HDF5 {found[0]} reads data from other files; only data stored in the file itself is "
            "read"
        )


def _check_chunks(path: Path, name: str, obj, nbytes: int, held: int, max_bytes: int | None) -> None:
    """HDF5 decodes whole chunks, and a chunk may be larger than its dataset (of any size when the dataset's
    maxshape is unlimited): a chunk larger than the dataset ``obj`` (``nbytes``) and than a slice
    (:data:`~elsa_vision.data.readers._common.SLICE_BYTES`) is refused; any other is counted against
    ``max_bytes`` beside the ``held`` bytes of the datasets read so far."""
    chunk = int(np.prod(obj.chunks, dtype=object)) * obj.dtype.itemsize
    if chunk > max(nbytes, SLICE_BYTES):
        raise ValueError(
            f"{path}: HDF5 dataset {name!r} of shape {obj.shape} is stored in chunks of shape {obj.chunks} "
            f"({chunk:,} bytes, larger than the dataset); HDF5 decodes whole chunks, so it is not read (a "
            "forged file?)"
        )
    check_array_bytes(path, obj.chunks, obj.dtype, max_bytes, f"a chunk of HDF5 dataset {name!r}", held=held)


def _read_mat_v73(path: Path, max_bytes: int | None) -> dict[str, np.ndarray]:
    import h5py

    out: dict[str, np.ndarray] = {}
    total = [0]  # bytes declared by the datasets read so far: many small ones count together, as in v5
    try:
        with h5py.File(path, "r") as f:
            _refuse_other_files(f, path)

            def visit(name, obj):
                if not isinstance(obj, h5py.Dataset) or name.startswith("#") or obj.dtype.kind not in "biuf":
                    return
                cls = obj.attrs.get("MATLAB_class", b"")
                if (cls.decode() if isinstance(cls, bytes) else str(cls)) == "char":  # uint16 text codes
                    return
                # declared shape first: a chunked, compressed dataset can declare gigabytes in a few bytes
                nbytes = check_array_bytes(path, obj.shape, obj.dtype, max_bytes, f"HDF5 dataset {name!r}")
                total[0] += nbytes
                check_array_bytes(path, (total[0],), np.uint8, max_bytes, f"the datasets up to {name!r}")
                if obj.chunks is not None:
                    _check_chunks(path, name, obj, nbytes, total[0], max_bytes)
                # MATLAB writes column-major: an (H, W, B) array is stored as (B, W, H).
                out[name] = np.asarray(obj[()]).T

            f.visititems(visit)
    except OSError as e:
        raise ValueError(f"{path}: cannot read MATLAB v7.3 (HDF5) file: {e}") from e
    return out


def _read_mat(path: Path, max_bytes: int | None) -> dict[str, np.ndarray]:
    import h5py

    return _read_mat_v73(path, max_bytes) if h5py.is_hdf5(str(path)) else _read_mat_v5(path, max_bytes)


def _envi_header(path: Path) -> Path:
    if path.suffix.lower() == ".hdr":
        return path
    for cand in (path.with_suffix(".hdr"), Path(str(path) + ".hdr"), path.with_suffix(".HDR")):
        if cand.exists():
            return cand
    raise ValueError(f"{path}: ENVI data file without a header; expected {path.with_suffix('.hdr')}")


# The data file of a header ``x.hdr``: ``x`` or ``x.<ext>``, as ``spectral.envi.open`` looks for it (the
# interleave names are tried for every header, not the one its header names).
_ENVI_DATA = ("", "img", "dat", "sli", "hyspex", "raw", "bin", "bsq", "bil", "bip")


def _envi_data(hdr: Path) -> Path:
    stem = str(hdr)[: -len(hdr.suffix)]
    names = [stem] + [f"{stem}.{e}" for e in _ENVI_DATA[1:]] + [f"{stem}.{e.upper()}" for e in _ENVI_DATA[1:]]
    for name in names:
        if os.path.lexists(name) and not os.path.isdir(name):
            return Path(name)
    raise ValueError(f"{hdr}: no ENVI data file beside the header (tried {stem}.img, .dat, .raw, ...)")


def _read_envi(path: Path, max_bytes: int | None) -> dict[str, np.ndarray]:
    import spectral.io.envi as envi

    hdr = _envi_header(path)
    check_regular_file(hdr, "ENVI header")
    try:
        header = envi.read_envi_header(str(hdr))
        envi.check_compatibility(header)
        params = envi.gen_params(header)
        interleave = str(header["interleave"]).strip().lower()
        scale = float(header.get("reflectance scale factor", 1.0))
    except Exception as e:  # spectral raises its own exception types for bad headers
        raise ValueError(f"{hdr}: cannot read ENVI image: {e}") from e
    if header.get("file type") == "ENVI Spectral Library":
        raise ValueError(f"{hdr}: an ENVI spectral library, not an image")
    if params.offset < 0:  # an integer (spectral's int()); np.fromfile refuses a negative one unnamed
        raise ValueError(f"{hdr}: cannot read ENVI image: header offset {params.offset} is negative")
    data = _envi_data(hdr) if path.suffix.lower() == ".hdr" else path
    check_regular_file(data, "ENVI data file")
    rows, cols, bands = params.nrows, params.ncols, params.nbands
    dtype = np.dtype(params.dtype)
    nbytes = check_array_bytes(hdr, (rows, cols, bands), dtype, max_bytes, "the ENVI image")
    if os.path.getsize(data) - params.offset < nbytes:
        raise ValueError(
            f"{hdr}: cannot read ENVI image: the data file {data} holds "
            f"{max(0, os.path.getsize(data) - params.offset):,} bytes after the header offset, the header "
            f"declares {rows}x{cols}x{bands} {dtype} ({nbytes:,} bytes)"
        )
    layouts = {"bil": ((rows, bands, cols), (0, 2, 1)), "bip": ((rows, cols, bands), (0, 1, 2))}
    # anything else is band sequential, as spectral reads it
    stored, axes = layouts.get(interleave, ((bands, rows, cols), (1, 2, 0)))
    arr = np.fromfile(data, dtype=dtype, count=rows * cols * bands, offset=params.offset)
    arr = arr.reshape(stored).transpose(axes)  # (rows, cols, bands), a view
    if scale != 1.0:  # reflectance scale factor: divided out in float32, as spectral's load() does
        check_array_bytes(hdr, arr.shape, np.float32, max_bytes, "the scaled ENVI image", held=nbytes)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        arr /= np.float32(scale)
    return {"image": arr}


def _read_tiff(path: Path, max_bytes: int | None) -> dict[str, np.ndarray]:
    tif = read_tiff(path, max_bytes=max_bytes, memmap=False)
    arr = tif.data
    if arr.ndim == 3 and tif.axes.endswith("YX"):  # planar (bands, H, W) -> (H, W, bands)
        arr = np.moveaxis(arr, 0, -1)
    return {"image": arr}


def _read_numpy(path: Path, max_bytes: int | None) -> dict[str, np.ndarray]:
    if path.suffix.lower() == ".npy":
        return {"array": read_npy(path, max_bytes)}  # header checked: declared size, data present
    try:
        with np.load(str(path), allow_pickle=False) as z:
            total, size = 0, os.path.getsize(path)
            for k in z.files:  # each member's header, before anything is decompressed
                info = z.zip.getinfo(f"{k}.npy")
                with z.zip.open(info) as f:
                    shape, dtype = npy_header(f, f"{path}[{k!r}]")
                    offset = f.tell()
                nbytes = check_array_bytes(path, shape, dtype, max_bytes, f"array {k!r}")
                total += nbytes
                # the data the member holds, as read_npy requires of a .npy file: NumPy allocates the
                # declared array before it reads (a deflated member inflates to at most its declared size,
                # a stored one is read from its stored bytes)
                held = info.file_size
                if info.compress_type == zipfile.ZIP_STORED:
                    held = min(held, info.compress_size, size)
                check_npy_holds(f"array {k!r}", shape, dtype, nbytes, held - offset)  # named below
            check_array_bytes(path, (total,), np.uint8, max_bytes, f"the {len(z.files)} arrays")
            return {k: z[k] for k in z.files}
    except FileTooLargeError:
        raise
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{path}: cannot read NumPy file: {e}") from e


def list_arrays(path: str | os.PathLike, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """All numeric arrays of a hyperspectral file, as ``{name: array}`` in ``(H, W[, bands])`` order.

    The declared size of what a file holds (MATLAB variable headers, HDF5 dataset shapes, the ENVI header,
    TIFF page shapes, ``.npy`` headers) is checked against ``max_bytes`` (default
    :data:`elsa_vision.files.DEFAULT_MAX_ARRAY_BYTES`) before it is read: ``FileTooLargeError`` otherwise.
    Only the file itself is read (an ENVI header: also its data file), and only a regular file.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"path: file not found: {p}")
    if p.is_dir():
        raise ValueError(f"path: expected a file, got a directory: {p}")
    check_regular_file(p, "path: input file")
    suffix = p.suffix.lower()
    if suffix in _MAT_SUFFIXES:
        arrays = _read_mat(p, max_bytes)
    elif suffix in _ENVI_SUFFIXES:
        arrays = _read_envi(p, max_bytes)
    elif suffix in _TIFF_SUFFIXES:
        arrays = _read_tiff(p, max_bytes)
    elif suffix in _NPY_SUFFIXES:
        arrays = _read_numpy(p, max_bytes)
    else:
        known = _MAT_SUFFIXES + _ENVI_SUFFIXES + _TIFF_SUFFIXES + _NPY_SUFFIXES
        raise ValueError(f"path: unsupported file type {suffix!r} for {p}; expected one of {known}")
    return {k: v for k, v in arrays.items() if v.dtype.kind in "biuf"}


def _describe(arrays: Mapping[str, np.ndarray]) -> str:
    if not arrays:
        return "no numeric arrays"
    return ", ".join(f"{k!r} {tuple(v.shape)} {v.dtype}" for k, v in arrays.items())


def _is_integer_valued(a: np.ndarray) -> bool:
    if a.dtype.kind in "biu":
        return True
    for s in row_slices(a):  # masks and rounded copies a slice at a time
        block = a[s]
        if not (np.isfinite(block).all() and (block == np.round(block)).all()):
            return False
    return True


def _select(
    path: Path, arrays: Mapping[str, np.ndarray], key: str | None, what: str, ndim: int, integer: bool
) -> tuple[str, np.ndarray]:
    if key is not None:
        if key not in arrays:
            raise ValueError(f"{what} key {key!r} not found in {path}; available arrays: {_describe(arrays)}")
        return key, arrays[key]
    cands = {k: v for k, v in arrays.items() if v.ndim == ndim}
    if integer:
        ints = {k: v for k, v in cands.items() if v.dtype.kind in "biu"}
        cands = ints or {k: v for k, v in cands.items() if _is_integer_valued(v)}
    if len(cands) == 1:
        return next(iter(cands.items()))
    kind = f"{ndim}-D {'integer ' if integer else ''}array"
    if not cands:
        raise ValueError(f"no {kind} for the {what} in {path}; available arrays: {_describe(arrays)}")
    raise ValueError(
        f"{what} key is ambiguous in {path}: {len(cands)} candidate {kind}s ({', '.join(map(repr, cands))}); "
        f"pass the key explicitly; available arrays: {_describe(arrays)}"
    )


def _held(arrays: Mapping[str, np.ndarray], *more: np.ndarray) -> int:
    """Bytes of the distinct arrays among ``arrays`` and ``more``: what the reader holds for one file."""
    distinct = {id(a): a for a in (*arrays.values(), *more)}
    return sum(a.nbytes for a in distinct.values())


def _check_nan_policy(nan_policy: str) -> None:
    """Refuse an unknown ``nan_policy`` before any file is read."""
    if nan_policy not in CUBE_NAN_POLICIES:
        raise ValueError(f"nan_policy must be one of {CUBE_NAN_POLICIES}, got {nan_policy!r}")


def load_cube(
    path: str | os.PathLike, key: str | None = None, nan_policy: str = "raise", max_bytes: int | None = None
) -> np.ndarray:
    """Read a hyperspectral cube as float32 ``(H, W, bands)``.

    Args:
        path: ``.mat`` (v5 or v7.3), ENVI ``.hdr`` (or its data file), ``.tif``/``.tiff``, ``.npy``/``.npz``.
        key: array name inside ``.mat``/``.npz``; auto-detected (the only 3-D array) when None.
        nan_policy: ``"raise"`` (non-finite values -> ``ValueError`` naming the bands) or ``"fill"``
            (each non-finite value is replaced by the mean of the finite values of its band; a band with no
            finite value becomes 0).
        max_bytes: the most the read may allocate: the arrays the file declares, and the float32 cube
            beside them when it is a copy (default :data:`elsa_vision.files.DEFAULT_MAX_ARRAY_BYTES`);
            ``FileTooLargeError`` before allocating more. See :func:`list_arrays`.
    """
    _check_nan_policy(nan_policy)
    p = Path(path)
    return _cube_from(p, list_arrays(p, max_bytes), key, nan_policy, max_bytes)


def _cube_from(
    p: Path, arrays: dict[str, np.ndarray], key: str | None, nan_policy: str, max_bytes: int | None
) -> np.ndarray:
    """:func:`load_cube` on the arrays already read from ``p``."""
    if key is None and len(arrays) == 1:  # a single-array file: its rank is checked below
        name, cube = next(iter(arrays.items()))
    else:
        name, cube = _select(p, arrays, key, "cube", 3, integer=False)
    if cube.ndim != 3:
        raise ValueError(
            f"cube {name!r} in {p} must have rank 3 (H, W, bands), got shape {tuple(cube.shape)}"
        )
    if min(cube.shape) == 0:
        raise ValueError(f"cube {name!r} in {p} is empty: shape {tuple(cube.shape)}")
    if not (cube.dtype == np.float32 and cube.flags.c_contiguous):
        held = _held(arrays)
        check_array_bytes(p, cube.shape, np.float32, max_bytes, f"cube {name!r} in float32", held=held)
        cube = np.ascontiguousarray(cube, dtype=np.float32)
    bad = np.zeros(cube.shape[-1], bool)  # bands with a non-finite value, found a slice at a time
    for s in row_slices(cube, 1):
        bad |= ~np.isfinite(cube[s]).all(axis=(0, 1))
    if bad.any():
        bands = np.flatnonzero(bad)
        if nan_policy == "raise":
            raise ValueError(
                f"cube {name!r} in {p} has NaN/inf values in {bands.size} band(s) {bands.tolist()[:32]}"
                f"{' ...' if bands.size > 32 else ''}; fix the file or use nan_policy='fill'"
            )
        total, count = np.zeros(bands.size), np.zeros(bands.size, np.int64)
        for s in row_slices(cube):
            block = cube[s][..., bands]
            finite = np.isfinite(block)
            total += np.where(finite, block, 0.0).sum(axis=(0, 1))
            count += finite.sum(axis=(0, 1))
        fill = np.divide(total, count, out=np.zeros(bands.size), where=count > 0).astype(np.float32)
        for s in row_slices(cube, 1):
            block = cube[s]  # a view: filled in place
            for b, value in zip(bands, fill):
                band = block[..., b]
                band[~np.isfinite(band)] = value
    return cube


def load_gt(path: str | os.PathLike, key: str | None = None, max_bytes: int | None = None) -> np.ndarray:
    """Read a ground-truth map as int64 ``(H, W)``: 0 = unlabelled; labels are integers in ``0..MAX_LABEL``
    with at most ``MAX_CLASSES`` distinct classes, anything else is a ``ValueError`` naming the file, the
    value and where it is. ``max_bytes``: as for :func:`load_cube` (the int64 map is the copy)."""
    p = Path(path)
    arrays = list_arrays(p, max_bytes)
    return _gt_from(p, arrays, key, max_bytes, _held(arrays))


def _gt_from(p: Path, arrays: dict[str, np.ndarray], key: str | None, max_bytes: int | None, held: int
             ) -> np.ndarray:
    """:func:`load_gt` on the arrays already read from ``p``, ``held`` bytes of them (and of copies made
    from them) still held."""
    if key is None and len(arrays) == 1:
        name, gt = next(iter(arrays.items()))
    else:
        name, gt = _select(p, arrays, key, "ground-truth", 2, integer=True)
    if gt.ndim != 2:
        raise ValueError(f"ground truth {name!r} in {p} must have rank 2 (H, W), got shape {tuple(gt.shape)}")
    if not _is_integer_valued(gt):
        raise ValueError(
            f"ground truth {name!r} in {p} must hold integer labels, got non-integer {gt.dtype} values"
        )
    if gt.size and gt.max() > MAX_LABEL:
        worst = int(np.argmax(gt))
        r, c = np.unravel_index(worst, gt.shape)
        raise ValueError(
            f"ground truth {name!r} in {p} has label {int(gt.flat[worst])} at row {r}, column {c}: "
            f"class labels are integers 0..{MAX_LABEL} (0 = unlabelled)"
        )
    if gt.size and gt.min() < 0:
        raise ValueError(
            f"ground truth {name!r} in {p} has negative labels (min {int(gt.min())}); expected 0 = unlabelled"
        )
    if gt.dtype != np.int64:
        check_array_bytes(p, gt.shape, np.int64, max_bytes, f"ground truth {name!r} in int64", held=held)
        gt = gt.astype(np.int64)
    seen = np.zeros(MAX_LABEL + 1, bool)  # labels present, found a slice at a time
    for s in row_slices(gt):
        seen[np.unique(gt[s])] = True
    classes = int(seen[1:].sum())
    if classes > MAX_CLASSES:
        raise ValueError(
            f"ground truth {name!r} in {p} has {classes} distinct labels, more than {MAX_CLASSES} classes: "
            "is it a label map (and not an image band)?"
        )
    return gt


@dataclass
class HSIScene:
    """A loaded scene: ``cube`` float32 ``(H, W, bands)``, ``gt`` int64 ``(H, W)`` or None."""

    cube: np.ndarray
    gt: np.ndarray | None = None
    source: str = ""
    meta: dict = field(default_factory=dict)


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def load_scene(
    path: str | os.PathLike,
    gt_path: str | os.PathLike | None = None,
    key: str | None = None,
    gt_key: str | None = None,
    nan_policy: str = "raise",
    max_bytes: int | None = None,
) -> HSIScene:
    """Read a cube and (optionally) its ground truth and check that they agree in size.

    When ``gt_path`` is None but ``gt_key`` is given, or ``gt_path`` is the cube's own file, the ground truth
    is read from the cube's file, which is read once for both (``max_bytes`` then bounds the arrays of the
    file, the float32 cube and the int64 map together); a separate ground-truth file is read within
    ``max_bytes`` of its own. ``max_bytes``: see :func:`load_cube`.
    """
    _check_nan_policy(nan_policy)
    p = Path(path)
    arrays = list_arrays(p, max_bytes)
    cube = _cube_from(p, arrays, key, nan_policy, max_bytes)
    gt = None
    if gt_path is None and gt_key is not None or gt_path is not None and _same_file(p, gt_path):
        gt = _gt_from(p, arrays, gt_key, max_bytes, _held(arrays, cube))
    elif gt_path is not None:
        arrays = None  # the cube file's other arrays are not needed any more
        gt = load_gt(gt_path, key=gt_key, max_bytes=max_bytes)
    if gt is not None and gt.shape != cube.shape[:2]:
        raise ValueError(
            f"gt/image size mismatch: ground truth {gt_path or path} is {gt.shape[0]}x{gt.shape[1]}, "
            f"cube {path} is {cube.shape[0]}x{cube.shape[1]} (H x W)"
        )
    return HSIScene(cube=cube, gt=gt, source=str(path))
