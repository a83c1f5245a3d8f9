"""Shared arrays: arrays in plain files under ``/dev/shm`` that workers map read-only, zero copy.

Why plain files and not ``multiprocessing.shared_memory``: on Python 3.11 attaching to a
``SharedMemory`` registers it with the attaching process's resource tracker, which may unlink it
when that worker exits, under the owner's feet. A file has one owner who unlinks it.

Names are ``lsh-<run>-<pid>.<start time>-r<rank>-g<generation>-i<item>``: the run token and the
owner's pid keep two runs apart; the owner's start time tells a live owner from a dead one whose
pid was reused, so :func:`sweep_dead` can remove what a SIGKILLed run left behind.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.private import create_file

SHM_DIR = Path("/dev/shm")
PREFIX = "lsh-"


def process_token(pid: int | None = None) -> str | None:
    """``<pid>.<start time in clock ticks>`` of a live process, or None when it is gone."""
    pid = os.getpid() if pid is None else pid
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces; the fields after its closing parenthesis do not.
    fields = stat.rsplit(")", 1)[1].split()
    return f"{pid}.{fields[19]}"


@dataclass(frozen=True)
class SharedArray:
    """Where a worker finds an array in shared memory: a file name, the array's shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def path(self) -> Path:
        """The file under ``/dev/shm``."""
        return SHM_DIR / self.name


def write_shared_array(name: str, chunks: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> SharedArray:
    """Write the arrays of iterable ``chunks`` back to back into ``/dev/shm/<name>``.

    The data is written with ``write`` (never mapped here), so the writer's memory holds one chunk
    at a time and none of the array. The file is fully written before its description is returned.
    """
    path = SHM_DIR / name
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    written = 0
    with os.fdopen(create_file(path), "wb") as f:  # 0600: other users of the node must not read the data
        for chunk in chunks:
            data = np.ascontiguousarray(chunk, dtype=dtype)
            f.write(data.data.cast("B"))
            written += data.nbytes
    if written != expected:
        path.unlink(missing_ok=True)
        raise ValueError(f"shared array {name}: wrote {written} bytes, expected {expected} for shape {shape}")
    return SharedArray(name, shape, dtype.str)


def open_shared_array(info: SharedArray) -> npt.NDArray[Any]:
    """A read-only array over the file's pages, shared with every other process mapping it."""
    with open(info.path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:  # mmap refuses empty files; an empty array needs no pages
            return np.empty(info.shape, dtype=np.dtype(info.dtype))
        mapping = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    array = np.ndarray(info.shape, dtype=np.dtype(info.dtype), buffer=mapping)
    array.flags.writeable = False
    return array


def unlink(name: str) -> None:
    """Remove a shared-memory file; its pages are freed once the last process mapping it lets go."""
    (SHM_DIR / name).unlink(missing_ok=True)


def sweep_dead() -> list[str]:
    """Remove this user's ``/dev/shm`` files (shared arrays, batch slots) whose owner process is gone
    (a run killed by SIGKILL); returns their names. Another user's files are left alone."""
    removed = []
    me = os.getuid()
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            if path.lstat().st_uid != me:  # another user's file (or link): never ours to judge or remove
                continue
        except OSError:
            continue
        parts = path.name.split("-")
        if len(parts) < 3 or "." not in parts[2]:
            continue
        pid, _, start = parts[2].partition(".")
        if not pid.isdigit():
            continue
        if process_token(int(pid)) != f"{pid}.{start}":
            try:
                path.unlink(missing_ok=True)
            except OSError:  # cannot remove it: a sweep never stops a run
                continue
            removed.append(path.name)
    return removed
