"""Outputs: the directories the command-line tools write into, checked before any work, and atomic writes.

:func:`prepare_output_dir` checks an output directory before a run starts, :func:`remove_outputs` clears an
earlier run's outputs for ``--overwrite``. Checkpoints are written next to their target and renamed over it
(:func:`atomic_torch_save`, :func:`atomic_write`), so a reader sees either the previous complete file or the
new complete file, also across a crash or a full disk.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch

__all__ = [
    "OUTPUT_MANIFEST",
    "atomic_torch_save",
    "atomic_write",
    "link_atomically",
    "prepare_output_dir",
    "record_outputs",
    "remove_outputs",
    "remove_stale_temp_files",
    "save_safetensors",
]

# The record of what a command-line tool wrote into its --out: names relative to --out, one per file. With
# --overwrite a later run removes these files (and the folders they leave empty), nothing else of the folder.
OUTPUT_MANIFEST = "outputs.json"


def prepare_output_dir(
    out: str | os.PathLike, outputs: Iterable[str], overwrite: bool = False, flag: str = "--out"
) -> Path:
    """Check, before any work is done, that a run can write its ``outputs`` into the directory ``out``.

    ``out`` is resolved first (``os.path.realpath``: symbolic links and ``..`` as the writes will meet
    them, so ``/tmp/missing/../out`` is ``/tmp/out``); the caller writes into the returned path. It (or, if
    it does not exist yet, its nearest existing parent, where it will be created) must be a directory this
    process can write to: a file is created and removed there to find out. None of ``outputs`` (names
    relative to ``out``; a trailing ``*`` matches a prefix) may exist unless ``overwrite``. Nothing is
    created: a run that fails later leaves no empty directory. Raises ``ValueError`` (one line, naming the
    directory); returns the resolved ``Path``.
    """
    if isinstance(outputs, (str, bytes, os.PathLike)):
        raise TypeError(f"prepare_output_dir: outputs must be a list of names, got one name {outputs!r}")
    given = os.fspath(out)
    out = Path(os.path.realpath(given))
    shown = given if Path(given).absolute() == out else f"{given} (= {out})"
    probe_dir = out
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ValueError(f"{flag} {shown!r} cannot be created: {str(probe_dir)!r} is not a directory")
    try:
        probe = probe_dir / f".write-test-{os.getpid()}-{secrets.token_hex(4)}"
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as e:
        reason = e.strerror or str(e)
        raise ValueError(f"{flag} {shown!r} is not writable ({str(probe_dir)!r}: {reason})") from e
    existing = [p.name for p in _existing_outputs(out, outputs)]
    if existing and not overwrite:
        listed = ", ".join(existing[:5]) + (" ..." if len(existing) > 5 else "")
        raise ValueError(
            f"{flag} {shown!r} already holds outputs of an earlier run ({listed}); pass --overwrite to "
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


def _relative_name(name: Any) -> bool:
    """Whether ``name`` is a path inside a folder: relative, ``/``-separated, without ``.`` / ``..``."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name or name.startswith("/"):
        return False
    return not any(p in ("", ".", "..") for p in name.split("/"))


def _recorded_name(name: Any, outputs: Iterable[str]) -> str | None:
    """``name`` if it can be a file a run recorded in its manifest: a relative path (no ``..``) whose first
    part is one of ``outputs`` (a trailing ``*`` matches a prefix); else None (an edited manifest never
    makes a run remove anything else)."""
    if not _relative_name(name):
        return None
    head = name.split("/")[0]
    for pattern in outputs:
        if head == pattern or (pattern.endswith("*") and head.startswith(pattern[:-1])):
            return name
    return None


def _read_manifest(out: Path) -> list[str]:
    """The names an earlier run recorded in ``out``'s :data:`OUTPUT_MANIFEST` (none when it is missing or
    is not one this package wrote)."""
    path = out / OUTPUT_MANIFEST
    if not path.is_file() or path.is_symlink():
        return []
    try:
        names = json.loads(path.read_text(encoding="utf-8")).get("outputs", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def record_outputs(out: str | os.PathLike, names: Iterable[str]) -> None:
    """Add ``names`` (relative to ``out``) to ``out``'s :data:`OUTPUT_MANIFEST`, before the files are
    written: a run stopped half way has recorded everything it may have written. The manifest is replaced
    atomically. What :func:`remove_outputs` removes with ``--overwrite``."""
    out = Path(out)
    names = list(names)
    for name in names:
        if not _relative_name(name):
            raise ValueError(f"record_outputs: {name!r} is not a relative path inside {str(out)!r}")
    recorded = _read_manifest(out)
    recorded += [n for n in names if n not in recorded]
    out.mkdir(parents=True, exist_ok=True)
    with atomic_write(out / OUTPUT_MANIFEST, "w", encoding="utf-8") as f:
        json.dump({"outputs": recorded}, f, indent=1)


def remove_outputs(out: str | os.PathLike, outputs: Iterable[str]) -> list[str]:
    """Delete what an earlier run wrote in ``out``: the files its :data:`OUTPUT_MANIFEST` records that fall
    under ``outputs`` (a trailing ``*`` matches a prefix), the folders this leaves empty and the files named
    by ``outputs`` without a ``*``; the manifest keeps only what it records of other outputs (another tool
    writing into the same folder). Nothing else: a ``slice_notes.txt`` or a file of the
    user's inside a ``slice_0003/`` folder stays, links are removed themselves (never what they point to),
    and no folder is removed whole. What ``--overwrite`` does once the new run is about to write, so that no
    output of a larger earlier run (a ``slice_0007`` where this run has three slices) stays mixed with the
    new ones. Returns the names removed."""
    if isinstance(outputs, (str, bytes, os.PathLike)):
        raise TypeError(f"remove_outputs: outputs must be a list of names, got one name {outputs!r}")
    out, outputs = Path(out), list(outputs)
    if not out.is_dir():
        return []
    names = [n for n in (_recorded_name(n, outputs) for n in _read_manifest(out)) if n is not None]
    names += [n for n in outputs if not n.endswith("*") and n not in names]
    removed, parents = [], set()
    for name in names:
        p = out / name
        folders = p.parents[: len(Path(name).parts) - 1]
        if any(d.is_symlink() for d in folders):
            continue  # a recorded file behind a link: the link leads out of ``out``
        if p.is_symlink() or p.is_file():
            p.unlink()
            removed.append(name)
            parents.update(folders)
    for folder in sorted(parents, key=lambda d: len(d.parts), reverse=True):  # deepest first
        with contextlib.suppress(OSError):  # not empty: something not recorded stays, and its folder
            folder.rmdir()
    manifest = out / OUTPUT_MANIFEST
    others = [n for n in _read_manifest(out) if _relative_name(n) and _recorded_name(n, outputs) is None]
    if others:  # what another tool recorded in the same folder stays recorded
        with atomic_write(manifest, "w", encoding="utf-8") as f:
            json.dump({"outputs": others}, f, indent=1)
    elif manifest.is_symlink() or manifest.is_file():
        manifest.unlink()
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
