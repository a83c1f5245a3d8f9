"""LitData as a peer: chunks written by its own ``optimize``, read by its ``StreamingDataset`` and
``StreamingDataLoader`` (spawned workers), with the same per-sample work as every system."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # LitData must never try the network

import numpy as np  # noqa: E402
from litdata import StreamingDataLoader, StreamingDataset, optimize  # noqa: E402

from benchmarks.throughput import BATCH, Work  # noqa: E402


def row_samples(path: str) -> Iterator[dict[str, np.ndarray]]:
    """``optimize``'s function: one ``{"row": float32 (DIM + 2,)}`` per row of one ``.npy`` file."""
    for row in np.load(path, mmap_mode="r"):
        yield {"row": np.array(row)}


def prepare(pattern: str, out: Path) -> None:
    optimize(fn=row_samples, inputs=sorted(glob.glob(pattern)), output_dir=str(out), chunk_bytes="16MB", num_workers=1)


class WorkedRows(StreamingDataset):  # type: ignore[misc]
    def __init__(self, input_dir: str, work: Work) -> None:
        super().__init__(input_dir, shuffle=True, seed=0)
        self.work = work

    def __getitem__(self, index: Any) -> Any:
        return self.work(super().__getitem__(index)["row"])


def loader(out: Path, workers: int, work: Work, batch: int = BATCH) -> Iterable[Any]:
    return StreamingDataLoader(
        WorkedRows(str(out), work),
        batch_size=batch,
        num_workers=workers,
        multiprocessing_context="spawn" if workers else None,
    )
