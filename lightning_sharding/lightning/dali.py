"""NVIDIA DALI: ``DaliDataModule``, a :class:`~lightning_sharding.ShardedDataModule` with ``sharding="dali"``.

The loader itself lives in :mod:`lightning_sharding.strategies.dali` (its worker side imports no
Lightning); this module keeps the names users import.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from lightning_sharding.lightning.datamodule import ShardedDataModule
from lightning_sharding.readers.base import Reader
from lightning_sharding.strategies._dali_layout import merge_layout, require_dali
from lightning_sharding.strategies.dali import DaliLoader, DaliStrategy, Graph, PipelineOptions

PIPELINE_KEYS = tuple(f.name for f in fields(PipelineOptions) if f.name != "graph")

__all__ = ["DaliDataModule", "DaliLoader", "DaliStrategy", "Graph", "PipelineOptions", "merge_layout", "require_dali"]


class DaliDataModule(ShardedDataModule):
    """``ShardedDataModule(sharding=DaliStrategy(graph, ...))``: the loaders are DALI pipelines.

    ``num_workers`` is the pipeline's ``py_num_workers``. Exactly-once, mid-epoch resume and rescale
    work as for ``ShardedDataModule``; DALI assembles batches, so ``collate_fn`` and the DataLoader
    options do not apply.

    Args:
        graph: ``graph(fields: dict[str, DataNode]) -> dict[str, DataNode]``, DALI operators run
            after the sources (decoding, augmentation), in the training process.
        **kwargs: ``num_threads``, ``device_id``, ``prefetch_queue_depth`` and ``py_start_method``
            (passed to DALI's ``Pipeline``, see :class:`PipelineOptions`), and the arguments of
            ``ShardedDataModule`` (batch_size, num_workers, seed...).
    """

    def __init__(self, reader: Reader | None = None, *, graph: Graph | None = None, **kwargs: Any) -> None:
        pipeline = {key: kwargs.pop(key) for key in PIPELINE_KEYS if key in kwargs}
        super().__init__(reader, sharding=DaliStrategy(graph, **pipeline), **kwargs)
