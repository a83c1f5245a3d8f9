"""The streaming peers by name: import each lazily, so a missing or broken one becomes a reason
printed in the table (never a figure) while the rest of the suite runs."""

from __future__ import annotations

import importlib
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.throughput import Work
from lightning_sharding.readers.tar import split_name

PEERS = {"LitData": "benchmarks.peer_litdata", "MosaicML Streaming": "benchmarks.peer_streaming"}


def load(name: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)`` when peer ``name`` imports here, else ``(None, reason)``."""
    try:
        return importlib.import_module(PEERS[name]), None
    except Exception as err:  # noqa: BLE001 - any failure to import is the reason to print
        return None, f"{type(err).__name__}: {err}".splitlines()[0]


def builder(module: ModuleType, out: Path) -> Any:
    """A throughput builder ``(pattern, workers, work, batch) -> loader`` over the peer's prepared chunks."""

    def build(pattern: str, workers: int, work: Work, batch: int) -> Iterable[Any]:
        return module.loader(out, workers, work, batch)  # type: ignore[no-any-return]

    return build


def tar_samples(path: str) -> Iterator[dict[str, Any]]:
    """One WebDataset tar shard's samples as ``{"jpg": bytes, "cls": int}``: what the peers' own
    writers get, so they store the same JPEG bytes (never re-encoded) and labels as the tar."""
    sample: dict[str, Any] = {}
    key = None
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            name, field = split_name(member.name)
            if name != key and sample:
                yield sample
                sample = {}
            key = name
            blob = tar.extractfile(member).read()  # type: ignore[union-attr]
            if field == "jpg":
                sample["jpg"] = blob
            elif field == "cls":
                sample["cls"] = int(blob)
    if sample:
        yield sample
