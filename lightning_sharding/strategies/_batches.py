"""``PlannedBatches``: inside a worker, read, transform and collate the batch a task names."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset, default_collate, get_worker_info
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from lightning_sharding.core.manifest import Item, Manifest
from lightning_sharding.core.order import Order
from lightning_sharding.core.plan import BatchTask
from lightning_sharding.core.spelling import option
from lightning_sharding.core.world import BatchContext, SampleContext, WorkerContext, World, sample_contexts
from lightning_sharding.mixture import mixture_of
from lightning_sharding.readers.base import Reader
from lightning_sharding.readers.storage import is_transient
from lightning_sharding.strategies._delivery import NO_POSITIONS, Delivery
from lightning_sharding.strategies._samples import Failed, SampleError, difference, structure
from lightning_sharding.strategies._shipped import ship, unship
from lightning_sharding.strategies._slots import SlotStates, WorkerSlots
from lightning_sharding.strategies._worker import WorkerContexts
from lightning_sharding.strategies.options import LoaderOptions

# The key of a mixture batch's stream rows (dict batches).
STREAM_KEY = "stream"
T = TypeVar("T")
# Under on_error="skip", a worker names its first SKIPS_NAMED skipped samples in a warning each, then
# says its count at 100, 1000, ... skipped (the epoch summary counts them all).
SKIPS_NAMED = 10


def _stack(
    tensors: Sequence[torch.Tensor], *, collate_fn_map: Any = None, slots: WorkerSlots | None = None
) -> torch.Tensor:
    first = tensors[0]
    if first.layout is not torch.strided or first.is_nested:  # PyTorch's own collate names what it can't
        return collate_tensor_fn(tensors, collate_fn_map=collate_fn_map)  # type: ignore[no-any-return]
    if slots is not None and all(  # alike, as stack(out=) takes them: else stack decides (and names a misfit)
        t.shape == first.shape and t.dtype == first.dtype and t.device.type == "cpu" and not t.requires_grad
        for t in tensors
    ):
        out = slots.take((len(tensors), *first.shape), first.dtype)
        if out is not None:
            return torch.stack(list(tensors), 0, out=out)
    return torch.stack(list(tensors), 0)


_POOLED_COLLATE = {**default_collate_fn_map, torch.Tensor: _stack}


def pooled_collate(samples: list[Any], slots: WorkerSlots | None = None) -> Any:
    """PyTorch's ``default_collate``, stacking tensors into the worker's own memory, or straight into
    a free slot of ``slots`` (:meth:`WorkerSlots.take`) that the batch is then sent from.

    In a worker, ``default_collate`` stacks each field into a new shared-memory file, for PyTorch's
    transport; the slot pool copies the batch into its slot anyway, so that file was made, faulted in
    page by page and dropped for nothing, every batch: batches of 64 JPEG crops of 224 x 224 took
    0.80 ms of worker CPU an image that way, 0.67 ms in the worker's memory. Stacked in the slot, the
    batch is not copied at all (a batch of them: 0.32 ms to stack there, against 1.08 ms to stack
    and copy). A batch that finds no free slot takes PyTorch's path, which moves it to shared memory then."""
    if slots is None:
        return collate(samples, collate_fn_map=_POOLED_COLLATE)
    return collate(samples, collate_fn_map={**_POOLED_COLLATE, torch.Tensor: partial(_stack, slots=slots)})


class PlannedBatches(Dataset[Delivery]):
    """Map-style dataset indexed by :class:`BatchTask`: reads, transforms and collates one batch.

    Runs inside workers and returns a :class:`Delivery`. A sample
    that fails to read or transform raises :class:`SampleError` naming the item and the sample;
    with ``on_error="skip"`` it is left out and counted, and a good sample of the same batch takes
    its place flagged as padding, so the batch keeps its size and the accounting stays exact. A
    warning names each skipped sample and why, the first :data:`SKIPS_NAMED` of each worker (then
    the worker's count, at 100, 1000, ...).
    """

    def __init__(
        self,
        reader: Reader,
        items: Sequence[Item] | Manifest,
        *,
        seed: int,
        world: World,
        options: LoaderOptions,
        worker_id: int | None = None,
    ) -> None:
        self.reader = reader
        self.manifest = items if isinstance(items, Manifest) else Manifest.from_items(items)
        self.items = self.manifest.items
        self.seed, self.shuffle, self.world = seed, options.shuffle, world
        self.transform, self.collate_fn, self.on_error = options.transform, options.collate_fn, options.on_error
        self.batch_transform = options.batch_transform
        # Set by the loader for the pooled transport (strategies/_slots.py); the worker's own slots.
        self.slot_states: SlotStates | None = None
        self._slots: WorkerSlots | None = None
        self._readers: tuple[int, ThreadPoolExecutor] | None = None  # the threads reading a batch's items (pid, pool)
        self._first_task = False  # in a worker until its first batch is read (see __setstate__)
        self.context = WorkerContexts(world, options.num_workers, seed, worker_id=worker_id)
        self._order: Order | None = None
        self._change: Any = None  # the last change of the epochs a task brought (a mixture decision)
        self._skipped = 0  # samples this process skipped under on_error="skip"
        # A mixture's stream of each item (stream after stream), for SampleContext.stream and the
        # batch's "stream" rows; None outside a mixture.
        mixture = mixture_of(self.manifest)
        self.stream_names: tuple[str, ...] = mixture.names if mixture is not None else ()
        self._stream_of_item = (
            np.repeat(np.arange(len(mixture.names), dtype=np.int64), mixture.stream_items)
            if mixture is not None
            else None
        )
        # Columns straight into the batch when nothing per sample runs: no transform, default collate.
        self.columnar = reader.columnar and self.transform is None and self.collate_fn is default_collate

    def __len__(self) -> int:
        raise TypeError("PlannedBatches is indexed by BatchTask and has no length")

    def reorder(self) -> None:
        """The manifest's epochs changed (a mixture decision): build the order again when next asked."""
        self._order = None
        self._change = None

    def _epoch_order(self, epoch: int, change: Any = None) -> Order:
        """``epoch``'s order; ``change``: a task's change of the epochs since this worker started (a
        mixture decision), applied to the manifest once."""
        if change is not None and change != self._change:
            self.manifest = self.manifest.with_epochs(change.apply(self.manifest.epochs), same_identity=True)
            self._change = change
            self._order = None
        if self._order is None or self._order.epoch != epoch:
            self._order = self.manifest.order(self.seed, epoch, shuffle=self.shuffle)
        return self._order

    def fetch_first(self, tasks: Sequence[BatchTask]) -> None:
        """In the training process, before its workers start: hand the reader the reads of ``tasks``
        (each worker's first), which it may fetch while the workers start (:meth:`Reader.first_reads`).
        Only for a reader whose reads wait on storage (``read_threads`` > 1); not for packed sequences or
        columns, whose reads the reader plans itself, nor for a task of changed epochs (a mixture
        decision, which a worker applies to its manifest first)."""
        if not tasks or self.reader.read_threads < 2 or self.reader.reads_sequences or self.columnar:
            return
        if any(t.change is not None for t in tasks):
            return
        reads = []
        order = None
        try:
            for task in tasks:
                if order is None or order.epoch != task.epoch:  # not kept: the workers make their own
                    order = self.manifest.order(self.seed, task.epoch, shuffle=self.shuffle)
                item_ids, indices = order.locate(task.positions)
                reads += [(self.items[int(item_ids[lo])], indices[lo:hi]) for lo, hi in _runs(item_ids)]
            self.reader.first_reads(reads, len(tasks))
        except Exception:  # noqa: BLE001 - fetching ahead only saves time: the workers read, and raise, themselves
            self.reader.drop_first_reads()

    def __getstate__(self) -> dict[str, Any]:
        # A worker maps its own slots; a large state (a long manifest) goes to a new worker through a
        # file, so that the DataLoader starts its workers at once, not one after the other (_shipped.py).
        return ship({**self.__dict__, "_slots": None, "_readers": None})

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(unship(state))
        # A worker: what the training process fetched for its first batch goes once that is read.
        self._first_task = True

    def __getitem__(self, task: BatchTask) -> Delivery:
        slots = self._worker_slots()
        if slots is not None:
            slots.reset()
        delivery = self._batch(task)
        if self._first_task:  # the bytes fetched for other workers' first batches are of no use here
            self._first_task = False
            self.reader.drop_first_reads()
        if slots is None:
            return delivery
        return delivery._replace(batch=slots.pack(delivery.batch))

    def _worker_slots(self) -> WorkerSlots | None:
        """This worker's slots (pooled transport), ``None`` in the training process or without a pool."""
        if self.slot_states is None:
            return None
        if self._slots is None:
            info = get_worker_info()
            if info is None:  # loading in the training process: nothing to move
                return None
            self._slots = WorkerSlots(self.slot_states, info.id)
        return self._slots

    def _batch(self, task: BatchTask) -> Delivery:
        ctx = self.context(task.epoch)
        order = self._epoch_order(task.epoch, task.change)
        if self.reader.reads_sequences:  # packed sequences: the reader builds the whole batch
            batch = self.reader.read_sequences(order, task.positions, self.items)
            return self._deliver(batch, task, task.positions, task.num_padding, ctx)
        item_ids, indices = order.locate(task.positions)
        if self.reader.fetch_ahead:
            self._tell_ahead(task, item_ids)
        runs = _runs(item_ids)  # each run of positions in the same item is read with one call
        if self.columnar:
            batch = self._read_columns(runs, item_ids, indices, ctx)
            if batch is not None:
                return self._deliver(batch, task, task.positions, task.num_padding, ctx)
        reads = [(self.items[int(item_ids[lo])], indices[lo:hi], task.positions[lo:hi]) for lo, hi in runs]
        samples = [s for got in self._each(lambda r: self._read_run(*r, ctx), reads) for s in got]
        if self.transform is not None:
            transform = self._transform  # the per-sample loop is the hot path: plain ints, no lookups
            names = self._stream_names_of(item_ids)
            contexts = sample_contexts(ctx, task.positions, item_ids.tolist(), indices.tolist(), names)
            samples = [transform(s, c) for s, c in zip(samples, contexts, strict=True)]
        while True:  # each pass marks at least one more misfit as failed, or raises
            try:
                if Failed not in map(type, samples):
                    return self._deliver(self._collate(samples), task, task.positions, task.num_padding, ctx)
                bad = np.array([isinstance(s, Failed) for s in samples], dtype=bool)
                return self._without_failed(task, samples, bad, ctx)
            except SampleError:
                raise
            except Exception as err:  # noqa: BLE001 - a collate failure: name the sample that does not fit
                for i, failed in self._misfits(samples, err, task, item_ids, indices, ctx):
                    samples[i] = failed

    def _collate(self, samples: list[Any]) -> Any:
        """``collate_fn`` of the samples; PyTorch's default one, in a worker of the slot pool, stacks
        into a free slot the batch is then sent from, or into this process's memory
        (:func:`pooled_collate`)."""
        slots = self._worker_slots() if self.collate_fn is default_collate else None
        if slots is None:
            return self.collate_fn(samples)
        if self.batch_transform is not None:  # it might keep the tensors (a memory bank): not in a slot
            return pooled_collate(samples)
        slots.begin()  # nothing else sees the batch before it is sent: straight into a slot
        return pooled_collate(samples, slots)

    def _tell_ahead(self, task: BatchTask, item_ids: npt.NDArray[np.int64]) -> None:
        """Tell the reader this batch's items, then those the epoch order lays out after its last
        position: this worker's next ones, 8 x fetch_ahead + 1 of them (enough files when several
        items share one) (:meth:`~lightning_sharding.core.order.Order.items_from`)."""
        real = task.positions[: len(task.positions) - task.num_padding]
        count = 8 * self.reader.fetch_ahead + 1
        upcoming = self._epoch_order(task.epoch).items_from(int(real.max()), count).tolist() if len(real) else []
        self.reader.ahead([self.items[i] for i in dict.fromkeys(item_ids.tolist())], [self.items[i] for i in upcoming])

    def _misfits(
        self,
        samples: list[Any],
        err: Exception,
        task: BatchTask,
        item_ids: npt.NDArray[np.int64],
        indices: npt.NDArray[np.int64],
        ctx: WorkerContext,
    ) -> list[tuple[int, Failed]]:
        """The samples whose shapes or dtypes differ from the rest of the batch, which ``collate_fn``
        could not stack (``err``); raises unless ``on_error="skip"`` or when none differs."""
        shapes = [None if isinstance(s, Failed) else structure(s) for s in samples]
        counts: dict[Any, int] = {}
        for shape in shapes:
            if shape is not None:
                counts[shape] = counts.get(shape, 0) + 1
        common = max(counts, key=lambda k: counts[k]) if counts else None
        odd = [i for i, shape in enumerate(shapes) if shape is not None and shape != common]
        if not odd:
            keys = sorted({self.items[int(k)].key for k in item_ids})
            raise SampleError(
                f"collate_fn failed on batch {task.index} (epoch {task.epoch}, items {keys}, rank {ctx.data_rank}, "
                f"worker {ctx.worker_id}): {type(err).__name__}: {err}"
            ) from err
        out = []
        for i in odd:
            failed = Failed(
                f"sample {int(indices[i])} of item {self.items[int(item_ids[i])].key!r} (epoch {task.epoch}, "
                f"position {int(task.positions[i])}, rank {ctx.data_rank}, worker {ctx.worker_id}) does not fit in a "
                f"batch with the others: {difference(shapes[i], common)} ({type(err).__name__}: {err})."
            )
            if self.on_error == "raise":
                raise failed.error() from err
            out.append((i, failed))
        return out

    def _read_columns(
        self, runs: list[tuple[int, int]], item_ids: npt.NDArray[np.int64], indices: npt.NDArray[np.int64], ctx: Any
    ) -> Any:
        """The batch from the reader's columns, one read per run; ``None`` (read sample by sample,
        which names a bad sample) when a read fails or the runs' columns do not line up."""
        try:
            read = self.reader.read_columns
            parts = self._each(lambda r: read(self.items[int(item_ids[r[0]])], indices[r[0] : r[1]], ctx), runs)
        except Exception:  # noqa: BLE001 - the per-sample path reads again and names the failing sample
            return None
        return join_columns(parts, len(item_ids))

    def _each(self, read: Callable[[T], Any], runs: Sequence[T]) -> list[Any]:
        """``read`` of each run, in order: at once, in threads, when the reader's reads wait on storage
        (:attr:`~lightning_sharding.readers.base.Reader.read_threads`), else one after the other."""
        threads = self.reader.read_threads
        if threads < 2 or len(runs) < 2:
            return [read(r) for r in runs]
        pid, pool = self._readers or (None, None)
        if pool is None or pid != os.getpid():  # a forked worker has no thread of its parent's: its own pool
            pool = ThreadPoolExecutor(threads, thread_name_prefix="lsh-read")  # threads start as needed
            self._readers = (os.getpid(), pool)
        return list(pool.map(read, runs))

    def _read_run(
        self, item: Item, indices: npt.NDArray[np.int64], positions: npt.NDArray[np.int64], ctx: WorkerContext
    ) -> list[Any]:
        """Samples ``indices`` of ``item`` in one read; on failure, sample by sample to name the bad one."""
        try:
            got = self.reader.read_batch(item, indices, ctx)
        except Exception:  # noqa: BLE001 - find and name the failing sample below
            return [self._read_one(item, int(i), int(p), ctx) for i, p in zip(indices, positions, strict=True)]
        if len(got) != len(indices):
            raise RuntimeError(
                f"{type(self.reader).__name__}.read_batch returned {len(got)} samples for "
                f"{len(indices)} indices of item {item.key!r}; it must return one sample per index"
            )
        return list(got)

    def _read_one(self, item: Item, index: int, position: int, ctx: WorkerContext) -> Any:
        try:
            return self.reader.read(item, index, ctx)
        except Exception as raised:
            err = self.reader.scrubbed(raised)  # a URL's credentials: shown redacted, the chain dropped
            if is_transient(raised):  # storage down beyond the retry budget is not bad data: never skip it
                raise SampleError(
                    f"cannot read item {item.key!r} (rank {ctx.data_rank}, worker {ctx.worker_id}): the storage "
                    f"failed beyond the retry budget: {err}. No sample of this batch counts as consumed; once "
                    "the storage is back, resume from the last checkpoint (or raise the reader's retry=RetryPolicy)."
                ) from (err if err is raised else None)
            failed = Failed(
                f"cannot read sample {index} of item {item.key!r} (epoch {ctx.epoch}, position {position}, "
                f"rank {ctx.data_rank}, worker {ctx.worker_id}): {type(err).__name__}: {err}."
            )
            if self.on_error == "raise":
                raise failed.error() from (err if err is raised else None)
            return failed

    def _transform(self, sample: Any, sctx: SampleContext) -> Any:
        if isinstance(sample, Failed):
            return sample
        assert self.transform is not None
        try:
            return self.transform(sample, sctx)
        except Exception as err:
            failure = SampleError(
                f"the transform failed on sample {sctx.index} of item {self.items[sctx.item].key!r} "
                f"(epoch {sctx.worker.epoch}, position {sctx.position}): {type(err).__name__}: {err}"
            )
            if self.on_error == "raise":
                raise failure from err
            return Failed(str(failure))

    def _deliver(
        self, batch: Any, task: BatchTask, positions: Any, num_padding: int, ctx: WorkerContext, skipped: Any = None
    ) -> Delivery:
        """The batch, through ``batch_transform`` when there is one, with its provenance; in a mixture
        a dict batch gets each row's stream (int64, an index into :attr:`stream_names`) as ``"stream"``."""
        streams = self._streams_of(task, positions)
        if self.batch_transform is not None:
            batch = self._run_batch_transform(batch, task, positions, num_padding, ctx, streams)
        if streams is not None and isinstance(batch, dict) and STREAM_KEY not in batch:
            batch = {**batch, STREAM_KEY: torch.from_numpy(streams)}
        skipped = NO_POSITIONS if skipped is None else skipped
        stats = self.reader.take_stats()
        return Delivery(batch, task.epoch, positions, num_padding, skipped, stats=stats, generation=task.generation)

    def _stream_names_of(self, item_ids: npt.NDArray[np.int64]) -> list[str | None]:
        """The stream name of each item of ``item_ids`` (``None`` each outside a mixture)."""
        if self._stream_of_item is None:
            return [None] * len(item_ids)
        names = self.stream_names
        return [names[s] for s in self._stream_of_item[item_ids].tolist()]

    def _streams_of(self, task: BatchTask, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | None:
        """Each row's stream (``None`` outside a mixture), from the epoch order's items of ``positions``."""
        if self._stream_of_item is None:
            return None
        items, _ = self._epoch_order(task.epoch).locate(positions)
        return self._stream_of_item[items]

    def _run_batch_transform(
        self,
        batch: Any,
        task: BatchTask,
        positions: Any,
        num_padding: int,
        ctx: WorkerContext,
        streams: npt.NDArray[np.int64] | None = None,
    ) -> Any:
        """``batch_transform`` on the batch; a failure or a changed number of rows names the batch (a
        batch-level failure has no one sample to skip, so it is never skipped)."""
        assert self.batch_transform is not None
        where = f"batch {task.index} (epoch {task.epoch}, rank {ctx.data_rank}, worker {ctx.worker_id})"
        try:
            out = self.batch_transform(batch, BatchContext(ctx, positions, num_padding, streams, self.stream_names))
        except Exception as err:
            raise SampleError(f"batch_transform failed on {where}: {type(err).__name__}: {err}") from err
        leaves = out.values() if isinstance(out, dict) else [out]
        rows = {len(v) for v in leaves if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim}
        if rows and rows != {len(positions)}:
            raise SampleError(
                f"batch_transform returned {sorted(rows)} rows for {where} of {len(positions)} samples: it must keep "
                "one row per sample, in order (the loader flags padding and counts samples by row)"
            )
        return out

    def _without_failed(
        self, task: BatchTask, samples: list[Any], bad: npt.NDArray[np.bool_], ctx: WorkerContext
    ) -> Delivery:
        """Leave failed samples out; good ones of the batch stand in for them, flagged as padding."""
        n_real = len(task.positions) - task.num_padding
        real_bad = bad.copy()
        real_bad[n_real:] = False
        good = np.flatnonzero(~bad)
        if good.size == 0:
            raise SampleError(
                f"every sample of batch {task.index} (epoch {task.epoch}, positions {task.positions.tolist()}) "
                f"failed, so on_error='skip' has nothing to fill the batch with. First error: {samples[0].message}"
            )
        fill = good[np.arange(int(bad.sum())) % good.size]
        keep_real, keep_pad = good[good < n_real], good[good >= n_real]
        order = np.concatenate((keep_real, keep_pad, fill))
        positions = task.positions[order]
        num_padding = len(order) - len(keep_real)
        skipped = task.positions[np.flatnonzero(real_bad)]
        self._warn_skipped([samples[i] for i in np.flatnonzero(real_bad).tolist()], ctx)
        return self._deliver(self._collate([samples[i] for i in order]), task, positions, num_padding, ctx, skipped)

    def _warn_skipped(self, failures: list[Failed], ctx: WorkerContext) -> None:
        """Name each skipped sample and why in a warning, the first :data:`SKIPS_NAMED` of this worker;
        after those, say how many it skipped at 100, 1000, ... (a data set of bad samples floods nothing)."""
        where = f"rank {ctx.data_rank}, worker {ctx.worker_id}"
        for failed in failures:
            self._skipped += 1
            count = self._skipped
            if count <= SKIPS_NAMED:
                last = (
                    f" ({where} names its first {SKIPS_NAMED} skipped samples; after them it gives their count at "
                    "100, 1000, ..., and the epoch summary's skipped column counts them all)"
                    if count == SKIPS_NAMED
                    else ""
                )
                warnings.warn(
                    f"skipped a bad sample ({option('on_error', 'skip')}): {failed.message}{last}", stacklevel=2
                )
            elif str(count) == "1" + "0" * (len(str(count)) - 1):  # 100, 1000, ...
                warnings.warn(
                    f"{where} has skipped {count} bad samples ({option('on_error', 'skip')}; the first {SKIPS_NAMED} "
                    "named above, the epoch summary's skipped column counts them all)",
                    stacklevel=2,
                )


def join_columns(parts: list[Any], n: int) -> Any:
    """The runs' columns (arrays of shape ``(k, ...)``, or dicts of them) as one batch of tensors of
    ``n`` rows; ``None`` when they do not line up (other fields, dtypes or row shapes, or a wrong length)."""

    def join(arrays: list[Any]) -> torch.Tensor | None:
        if not all(isinstance(a, np.ndarray) for a in arrays):
            return None
        first = arrays[0]
        if any(a.dtype != first.dtype or a.shape[1:] != first.shape[1:] for a in arrays):
            return None
        joined = np.concatenate(arrays) if len(arrays) > 1 else first
        if joined.shape[:1] != (n,) or joined.dtype.kind not in "biuf":
            return None
        if not (joined.flags.writeable and joined.flags.c_contiguous):
            joined = np.array(joined)  # a copy the tensor may own
        return torch.from_numpy(joined)

    if all(isinstance(p, dict) for p in parts):
        keys = list(parts[0])
        if any(list(p) != keys for p in parts):
            return None
        batch = {k: join([p[k] for p in parts]) for k in keys}
        return None if any(v is None for v in batch.values()) else batch
    return join(parts)


def _runs(item_ids: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive positions in the same item: read with one call."""
    cuts = np.flatnonzero(np.diff(item_ids)) + 1
    starts, ends = np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [len(item_ids)])).tolist()
    return list(zip(starts, ends, strict=True))
