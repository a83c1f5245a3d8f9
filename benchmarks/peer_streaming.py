"""MosaicML Streaming as a peer: MDS shards written by its own ``MDSWriter``, read by its
``StreamingDataset`` through a plain DataLoader (spawned workers), with the same per-sample work.

``import streaming`` imports ``streaming.vision`` and so torchvision, whose registry wheel cannot
load beside a CPU-only torch; ``streaming.base`` imports transformers for its own DataLoader.
Neither is needed to write or read MDS shards, so the two packages are registered here without
running their ``__init__`` and only the writer and dataset modules are imported. Workers unpickle
the dataset by importing this module, which repeats the same registration first.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _register_packages() -> None:
    spec = importlib.util.find_spec("streaming")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mosaicml-streaming is not installed (see benchmarks/requirements.txt)")
    root = Path(list(spec.submodule_search_locations)[0])
    for name, path in (("streaming", root), ("streaming.base", root / "base")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package


_register_packages()

import numpy as np  # noqa: E402
from streaming.base.dataset import StreamingDataset  # noqa: E402
from streaming.base.format.mds.writer import MDSWriter  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks.peers import tar_samples  # noqa: E402
from benchmarks.throughput import BATCH, DIM, Work, rows_of  # noqa: E402


def prepare(pattern: str, out: Path) -> None:
    with MDSWriter(out=str(out), columns={"row": f"ndarray:float32:{DIM + 2}"}, size_limit=16 << 20) as writer:
        for rows in rows_of(pattern):
            for row in rows:
                writer.write({"row": np.asarray(row)})


def prepare_tars(tars: list[str], out: Path) -> None:
    """The JPEGs and labels of WebDataset ``tars`` as MDS shards (``jpg`` as raw bytes, ``cls`` int)."""
    with MDSWriter(out=str(out), columns={"jpg": "bytes", "cls": "int"}, size_limit=64 << 20) as writer:
        for tar in tars:
            for sample in tar_samples(tar):
                writer.write(sample)


class Worked(StreamingDataset):  # type: ignore[misc]
    """Streaming's dataset with the benchmark's work applied to each sample's ``field`` (``None``:
    the whole sample)."""

    def __init__(
        self, local: str, work: Work, batch: int, field: str | None = "row", remote: str | None = None
    ) -> None:
        super().__init__(local=local, remote=remote, shuffle=True, shuffle_seed=0, batch_size=batch)
        self.work, self.field = work, field

    def __getitem__(self, index: int) -> Any:
        sample = super().__getitem__(index)
        return self.work(sample if self.field is None else sample[self.field])


def loader(
    out: Path | str, workers: int, work: Work, batch: int = BATCH, field: str | None = "row", local: str | None = None
) -> Iterable[Any]:
    """A DataLoader over the MDS shards at ``out``; with ``local``, ``out`` is a remote URL (``s3://``,
    its endpoint in ``S3_ENDPOINT_URL``) whose index and shards Streaming downloads into ``local``."""
    context = "spawn" if workers else None
    dataset = Worked(local or str(out), work, batch, field, remote=str(out) if local else None)
    return DataLoader(dataset, batch_size=batch, num_workers=workers, multiprocessing_context=context)
