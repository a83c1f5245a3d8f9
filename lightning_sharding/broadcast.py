"""Strategy ``broadcast``: each rank loads an item once into shared memory; its workers crop from it.

It is a different loader over the same plan as ``shard``: the same epoch order, ledger and
provenance, so resume and rescale work unchanged. What differs:

- workers take batches interleaved (batch ``i`` to worker ``i % W``), so all of them crop windows
  from the same item at the same time, each from its own batches (disjoint window indices);
- the main process loads the rank's current item into a ``/dev/shm`` segment in a background
  thread, ``depth`` items ahead, and every task carries the segments its batch needs;
- a segment is unlinked once every batch touching it has come back (the loader sees every batch,
  in order), at the end or abandonment of an epoch, and at process exit; a run killed by SIGKILL
  leaves segments that the next run's start sweeps away.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from torch.utils.data import default_collate

from lightning_sharding import segments
from lightning_sharding.ledger import Ledger
from lightning_sharding.loader import PlannedBatches, PlanSampler, Provenance, ShardedLoader, Transform, flag_padding
from lightning_sharding.manifest import Item
from lightning_sharding.order import EpochOrder
from lightning_sharding.plan import BatchTask, EvenBatches, WorkerLayout
from lightning_sharding.readers.windows import WindowedReader
from lightning_sharding.segments import SegmentInfo
from lightning_sharding.world import SampleContext, World

Int64Array = npt.NDArray[np.int64]
# Bytes read from storage per call while filling a segment: bounds the loader's own memory.
CHUNK_BYTES = 64 << 20
_RUN = secrets.token_hex(3)
_generations = itertools.count()
_swept = threading.Lock()
_swept_once: list[bool] = []


@dataclass(frozen=True)
class BroadcastTask:
    """A :class:`BatchTask` plus the shared-memory segment of every item its positions fall in."""

    task: BatchTask
    segments: dict[int, SegmentInfo]


def _unlink_all(names: set[str]) -> None:
    for name in list(names):
        segments.unlink(name)
    names.clear()


class SegmentPool:
    """One rank's segments for one pass over an epoch plan (main process only).

    ``issue`` hands out an item's segment (loading it now if the prefetch has not) and counts the
    batch; ``release`` counts it back; ``done_issuing`` says no later batch will need the item. A
    segment is unlinked when both hold. At most ``1 + depth`` segments are loading or live unless
    the current batch needs another.
    """

    def __init__(self, reader: WindowedReader, rank: int, depth: int) -> None:
        with _swept:
            if not _swept_once:  # once per process: leftovers of killed runs on this machine
                segments.sweep_dead()
                _swept_once.append(True)
        self.reader, self.depth = reader, depth
        token = segments.process_token()
        self._prefix = f"{segments.PREFIX}{_RUN}-{token}-r{rank}-g{next(_generations)}"
        self._loads = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lsh-broadcast")
        self._futures: dict[int, Future[SegmentInfo]] = {}
        self._names: dict[int, str] = {}
        self._refs: dict[int, int] = {}
        self._issuing: set[int] = set()
        self._upcoming: list[int] = []
        # Every name is registered before its file exists, so exit-time cleanup never misses one.
        self.created: set[str] = set()
        self._finalizer = weakref.finalize(self, _unlink_all, self.created)

    def _start(self, item: int) -> Future[SegmentInfo]:
        future = self._futures.get(item)
        if future is None:
            name = f"{self._prefix}-n{next(self._loads)}-i{item}"
            self.created.add(name)
            self._names[item] = name
            future = self._futures[item] = self._executor.submit(self._load, item, name)
        return future

    def _load(self, item: int, name: str) -> SegmentInfo:
        reader = self.reader
        pieces = reader.segment_pieces(item)
        shape, dtype = reader.signature(pieces[0][0])
        steps = sum(stop - start for _, start, stop in pieces)
        step_bytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        per_chunk = max(1, CHUNK_BYTES // step_bytes)

        def chunks() -> Iterator[npt.NDArray[Any]]:
            for key, start, stop in pieces:
                for lo in range(start, stop, per_chunk):
                    hi = min(stop, lo + per_chunk)
                    data = np.asarray(reader.load(key, lo, hi))
                    if data.shape != (hi - lo, *shape) or data.dtype != dtype:
                        raise ValueError(
                            f"item {key!r}: load({lo}, {hi}) returned shape {data.shape} and dtype {data.dtype}, "
                            f"expected {(hi - lo, *shape)} and {dtype} like the first item"
                        )
                    yield data

        return segments.write_segment(name, chunks(), (steps, *shape), dtype)

    def upcoming(self, items: Sequence[int]) -> None:
        """The items the following batches will need, in order: the prefetch queue."""
        self._upcoming = [i for i in items if i not in self._futures]
        self._pump()

    def _pump(self) -> None:
        while self._upcoming and len(self._futures) < 1 + self.depth:
            self._start(self._upcoming.pop(0))

    def issue(self, items: Iterable[int]) -> dict[int, SegmentInfo]:
        """The segments of ``items`` for one batch (blocks while one is loading); counts the batch."""
        got: dict[int, SegmentInfo] = {}
        for item in items:
            if item in self._upcoming:
                self._upcoming.remove(item)
            try:
                got[item] = self._start(item).result()
            except Exception as err:
                raise RuntimeError(
                    f"loading item {self.reader.segment_pieces(item)[0][0]!r} into shared memory failed: {err}"
                ) from err
            self._refs[item] = self._refs.get(item, 0) + 1
            self._issuing.add(item)
        return got

    def done_issuing(self, item: int) -> None:
        """No batch issued from now on needs ``item``."""
        self._issuing.discard(item)
        self._maybe_unlink(item)

    def release(self, items: Iterable[int]) -> None:
        """A batch that used ``items`` came back from its worker."""
        for item in items:
            self._refs[item] -= 1
            self._maybe_unlink(item)

    def _maybe_unlink(self, item: int) -> None:
        if self._refs.get(item, 0) > 0 or item in self._issuing or item not in self._futures:
            return
        wait([self._futures.pop(item)])  # a load still running finishes before its file goes
        name = self._names.pop(item)
        segments.unlink(name)
        self.created.discard(name)
        self._refs.pop(item, None)
        self._pump()

    @property
    def live(self) -> list[str]:
        """Names of the segments loading or alive now."""
        return sorted(self._names.values())

    def close(self) -> None:
        """Stop prefetching and unlink every segment of this pool (idempotent)."""
        for future in self._futures.values():
            future.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._futures.clear()
        self._names.clear()
        self._upcoming.clear()
        _unlink_all(self.created)


class BroadcastSampler(PlanSampler):
    """The rank's plan with interleaved workers; attaches each batch's segments from a :class:`SegmentPool`."""

    worker_layout: WorkerLayout = "interleaved"

    def __init__(
        self,
        ledger: Ledger,
        reader: WindowedReader,
        counts: Int64Array,
        *,
        shuffle: bool,
        depth: int,
        **options: Any,
    ) -> None:
        super().__init__(ledger, **options)
        self.reader, self.counts, self.shuffle, self.depth = reader, counts, shuffle, depth
        self.pool: SegmentPool | None = None

    def close_pool(self, pool: SegmentPool | None = None) -> None:
        """Unlink the segments of ``pool`` (default: the current one)."""
        pool = pool or self.pool
        if pool is not None:
            pool.close()
        if pool is self.pool:
            self.pool = None

    def __iter__(self) -> Iterator[BroadcastTask]:  # type: ignore[override]
        tasks = super().__iter__()
        self.close_pool()  # a new pass: the previous one is over or abandoned
        self.pool = SegmentPool(self.reader, self.world.rank, self.depth)
        assert self.rank_plan is not None
        order = EpochOrder(self.counts, self.ledger.seed, self.ledger.epoch, shuffle=self.shuffle)
        return self._attach(tasks, order, self.pool, _item_sequence(order, self.rank_plan.positions))

    @staticmethod
    def _attach(
        tasks: Iterator[BatchTask], order: EpochOrder, pool: SegmentPool, sequence: list[int]
    ) -> Iterator[BroadcastTask]:
        where = {item: i for i, item in enumerate(sequence)}
        current: list[int] = []
        for task in tasks:
            slots = np.searchsorted(order.starts, task.positions, side="right") - 1
            items = [int(order.item_order[s]) for s in dict.fromkeys(slots.tolist())]
            for item in current:
                if item not in items:
                    pool.done_issuing(item)
            last = where.get(items[-1])
            if last is not None:
                pool.upcoming(sequence[last + 1 :][: pool.depth])
            yield BroadcastTask(task, pool.issue(items))
            current = items
        for item in current:
            pool.done_issuing(item)


def _item_sequence(order: EpochOrder, positions: Any) -> list[int]:
    """The items a rank's positions (a RangeSet) fall in, in epoch order, without building positions."""
    seq: list[int] = []
    for start, end in zip(positions.starts.tolist(), positions.ends.tolist(), strict=True):
        lo = int(np.searchsorted(order.starts, start, side="right")) - 1
        hi = int(np.searchsorted(order.starts, end - 1, side="right")) - 1
        for slot in range(lo, hi + 1):
            item = int(order.item_order[slot])
            if not seq or seq[-1] != item:
                seq.append(item)
    return seq


class BroadcastBatches(PlannedBatches):
    """Runs in workers: crops a batch of windows from zero-copy views of the rank's segments.

    Returns ``(batch, epoch, positions, num_padding, items)``; ``items`` (int64, ``(k,)``) are the
    items whose segments the batch used, so the main process can release them.
    """

    def __init__(self, reader: WindowedReader, items: Sequence[Item], **options: Any) -> None:
        super().__init__(reader, items, **options)
        self.window, self.stride = reader.window, reader.stride
        self.bases, self.first_ids, self.offsets = reader.bases(), reader.first_ids(), reader.offsets()
        self._maps: dict[str, npt.NDArray[Any]] = {}

    def _segment(self, info: SegmentInfo, keep: dict[str, npt.NDArray[Any]]) -> npt.NDArray[Any]:
        array = self._maps.get(info.name)
        if array is None:
            array = segments.open_segment(info)
        keep[info.name] = array
        return array

    def __getitem__(self, btask: BroadcastTask) -> tuple[Any, int, Int64Array, int, Int64Array]:  # type: ignore[override]
        task = btask.task
        ctx = self.context(task.epoch)
        item_ids, indices = self._epoch_order(task.epoch).locate(task.positions)
        keep: dict[str, npt.NDArray[Any]] = {}
        starts = self.bases[item_ids] + indices * self.stride
        steps = np.arange(self.window)
        parts = []
        for item in dict.fromkeys(item_ids.tolist()):
            mask = item_ids == item
            data = self._segment(btask.segments[item], keep)
            parts.append((mask, data[starts[mask][:, None] + steps]))  # a copy: (n, T, *shape)
        # Only the segments of this batch stay mapped: a worker never goes back to an earlier item.
        self._maps = keep
        windows = parts[0][1] if len(parts) == 1 else _merge(parts, len(item_ids))
        ids = self.first_ids[item_ids] + indices
        global_starts = self.offsets[item_ids] + starts
        reader: WindowedReader = self.reader  # type: ignore[assignment]
        if self.transform is None:
            batch = reader.make_batch(windows, ids, global_starts)
        else:
            samples = [
                self.transform(
                    {"x": windows[i], "id": int(ids[i]), "start": int(global_starts[i])},
                    SampleContext(ctx, int(task.positions[i]), int(item_ids[i]), int(indices[i])),
                )
                for i in range(len(ids))
            ]
            batch = self.collate_fn(samples)
        used = np.fromiter(btask.segments, dtype=np.int64, count=len(btask.segments))
        return batch, task.epoch, task.positions, task.num_padding, used


def _merge(parts: list[tuple[npt.NDArray[np.bool_], npt.NDArray[Any]]], n: int) -> npt.NDArray[Any]:
    first = parts[0][1]
    out = np.empty((n, *first.shape[1:]), dtype=first.dtype)
    for mask, windows in parts:
        out[mask] = windows
    return out


class BroadcastLoader(ShardedLoader):
    """The ``broadcast`` strategy's loader of one rank: releases segments as batches come back."""

    sampler: BroadcastSampler

    @classmethod
    def build(  # type: ignore[override]
        cls,
        reader: WindowedReader,
        items: Sequence[Item],
        ledger: Ledger,
        *,
        world: World,
        batch_size: int,
        num_workers: int = 0,
        shuffle: bool = True,
        even_batches: EvenBatches = "pad",
        transform: Transform | None = None,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        prefetch_items: int = 1,
        on_error: str = "raise",
        **options: Any,
    ) -> BroadcastLoader:
        """The loader of ``world.rank``; ``prefetch_items`` is how many items are loaded ahead."""
        if on_error != "raise":
            raise ValueError(
                f"strategy 'broadcast' does not support on_error={on_error!r}: a window is cut from an item "
                "already loaded, so an unreadable item fails when it is loaded, naming it"
            )
        if not isinstance(reader, WindowedReader):
            raise TypeError(
                f"strategy 'broadcast' needs a WindowedReader (such as NpyWindows), got {type(reader).__name__}"
            )
        if prefetch_items < 0:
            raise ValueError(f"prefetch_items={prefetch_items} must be 0 or more")
        with_samples = [it for it in items if it.num_samples > 0]
        if world.world_size > len(with_samples):
            names = ", ".join(repr(it.key) for it in with_samples[:3]) + (", ..." if len(with_samples) > 3 else "")
            raise ValueError(
                f"strategy 'broadcast' has {world.world_size} ranks but only {len(with_samples)} items with windows "
                f"({names}): every rank needs an item of its own. Use at most {len(with_samples)} ranks, "
                "or split the data into more items."
            )
        dataset = BroadcastBatches(
            reader,
            items,
            seed=ledger.seed,
            shuffle=shuffle,
            world=world,
            num_workers=num_workers,
            transform=transform,
            collate_fn=collate_fn,
        )
        counts = np.array([it.num_samples for it in items], dtype=np.int64)
        sampler = BroadcastSampler(
            ledger,
            reader,
            counts,
            shuffle=shuffle,
            depth=prefetch_items,
            world=world,
            num_workers=num_workers,
            batch_size=batch_size,
            even_batches=even_batches,
        )
        return cls(dataset, sampler, num_workers=num_workers, **options)

    def __iter__(self) -> Iterator[Any]:
        self.delivered.clear()
        batches = iter(self._loader)  # creates this pass's pool (through the sampler)
        pool = self.sampler.pool
        try:
            for batch, epoch, positions, num_padding, used in self._guarded(batches):
                if pool is not None:
                    pool.release(used.tolist())
                if epoch != self.sampler.epoch:
                    raise RuntimeError(
                        f"a batch planned for epoch {epoch} arrived in epoch {self.sampler.epoch}; "
                        "this is a bug in lightning_sharding, please report it"
                    )
                if self.track:
                    self.delivered.append(Provenance(epoch, positions, num_padding))
                yield flag_padding(batch, len(positions), num_padding, self.padding_key)
        finally:
            self.sampler.close_pool(pool)

    def close(self) -> None:
        """Stop the workers and unlink every segment now (teardown, exceptions)."""
        super().close()
        self.sampler.close_pool()
