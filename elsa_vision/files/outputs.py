"""Outputs: the directories the command-line tools write into, checked before any work, and atomic writes.

:func:`prepare_output_dir` checks an output directory before a run starts, :func:`remove_outputs` clears an
earlier run's outputs for ``--overwrite``. Checkpoints are written next to their target and renamed over it
(:func:`atomic_torch_save`, :func:`atomic_write`), so a reader sees either the previous complete file or the
new complete file, also across a crash or a full disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import torch

__all__ = [
    "atomic_torch_save",
    "atomic_write",
    "link_atomically",
    "prepare_output_dir",
    "remove_outputs",
    "remove_stale_temp_files",
]

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
