"""Picklable pieces the DALI tests send into DALI's spawned workers (light imports only)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding import SampleContext, SyntheticReader
from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import WorkerContext


class RecordingReader(SyntheticReader):
    """Synthetic data that writes down, per process, every (item, indices) it reads, in order."""

    def __init__(self, log_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log_dir = log_dir

    def read_batch(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> list[Any]:
        record = {"pid": os.getpid(), "item": item.key, "indices": indices.tolist(), "source": ctx.worker_id}
        with open(Path(self.log_dir) / f"reads-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return super().read_batch(item, indices, ctx)


def add_image(sample: dict[str, Any], ctx: SampleContext) -> dict[str, Any]:
    """Adds a 2-d field (``x`` as 2 x 4) and the sample's epoch position, to check both survive DALI."""
    return {**sample, "img": sample["x"].reshape(2, 4), "pos": np.int64(ctx.position)}
