"""The TorchScript reader: the ``state_dict`` of a ``torch.jit.save`` archive (OpenAI's CLIP ``.pt`` files),
read without running anything from it (:func:`read_torchscript_state_dict`)."""

from __future__ import annotations

import ast
import collections
import os
import pickle
import re
import sys
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .limits import STORAGE_DTYPES, check_tensors, check_zip_records, view_end

__all__ = ["read_torchscript_state_dict"]

# Globals a TorchScript archive's data.pkl may name, as torch's own TorchScript unpickler knows them
# (torch/csrc/jit/serialization/unpickler.cpp, readGlobal), and what a weights reader does with them.
# Quantized, sparse and subclassed tensors, RRefs and the legacy `__main__` ids are refused.
_TS_PASSTHROUGH = {
    ("torch.jit._pickle", "build_intlist"),
    ("torch.jit._pickle", "build_tensorlist"),
    ("torch.jit._pickle", "build_doublelist"),
    ("torch.jit._pickle", "build_boollist"),
}
# The code records together (a model's is a few hundred KB) are inflated up to this many bytes, and scanned
# a block of lines at a time: only class headers and their __parameters__ / __buffers__ lines are kept.
_TS_MAX_CODE_BYTES = 64 * 2**20
_TS_CODE_BLOCK = 2**18
_TS_CODE_LINE = re.compile(
    rb"^class[ \t]+([A-Za-z_][A-Za-z0-9_]*)[ \t]*[(:]"
    rb"|^[ \t]+(__parameters__|__buffers__)[ \t]*=[ \t]*(\[.*\])[ \t\r]*$",
    re.MULTILINE,
)


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


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                    hooks: Any = None, metadata: Any = None) -> Tensor:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor record does not refer to a storage of the archive")
    ints = (offset, *size, *stride) if isinstance(size, tuple) and isinstance(stride, tuple) else None
    if ints is None or not all(type(v) is int for v in ints) or len(size) != len(stride):
        raise pickle.UnpicklingError("a tensor record has a malformed offset, size or stride")
    data = storage.data
    # set_ grows a storage too small for the view (an empty record's is resizable) to the size the record
    # declares, whatever it is: checked first
    if min(ints) < 0 or view_end(offset, size, stride) > data.numel():
        raise pickle.UnpicklingError(
            f"a tensor record declares shape {size} (strides {stride}, offset {offset}) over a storage of "
            f"{data.numel():,} elements{' (a negative size, stride or offset)' if min(ints) < 0 else ''}: a "
            "forged archive"
        )
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
        if module == "torch" and name.endswith("Storage") and name[: -len("Storage")] in STORAGE_DTYPES:
            return ("storage_type", STORAGE_DTYPES[name[: -len("Storage")]])
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


def _class_declarations(zf: zipfile.ZipFile, prefix: str, path: str) -> dict[str, tuple[list, list]]:
    """``qualified class name -> (parameter names, buffer names)`` from the archive's ``code/`` records.

    The records are read as text, a block of whole lines at a time (a record of short lines is never held
    whole, nor split into a string per line): a class header line and its ``__parameters__`` /
    ``__buffers__`` list literals (``ast.literal_eval``); nothing is compiled. The records together are
    inflated up to ``_TS_MAX_CODE_BYTES`` (the sizes their headers declare, which bound what zipfile
    inflates).
    """
    decls: dict[str, tuple[list[str], list[str]]] = {}
    code_dir = f"{prefix}code/"
    left = _TS_MAX_CODE_BYTES
    for info in zf.infolist():
        name = info.filename
        if not (name.startswith(code_dir) and name.endswith(".py")):
            continue
        left -= info.file_size
        if left < 0:
            raise ValueError(f"TorchScript archive {path!r}: its code records hold more than "
                             f"{_TS_MAX_CODE_BYTES:,} bytes (at {name!r}); not a module archive")
        module = name[len(code_dir) : -len(".py")].replace("/", ".")
        current: str | None = None  # the class whose body the scan is in
        try:
            with zf.open(info) as f:
                buf = bytearray()  # lines not scanned yet: none complete, but for the last block
                while True:
                    block = f.read(_TS_CODE_BLOCK)
                    buf += block
                    end = buf.rfind(b"\n", len(buf) - len(block)) + 1 if block else len(buf)
                    for m in _TS_CODE_LINE.finditer(buf, 0, end):
                        current = _declaration(m, module, current, decls, name, path)
                    del buf[:end]
                    if not block:
                        break
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError) as e:
            raise ValueError(f"TorchScript archive {path!r}: code record {name!r} cannot be read: {e}") from e
    return decls


def _declaration(
    m: re.Match, module: str, current: str | None, decls: dict, name: str, path: str
) -> str | None:
    """Record the line ``m`` of code record ``name`` (in the body of class ``current``) in ``decls``; returns
    the class the lines after it belong to."""
    if m.group(1) is not None:
        return f"{module}.{m.group(1).decode()}"
    if current is None:
        return None
    try:
        names = ast.literal_eval(m.group(3).decode("utf-8", errors="replace"))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        names = None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"TorchScript archive {path!r}: {name!r}: malformed {m.group(2).decode()} of class "
                         f"{current}")
    params, buffers = decls.get(current, ([], []))
    decls[current] = (names, buffers) if m.group(2) == b"__parameters__" else (params, names)
    return current


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
        # the module pickle and the tensors are read whole; code records (deflated by torch.jit.save) are
        # scanned a block at a time, together at most _TS_MAX_CODE_BYTES
        check_zip_records(path, zf, stored=lambda name: name == pkl[0] or name.startswith(f"{prefix}data/"))
        order = f"{prefix}byteorder"
        if order in zf.namelist() and zf.read(order).decode(errors="replace").strip() != sys.byteorder:
            raise ValueError(f"TorchScript archive {path!r} was written on a machine of another byte order")
        decls = _class_declarations(zf, prefix, path)
        with zf.open(pkl[0]) as f:
            try:
                root = _TorchScriptUnpickler(f, zf, prefix, path).load()
            except Exception as e:  # a forged pickle can fail in many ways; nothing was run either way
                raise ValueError(f"TorchScript archive {path!r} refused: {e}; nothing in it was run") from e
    if not isinstance(root, _ScriptObject):
        raise ValueError(f"TorchScript archive {path!r} does not hold a module (data.pkl is a {type(root)})")
    out: dict[str, Tensor] = {}
    _collect(root, "", decls, out, path, set())
    check_tensors(out, path)
    return out


# Modules nested deeper than this are refused (a model's tree is a few levels deep; the walk below is
# recursive, and Python's own limit would end it in a RecursionError)
_TS_MAX_DEPTH = 100


def _collect(obj: _ScriptObject, prefix: str, decls: Mapping, out: dict, path: str, active: set) -> None:
    if len(active) >= _TS_MAX_DEPTH:
        raise ValueError(f"TorchScript archive {path!r}: modules nested more than {_TS_MAX_DEPTH} levels "
                         "deep (not a model's module tree); not read")
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
