"""Hyperspectral files: MATLAB ``.mat`` v5 / v7.3, ENVI, TIFF and NumPy, read as ``(H, W[, bands])`` arrays.

* MATLAB ``.mat`` v5 (``scipy.io.loadmat``) and v7.3 (HDF5, ``h5py``; MATLAB stores arrays column-major, so
  the datasets are transposed back to ``(H, W, bands)``),
* ENVI (``.hdr`` + data file, through ``spectral.envi.open``),
* TIFF (:func:`~elsa_vision.data.readers.tiff.read_tiff`; band-first ``(bands, H, W)`` pages are detected from
  the series axes),
* NumPy ``.npy`` / ``.npz`` (``allow_pickle=False``).

When ``key`` is not given, the cube is the only 3-D numeric array of the file and the ground truth the only
2-D integer array; otherwise a ``ValueError`` lists the arrays the file holds. The declared size of what a
file holds is checked before it is read (``FileTooLargeError`` over the limit).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...files import FileTooLargeError, check_array_bytes, npy_header, read_npy
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

# bytes per element of a MATLAB class, for the declared-size check (8 for anything else)
_MAT_ITEMSIZE = {"int8": 1, "uint8": 1, "logical": 1, "int16": 2, "uint16": 2, "char": 2, "int32": 4,
                 "uint32": 4, "single": 4}


def _scipy_mat(path: Path, read):
    """``read(str(path))`` (a scipy.io reader) with scipy's errors on damaged files named as such."""
    try:
        return read(str(path))
    except NotImplementedError as e:  # a v7.3 header on a file that is not valid HDF5
        raise ValueError(f"{path}: MATLAB v7.3 header but not a readable HDF5 file ({e})") from e
    except Exception as e:  # scipy raises ValueError/TypeError/OSError on corrupt files
        raise ValueError(f"{path}: cannot read MATLAB file: {e}") from e


def _read_mat_v5(path: Path, max_bytes: int | None) -> dict[str, np.ndarray]:
    import scipy.io

    # variable headers only: compressed variables can declare far more than the file holds
    declared = _scipy_mat(path, scipy.io.whosmat)
    total = sum(int(np.prod(shape, dtype=object)) * _MAT_ITEMSIZE.get(cls, 8) for _, shape, cls in declared)
    check_array_bytes(path, (total,), np.uint8, max_bytes, f"the MATLAB variables ({len(declared)})")
    raw = _scipy_mat(path, scipy.io.loadmat)
    return {k: v for k, v in raw.items() if not k.startswith("__") and isinstance(v, np.ndarray)}


def _read_mat_v73(path: Path, max_bytes: int | None) -> dict[str, np.ndarray]:
    import h5py

    out: dict[str, np.ndarray] = {}
    total = [0]  # bytes declared by the datasets read so far: many small ones count together, as in v5
    try:
        with h5py.File(path, "r") as f:

            def visit(name, obj):
                if not isinstance(obj, h5py.Dataset) or name.startswith("#") or obj.dtype.kind not in "biuf":
                    return
                cls = obj.attrs.get("MATLAB_class", b"")
                if (cls.decode() if isinstance(cls, bytes) else str(cls)) == "char":  # uint16 text codes
                    return
                # declared shape first: a chunked, compressed dataset can declare gigabytes in a few bytes
                total[0] += check_array_bytes(path, obj.shape, obj.dtype, max_bytes, f"HDF5 dataset {name!r}")
                check_array_bytes(path, (total[0],), np.uint8, max_bytes, f"the datasets up to {name!r}")
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


def _read_envi(path: Path, max_bytes: int | None) -> dict[str, np.ndarray]:
    import spectral.io.envi as envi

    hdr = _envi_header(path)
    data = None if path.suffix.lower() == ".hdr" else str(path)
    try:
        img = envi.open(str(hdr), data)
    except Exception as e:  # spectral raises its own exception types for bad headers / missing data files
        raise ValueError(f"{hdr}: cannot read ENVI image: {e}") from e
    check_array_bytes(hdr, img.shape, img.dtype, max_bytes, "the ENVI image")
    try:
        arr = np.array(img.load())  # (rows, cols, bands) whatever the interleave
    except Exception as e:  # truncated data files
        raise ValueError(f"{hdr}: cannot read ENVI image: {e}") from e
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
            total = 0
            for k in z.files:  # each member's header, before anything is decompressed
                with z.zip.open(f"{k}.npy") as f:
                    shape, dtype = npy_header(f, f"{path}[{k!r}]")
                total += check_array_bytes(path, shape, dtype, max_bytes, f"array {k!r}")
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
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"path: file not found: {p}")
    if p.is_dir():
        raise ValueError(f"path: expected a file, got a directory: {p}")
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
    return bool(np.all(np.isfinite(a)) and np.all(a == np.round(a)))


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
        max_bytes: see :func:`list_arrays`.
    """
    _check_nan_policy(nan_policy)
    p = Path(path)
    return _cube_from(p, list_arrays(p, max_bytes), key, nan_policy)


def _cube_from(p: Path, arrays: dict[str, np.ndarray], key: str | None, nan_policy: str) -> np.ndarray:
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
    cube = np.ascontiguousarray(cube, dtype=np.float32)
    bad = ~np.isfinite(cube)
    if bad.any():
        bands = np.flatnonzero(bad.any(axis=(0, 1)))
        if nan_policy == "raise":
            raise ValueError(
                f"cube {name!r} in {p} has NaN/inf values in {bands.size} band(s) {bands.tolist()[:32]}"
                f"{' ...' if bands.size > 32 else ''}; fix the file or use nan_policy='fill'"
            )
        for b in bands:
            band = cube[..., b]
            finite = np.isfinite(band)
            band[~finite] = band[finite].mean() if finite.any() else 0.0
    return cube


def load_gt(path: str | os.PathLike, key: str | None = None, max_bytes: int | None = None) -> np.ndarray:
    """Read a ground-truth map as int64 ``(H, W)``: 0 = unlabelled; labels are integers in ``0..MAX_LABEL``
    with at most ``MAX_CLASSES`` distinct classes, anything else is a ``ValueError`` naming the file, the
    value and where it is."""
    p = Path(path)
    return _gt_from(p, list_arrays(p, max_bytes), key)


def _gt_from(p: Path, arrays: dict[str, np.ndarray], key: str | None) -> np.ndarray:
    """:func:`load_gt` on the arrays already read from ``p``."""
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
    gt = gt.astype(np.int64)
    if (gt < 0).any():
        raise ValueError(
            f"ground truth {name!r} in {p} has negative labels (min {gt.min()}); expected 0 = unlabelled"
        )
    classes = np.unique(gt[gt > 0]).size
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


def load_scene(
    path: str | os.PathLike,
    gt_path: str | os.PathLike | None = None,
    key: str | None = None,
    gt_key: str | None = None,
    nan_policy: str = "raise",
    max_bytes: int | None = None,
) -> HSIScene:
    """Read a cube and (optionally) its ground truth and check that they agree in size.

    When ``gt_path`` is None but ``gt_key`` is given, the ground truth is read from the cube's own file (which
    is read once for both). ``max_bytes``: see :func:`list_arrays`.
    """
    _check_nan_policy(nan_policy)
    p = Path(path)
    arrays = list_arrays(p, max_bytes)
    cube = _cube_from(p, arrays, key, nan_policy)
    gt = None
    if gt_path is not None or gt_key is not None:
        gt = load_gt(gt_path, key=gt_key, max_bytes=max_bytes) if gt_path is not None else _gt_from(
            p, arrays, gt_key)
        if gt.shape != cube.shape[:2]:
            raise ValueError(
                f"gt/image size mismatch: ground truth {gt_path or path} is {gt.shape[0]}x{gt.shape[1]}, "
                f"cube {path} is {cube.shape[0]}x{cube.shape[1]} (H x W)"
            )
    return HSIScene(cube=cube, gt=gt, source=str(path))
