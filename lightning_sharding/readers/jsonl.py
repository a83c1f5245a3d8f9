"""JSONL: one item per file, one sample per non-blank line, found through a line-offset index.

Indexing reads each file once and records where every non-blank line starts and ends, so a
sample is one ranged read of its own bytes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.readers.files import FileReader
from lightning_sharding.readers.index import FileIndex
from lightning_sharding.readers.storage import FileInfo, filesystem

_CHUNK = 1 << 22


def line_offsets(data: bytes, base: int = 0) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Starts and ends (exclusive, newline excluded) of the lines of ``data``, shape ``(n,)`` each."""
    buf = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(buf == ord("\n")).astype(np.int64)
    ends = np.concatenate((newlines, [len(buf)] if len(buf) and buf[-1] != ord("\n") else [])).astype(np.int64)
    starts = np.concatenate(([0], newlines + 1))[: len(ends)].astype(np.int64)
    return starts + base, ends + base


def _blank(data: bytes, starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Which lines ``[starts, ends)`` of ``data`` hold only whitespace, shape ``(n,)``."""
    buf = np.frombuffer(data, dtype=np.uint8)
    ink = np.concatenate(([0], np.cumsum(~np.isin(buf, (9, 10, 13, 32)), dtype=np.int64)))
    return np.asarray(ink[ends] - ink[starts] == 0)


class JsonlReader(FileReader):
    """JSON Lines files; a sample is the decoded JSON value of one line (blank lines are skipped).

    ``**options`` are :class:`FileReader` options (``storage_options``, ``cache_dir``, ...).
    """

    format = "jsonl"

    def scan(self, info: FileInfo) -> FileIndex:
        """Find every non-blank line, streaming the file in chunks."""
        fs, path = filesystem(info.url, self.storage_options)
        starts, ends, lines = [], [], []
        offset = 0  # where the bytes being scanned start in the file
        line_no = 0  # lines found so far
        carry = b""  # the last, unfinished line of what was read so far
        with fs.open(path, "rb") as f:
            while True:
                chunk = f.read(_CHUNK)
                data = carry + chunk
                if not chunk:
                    cut = len(data)  # the last line may lack its newline
                else:
                    cut = data.rfind(b"\n") + 1
                s, e = line_offsets(data[:cut], offset)
                blank = _blank(data[:cut], s - offset, e - offset)
                numbers = np.arange(line_no, line_no + len(s), dtype=np.int64) + 1
                starts.append(s[~blank])
                ends.append(e[~blank])
                lines.append(numbers[~blank])
                line_no += len(s)
                offset += cut
                carry = data[cut:]
                if not chunk:
                    break
        arrays = {"start": np.concatenate(starts), "end": np.concatenate(ends), "line": np.concatenate(lines)}
        return FileIndex([""], [len(arrays["start"])], [arrays])

    def read_batch(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> list[Any]:
        """Read each line's bytes (concurrently on object stores) and decode it."""
        url, _ = self.split_key(item)
        idx = self.index_of(item)
        blobs = self.read_ranges(item, idx["start"][indices], idx["end"][indices])
        out = []
        for i, blob in zip(indices, blobs, strict=True):
            try:
                out.append(json.loads(blob))
            except ValueError as err:
                line = int(idx["line"][i])
                raise ValueError(f"{url}: line {line} (sample {int(i)}) is not valid JSON: {err}") from err
        return out
