"""A file's cached index: what scanning it found, written atomically under the cache directory."""

from __future__ import annotations

import io
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.private import FILE_MODE, dir_mode, make_dirs

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

    def step(self) -> None:
        """One more done; print if the last print is a while ago."""
        with self._lock:
            self.count += 1
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
