"""A file's cached index: what scanning it found, written atomically under the cache directory."""

from __future__ import annotations

import io
import os
import secrets
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.private import FILE_MODE, create_file, dir_mode, make_dirs

# Part of every cache name: bump it when a reader's index layout changes, and old caches are ignored.
INDEX_VERSION = 1


def default_cache_dir() -> Path:
    """``$LIGHTNING_SHARDING_CACHE`` or ``~/.cache/lightning_sharding`` (read when a manifest is built)."""
    env = os.environ.get("LIGHTNING_SHARDING_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lightning_sharding"


@dataclass
class FileIndex:
    """What scanning one file found: one entry per item inside it (usually one).

    ``suffixes[j]`` names item ``j`` inside the file ("" for the whole file), ``counts[j]`` is its
    sample count, and ``arrays[j]`` holds its index arrays (offsets, line numbers...), each of
    shape ``(counts[j], ...)`` or ``(counts[j] + 1,)`` for boundaries.
    """

    suffixes: list[str]
    counts: list[int]
    arrays: list[dict[str, npt.NDArray[Any]]] = field(default_factory=list)

    def save(self, path: Path, mode: int = FILE_MODE) -> None:
        """Write atomically (ranks on one machine may index the same file at once), given ``mode``."""
        flat: dict[str, npt.NDArray[Any]] = {
            "suffixes": np.array(self.suffixes, dtype=str),
            "counts": np.array(self.counts, dtype=np.int64),
        }
        for j, arrays in enumerate(self.arrays):
            flat.update({f"{j}/{name}": value for name, value in arrays.items()})
        buf = io.BytesIO()
        np.savez(buf, **flat)  # type: ignore[arg-type]  # numpy's stub wants positional arrays
        write_atomically(path, buf.getvalue(), mode)

    @classmethod
    def load(cls, path: Path) -> FileIndex:
        """Read a saved index (raises ``OSError``/``ValueError`` when missing or unreadable)."""
        with np.load(path, allow_pickle=False) as z:
            suffixes = [str(s) for s in z["suffixes"]]
            arrays: list[dict[str, npt.NDArray[Any]]] = [{} for _ in suffixes]
            for name in z.files:
                if "/" in name:
                    j, key = name.split("/", 1)
                    arrays[int(j)][key] = z[name]
            return cls(suffixes, [int(c) for c in z["counts"]], arrays)


def write_atomically(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file, the new one, or none; the file
    gets ``mode`` (its owner's only by default) and the directories made for it the matching one."""
    make_dirs(path.parent, dir_mode(mode))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class Progress:
    """Prints progress to stderr when indexing takes longer than a few seconds."""

    def __init__(self, what: str, total: int, every: float = 5.0) -> None:
        self.what = what
        self.total = total
        self.every = every
        self.count = 0
        self.start = time.monotonic()
        self.last = self.start  # when progress was last printed
        self._lock = threading.Lock()

    def step(self, count: int = 1) -> None:
        """``count`` more done; print if the last print is a while ago."""
        with self._lock:
            self.count += count
            now = time.monotonic()
            if now - self.last >= self.every:
                self.last = now
                print(
                    f"lightning_sharding: {self.what}: {self.count}/{self.total} ({now - self.start:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

    def done(self) -> None:
        """Print the total, if anything was printed before."""
        if self.last != self.start:
            print(
                f"lightning_sharding: {self.what}: done in {time.monotonic() - self.start:.1f} s",
                file=sys.stderr,
                flush=True,
            )


class ListingIndex:
    """The indexes of every file of one listing in one directory of ``.npy`` arrays, read through
    memory maps: a first start writes a handful of files, not one per shard (creating a file in a
    directory of thousands cost about 1 ms here), and a worker pages in only the files it reads.

    ``suffixes``, ``counts`` and ``file_items`` (per file, its first item) describe the items; each
    index array ``NAME`` of the files' items is concatenated in ``NAME.npy`` with ``NAME.bounds.npy``
    (per item, its first row).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._arrays: dict[str, npt.NDArray[Any]] = {}
        self._names: list[str] | None = None

    @staticmethod
    def save(directory: Path, indexes: list[FileIndex], mode: int = FILE_MODE) -> bool:
        """Write ``indexes`` (one per file, in listing order) atomically; False when their arrays do
        not line up (names, trailing shapes), for the caller to keep one file per index instead."""
        names = {tuple(sorted(arrays)) for idx in indexes for arrays in idx.arrays}
        if len(names) > 1:
            return False
        columns: dict[str, npt.NDArray[Any]] = {}
        bounds: dict[str, npt.NDArray[np.int64]] = {}
        for name in next(iter(names), ()):
            parts = [arrays[name] for idx in indexes for arrays in idx.arrays]
            if len({p.shape[1:] for p in parts}) > 1 or len({p.dtype.kind for p in parts}) > 1:
                return False
            columns[name] = np.concatenate(parts) if parts else np.zeros(0)
            bounds[name] = np.concatenate(([0], np.cumsum([len(p) for p in parts]))).astype(np.int64)
        meta = {
            "suffixes": np.array([s for idx in indexes for s in idx.suffixes], dtype=str),
            "counts": np.array([c for idx in indexes for c in idx.counts], dtype=np.int64),
            "file_items": np.concatenate(([0], np.cumsum([len(idx.suffixes) for idx in indexes]))).astype(np.int64),
        }
        make_dirs(directory.parent, dir_mode(mode))
        writer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"  # unique on a shared cache_dir
        tmp = directory.with_name(f".{directory.name}.{writer}.tmp")
        make_dirs(tmp, dir_mode(mode))
        try:
            files = {**meta, **columns, **{f"{name}.bounds": b for name, b in bounds.items()}}
            for name, array in files.items():
                fd = create_file(tmp / f"{name}.npy", mode=mode)
                with os.fdopen(fd, "wb") as f:
                    np.save(f, array, allow_pickle=False)
            try:
                os.rename(tmp, directory)
            except OSError:  # another rank of this machine wrote it first: theirs is the same
                if not directory.is_dir():
                    raise
        finally:
            if tmp.exists():
                for leftover in tmp.iterdir():
                    leftover.unlink()
                tmp.rmdir()
        return True

    def _array(self, name: str) -> npt.NDArray[Any]:
        if name not in self._arrays:  # a plain array over the map: its slices cost what an array's do
            self._arrays[name] = np.asarray(np.load(self.directory / f"{name}.npy", mmap_mode="r", allow_pickle=False))
        return self._arrays[name]

    def files(self) -> int:
        """How many files it holds, every array opened first: one missing or truncated raises
        (``OSError``/``ValueError``) here, not when a file's index is asked for."""
        if self._names is None:
            self._names = sorted(p.name[: -len(".bounds.npy")] for p in self.directory.glob("*.bounds.npy"))
        for name in ("suffixes", "counts", *self._names, *(f"{n}.bounds" for n in self._names)):
            self._array(name)
        return len(self._array("file_items")) - 1

    def file(self, number: int) -> FileIndex:
        """The index of the listing's file ``number`` (raises ``OSError``/``ValueError`` when unreadable)."""
        lo, hi = self._array("file_items")[number : number + 2].tolist()
        if self._names is None:
            self._names = sorted(p.name[: -len(".bounds.npy")] for p in self.directory.glob("*.bounds.npy"))
        arrays: list[dict[str, npt.NDArray[Any]]] = []
        for item in range(lo, hi):
            row: dict[str, npt.NDArray[Any]] = {}
            for name in self._names:
                start, end = self._array(f"{name}.bounds")[item : item + 2].tolist()
                row[name] = self._array(name)[start:end]
            arrays.append(row)
        suffixes = [str(s) for s in self._array("suffixes")[lo:hi]]
        return FileIndex(suffixes, self._array("counts")[lo:hi].tolist(), arrays)
