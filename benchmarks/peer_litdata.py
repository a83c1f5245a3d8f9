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
from litdata.streaming import downloader  # noqa: E402

if os.environ.get("AWS_ALLOW_HTTP") == "true":
    # LitData reads S3 chunks through obstore with fixed client options that refuse an http
    # endpoint (real S3 is https; our loopback server is http). Allow it, in every process that
    # imports this module: the DataLoader's workers too, since they unpickle ``Worked`` from here.
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}

from benchmarks.peers import tar_samples  # noqa: E402
from benchmarks.throughput import BATCH, Work  # noqa: E402


def row_samples(path: str) -> Iterator[dict[str, np.ndarray]]:
    """``optimize``'s function: one ``{"row": float32 (DIM + 2,)}`` per row of one ``.npy`` file."""
    for row in np.load(path, mmap_mode="r"):
        yield {"row": np.array(row)}


def prepare(pattern: str, out: Path) -> None:
    optimize(fn=row_samples, inputs=sorted(glob.glob(pattern)), output_dir=str(out), chunk_bytes="16MB", num_workers=1)


def prepare_tars(tars: list[str], out: Path, chunk_bytes: str | None = "64MB", chunk_size: int | None = None) -> None:
    """The JPEGs and labels of WebDataset ``tars`` as LitData chunks (``{"jpg": bytes, "cls": int}``)
    of ``chunk_bytes``, or of ``chunk_size`` samples each."""
    optimize(
        fn=tar_samples, inputs=tars, output_dir=str(out), chunk_bytes=chunk_bytes, chunk_size=chunk_size, num_workers=1
    )


class Worked(StreamingDataset):  # type: ignore[misc]
    """LitData's dataset with the benchmark's work applied to each sample's ``field`` (``None``: the
    whole sample)."""

    def __init__(self, input_dir: str, work: Work, field: str | None = "row", **options: Any) -> None:
        super().__init__(input_dir, shuffle=True, seed=0, **options)
        self.work, self.field = work, field

    def __getitem__(self, index: Any) -> Any:
        sample = super().__getitem__(index)
        return self.work(sample if self.field is None else sample[self.field])


def loader(
    out: Path | str, workers: int, work: Work, batch: int = BATCH, field: str | None = "row", **options: Any
) -> Iterable[Any]:
    return StreamingDataLoader(
        Worked(str(out), work, field, **options),
        batch_size=batch,
        num_workers=workers,
        multiprocessing_context="spawn" if workers else None,
    )
