"""Checkpoint readers: weights and checkpoint files read without executing anything from them.

Every weights or checkpoint file the package reads goes through :func:`read_checkpoint`: ``.safetensors``
through safetensors, ``torch.save`` files through ``torch.load(weights_only=True)`` (tensors, containers and
plain values only), and TorchScript archives (OpenAI's CLIP ``.pt`` files) through
:func:`~elsa_vision.files.torchscript.read_torchscript_state_dict`, which reads their tensors without running
the archive's code. A file that is none of these is reported as "not a checkpoint", naming what it looks
like. What a file may make a reader allocate is bounded by the file's size before anything is read
(:func:`~elsa_vision.files.limits.check_zip_records`, :func:`~elsa_vision.files.limits.check_legacy_torch`,
:func:`~elsa_vision.files.limits.check_tensors`).
:func:`read_weights` (:func:`unwrap_weights` for a checkpoint already read) unwraps what training scripts put
around the weights (a Lightning checkpoint's ``state_dict``, timm's ``state_dict_ema``, DDP's ``module.``
prefix ...) into one flat ``{name: tensor}``; ``submodule="net"`` takes the network out of a training
module's weights (:func:`submodule_weights`); :func:`strip_prefixes` is the one place prefixes are removed.
Every reader takes ``arg``, the name the caller gives the file (``"ckpt_path"``, ``"--weights"`` ...): its
errors then start with that name and keep their exception class, so no caller checks the path or rewords
the errors itself.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .limits import check_legacy_torch, check_tensors, check_zip_records
from .torchscript import read_torchscript_state_dict

__all__ = [
    "NotACheckpointError",
    "STATE_DICT_KEYS",
    "UnsafeCheckpointError",
    "checkpoint_kind",
    "read_checkpoint",
    "read_safetensors_metadata",
    "read_weights",
    "strip_prefixes",
    "submodule_weights",
    "unwrap_weights",
]

class NotACheckpointError(ValueError):
    """The file is not a checkpoint in any format the package reads."""


class UnsafeCheckpointError(ValueError):
    """The checkpoint holds Python objects that a weights-only load does not rebuild."""


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
    if kind == "torch":
        with _open_zip(path) as zf:
            check_zip_records(path, zf, stored=lambda name: True)
    else:  # torch-legacy: torch reserves each storage at its declared size before reading it
        check_legacy_torch(path)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and kind == "torch")
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path!r} holds Python objects that a weights-only load does not rebuild "
            f"({_refused_global(e)}); checkpoints must hold only tensors, containers and plain values"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path!r} is a truncated or damaged checkpoint: {_first_line(e)}") from e
    check_tensors(obj, path)
    return obj


def _open_zip(path: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{path!r} is a damaged zip archive: {e}") from e


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
        tensors = strip_prefixes(submodule_weights(tensors, submodule) or tensors, _WRAPPER_PREFIXES,
                                 repeat=True)
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
    return strip_prefixes(tensors, _WRAPPER_PREFIXES, repeat=True)


def strip_prefixes(
    state: Mapping[str, Any],
    prefixes: Iterable[str],
    *,
    keep: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None,
    repeat: bool = False,
) -> dict[str, Any]:
    """``state`` without the ``prefixes`` that every one of its keys carries, in the order given: DDP's
    ``module.`` and torch.compile's ``_orig_mod.`` (:func:`unwrap_weights`), a training module's ``net.`` /
    ``model.`` (``models._builder.read_state_dict``). A prefix is removed only when every key has it (a
    model may have a submodule of that name), and only if ``keep(stripped, state)`` (when given) accepts the
    result; with ``repeat``, the prefixes are tried again until none applies (wrappers nest in any order)."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in prefixes:
            if state and all(isinstance(k, str) and k.startswith(prefix) for k in state):
                candidate = {k[len(prefix) :]: v for k, v in state.items()}
                if keep is None or keep(candidate, state):
                    state, stripped = candidate, True
        stripped = stripped and repeat
    return state


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
