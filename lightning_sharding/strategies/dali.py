"""Strategy ``dali``: an NVIDIA DALI pipeline per rank, one parallel external source per worker.

``num_workers`` is the pipeline's ``py_num_workers``: each worker owns one source and reads the
plan's positions for its (rank, worker) in order (see :mod:`lightning_sharding.strategies._dali_layout`).
DALI assembles batches, so ``collate_fn`` and the DataLoader options do not apply; ``graph(fields)``
gets the merged fields (a DataNode per sample field) and returns the named outputs of the pipeline.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import numpy as np
from typing_extensions import override

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.order import derive_seed
from lightning_sharding.core.plan import BatchTask
from lightning_sharding.core.world import World
from lightning_sharding.strategies._batches import PlannedBatches
from lightning_sharding.strategies._dali_layout import Field, fields_of, require_dali
from lightning_sharding.strategies._dali_source import ShardedSource, SourcePlan, sharded_sources
from lightning_sharding.strategies._delivery import DeliveredLog, Delivery
from lightning_sharding.strategies.base import Strategy, TrainLoader, register_strategy
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import PlanSampler

PROVENANCE = "_provenance"
"""Name of the pipeline output that carries provenance: int64, shape ``(batch, 4)`` with columns
``(epoch, position, is_padding, source)``. :class:`DaliLoader` strips it from the batch."""

Graph = Callable[[dict[str, Any]], Mapping[str, Any]]
_PIPELINE_SEEDS = 0xDA11


@dataclass(frozen=True)
class PipelineOptions:
    """DALI ``Pipeline`` settings. ``device_id=None`` runs CPU-only; ``py_start_method="spawn"`` is
    the safe choice with CUDA or threads in the training process. ``graph(fields)`` gets a DataNode
    per sample field and returns the named outputs (default: the fields themselves)."""

    num_threads: int = 1
    device_id: int | None = None
    prefetch_queue_depth: int = 2
    py_start_method: str = "spawn"
    graph: Graph | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.num_threads < 1 or self.prefetch_queue_depth < 1:
            raise ValueError(
                f"`num_threads={self.num_threads}, prefetch_queue_depth={self.prefetch_queue_depth}` must be >= 1"
            )


def graph_at(path: str) -> Graph:
    """The graph function at the dotted ``path`` (``"package.module.function"``), named if it is not one."""
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError) as err:
        raise ValueError(f"DaliStrategy(graph={path!r}): cannot import it ({err}); give module.function") from None
    if not callable(found):
        raise ValueError(f"DaliStrategy(graph={path!r}) is not a function: give the dotted path of one")
    return found  # type: ignore[no-any-return]


class DaliLoader(TrainLoader[PlanSampler]):
    """The iterable Lightning gets for one rank: a DALI pipeline's batches, provenance stripped.

    Same interface as every :class:`TrainLoader`. A pipeline serves consecutive epochs; it is
    rebuilt (its workers restarted) only when an epoch did not run to its end or the plan continues
    a ledger, e.g. after a resume.
    """

    def __init__(
        self,
        batches: Callable[[int], PlannedBatches],
        sampler: PlanSampler,
        *,
        pipeline: PipelineOptions = PipelineOptions(),
        padding_key: str | None = "is_padding",
        track: bool = False,
    ) -> None:
        require_dali()
        self.sampler = sampler
        self.num_workers = sampler.num_workers
        self.graph = pipeline.graph
        self.options = pipeline
        self.delivered = DeliveredLog(padding_key=padding_key, track=track)
        self._batches = batches
        self._fields: tuple[Field, ...] | None = None
        self._iterator: Any = None
        self._next_epoch: int | None = None

    @property
    def num_sources(self) -> int:
        """Parallel sources (one per worker), or the one source of the training process."""
        return max(1, self.num_workers)

    def fields(self) -> tuple[Field, ...]:
        """The fields of the data, from one sample read in this process (once)."""
        if self._fields is None:
            ledger = self.sampler.ledger
            probe = self._batches(0)
            task = BatchTask(ledger.epoch, 0, 0, np.zeros(1, dtype=np.int64), 0)
            self._fields = fields_of(probe[task].batch[0], "the sample at epoch position 0")
        return self._fields

    def __iter__(self) -> Iterator[Any]:
        self.delivered.clear()
        iter(self.sampler)  # plans the epoch; the callback reports from sampler.epoch_plan
        rank_plan = self.sampler.rank_plan
        assert rank_plan is not None
        if rank_plan.num_batches == 0:
            return
        iterator = self._pipeline_for(rank_plan.epoch)
        served = 0
        finished = False
        try:
            for outputs in iterator:
                served += 1
                yield self._batch(outputs[0])
            finished = True
        finally:
            if finished:  # the sources can serve the next epoch; reset when it starts, so that
                self._next_epoch = rank_plan.epoch + 1  # no epoch is read ahead that never comes
            else:  # stopped early: the sources are mid-epoch and cannot be rewound
                self.close()
        if served != rank_plan.num_batches:
            raise RuntimeError(
                f"the DALI pipeline of rank {rank_plan.rank} yielded {served} batches in epoch {rank_plan.epoch}, "
                f"the plan has {rank_plan.num_batches}; this is a bug in lightning_sharding, please report it"
            )

    def _pipeline_for(self, epoch: int) -> Any:
        ledger = self.sampler.ledger
        if self._iterator is not None and self._next_epoch == epoch and not ledger.settled:
            self._iterator.reset()
            return self._iterator
        self.close()
        plan = SourcePlan(
            total=ledger.total,
            epoch=epoch,
            consumed=ledger.settled,
            world=self.sampler.world,
            num_sources=self.num_sources,
            batch_size=self.sampler.batch_size,
            even_batches=self.sampler.even_batches,
        )
        self._iterator = self._build(plan)
        return self._iterator

    def _build(self, plan: SourcePlan) -> Any:
        Pipeline = require_dali("nvidia.dali.pipeline").Pipeline
        pytorch = require_dali("nvidia.dali.plugin.pytorch")

        fields = self.fields()
        sources = [ShardedSource(self._batches(w), w, plan, fields) for w in range(self.num_sources)]
        opts = self.options
        seed = derive_seed(self.sampler.ledger.seed, _PIPELINE_SEEDS, plan.epoch, plan.world.data_rank) % 2**31
        pipe = Pipeline(
            batch_size=self.sampler.batch_size,
            num_threads=opts.num_threads,
            device_id=opts.device_id,
            seed=seed,
            prefetch_queue_depth=opts.prefetch_queue_depth,
            py_num_workers=self.num_sources,
            py_start_method=opts.py_start_method,
        )
        with pipe:
            nodes, provenance = sharded_sources(sources, parallel=self.num_workers > 0)
            outputs = dict(self.graph(nodes) if self.graph is not None else nodes)
            if PROVENANCE in outputs:
                raise KeyError(f"the graph returned an output named {PROVENANCE!r}, which lightning_sharding uses")
            pipe.set_outputs(*outputs.values(), provenance)
        return pytorch.DALIGenericIterator(
            pipe, [*outputs, PROVENANCE], last_batch_policy=pytorch.LastBatchPolicy.PARTIAL, auto_reset=False
        )

    def _batch(self, batch: dict[str, Any]) -> Any:
        rows = batch.pop(PROVENANCE).cpu().numpy()
        epochs, positions, padding = rows[:, 0], rows[:, 1].astype(np.int64), rows[:, 2].astype(bool)
        num_padding = int(padding.sum())
        if len(set(epochs.tolist())) > 1 or padding[: len(padding) - num_padding].any():
            raise RuntimeError(
                f"a DALI batch of epochs {sorted(set(epochs.tolist()))} (padding {padding.tolist()}) arrived in "
                f"epoch {self.sampler.epoch}; this is a bug in lightning_sharding, please report it"
            )
        epoch = int(epochs[0]) if len(epochs) else self.sampler.epoch
        return self.delivered.accept(Delivery(batch, epoch, positions, num_padding), self.sampler.epoch)

    def close(self) -> None:
        """Stop the pipeline and its worker processes (a new one starts on the next ``iter()``)."""
        if self._iterator is not None:
            self._iterator = None
            self._next_epoch = None
            gc.collect()  # DALI closes its worker pool when the pipeline is collected


@register_strategy
class DaliStrategy(Strategy):
    """Each rank's batches come from a DALI pipeline (``pip install 'lightning-sharding[dali]'``).

    Args:
        graph: ``graph(fields: dict[str, DataNode]) -> dict[str, DataNode]``, DALI operators run
            after the sources (decoding, augmentation), in the training process; or its dotted path
            (``"my_package.augment.graph"``), as a Hydra config gives it.
        num_threads, device_id, prefetch_queue_depth, py_start_method: passed to DALI's ``Pipeline``
            (see :class:`PipelineOptions`).
    """

    name = "dali"
    # The DataLoader settings a DALI pipeline does without: it assembles batches and runs its own workers.
    _NOT_USED = ("collate_fn", "batch_transform", "persistent_workers", "prefetch_factor", "pin_memory")

    @classmethod
    @override
    def refusal(cls, setting: str, value: Any) -> str | None:
        if setting in ("collate_fn", "batch_transform"):
            return "assembles each batch in its pipeline: put batch-level work in its graph (DaliStrategy(graph=...))"
        if setting in cls._NOT_USED or setting == "multiprocessing_context":
            return (
                "runs its own workers and queues; set them with "
                "sharding=DaliStrategy(prefetch_queue_depth=..., py_start_method=...)"
            )
        if setting == "on_error":
            return None if value == "raise" else "cannot fill the place of a skipped sample in a DALI pipeline"
        if setting == "streams":  # a mixture, of mixed batches
            return None if value == "mixed" else "plans only ['mixed'] batches"
        if setting == "skip_steps" and value > 1:  # the value: num_workers, its sources
            return (
                f"merges a run of each of its {value} sources into every batch, which the training history does "
                "not replay: skip= cannot name its steps"
            )
        return super().refusal(setting, value)

    def __init__(
        self,
        graph: Graph | str | None = None,
        *,
        num_threads: int = 1,
        device_id: int | None = None,
        prefetch_queue_depth: int = 2,
        py_start_method: str = "spawn",
    ) -> None:
        if isinstance(graph, str):
            graph = graph_at(graph)
        self.pipeline = PipelineOptions(
            num_threads=num_threads,
            device_id=device_id,
            prefetch_queue_depth=prefetch_queue_depth,
            py_start_method=py_start_method,
            graph=graph,
        )

    @override
    def settings(self) -> dict[str, Any]:
        return {f.name: getattr(self.pipeline, f.name) for f in fields(self.pipeline)}

    @override
    def check(self, options: LoaderOptions, data: object = None, owner: str = "ShardedDataModule") -> None:
        super().check(options, data, owner)
        require_dali()

    @override
    def build(
        self, data: Any, manifest: Manifest, ledger: Ledger, world: World, options: LoaderOptions, *, track: bool
    ) -> DaliLoader:
        """The DALI loader of ``world.rank``; ``options.num_workers`` is the pipeline's ``py_num_workers``
        (0 runs one source in the training process)."""
        per_sample = options.replace(collate_fn=list)  # DALI assembles the batch from the samples

        def batches(source: int) -> PlannedBatches:
            return PlannedBatches(data, manifest, seed=ledger.seed, world=world, options=per_sample, worker_id=source)

        sampler = PlanSampler.of(ledger, world, options, orders=partial(manifest.order, shuffle=options.shuffle))
        return DaliLoader(batches, sampler, pipeline=self.pipeline, padding_key=options.padding_key, track=track)
