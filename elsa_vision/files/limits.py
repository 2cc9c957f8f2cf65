"""Limits on what an input file can make the process allocate or open, checked before it is read.

Inputs declare their size before they are decoded (image headers, TIFF page shapes, ``.npy`` headers, HDF5 /
MATLAB variable shapes); :func:`check_image_pixels` and :func:`check_array_bytes` compare the declared size
with a limit before any pixel is decoded: Pillow's ``Image.MAX_IMAGE_PIXELS`` for images, ``max_bytes``
(:data:`DEFAULT_MAX_ARRAY_BYTES` unless the caller passes another) for arrays, counting what the reader
already holds for the same file. :func:`open_image` and :func:`read_npy` are the readers that apply them to
images and ``.npy`` files (:func:`open_image` opens only :data:`IMAGE_FORMATS`, recognised by content).
:func:`check_regular_file` refuses FIFOs and devices before anything opens them. Checkpoints declare their
sizes in their zip directory and tensor records: :func:`check_zip_records` and :func:`check_tensors` bound
what a checkpoint reader allocates by the file's size, :func:`check_legacy_torch` the storages of a legacy
(pre-1.6, non-zip) ``torch.save`` file, and :func:`view_end` (how far into its storage a tensor record
reaches) is checked before a reader makes the view.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import stat
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DEFAULT_MAX_ARRAY_BYTES",
    "FileTooLargeError",
    "IMAGE_FORMATS",
    "STORAGE_DTYPES",
    "SizedReader",
    "check_array_bytes",
    "check_image_pixels",
    "check_legacy_torch",
    "check_npy_holds",
    "check_regular_file",
    "check_tensors",
    "check_zip_records",
    "npy_header",
    "open_image",
    "read_npy",
    "view_end",
]

# Decoded arrays (TIFF/HDF5/MATLAB/NumPy inputs) larger than this are refused before decoding: 4 GiB holds an
# 8192 x 8192 float32 image with 16 channels or a 1217 x 303 x 274 hyperspectral cube 10 times over.
DEFAULT_MAX_ARRAY_BYTES = 4 * 2**30


class FileTooLargeError(ValueError):
    """The file declares more pixels or bytes than the configured limit allows."""


_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_regular_file(path: str | os.PathLike, what: str = "input file") -> str:
    """Refuse ``path`` unless it is a regular file (symbolic links followed), before anything opens it: a
    FIFO blocks its reader until some other process writes to it, a device such as ``/dev/zero`` never
    ends. Returns ``os.fspath(path)``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: it is a directory, FIFO, device or socket, or cannot be examined; ``what`` (the
            caller's name for the file) starts the message.
    """
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path!r} does not exist") from None
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e.strerror or e}") from e
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
        raise ValueError(f"{what} {path!r} is {kind}; only regular files are read")
    return path


def _too_many_pixels(path: str | os.PathLike, pixels: str, limit: int) -> FileTooLargeError:
    return FileTooLargeError(
        f"image {os.fspath(path)!r} declares {pixels} pixels, more than the limit of {int(limit):,} (a "
        "decompression bomb?); raise PIL.Image.MAX_IMAGE_PIXELS (training: extras.max_image_pixels=N, "
        "inference: --max-image-pixels N) to read it"
    )


def check_image_pixels(
    path: str | os.PathLike, width: int, height: int, max_pixels: int | None = None
) -> None:
    """Refuse an image whose header declares more than ``max_pixels`` (default: Pillow's
    ``Image.MAX_IMAGE_PIXELS``; ``None`` there disables the check) pixels."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    if limit is not None and width * height > limit:
        raise _too_many_pixels(path, f"{width}x{height} = {width * height:,}", limit)


# The Pillow formats the package reads (image folders' IMG_EXTENSIONS, multiview frames and depth maps, the
# medical PNG / JPEG reader): Pillow's ID -> the name errors give. PPM covers .pgm / .pbm / .pnm. Pillow picks
# the format from the content, whatever the name, and some of its other plugins trust declared lengths (ICNS
# reads a JPEG 2000 block of any declared size into memory); those are never opened.
IMAGE_FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "BMP": "BMP", "GIF": "GIF", "PPM": "PPM", "TIFF": "TIFF",
                 "WEBP": "WebP"}


def open_image(path: str | os.PathLike, max_pixels: int | None = None):
    """``PIL.Image.open(path)`` restricted to :data:`IMAGE_FORMATS`, with the declared size checked before
    any decoding (see :func:`check_image_pixels`). Pillow's own ``DecompressionBombError`` (above twice its
    limit) becomes the same ``FileTooLargeError`` naming the file; a file in another format (by content) is
    ``PIL.UnidentifiedImageError`` (an ``OSError``) naming it."""
    from PIL import Image, UnidentifiedImageError

    check_regular_file(path, "image")
    try:
        with warnings.catch_warnings():
            # Pillow warns between 1x and 2x its limit and refuses above; the limit is enforced below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(path, formats=tuple(IMAGE_FORMATS))
    except UnidentifiedImageError:
        names = list(IMAGE_FORMATS.values())
        raise UnidentifiedImageError(
            f"image {os.fspath(path)!r} is not a readable {', '.join(names[:-1])} or {names[-1]} image (the "
            "format is recognised by content, whatever the name); other formats are not read"
        ) from None
    except Image.DecompressionBombError as e:
        found = re.search(r"\((\d+) pixels\)", str(e))
        pixels = f"{int(found.group(1)):,}" if found else "too many"
        raise _too_many_pixels(path, pixels, Image.MAX_IMAGE_PIXELS or 0) from None
    try:
        check_image_pixels(path, im.width, im.height, max_pixels)
    except FileTooLargeError:
        im.close()
        raise
    return im


def check_array_bytes(
    path: str | os.PathLike,
    shape: Iterable[int],
    dtype: Any,
    max_bytes: int | None = None,
    what: str = "array",
    held: int = 0,
) -> int:
    """Refuse an array whose declared ``shape`` x ``dtype`` exceeds ``max_bytes`` (default
    :data:`DEFAULT_MAX_ARRAY_BYTES`) or has a negative size (``ValueError`` naming the file); returns the
    declared size in bytes.

    ``held``: bytes the reader already holds for this file (the arrays decoded so far, the decoded data an
    image is converted from): the new array must fit beside them, so that ``max_bytes`` bounds what the
    reader allocates at once, not only each array it declares. Checked before the array is allocated.
    """
    limit = DEFAULT_MAX_ARRAY_BYTES if max_bytes is None else int(max_bytes)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"{os.fspath(path)!r}: {what} declares shape {shape}, with a negative size (a "
                         "forged header?)")
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if nbytes + held > limit:
        where = f"beside {held / 2**30:.1f} GiB held for the same file" if held else "when decoded"
        raise FileTooLargeError(
            f"{os.fspath(path)!r}: {what} of shape {shape} {dtype} would take {nbytes / 2**30:.1f} GiB "
            f"{where}, more than the limit of {limit / 2**30:.1f} GiB (a decompression bomb or a forged "
            "header?); raise the input size limit (--max-input-gib, data.max_input_gib) to read it"
        )
    return nbytes


def npy_header(f, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` from the header of the ``.npy`` stream ``f`` (positioned at its start), read with
    NumPy's own ``read_magic`` / ``read_array_header_*``; object arrays are refused."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{name} is not a readable .npy array: {e}") from e
    if dtype.hasobject:
        raise ValueError(f"{name} holds Python objects (dtype {dtype}); only numeric arrays are read")
    return tuple(shape), dtype


def read_npy(path: str | os.PathLike, max_bytes: int | None = None) -> np.ndarray:
    """``np.load(path, allow_pickle=False)`` for a ``.npy`` file, after checking its header: the declared
    shape must fit ``max_bytes`` and the file must hold that many bytes (a short file is refused before any
    allocation)."""
    path = check_regular_file(path, ".npy file")
    try:
        with open(path, "rb") as f:
            shape, dtype = npy_header(f, repr(path))
            offset = f.tell()
    except OSError as e:
        raise ValueError(f"{path!r} cannot be read: {e}") from e
    nbytes = check_array_bytes(path, shape, dtype, max_bytes, "the .npy array")
    check_npy_holds(repr(path), shape, dtype, nbytes, os.path.getsize(path) - offset)
    return np.load(path, allow_pickle=False)


def check_npy_holds(name: str, shape: tuple[int, ...], dtype: np.dtype, nbytes: int, held: int) -> None:
    """Refuse a ``.npy`` array (``name``: the file, or a member of an ``.npz``) whose header declares
    ``nbytes`` bytes of data (``shape``, ``dtype``) where only ``held`` follow the header: NumPy allocates the
    declared array before it reads it (a header of a few bytes can declare gigabytes)."""
    if held < nbytes:
        raise ValueError(
            f"{name}: the .npy header declares shape {tuple(shape)} {dtype} ({nbytes:,} bytes) but "
            f"it holds {max(0, held):,} bytes of data (truncated or forged header)"
        )


def check_zip_records(path: str, zf: zipfile.ZipFile, stored: Callable[[str], bool]) -> None:
    """Refuse a ``torch.save`` / ``torch.jit.save`` archive whose records could make a reader allocate more
    than the file holds, before any record is read.

    Both writers store every tensor and pickle record uncompressed (TorchScript deflates only its ``code/``
    records), so the records ``stored(name)`` names must be stored: a deflated record inflates to whatever
    its header declares (1 MB of zeros deflates to 1 KB). And the records must not overlap: each one's
    declared bytes lie in the file, apart from every other record's, so reading all of them allocates at
    most the file's size (records pointing at the same bytes would each be read in full).
    """
    size = os.path.getsize(path)
    spans = []
    for info in zf.infolist():
        if stored(info.filename) and (
            info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size
        ):
            raise ValueError(
                f"{path!r}: record {info.filename!r} is compressed (method {info.compress_type}, "
                f"{info.compress_size:,} bytes declaring {info.file_size:,}); torch.save stores its records "
                "uncompressed and a compressed record can inflate to any size, so it is not read"
            )
        spans.append((info.header_offset, info.header_offset + info.compress_size, info.filename))
    spans.sort()
    for (start, end, name), (after, _, other) in zip(spans, spans[1:] + [(size, size, None)]):
        if end > after:
            where = f"into record {other!r}" if other else f"past the end of the {size:,}-byte file"
            raise ValueError(
                f"{path!r}: record {name!r} declares {end - start:,} bytes at offset {start:,}, which reach "
                f"{where}: a forged archive"
            )


def check_tensors(obj: Any, path: str) -> None:
    """Refuse a checkpoint whose tensors describe more data than its file holds.

    ``torch.load`` rebuilds each tensor as a view (offset, sizes, strides) of a storage read from the file, so
    a few bytes of storage can carry a tensor of any size: an ``expand``ed (stride-0) or overlapping view, or
    the same bytes viewed again and again, which the first copy, ``.to()`` or a model built from the
    tensor's shape turns into real memory. So every tensor in ``obj`` must be dense (strided), lie inside
    its storage and have no more elements than it; the storages together hold no more bytes than the file;
    and the distinct views together describe at most twice what their storages hold (one weight under two
    names, as tied embeddings, is the most a saved module shares; a view saved under several names, as
    ``state_dict()`` gives for a module registered twice, counts once).
    """
    file_bytes = os.path.getsize(path)
    storages: dict[int, int] = {}
    views: set[tuple] = set()
    described = 0
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, Tensor):
            if id(item) in seen:
                continue
            seen.add(id(item))
            nbytes = _tensor_extent(item, where, path, storages)
            view = (item.untyped_storage()._cdata, item.storage_offset(), item.dtype, tuple(item.shape),
                    item.stride())
            if view not in views:
                views.add(view)
                described += nbytes
        elif isinstance(item, (Mapping, list, tuple, set, frozenset)) and id(item) not in seen:
            seen.add(id(item))  # containers shared many times (a pickle can nest them) are walked once
            pairs = item.items() if isinstance(item, Mapping) else enumerate(item)
            stack.extend((v, f"{where}[{k!r}]") for k, v in pairs)
    held = sum(storages.values())
    _check_storage_bytes(path, held, file_bytes)
    if described > 2 * held:
        raise ValueError(
            f"{path!r}: its tensors describe {described:,} bytes over {held:,} bytes of storage: the same "
            "data viewed under many names (a forged checkpoint); save each tensor once (.clone())"
        )


def _check_storage_bytes(path: str, held: int, file_bytes: int) -> None:
    if held > file_bytes:
        raise ValueError(
            f"{path!r}: its tensors' storages declare {held:,} bytes, more than the {file_bytes:,}-byte file "
            "holds (a forged checkpoint)"
        )


def view_end(offset: int, size: Sequence[int], stride: Sequence[int]) -> int:
    """One past the last element of its storage that the view ``offset``, ``size``, ``stride`` (in elements)
    reaches; 0 for a view without elements. A view is inside a storage of ``n`` elements iff this is ``<= n``
    (sizes, strides and offset non-negative)."""
    if any(n == 0 for n in size):
        return 0
    return offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1


def _tensor_extent(t: Tensor, where: str, path: str, storages: dict[int, int]) -> int:
    """``t``'s size in bytes once dense, after checking it is a dense view inside its storage, no larger
    than it (see :func:`check_tensors`); its storage is recorded in ``storages`` (id -> bytes)."""
    name = f"tensor {where}" if where else "the tensor"
    if t.layout != torch.strided:
        raise ValueError(f"{path!r}: {name} is a {t.layout} tensor; checkpoints of weights are dense")
    storage = t.untyped_storage()
    storages[storage._cdata] = storage.nbytes()
    elements = storage.nbytes() // t.element_size()
    numel = t.numel()
    if numel > elements or view_end(t.storage_offset(), t.shape, t.stride()) > elements:
        raise ValueError(
            f"{path!r}: {name} declares shape {tuple(t.shape)} ({numel:,} elements, strides {t.stride()}) "
            f"over a storage of {elements:,} elements: an expanded (stride-0) or overlapping view, or a "
            "forged checkpoint; save it with .contiguous()"
        )
    return numel * t.element_size()


# torch.<X>Storage, in a pickle's storage references, names the element type of the storage.
STORAGE_DTYPES = {
    "Float": torch.float32, "Double": torch.float64, "Half": torch.float16, "BFloat16": torch.bfloat16,
    "Long": torch.int64, "Int": torch.int32, "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8,
    "Bool": torch.bool, "ComplexFloat": torch.complex64, "ComplexDouble": torch.complex128,
}


class _Inert:
    """What every global a legacy pickle names becomes while its storages are counted: nothing is looked up
    or run, and it takes whatever the pickle does with it (calls, state, items)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _StorageType(_Inert):
    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize


class _StorageCounter(pickle.Unpickler):
    """Reads one pickle of a legacy ``torch.save`` file, recording the bytes each storage it references
    declares (``storages``: key -> bytes, the first declaration of a key, which is what torch reserves)."""

    def __init__(self, file: io.BufferedReader) -> None:
        super().__init__(file, encoding="utf-8")  # as torch.load reads Python 2 pickles
        self.storages: dict[Any, int] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name.endswith("Storage"):
            dtype = STORAGE_DTYPES.get(name[: -len("Storage")])
            return _StorageType(torch._utils._element_size(dtype) if dtype is not None else 16)
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 6 and pid[0] in ("storage", b"storage"):
            _, stype, key, _location, numel, _view = pid
            if type(numel) is not int or numel < 0:
                raise pickle.UnpicklingError(f"storage {str(key)[:40]!r} declares {str(numel)[:40]} elements")
            itemsize = stype.itemsize if isinstance(stype, _StorageType) else 16
            self.storages.setdefault(key, numel * itemsize)
        return _Inert()


class SizedReader(io.BufferedReader):
    """A file opened for reading that refuses a read of more bytes than it holds from the current position.

    Parsers read a value of a declared length with ``read(length)``, and ``read(n)`` allocates ``n`` bytes
    before the read comes back short: pydicom reads every DICOM element so (4 GiB from a 200-byte file),
    Python's unpickler a pickle's strings and buffers. Reads of up to 64 KiB (headers at the end of a file)
    pass unchecked. Raises ``ValueError``: ``expected N bytes at byte P, past the end of the F-byte file``."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(io.FileIO(os.fspath(path), "rb"))
        self._size = os.fstat(self.fileno()).st_size

    def read(self, size: int | None = -1, _read=io.BufferedReader.read) -> bytes:
        if size is not None and size > 2**16 and size > self._size - self.tell():
            raise ValueError(
                f"expected {size:,} bytes at byte {self.tell():,}, past the end of the {self._size:,}-byte "
                "file (truncated or forged)"
            )
        return _read(self, size)


def check_legacy_torch(path: str) -> None:
    """Refuse a legacy (pre-1.6, non-zip) ``torch.save`` file whose storages declare more bytes than the
    file holds, before ``torch.load`` reads it.

    The legacy container is a sequence of pickles (a magic number, the protocol version, system information,
    the saved object, the list of storage keys) followed by each storage's element count and bytes; torch
    reserves every storage at the size the object's persistent ids declare before it reads any of them (8 GiB
    from a 368-byte file). Those sizes are read here from the object's pickle, with every global it names
    replaced by an inert stand-in (nothing is imported or run), and must fit the file together. A pickle that
    cannot be read this way is a ``ValueError`` naming the file. Each pickle's opcodes are walked first
    (``pickletools.genops``) through a :class:`SizedReader`: a string or buffer declaring more bytes than are
    left is refused there, where Python's unpickler would reserve the declared size (``bytearray8`` of 8 GiB)
    before reading it.
    """
    try:
        with SizedReader(path) as f:
            for _ in range(4):  # magic number, protocol version, system information, the saved object
                start = f.tell()
                for _op in pickletools.genops(f):
                    pass
                f.seek(start)
                counter = _StorageCounter(f)
                counter.load()
    except Exception as e:  # a forged pickle can fail in many ways; nothing was run either way
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path!r} is a truncated or damaged checkpoint: {first}") from e
    _check_storage_bytes(path, sum(counter.storages.values()), os.path.getsize(path))
