"""Strategy ``broadcast``: each rank loads an item once into shared memory; its workers crop from it.

It is a different loader over the same plan as ``shard``: the same epoch order, ledger and
provenance, so resume and rescale work unchanged. What differs:

- workers take batches interleaved (batch ``i`` to worker ``i % W``), so all of them crop windows
  from the same item at the same time, each from its own batches (disjoint window indices);
- the main process loads the rank's current item into a shared array (a ``/dev/shm`` file) in a
  background thread, ``prefetch_items`` items ahead (:class:`SharedItems`), and every task carries
  the shared arrays its batch needs;
- a shared array is unlinked once every batch touching it has come back (the loader sees every batch,
  in order), at the end or abandonment of an epoch, and at process exit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import override

import lightning_sharding.strategies._shared_memory as shared_memory
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Item, Manifest
from lightning_sharding.core.order import EpochOrder
from lightning_sharding.core.plan import BatchTask
from lightning_sharding.core.world import World, sample_contexts
from lightning_sharding.readers.windows import WindowedReader
from lightning_sharding.strategies._batches import PlannedBatches
from lightning_sharding.strategies._delivery import Delivery
from lightning_sharding.strategies._shared_items import SharedItems
from lightning_sharding.strategies._shared_memory import SharedArray
from lightning_sharding.strategies.base import Strategy, register_strategy
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import LoaderRequest, PlanSampler, ShardedLoader, Transport, check_transport

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class BroadcastTask:
    """A :class:`BatchTask` plus the shared array of every item its positions fall in."""

    task: BatchTask
    arrays: dict[int, SharedArray]


class BroadcastSampler(PlanSampler):
    """The rank's plan with interleaved workers; attaches each batch's shared arrays from :class:`SharedItems`."""

    def __init__(
        self,
        ledger: Ledger,
        reader: WindowedReader,
        items: Sequence[Item],
        world: World,
        options: LoaderOptions,
        prefetch_items: int = 1,
    ) -> None:
        super().__init__(
            ledger,
            world=world,
            num_workers=options.num_workers,
            batch_size=options.batch_size,
            even_batches=options.even_batches,  # type: ignore[arg-type]  # the strategy's check allowed it
            worker_layout=BroadcastStrategy.worker_layout,
        )
        self.reader = reader
        self.shuffle = options.shuffle
        self.depth = prefetch_items
        self.counts = np.array([it.num_samples for it in items], dtype=np.int64)
        self.pool: SharedItems | None = None

    def close_pool(self, pool: SharedItems | None = None) -> None:
        """Unlink the shared arrays of ``pool`` (default: the current one)."""
        pool = pool or self.pool
        if pool is not None:
            pool.close()
        if pool is self.pool:
            self.pool = None

    def __iter__(self) -> Iterator[BroadcastTask]:  # type: ignore[override]
        tasks = super().__iter__()
        self.close_pool()  # a new pass: the previous one is over or abandoned
        self.pool = SharedItems(self.reader, self.world.rank, self.depth)
        assert self.rank_plan is not None
        order = EpochOrder(self.counts, self.ledger.seed, self.ledger.epoch, shuffle=self.shuffle)
        return self._attach(tasks, order, self.pool, _item_sequence(order, self.rank_plan.positions))

    @staticmethod
    def _attach(
        tasks: Iterator[BatchTask], order: EpochOrder, pool: SharedItems, sequence: list[int]
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
    """Runs in workers: crops a batch of windows from zero-copy views of the rank's shared arrays.

    Its :class:`Delivery` names in ``used`` the items whose shared arrays the batch used, so that the
    main process can release them.
    """

    def __init__(
        self, reader: WindowedReader, items: Sequence[Item], *, seed: int, world: World, options: LoaderOptions
    ) -> None:
        super().__init__(reader, items, seed=seed, world=world, options=options)
        self.window = reader.window
        self.stride = reader.stride
        self.bases = reader.bases()
        self.first_ids = reader.first_ids()
        self.offsets = reader.offsets()
        self._maps: dict[str, npt.NDArray[Any]] = {}

    def _shared_array(self, info: SharedArray, keep: dict[str, npt.NDArray[Any]]) -> npt.NDArray[Any]:
        array = self._maps.get(info.name)
        if array is None:
            array = shared_memory.open_shared_array(info)
        keep[info.name] = array
        return array

    def __getitem__(self, btask: BroadcastTask) -> Delivery:  # type: ignore[override]
        task = btask.task
        ctx = self.context(task.epoch)
        item_ids, indices = self._epoch_order(task.epoch).locate(task.positions)
        keep: dict[str, npt.NDArray[Any]] = {}
        starts = self.bases[item_ids] + indices * self.stride
        steps = np.arange(self.window)
        parts = []
        for item in dict.fromkeys(item_ids.tolist()):
            mask = item_ids == item
            data = self._shared_array(btask.arrays[item], keep)
            parts.append((mask, data[starts[mask][:, None] + steps]))  # a copy: (n, T, *shape)
        # Only the shared arrays of this batch stay mapped: a worker never goes back to an earlier item.
        self._maps = keep
        windows = parts[0][1] if len(parts) == 1 else _merge(parts, len(item_ids))
        ids = self.first_ids[item_ids] + indices
        global_starts = self.offsets[item_ids] + starts
        reader: WindowedReader = self.reader  # type: ignore[assignment]
        if self.transform is None:
            batch = reader.make_batch(windows, ids, global_starts)
        else:
            contexts = sample_contexts(ctx, task.positions, item_ids.tolist(), indices.tolist())
            samples = [
                self.transform({"x": windows[i], "id": int(ids[i]), "start": int(global_starts[i])}, contexts[i])
                for i in range(len(ids))
            ]
            batch = self.collate_fn(samples)
        used = np.fromiter(btask.arrays, dtype=np.int64, count=len(btask.arrays))
        return Delivery(batch, task.epoch, task.positions, task.num_padding, used=used)


def _merge(parts: list[tuple[npt.NDArray[np.bool_], npt.NDArray[Any]]], n: int) -> npt.NDArray[Any]:
    first = parts[0][1]
    out = np.empty((n, *first.shape[1:]), dtype=first.dtype)
    for mask, windows in parts:
        out[mask] = windows
    return out


class BroadcastLoader(ShardedLoader):
    """The ``broadcast`` strategy's loader of one rank: releases shared arrays as batches come back."""

    sampler: BroadcastSampler

    @classmethod
    def _parts(cls, request: LoaderRequest) -> tuple[Any, Any]:
        """Checked windows, cropped by workers from the shared arrays the sampler attaches to each task."""
        reader, manifest, ledger, world, options, _, prefetch_items = request
        items = manifest.items
        BroadcastStrategy().check(options, reader, owner="BroadcastLoader")
        assert isinstance(reader, WindowedReader)
        with_samples = [it for it in items if it.num_samples > 0]
        if world.data_size > len(with_samples):
            names = ", ".join(repr(it.key) for it in with_samples[:3]) + (", ..." if len(with_samples) > 3 else "")
            raise ValueError(
                f"strategy 'broadcast' has {world.data_size} {'data-parallel ' * (world.replica_size > 1)}ranks "
                f"but only {len(with_samples)} items with windows "
                f"({names}): every rank needs an item of its own. Use at most {len(with_samples)} ranks, "
                "or split the data into more items."
            )
        dataset = BroadcastBatches(reader, items, seed=ledger.seed, world=world, options=options)
        return dataset, BroadcastSampler(ledger, reader, items, world, options, prefetch_items)

    def __iter__(self) -> Iterator[Any]:
        self.delivered.clear()
        batches = iter(self._loader)  # creates this pass's pool (through the sampler)
        pool = self.sampler.pool
        try:
            for delivery in self._guarded(batches):
                if pool is not None:
                    pool.release(delivery.used.tolist())
                yield self.delivered.accept(delivery, self.sampler.epoch)
        finally:
            self.sampler.close_pool(pool)

    def close(self) -> None:
        """Stop the workers and unlink every shared array now (teardown, exceptions)."""
        super().close()
        self.sampler.close_pool()


@register_strategy
class BroadcastStrategy(Strategy):
    """Each rank loads an item once into shared memory; its workers crop disjoint windows from it.

    Args:
        prefetch_items: how many items each rank loads ahead of the current one (0: none).
        transport: how DataLoader workers hand batches over, as for
            :class:`~lightning_sharding.strategies.shard.ShardStrategy`.
    """

    name = "broadcast"
    takes = "windows"
    worker_layout = "interleaved"

    @classmethod
    @override
    def refusal(cls, setting: str, value: Any) -> str | None:
        if setting == "on_error" and value != "raise":
            return (
                "cannot skip a sample: a window is cut from an item already loaded, so an unreadable item "
                "fails when it is loaded, naming it"
            )
        return super().refusal(setting, value)

    def __init__(self, *, prefetch_items: int = 1, transport: Transport = "pool") -> None:
        if isinstance(prefetch_items, bool) or not isinstance(prefetch_items, int) or prefetch_items < 0:
            raise ValueError(f"`BroadcastStrategy(prefetch_items={prefetch_items!r})` must be an integer >= 0")
        check_transport(transport, type(self).__name__)
        self.prefetch_items = prefetch_items
        self.transport: Transport = transport

    @override
    def settings(self) -> dict[str, Any]:
        return {"prefetch_items": self.prefetch_items, "transport": self.transport}

    @override
    def build(
        self, data: Any, manifest: Manifest, ledger: Ledger, world: World, options: LoaderOptions, *, track: bool
    ) -> BroadcastLoader:
        return BroadcastLoader.build(
            data,
            manifest.items,
            ledger,
            world=world,
            options=options,
            track=track,
            prefetch_items=self.prefetch_items,
            transport=self.transport,
        )
