"""NVIDIA DALI: one parallel external source per Python worker, pinned, merged, resumable.

DALI runs every *iterable* parallel external source in one dedicated worker, assigned round-robin
(``WorkerPool.assign_dedicated_workers`` in ``nvidia/dali/_multiproc/pool.py``). With as many
iterable sources as ``py_num_workers``, source ``w`` therefore owns one worker process: it yields
the plan's positions for (rank, ``w``) in order, so that worker reads its own run of shards
sequentially. Each source fills only its own slots of every batch and leaves the other slots as
empty arrays; ``fn.cat`` of all sources along axis 0 then merges the mini-batches into one batch
with no padding copies. The epoch positions come out as an extra output, for the ledger.
"""

from __future__ import annotations

import gc
import importlib
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from lightning_sharding.ledger import Ledger
from lightning_sharding.loader import PlannedBatches, PlanSampler, Provenance, Transform, seed_rngs
from lightning_sharding.manifest import Item
from lightning_sharding.order import derive_seed
from lightning_sharding.plan import BatchTask, EvenBatches, RankPlan, plan_epoch
from lightning_sharding.rangeset import RangeSet
from lightning_sharding.readers.base import Reader
from lightning_sharding.world import ShardContext, World

PROVENANCE = "_provenance"
"""Name of the pipeline output that carries provenance: int64, shape ``(batch, 4)`` with columns
``(epoch, position, is_padding, source)``. :class:`DaliLoader` strips it from the batch."""

Int64Array = npt.NDArray[np.int64]
Graph = Callable[[dict[str, Any]], Mapping[str, Any]]
_PIPELINE_SEEDS = 0xDA11


def require_dali(module: str = "nvidia.dali") -> Any:
    """Import a module of NVIDIA DALI (untyped, as DALI is), or raise an ImportError that names the
    extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            "lightning_sharding.dali needs NVIDIA DALI, which is not installed: "
            "`pip install 'lightning-sharding[dali]'` (it installs nvidia-dali-cuda120)"
        ) from err


# -- the merged layout: pure integers ---------------------------------------------------------


@dataclass(frozen=True)
class MergedLayout:
    """How ``num_sources`` pinned sources fill the merged batches of one rank's epoch.

    The rank's sequence is its served positions followed by its padding (``RankPlan``). Batch
    sizes are the plan's; batch ``s`` takes ``parts[s, w]`` samples from source ``w`` (int64, shape
    ``(num_batches, num_sources)``, near-equal shares), placed after those of sources ``< w``.
    Source ``w`` reads a contiguous run of the sequence, starting at ``starts[w]``.
    """

    rank_plan: RankPlan
    parts: Int64Array

    @property
    def sizes(self) -> Int64Array:
        """Samples per merged batch, shape ``(num_batches,)``."""
        return np.asarray(self.parts.sum(axis=1), dtype=np.int64)

    @property
    def offsets(self) -> Int64Array:
        """Where source ``w``'s samples start inside batch ``s``, shape ``(num_batches, num_sources)``."""
        return np.asarray(np.cumsum(self.parts, axis=1) - self.parts, dtype=np.int64)

    @property
    def starts(self) -> Int64Array:
        """Where each source's run starts in the rank's sequence, shape ``(num_sources,)``."""
        lengths = self.parts.sum(axis=0)
        return np.asarray(np.cumsum(lengths) - lengths, dtype=np.int64)

    def run(self, source: int) -> tuple[Int64Array, int]:
        """Source ``source``'s positions in reading order (shape ``(n,)``) and how many of the last
        ones are padding."""
        plan = self.rank_plan
        lo = int(self.starts[source])
        hi = lo + int(self.parts[:, source].sum())
        served = plan.num_served
        real = plan.positions.select(min(lo, served), min(hi, served)).to_array()
        pad = hi - max(lo, served) if hi > served else 0
        return np.concatenate((real, np.full(pad, plan.pad_position, dtype=np.int64))), pad


def merge_layout(rank_plan: RankPlan, num_sources: int) -> MergedLayout:
    """The :class:`MergedLayout` of ``rank_plan`` for ``num_sources`` sources (at least one)."""
    if num_sources < 1:
        raise ValueError(f"merge_layout(num_sources={num_sources}) needs at least one source")
    sizes = np.array(
        [hi - lo for lo, hi in (rank_plan.bounds(i) for i in range(rank_plan.num_batches))], dtype=np.int64
    )
    if sizes.size:
        sizes[-1] += rank_plan.num_padding
    base, extra = np.divmod(sizes, num_sources)
    parts = base[:, None] + (np.arange(num_sources)[None, :] < extra[:, None])
    return MergedLayout(rank_plan, parts.astype(np.int64).reshape(len(sizes), num_sources))


# -- the fields of a sample --------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One array of a sample: its name in the batch, NumPy dtype and number of dimensions."""

    name: str
    dtype: str
    ndim: int


def sample_arrays(sample: Any) -> list[tuple[str, npt.NDArray[Any]]]:
    """A sample as named arrays: a dict by key, a tuple or list by index, anything else as ``data``."""
    if isinstance(sample, Mapping):
        pairs = [(str(k), v) for k, v in sample.items()]
    elif isinstance(sample, (tuple, list)):
        pairs = [(str(i), v) for i, v in enumerate(sample)]
    else:
        pairs = [("data", sample)]
    return [(name, np.asarray(value)) for name, value in pairs]


def fields_of(sample: Any, where: str) -> tuple[Field, ...]:
    """The fields of ``sample`` (read at ``where``); DALI carries only numeric and boolean arrays."""
    fields = []
    for name, array in sample_arrays(sample):
        if array.dtype.kind not in "biuf":
            raise TypeError(
                f"{where}: field {name!r} has dtype {array.dtype}, which DALI cannot carry. Return numeric "
                "arrays from the reader (for bytes, `np.frombuffer(data, dtype=np.uint8)`)."
            )
        fields.append(Field(name, array.dtype.str, array.ndim))
    return tuple(fields)


# -- the worker side ---------------------------------------------------------------------------


class _SourceBatches(PlannedBatches):
    """:class:`PlannedBatches` whose worker identity is the source's, not a DataLoader worker's."""

    def __init__(self, *args: Any, source: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source = source
        self._main_pid = os.getpid()

    def context(self, epoch: int) -> ShardContext:
        """The :class:`ShardContext` of this source; seeds the worker's RNGs once per epoch."""
        if self._context is None or self._context.epoch != epoch:
            self._context = ShardContext(
                rank=self.world.rank,
                world_size=self.world.world_size,
                worker_id=self.source,
                num_workers=self.num_workers,
                epoch=epoch,
                seed=self.seed,
            )
            if os.getpid() != self._main_pid:  # never reseed the training process itself
                seed_rngs(self._context.worker_seed)
        return self._context


@dataclass(frozen=True)
class SourcePlan:
    """What a source needs to plan its epochs by itself: the first epoch continues ``consumed``,
    every later one starts afresh (as the ledger does), so a pipeline serves consecutive epochs."""

    total: int
    epoch: int
    consumed: RangeSet
    world: World
    num_sources: int
    batch_size: int
    even_batches: EvenBatches

    def layout(self, epochs_done: int) -> tuple[int, MergedLayout]:
        """The epoch and layout of this pipeline's ``epochs_done``-th epoch."""
        epoch = self.epoch + epochs_done
        plan = plan_epoch(
            self.total,
            self.consumed if epochs_done == 0 else RangeSet(),
            epoch=epoch,
            world_size=self.world.world_size,
            num_workers=self.num_sources,
            batch_size=self.batch_size,
            even_batches=self.even_batches,
        )
        return epoch, merge_layout(plan.rank(self.world.rank), self.num_sources)


class ShardedSource:
    """The iterable external source of source ``source``: each ``iter()`` is one epoch.

    Every step yields one batch per output: for each field its flattened samples (and, for 2+
    dimensions, their shapes), then provenance rows ``(epoch, position, is_padding, source)``.
    Slots of the merged batch that other sources fill get empty arrays, which ``fn.cat`` skips.
    """

    def __init__(self, batches: _SourceBatches, plan: SourcePlan, fields: tuple[Field, ...]) -> None:
        self.batches, self.plan, self.fields = batches, plan, fields
        self.source = batches.source
        self._epochs = 0

    def __iter__(self) -> Iterator[tuple[list[npt.NDArray[Any]], ...]]:
        # One iter() per epoch: DALI calls it when the worker starts and again after each reset
        # that follows the end of the data (cycle="raise"). It also calls it once in the training
        # process when the source is defined, before pickling it into the worker; so the epoch
        # advances only when an iterator is actually started, never on iter() alone.
        epoch, layout = self.plan.layout(self._epochs)
        self._epochs += 1
        positions, num_padding = layout.run(self.source)
        first_padding = len(positions) - num_padding
        cursor = 0
        for step, size in enumerate(layout.sizes.tolist()):
            count, offset = int(layout.parts[step, self.source]), int(layout.offsets[step, self.source])
            mine = positions[cursor : cursor + count]
            padding = max(0, cursor + count - max(cursor, first_padding))
            cursor += count
            samples: list[Any] = []
            if count:
                samples = self.batches[BatchTask(epoch, step, self.source, mine, padding)][0]
            yield self._outputs(epoch, size, offset, mine, count - padding, samples)

    def _outputs(
        self, epoch: int, size: int, offset: int, positions: Int64Array, num_real: int, samples: list[Any]
    ) -> tuple[list[npt.NDArray[Any]], ...]:
        outputs: list[list[npt.NDArray[Any]]] = []
        empty = [np.empty(0, dtype=np.dtype(f.dtype)) for f in self.fields]
        arrays = [self._checked(s, int(p)) for s, p in zip(samples, positions, strict=True)]
        for i, field in enumerate(self.fields):
            flat = [empty[i]] * size
            flat[offset : offset + len(arrays)] = [np.ascontiguousarray(a[i]).reshape(-1) for a in arrays]
            outputs.append(flat)
            if field.ndim >= 2:
                shapes = [np.empty(0, dtype=np.int32)] * size
                shapes[offset : offset + len(arrays)] = [np.array(a[i].shape, dtype=np.int32) for a in arrays]
                outputs.append(shapes)
        rows = [np.empty(0, dtype=np.int64)] * size
        flags = np.arange(len(positions)) >= num_real
        rows[offset : offset + len(positions)] = [
            np.array([epoch, p, f, self.source], dtype=np.int64) for p, f in zip(positions, flags, strict=True)
        ]
        outputs.append(rows)
        return tuple(outputs)

    def _checked(self, sample: Any, position: int) -> list[npt.NDArray[Any]]:
        arrays = sample_arrays(sample)
        got = tuple((name, a.dtype.str, a.ndim) for name, a in arrays)
        want = tuple((f.name, f.dtype, f.ndim) for f in self.fields)
        if got != want:
            raise ValueError(
                f"the sample at epoch position {position} has fields (name, dtype, ndim) {got}, but the "
                f"first sample had {want}. DALI needs every sample of a field to share its dtype and number "
                "of dimensions: make the reader (or transform) return the same structure for every sample."
            )
        return [a for _, a in arrays]


# -- the pipeline -----------------------------------------------------------------------------


def sharded_sources(sources: Sequence[ShardedSource], *, parallel: bool) -> tuple[dict[str, Any], Any]:
    """Inside a pipeline definition: one external source per :class:`ShardedSource`, merged.

    Returns ``(fields, provenance)``: a DataNode per field (named as in :func:`sample_arrays`) and the
    provenance DataNode (int64, shape ``(4,)`` per sample).
    """
    fn, types = require_dali("nvidia.dali.fn"), require_dali("nvidia.dali.types")

    slots = _expand(sources[0].fields)
    dtypes = [types.INT32 if f is None else types.to_dali_type(np.dtype(f.dtype)) for f in slots] + [types.INT64]
    nodes = [
        fn.external_source(
            source=s,
            num_outputs=len(dtypes),
            parallel=parallel,
            batch=True,
            cycle="raise",
            dtype=dtypes,
            ndim=[1] * len(dtypes),
        )
        for s in sources
    ]
    merged = [fn.cat(*(n[i] for n in nodes), axis=0) for i in range(len(dtypes))]
    out: dict[str, Any] = {}
    for i, f in enumerate(slots):
        if f is None:
            continue
        if f.ndim == 0:
            out[f.name] = fn.reshape(merged[i], shape=[])
        elif f.ndim == 1:
            out[f.name] = merged[i]
        else:  # the next slot holds the shapes
            out[f.name] = fn.reshape(merged[i], shape=merged[i + 1])
    return out, merged[-1]


def _expand(fields: tuple[Field, ...]) -> list[Field | None]:
    """Output slots of a source: each field, followed by ``None`` for its shapes when 2+-d."""
    return [x for f in fields for x in ((f, None) if f.ndim >= 2 else (f,))]


@dataclass(frozen=True)
class PipelineOptions:
    """DALI ``Pipeline`` settings. ``device_id=None`` runs CPU-only; ``py_start_method="spawn"`` is
    the safe choice with CUDA or threads in the training process."""

    num_threads: int = 1
    device_id: int | None = None
    prefetch_queue_depth: int = 2
    py_start_method: str = "spawn"


class DaliLoader:
    """The iterable Lightning gets for one rank: a DALI pipeline's batches, provenance stripped.

    Same interface as :class:`~lightning_sharding.loader.ShardedLoader`: ``sampler`` (Lightning's
    ``set_epoch`` reaches the ledger through it), ``delivered``/``pop_delivered`` (provenance of
    delivered batches, oldest first, when ``track``), and no length. A pipeline serves consecutive
    epochs; it is rebuilt (its workers restarted) only when an epoch did not run to its end or the
    plan continues a ledger, e.g. after a resume.
    """

    def __init__(
        self,
        batches: Callable[[int], _SourceBatches],
        sampler: PlanSampler,
        *,
        num_workers: int,
        graph: Graph | None = None,
        options: PipelineOptions = PipelineOptions(),
        padding_key: str | None = "is_padding",
        track: bool = False,
    ) -> None:
        require_dali()
        self.sampler = sampler
        self.batch_sampler = None  # Lightning's evaluation loop reads it off any loader with a sampler
        self.num_workers, self.graph, self.options = num_workers, graph, options
        self.padding_key, self.track = padding_key, track
        self.delivered: deque[Provenance] = deque()
        self._batches = batches
        self._fields: tuple[Field, ...] | None = None
        self._iterator: Any = None
        self._next_epoch: int | None = None

    @classmethod
    def build(
        cls,
        reader: Reader,
        items: Sequence[Item],
        ledger: Ledger,
        *,
        world: World,
        batch_size: int,
        num_workers: int = 0,
        shuffle: bool = True,
        even_batches: EvenBatches = "pad",
        transform: Transform | None = None,
        **options: Any,
    ) -> DaliLoader:
        """The loader of ``world.rank`` for ``ledger``'s epoch; ``options`` go to :class:`DaliLoader`.

        ``num_workers`` is the pipeline's ``py_num_workers`` (0 runs one source in the training process).
        """

        def batches(source: int) -> _SourceBatches:
            return _SourceBatches(
                reader,
                items,
                seed=ledger.seed,
                shuffle=shuffle,
                world=world,
                num_workers=num_workers,
                transform=transform,
                collate_fn=list,
                source=source,
            )

        sampler = PlanSampler(
            ledger, world=world, num_workers=num_workers, batch_size=batch_size, even_batches=even_batches
        )
        return cls(batches, sampler, num_workers=num_workers, **options)

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
            self._fields = fields_of(probe[task][0][0], "the sample at epoch position 0")
        return self._fields

    def __iter__(self) -> Iterator[Any]:
        self.delivered.clear()
        iter(self.sampler)  # plans the epoch; the callback reports from sampler.epoch_plan
        rank_plan = self.sampler.rank_plan
        assert rank_plan is not None
        if rank_plan.num_batches == 0:
            return
        iterator = self._pipeline_for(rank_plan.epoch)
        served, finished = 0, False
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
        if self._iterator is not None and self._next_epoch == epoch and not ledger.done:
            self._iterator.reset()
            return self._iterator
        self.close()
        plan = SourcePlan(
            total=ledger.total,
            epoch=epoch,
            consumed=ledger.done,
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
        sources = [ShardedSource(self._batches(w), plan, fields) for w in range(self.num_sources)]
        opts = self.options
        seed = derive_seed(self.sampler.ledger.seed, _PIPELINE_SEEDS, plan.epoch, plan.world.rank) % 2**31
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

    def _batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        rows = batch.pop(PROVENANCE).cpu().numpy()
        epoch, positions, padding = rows[:, 0], rows[:, 1], rows[:, 2].astype(bool)
        num_padding = int(padding.sum())
        if (epoch != self.sampler.epoch).any() or padding[: len(padding) - num_padding].any():
            raise RuntimeError(
                f"a DALI batch of epochs {sorted(set(epoch.tolist()))} (padding {padding.tolist()}) arrived in "
                f"epoch {self.sampler.epoch}; this is a bug in lightning_sharding, please report it"
            )
        if self.track:
            self.delivered.append(Provenance(self.sampler.epoch, positions.astype(np.int64), num_padding))
        if self.padding_key is not None:
            if self.padding_key in batch:
                raise KeyError(
                    f"the batch already has a key {self.padding_key!r}, where lightning_sharding puts its padding "
                    "flags; pass another `padding_key=` (or None) to DaliDataModule"
                )
            batch[self.padding_key] = torch.from_numpy(padding)
        return batch

    def pop_delivered(self) -> Provenance:
        """Provenance of the oldest delivered batch whose step has not been accounted yet."""
        if not self.delivered:
            raise RuntimeError(
                "a training step ended but no batch of the DALI loader is waiting to be accounted. "
                "Return the DaliLoader from train_dataloader() as it is (no wrapping or re-batching)."
            )
        return self.delivered.popleft()

    def close(self) -> None:
        """Stop the pipeline and its worker processes (a new one starts on the next ``iter()``)."""
        if self._iterator is not None:
            self._iterator = None
            self._next_epoch = None
            gc.collect()  # DALI closes its worker pool when the pipeline is collected


def __getattr__(name: str) -> Any:
    # DaliDataModule lives apart so that DALI workers, which unpickle ShardedSource from this
    # module, never import Lightning.
    if name == "DaliDataModule":
        from lightning_sharding.dali_datamodule import DaliDataModule

        return DaliDataModule
    raise AttributeError(f"module 'lightning_sharding.dali' has no attribute {name!r}")
