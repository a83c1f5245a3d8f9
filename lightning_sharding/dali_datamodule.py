"""``DaliDataModule``: a :class:`~lightning_sharding.ShardedDataModule` whose loaders are DALI pipelines.

Import it as ``from lightning_sharding.dali import DaliDataModule``; it is kept out of ``dali.py``
so that DALI's worker processes never import Lightning.
"""

from __future__ import annotations

from typing import Any

from lightning_sharding.dali import DaliLoader, Graph, PipelineOptions, require_dali
from lightning_sharding.datamodule import ShardedDataModule
from lightning_sharding.ledger import Ledger
from lightning_sharding.manifest import Manifest
from lightning_sharding.plan import EvenBatches
from lightning_sharding.readers.base import Reader


class DaliDataModule(ShardedDataModule):
    """:class:`~lightning_sharding.ShardedDataModule` whose loaders are DALI pipelines.

    ``num_workers`` is the pipeline's ``py_num_workers``: each worker owns one parallel external
    source and reads the plan's positions for its (rank, worker) in order. ``graph(fields)`` gets
    the merged fields (a DataNode per sample field) and returns the named outputs of the pipeline
    (default: the fields themselves). Exactly-once, mid-epoch resume and rescale work as for
    ``ShardedDataModule``; DALI assembles batches, so ``collate_fn`` and the DataLoader options
    do not apply.

    Args:
        graph: ``graph(fields: dict[str, DataNode]) -> dict[str, DataNode]``, DALI operators run
            after the sources (decoding, augmentation), in the training process.
        num_threads, device_id, prefetch_queue_depth, py_start_method: passed to ``Pipeline``.
        **kwargs: the arguments of ``ShardedDataModule`` (reader, batch_size, num_workers, seed...).
    """

    def __init__(
        self,
        reader: Reader | None = None,
        *,
        graph: Graph | None = None,
        num_threads: int = 1,
        device_id: int | None = None,
        prefetch_queue_depth: int = 2,
        py_start_method: str = "spawn",
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        for key in ("collate_fn", "persistent_workers", "prefetch_factor", "pin_memory", "multiprocessing_context"):
            if kwargs.get(key):
                raise ValueError(
                    f"`{name}({key}=...)` does not apply: DALI assembles batches and runs its own workers "
                    "(use `prefetch_queue_depth=` and `py_start_method=`)"
                )
        if kwargs.get("on_error", "raise") != "raise":
            raise ValueError(
                f"`{name}(on_error={kwargs['on_error']!r})` is not supported: a DALI pipeline cannot fill the place "
                "of a skipped sample; use ShardedDataModule for on_error='skip'"
            )
        if num_threads < 1 or prefetch_queue_depth < 1:
            raise ValueError(
                f"`{name}(num_threads={num_threads}, prefetch_queue_depth={prefetch_queue_depth})` must be >= 1"
            )
        require_dali()
        super().__init__(reader, **kwargs)
        self.graph = graph
        self.pipeline_options = PipelineOptions(num_threads, device_id, prefetch_queue_depth, py_start_method)

    def _loader(  # type: ignore[override]  # a DaliLoader stands in for the ShardedLoader
        self,
        reader: Reader,
        manifest: Manifest,
        ledger: Ledger,
        shuffle: bool,
        track: bool,
        even_batches: EvenBatches | None = None,
    ) -> DaliLoader:
        return DaliLoader.build(
            reader,
            manifest.items,
            ledger,
            world=self.world,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            shuffle=shuffle,
            even_batches=even_batches or self.even_batches,
            transform=self.transform,
            graph=self.graph,
            options=self.pipeline_options,
            padding_key=self.padding_key,
            track=track,
        )
