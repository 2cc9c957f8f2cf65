"""Files from outside: read without executing anything, refuse what is too large, write atomically.

Every weights or checkpoint file the package reads goes through :func:`read_checkpoint`: ``.safetensors``
through safetensors, ``torch.save`` files through ``torch.load(weights_only=True)`` (tensors, containers and
plain values only), and TorchScript archives (OpenAI's CLIP ``.pt`` files) through
:func:`read_torchscript_state_dict`, which reads their tensors without running the archive's code. A file
that is none of these is reported as "not a checkpoint", naming what it looks like. :func:`read_weights`
(:func:`unwrap_weights` for a checkpoint already read) unwraps what training scripts put around the weights
(a Lightning checkpoint's ``state_dict``, timm's ``state_dict_ema``, DDP's ``module.`` prefix ...) into one
flat ``{name: tensor}``; ``submodule="net"`` takes the network out of a training module's weights
(:func:`submodule_weights`). Every reader takes ``arg``, the name the caller gives the file (``"ckpt_path"``,
``"--weights"`` ...): its errors then start with that name and keep their exception class, so no caller
checks the path or rewords the errors itself.

Inputs declare their size before they are decoded (image headers, TIFF page shapes, ``.npy`` headers, HDF5 /
MATLAB variable shapes); :func:`check_image_pixels` and :func:`check_array_bytes` compare the declared size
with a limit before any pixel is decoded: Pillow's ``Image.MAX_IMAGE_PIXELS`` for images, ``max_bytes``
(:data:`DEFAULT_MAX_ARRAY_BYTES` unless the caller passes another) for arrays.

Checkpoints are written next to their target and renamed over it (:func:`atomic_torch_save`), so a reader
sees either the previous complete file or the new complete file, also across a crash or a full disk.
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import errno
import math
import os
import pickle
import re
import secrets
import shutil
import sys
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DEFAULT_MAX_ARRAY_BYTES",
    "FileTooLargeError",
    "NotACheckpointError",
    "STATE_DICT_KEYS",
    "UnsafeCheckpointError",
    "atomic_torch_save",
    "atomic_write",
    "add_max_input_argument",
    "add_output_arguments",
    "check_array_bytes",
    "check_image_pixels",
    "checkpoint_kind",
    "link_atomically",
    "npy_header",
    "open_image",
    "prepare_output_dir",
    "read_checkpoint",
    "read_npy",
    "read_safetensors_metadata",
    "read_torchscript_state_dict",
    "read_weights",
    "remove_outputs",
    "remove_stale_temp_files",
    "save_safetensors",
    "submodule_weights",
    "unwrap_weights",
]

# Decoded arrays (TIFF/HDF5/MATLAB/NumPy inputs) larger than this are refused before decoding: 4 GiB holds an
# 8192 x 8192 float32 image with 16 channels or a 1217 x 303 x 274 hyperspectral cube 10 times over.
DEFAULT_MAX_ARRAY_BYTES = 4 * 2**30


class NotACheckpointError(ValueError):
    """The file is not a checkpoint in any format the package reads."""


class UnsafeCheckpointError(ValueError):
    """The checkpoint holds Python objects that a weights-only load does not rebuild."""


class FileTooLargeError(ValueError):
    """The file declares more pixels or bytes than the configured limit allows."""


# ------------------------------------------------------------------------------------------ checkpoints

# What a file that is not a checkpoint usually is, by its first bytes (for the error message only).
_SIGNATURES = (
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"GIF8", "a GIF image"),
    (b"II*\x00", "a TIFF image"),
    (b"MM\x00*", "a TIFF image"),
    (b"%PDF", "a PDF document"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"\x89HDF", "an HDF5 file"),
    (b"\x93NUMPY", "a NumPy .npy array"),
)
# torch.save's legacy (non-zip) format starts with a pickled magic number.
_LEGACY_TORCH = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


def _describe_bytes(head: bytes) -> str:
    for magic, what in _SIGNATURES:
        if head.startswith(magic):
            return what
    if not head:
        return "empty"
    try:
        head.decode("utf-8")
        return "a text file"
    except UnicodeDecodeError:
        return f"unrecognised data (first bytes {head[:8].hex(' ')})"


@contextlib.contextmanager
def _named(arg: str | None):
    """Errors about the file (``FileNotFoundError``, ``ValueError`` and its subclasses) raised inside start
    with ``arg``, the caller's name for it (``"ckpt_path: '/x.ckpt' does not exist ..."``), and keep their
    class, cause and traceback."""
    if not arg:
        yield
        return
    try:
        yield
    except (FileNotFoundError, ValueError) as e:
        try:
            named = type(e)(f"{arg}: {e}")
        except TypeError:  # a class whose constructor takes other arguments (UnicodeDecodeError): as it is
            raise e from e.__cause__
        raise named.with_traceback(e.__traceback__) from e.__cause__


def checkpoint_kind(path: str | os.PathLike, *, arg: str | None = None) -> str:
    """``"safetensors"``, ``"torch"`` (a ``torch.save`` zip), ``"torch-legacy"`` or ``"torchscript"``.

    Decided from the file's first bytes and, for zips, its record names; nothing is unpickled. ``arg``: the
    caller's name for the file (``"ckpt_path"``, ``"--weights"``); errors then start with it.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        NotACheckpointError: the file is none of the four, e.g. an image.
    """
    with _named(arg):
        return _checkpoint_kind(os.fspath(path))


def _checkpoint_kind(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r} does not exist or is not a file")
    if path.endswith(".safetensors"):
        return "safetensors"  # the safetensors reader validates the header itself
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            raise NotACheckpointError(f"{path!r} is not a checkpoint: a damaged zip archive ({e})") from e
        if any(n.endswith("constants.pkl") or "/code/" in n or n.startswith("code/") for n in names):
            return "torchscript"
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            return "torch"
        raise NotACheckpointError(
            f"{path!r} is not a checkpoint: a zip archive without the data.pkl record torch.save writes"
        )
    if head.startswith(_LEGACY_TORCH):
        return "torch-legacy"
    if len(head) >= 9:
        header_len = int.from_bytes(head[:8], "little")
        if head[8:9] == b"{" and 0 < header_len <= os.path.getsize(path) - 8:
            return "safetensors"
    raise NotACheckpointError(
        f"{path!r} is not a checkpoint: it is {_describe_bytes(head)}, not a file written by torch.save "
        "or safetensors"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _refused_global(e: BaseException) -> str:
    """What torch's weights-only unpickler refused, without its advice to load the file unsafely."""
    found = re.search(r"GLOBAL ([\w.]+)", str(e))
    return f"it names {found.group(1)}" if found else "an object that is not a tensor or a plain value"


def read_checkpoint(
    path: str | os.PathLike,
    *,
    arg: str | None = None,
    map_location: Any = "cpu",
    torchscript: bool = False,
    mmap: bool = False,
) -> Any:
    """Read a weights or checkpoint file without executing anything from it.

    Args:
        path: ``.safetensors`` (-> ``{name: tensor}``), a ``torch.save`` file (-> what was saved, loaded with
            ``torch.load(weights_only=True)``), or, with ``torchscript=True``, a TorchScript archive
            (-> its ``state_dict``, see :func:`read_torchscript_state_dict`).
        arg: the caller's name for the file (``"ckpt_path"``, ``"--weights"``); every error below then
            starts with it (``"ckpt_path: '/x.ckpt' does not exist or is not a file"``), same class.
        map_location: as for ``torch.load``.
        torchscript: accept TorchScript archives; otherwise they are refused.
        mmap: memory-map a ``torch.save`` zip's tensors instead of reading them (to look at a few entries
            of a large checkpoint).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        NotACheckpointError: the file is not a checkpoint (an image, text, a damaged archive ...).
        ValueError: the file holds Python objects a weights-only load does not rebuild, or is truncated /
            corrupt. Messages name the file; none suggests loading it with code execution.
    """
    with _named(arg):
        return _read_checkpoint(os.fspath(path), map_location, torchscript, mmap)


def _read_checkpoint(path: str, map_location: Any, torchscript: bool, mmap: bool) -> Any:
    kind = _checkpoint_kind(path)
    if kind == "safetensors":
        from safetensors.torch import load_file

        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        try:
            return load_file(path, device=str(device))
        except Exception as e:  # safetensors raises its own SafetensorError on damaged headers
            raise ValueError(f"{path!r} is a damaged .safetensors file: {_first_line(e)}") from e
    if kind == "torchscript":
        if not torchscript:
            raise ValueError(
                f"{path!r} is a TorchScript archive, not a checkpoint of weights; save its state_dict "
                "(torch.save(module.state_dict(), path)) or pass a .safetensors file"
            )
        return read_torchscript_state_dict(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and kind == "torch")
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path!r} holds Python objects that a weights-only load does not rebuild "
            f"({_refused_global(e)}); checkpoints must hold only tensors, containers and plain values"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path!r} is a truncated or damaged checkpoint: {_first_line(e)}") from e


# Keys under which training scripts nest the weights, in the order they are taken: timm's EMA weights first
# (as timm's own loader), then Lightning's / timm's state_dict, ``model`` (DeiT, MAE), DINOv2's ``teacher``.
STATE_DICT_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model", "module", "teacher", "model_state")
# Prefixes wrappers add to every key: DDP (``module.``) and torch.compile (``_orig_mod.``), in either order.
# Removed only when every key has one (a model may have a submodule of that name).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def read_weights(
    path: str | os.PathLike,
    *,
    arg: str | None = None,
    submodule: str | None = None,
    torchscript: bool = False,
    map_location: Any = "cpu",
) -> dict[str, Tensor]:
    """The weights a file holds, as one flat ``{name: tensor}``: :func:`read_checkpoint`, then
    :func:`unwrap_weights`.

    Args:
        path: a ``.safetensors`` file, a ``torch.save`` file or, with ``torchscript=True``, a TorchScript
            archive (see :func:`read_checkpoint`).
        arg: the caller's name for the file (``"checkpoint_path"``, ``"--weights"``); every error below
            then starts with it and keeps its class.
        submodule: the attribute of a training module that holds the network (a LightningModule's
            ``"net"``): where keys carry that prefix, the weights are those keys with it removed (metric
            states or a decoder beside the network are left out); otherwise all weights, as they are.
        torchscript, map_location: as for :func:`read_checkpoint`.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        NotACheckpointError, UnsafeCheckpointError, ValueError: as :func:`read_checkpoint`; a
            ``ValueError`` naming the file when it holds no tensors.
    """
    with _named(arg):
        obj = _read_checkpoint(os.fspath(path), map_location, torchscript, False)
        return unwrap_weights(obj, path, submodule=submodule)


def unwrap_weights(
    obj: Any, path: str | os.PathLike, *, arg: str | None = None, submodule: str | None = None
) -> dict[str, Tensor]:
    """The flat ``{name: tensor}`` inside what :func:`read_checkpoint` returned for ``path``.

    A mapping without tensors of its own is unwrapped through the first of :data:`STATE_DICT_KEYS` it holds
    (a Lightning checkpoint's ``state_dict``, timm's ``state_dict_ema`` ...), as often as that applies;
    entries that are not tensors are dropped, and a ``module.`` / ``_orig_mod.`` prefix that every key
    carries (DDP, ``torch.compile``) is removed. A training module's own prefix (a LightningModule's
    ``net.``) is removed only when the caller names it: with ``submodule="net"`` the weights are the keys
    under ``net.`` (:func:`submodule_weights`, wrapper prefixes inside it removed as above), or all weights
    when no key has that prefix. ``path`` names the file in errors, ``arg`` (the caller's name for it)
    starts them.

    Raises:
        ValueError: naming the file, when it holds no tensors.
    """
    with _named(arg):
        tensors = _unwrap_weights(obj, os.fspath(path))
    if submodule:
        tensors = _strip_wrappers(submodule_weights(tensors, submodule) or tensors)
    return tensors


def submodule_weights(state: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The entries of ``state`` under the submodule ``name`` (keys starting with ``name + "."``), with that
    prefix removed; ``None`` when no key has it. E.g. ``submodule_weights(lightning_state, "net")``: the
    network's weights without the metric states or heads kept beside it."""
    prefix = f"{name}."
    found = {k[len(prefix) :]: v for k, v in state.items() if isinstance(k, str) and k.startswith(prefix)}
    return found or None


def _unwrap_weights(obj: Any, path: str) -> dict[str, Tensor]:
    top, inside = obj, ""
    while isinstance(obj, Mapping) and not any(isinstance(v, Tensor) for v in obj.values()):
        nested = next((k for k in STATE_DICT_KEYS if isinstance(obj.get(k), Mapping)), None)
        if nested is None:
            break
        obj, inside = obj[nested], f"{inside}[{nested!r}]"
    tensors = {k: v for k, v in obj.items() if isinstance(v, Tensor)} if isinstance(obj, Mapping) else {}
    if not tensors:
        what = f"keys {list(top)[:8]}" if isinstance(top, Mapping) else f"a {type(top).__name__}"
        where = f", none in {inside}" if inside else ""
        raise ValueError(f"{path!r} holds no tensors ({what}{where})")
    return _strip_wrappers(tensors)


def _strip_wrappers(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if tensors and all(isinstance(k, str) and k.startswith(prefix) for k in tensors):
                tensors = {k[len(prefix) :]: v for k, v in tensors.items()}
                stripped = True
    return tensors


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` strings of a ``.safetensors`` file (its header only); ``{}`` for other files."""
    if checkpoint_kind(path) != "safetensors":
        return {}
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own SafetensorError on damaged headers
        raise ValueError(f"{os.fspath(path)!r} is a damaged .safetensors file: {_first_line(e)}") from e


# ------------------------------------------------------------------------------- TorchScript archives

# Globals a TorchScript archive's data.pkl may name, as torch's own TorchScript unpickler knows them
# (torch/csrc/jit/serialization/unpickler.cpp, readGlobal), and what a weights reader does with them.
# Quantized, sparse and subclassed tensors, RRefs and the legacy `__main__` ids are refused.
_TS_PASSTHROUGH = {
    ("torch.jit._pickle", "build_intlist"),
    ("torch.jit._pickle", "build_tensorlist"),
    ("torch.jit._pickle", "build_doublelist"),
    ("torch.jit._pickle", "build_boollist"),
}
_TS_MAX_CODE_BYTES = 64 * 2**20
_TS_CLASS = re.compile(r"^class\s+([A-Za-z_][A-Za-z0-9_]*)\s*[(:]")
_TS_DECL = re.compile(r"^\s+(__parameters__|__buffers__)\s*=\s*(\[.*\])\s*$")


class _ScriptObject:
    """An inert stand-in for a TorchScript class instance: keeps the pickled state, runs nothing."""

    qualname = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Storage:
    def __init__(self, data: Tensor) -> None:
        self.data = data  # 1-D, the storage's dtype


# torch.<X>Storage names the element type of a storage record.
_TS_DTYPES = {
    "Float": torch.float32, "Double": torch.float64, "Half": torch.float16, "BFloat16": torch.bfloat16,
    "Long": torch.int64, "Int": torch.int32, "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8,
    "Bool": torch.bool, "ComplexFloat": torch.complex64, "ComplexDouble": torch.complex128,
}


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                    hooks: Any = None, metadata: Any = None) -> Tensor:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor record does not refer to a storage of the archive")
    ints = (offset, *size, *stride) if isinstance(size, tuple) and isinstance(stride, tuple) else None
    if ints is None or not all(type(v) is int for v in ints) or len(size) != len(stride):
        raise pickle.UnpicklingError("a tensor record has a malformed offset, size or stride")
    data = storage.data
    return torch.empty(0, dtype=data.dtype).set_(data.untyped_storage(), offset, size, stride)


class _TorchScriptUnpickler(pickle.Unpickler):
    def __init__(self, file, zf: zipfile.ZipFile, prefix: str, path: str) -> None:
        super().__init__(file)
        self._zf, self._prefix, self._path = zf, prefix, path
        self._storages: dict[str, _Storage] = {}
        self._classes: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) in _TS_PASSTHROUGH:
            return lambda data: data
        if (module, name) == ("torch.jit._pickle", "restore_type_tag"):
            return lambda value, type_str: value
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("builtins", "complex"):
            return complex
        if (module, name) == ("torch", "device"):
            return torch.device
        if module == "torch" and name.endswith("Storage") and name[: -len("Storage")] in _TS_DTYPES:
            return ("storage_type", _TS_DTYPES[name[: -len("Storage")]])
        if module == "__torch__" or module.startswith("__torch__."):
            qualname = f"{module}.{name}"
            if qualname not in self._classes:
                self._classes[qualname] = type("ScriptObject", (_ScriptObject,), {"qualname": qualname})
            return self._classes[qualname]
        raise pickle.UnpicklingError(
            f"data.pkl names {module}.{name}, which a weights reader does not rebuild"
        )

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:80]}")
        _, stype, key, _location, numel = pid
        if not (isinstance(stype, tuple) and stype[0] == "storage_type") or not isinstance(key, str):
            raise pickle.UnpicklingError("malformed storage reference")
        if type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"storage {key!r} has a malformed size")
        if key in self._storages:
            return self._storages[key]
        dtype = stype[1]
        nbytes = numel * dtype.itemsize
        record = f"{self._prefix}data/{key}"
        try:
            info = self._zf.getinfo(record)
        except KeyError:
            raise pickle.UnpicklingError(f"storage record {record!r} is missing") from None
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
            raise pickle.UnpicklingError(
                f"storage record {record!r} holds {info.file_size} bytes (compression {info.compress_type}), "
                f"expected {nbytes} stored bytes"
            )
        raw = bytearray(self._zf.read(record)) if nbytes else bytearray()
        data = torch.frombuffer(raw, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        self._storages[key] = _Storage(data)
        return self._storages[key]


def _class_declarations(zf: zipfile.ZipFile, prefix: str) -> dict[str, tuple[list[str], list[str]]]:
    """``qualified class name -> (parameter names, buffer names)`` from the archive's ``code/`` records.

    The records are read as text: a class header line and its ``__parameters__`` / ``__buffers__`` list
    literals (``ast.literal_eval``); nothing is compiled.
    """
    decls: dict[str, tuple[list[str], list[str]]] = {}
    code_dir = f"{prefix}code/"
    for info in zf.infolist():
        name = info.filename
        if not (name.startswith(code_dir) and name.endswith(".py")):
            continue
        if info.file_size > _TS_MAX_CODE_BYTES:
            raise ValueError(f"code record {name!r} is {info.file_size} bytes; not a module archive")
        module = name[len(code_dir) : -len(".py")].replace("/", ".")
        current: str | None = None
        for line in zf.read(name).decode("utf-8", errors="replace").splitlines():
            m = _TS_CLASS.match(line)
            if m:
                current = f"{module}.{m.group(1)}"
                continue
            d = _TS_DECL.match(line) if current else None
            if d:
                names = ast.literal_eval(d.group(2))
                if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                    raise ValueError(f"{name!r}: malformed {d.group(1)} of class {current}")
                params, buffers = decls.get(current, ([], []))
                decls[current] = (names, buffers) if d.group(1) == "__parameters__" else (params, names)
    return decls


def read_torchscript_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The ``state_dict`` of a TorchScript module archive (``torch.jit.save``), read without running it.

    A TorchScript archive stores its tensors as raw ``data/<key>`` records and the module tree in
    ``data.pkl``, a pickle whose objects are instances of the archive's own TorchScript classes (whose
    ``__setstate__`` ``torch.jit.load`` would run). Here ``data.pkl`` is read with an unpickler that knows
    only the handful of globals a module's data needs (tensor rebuilding, storage types, ``OrderedDict``,
    TorchScript's list tags, ``complex``, ``torch.device``) and turns every TorchScript class into an inert
    record of its pickled state; which attributes are parameters and buffers is read from the class
    declarations (``__parameters__``, ``__buffers__``) in the archive's ``code/`` records, as text.
    Tensors come back as plain (non-``requires_grad``) CPU tensors with the names
    ``torch.jit.load(path).state_dict()`` would give.

    Raises:
        ValueError: naming the file, for anything else in ``data.pkl`` (another global, a module whose state
            is not a plain attribute dict: one with a custom ``__getstate__``), missing or compressed
            storage records, or a big-endian archive.
    """
    path = os.fspath(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"TorchScript archive {path!r} cannot be opened: {e}") from e
    with zf:
        pkl = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise ValueError(f"TorchScript archive {path!r} has {len(pkl)} data.pkl records, expected one")
        prefix = pkl[0][: -len("data.pkl")]
        order = f"{prefix}byteorder"
        if order in zf.namelist() and zf.read(order).decode(errors="replace").strip() != sys.byteorder:
            raise ValueError(f"TorchScript archive {path!r} was written on a machine of another byte order")
        decls = _class_declarations(zf, prefix)
        with zf.open(pkl[0]) as f:
            try:
                root = _TorchScriptUnpickler(f, zf, prefix, path).load()
            except Exception as e:  # a forged pickle can fail in many ways; nothing was run either way
                raise ValueError(f"TorchScript archive {path!r} refused: {e}; nothing in it was run") from e
    if not isinstance(root, _ScriptObject):
        raise ValueError(f"TorchScript archive {path!r} does not hold a module (data.pkl is a {type(root)})")
    out: dict[str, Tensor] = {}
    _collect(root, "", decls, out, path, set())
    return out


def _collect(obj: _ScriptObject, prefix: str, decls: Mapping, out: dict, path: str, active: set) -> None:
    decl = decls.get(obj.qualname)
    if decl is None:
        raise ValueError(f"TorchScript archive {path!r}: no declaration of module class {obj.qualname}")
    state = obj.state
    if not isinstance(state, dict):
        raise ValueError(
            f"TorchScript archive {path!r}: module {prefix.rstrip('.') or '<root>'} ({obj.qualname}) keeps "
            "its state through its own __getstate__/__setstate__ code, which is never run; not read"
        )
    if id(obj) in active:
        raise ValueError(f"TorchScript archive {path!r}: module {obj.qualname} contains itself")
    active.add(id(obj))
    params, buffers = decl
    for name in (*params, *buffers):
        value = state.get(name)
        if value is None:
            continue  # an optional parameter that is unset (e.g. bias=None), as in state_dict()
        if not isinstance(value, Tensor):
            raise ValueError(f"TorchScript archive {path!r}: {prefix}{name} is not a tensor")
        out[prefix + name] = value
    for name, value in state.items():
        if isinstance(value, _ScriptObject) and value.qualname in decls:
            _collect(value, f"{prefix}{name}.", decls, out, path, active)
    active.discard(id(obj))


# -------------------------------------------------------------------------------------- size limits


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


def open_image(path: str | os.PathLike, max_pixels: int | None = None):
    """``PIL.Image.open(path)`` with the declared size checked before any decoding (see
    :func:`check_image_pixels`). Pillow's own ``DecompressionBombError`` (above twice its limit) becomes the
    same ``FileTooLargeError`` naming the file."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            # Pillow warns between 1x and 2x its limit and refuses above; the limit is enforced below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(path)
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


def add_max_input_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    """``--max-input-gib`` of a command-line tool (default :data:`DEFAULT_MAX_ARRAY_BYTES`): ``what`` files
    declaring more GiB of data are refused before they are read. The value must be a number > 0; the
    limit in bytes is ``int(args.max_input_gib * 2**30)``."""

    def gib(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value

    parser.add_argument(
        "--max-input-gib",
        type=gib,
        default=DEFAULT_MAX_ARRAY_BYTES / 2**30,
        help=f"refuse {what} declaring more than this many GiB of data, before reading (default %(default)g)",
    )


def check_array_bytes(
    path: str | os.PathLike,
    shape: Iterable[int],
    dtype: Any,
    max_bytes: int | None = None,
    what: str = "array",
) -> int:
    """Refuse an array whose declared ``shape`` x ``dtype`` exceeds ``max_bytes`` (default
    :data:`DEFAULT_MAX_ARRAY_BYTES`); returns the declared size in bytes."""
    limit = DEFAULT_MAX_ARRAY_BYTES if max_bytes is None else int(max_bytes)
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if nbytes > limit:
        raise FileTooLargeError(
            f"{os.fspath(path)!r}: {what} of shape {shape} {dtype} would take {nbytes / 2**30:.1f} GiB when "
            f"decoded, more than the limit of {limit / 2**30:.1f} GiB (a decompression bomb or a forged "
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
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            shape, dtype = npy_header(f, repr(path))
            offset = f.tell()
    except OSError as e:
        raise ValueError(f"{path!r} cannot be read: {e}") from e
    nbytes = check_array_bytes(path, shape, dtype, max_bytes, "the .npy array")
    size = os.path.getsize(path) - offset
    if size < nbytes:
        raise ValueError(
            f"{path!r}: the .npy header declares shape {tuple(shape)} {dtype} ({nbytes:,} bytes) but the "
            f"file holds {size:,} bytes of data (truncated or forged header)"
        )
    return np.load(path, allow_pickle=False)


# ----------------------------------------------------------------------------------- output directories


def add_output_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, help: str, **out: Any
) -> None:
    """``--out`` (``help`` and ``out``: its other ``add_argument`` settings, ``default=``, ``required=``,
    ``type=``) and ``--overwrite`` of a command-line tool: the pair :func:`prepare_output_dir` checks."""
    parser.add_argument("--out", help=help, **out)
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the outputs of an earlier run in --out"
    )


def prepare_output_dir(
    out: str | os.PathLike, outputs: Iterable[str], overwrite: bool = False, flag: str = "--out"
) -> Path:
    """Check, before any work is done, that a run can write its ``outputs`` into the directory ``out``.

    ``out`` (or, if it does not exist yet, its nearest existing parent, where it will be created) must be a
    directory this process can write to: a file is created and removed there to find out. None of
    ``outputs`` (names relative to ``out``; a trailing ``*`` matches a prefix) may exist unless
    ``overwrite``. Nothing is created: a run that fails later leaves no empty directory. Raises
    ``ValueError`` (one line, naming the directory); returns ``Path(out)``.
    """
    if isinstance(outputs, (str, bytes, os.PathLike)):
        raise TypeError(f"prepare_output_dir: outputs must be a list of names, got one name {outputs!r}")
    out = Path(out)
    probe_dir = out
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ValueError(f"{flag} {str(out)!r} cannot be created: {str(probe_dir)!r} is not a directory")
    try:
        probe = probe_dir / f".write-test-{os.getpid()}-{secrets.token_hex(4)}"
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as e:
        reason = e.strerror or str(e)
        raise ValueError(f"{flag} {str(out)!r} is not writable ({str(probe_dir)!r}: {reason})") from e
    existing = [p.name for p in _existing_outputs(out, outputs)]
    if existing and not overwrite:
        shown = ", ".join(existing[:5]) + (" ..." if len(existing) > 5 else "")
        raise ValueError(
            f"{flag} {str(out)!r} already holds outputs of an earlier run ({shown}); pass --overwrite to "
            "replace them or choose another directory"
        )
    return out


def _existing_outputs(out: Path, outputs: Iterable[str]) -> list[Path]:
    """The entries of directory ``out`` named by ``outputs`` (a trailing ``*`` matches a prefix), links
    included; none when ``out`` is not a directory."""
    if not out.is_dir():
        return []
    found: list[Path] = []
    for name in outputs:
        if name.endswith("*"):
            found += sorted(out.glob(name))
        elif (out / name).exists() or (out / name).is_symlink():
            found.append(out / name)
    return found


def remove_outputs(out: str | os.PathLike, outputs: Iterable[str]) -> list[str]:
    """Delete what an earlier run left in ``out`` under the names of ``outputs`` (as in
    :func:`prepare_output_dir`: a trailing ``*`` matches a prefix; directories are removed whole, links
    themselves, never what they point to). What ``--overwrite`` does once the new run is about to write, so
    that no output of a larger earlier run (a ``slice_0007`` where this run has three slices) stays mixed
    with the new ones. Returns the names removed."""
    if isinstance(outputs, (str, bytes, os.PathLike)):
        raise TypeError(f"remove_outputs: outputs must be a list of names, got one name {outputs!r}")
    removed = []
    for p in _existing_outputs(Path(out), outputs):
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            continue
        removed.append(p.name)
    return removed


# ----------------------------------------------------------------------------------------- atomic writes

_TEMP = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.tmp$")


def _temp_path(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened / synced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO]:
    """Open ``path`` for writing such that it is never seen half written: the data goes to a temporary file
    in the same directory (same filesystem; created exclusively), which on a clean exit is flushed, fsynced
    and renamed over ``path``, and the directory fsynced. On any error (a full disk, an interrupt) the
    temporary file is removed and ``path`` keeps its previous content; a process killed mid-write leaves it
    for :func:`remove_stale_temp_files`. ``mode``: ``"wb"`` or ``"w"`` (text; ``open_kwargs`` such as
    ``newline=""`` go to :func:`open`)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = _temp_path(path)
    try:
        with open(tmp, mode.replace("w", "x"), **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` through :func:`atomic_write`: ``path`` holds the old or the new checkpoint,
    never a partial one."""
    with atomic_write(path) as f:
        torch.save(obj, f)


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> Path:
    """``safetensors.torch.save_file`` with the file mode every other output gets.

    safetensors writes through a temporary file of mode 0600 that it renames over ``path``: weights and
    features were readable by their owner only while checkpoints, images and JSON files are ``0o666`` less
    the process umask (0644 usually). The file gets that mode after the write. Returns ``Path(path)``.
    """
    from safetensors.torch import save_file

    path = Path(path)
    save_file(dict(tensors), os.fspath(path), metadata=dict(metadata) if metadata is not None else None)
    umask = os.umask(0o022)  # read the process umask (os has no getter) and put it back
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    return path


def link_atomically(source: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Make ``path`` a hard link to ``source`` (one file, two names), replacing ``path`` atomically.

    Returns False, touching nothing, where the filesystem has no hard links (the caller then writes a copy).
    """
    source, path = os.fspath(source), os.fspath(path)
    tmp = _temp_path(path)
    try:
        os.link(source, tmp)
    except OSError as e:
        if e.errno in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return True


def remove_stale_temp_files(directory: str | os.PathLike) -> list[str]:
    """Delete the temporary files that :func:`atomic_write` / :func:`link_atomically` leave when the
    process is killed mid-write; returns their names."""
    directory = os.fspath(directory)
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if entry.is_file(follow_symlinks=False) and _TEMP.match(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed
