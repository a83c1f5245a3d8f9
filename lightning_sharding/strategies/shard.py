"""Strategy ``shard``: every worker reads its own positions, the plan made in the main process.

Why a plain ``torch.utils.data.DataLoader`` and not torchdata's ``StatefulDataLoader``: the data
state that matters is the ledger, which is topology-free and lives in the main process. A
StatefulDataLoader's own state is per rank and per worker, counts batches a worker produced rather
than steps that completed, and its ``load_state_dict`` asserts the same ``num_workers`` (checked
with torchdata 0.11: Lightning restores it and resuming on another worker count crashes). We keep
no loader state at all, so there is nothing for it to save.

A mixture decision (:class:`~lightning_sharding.lightning.controller.MixtureController`) changes the
order from the first position no rank has delivered (:func:`delivered_positions`): the sampler plans the
rest of the pass again and deals the new plan's tasks, which carry the decisions to the workers, and
the loader drops what the workers prepared ahead under the old plan (:meth:`ShardedLoader.switch_order`).

Why map-style tasks instead of an ``IterableDataset``: the main process deals each worker a
:class:`~lightning_sharding.core.plan.BatchTask` through the DataLoader's own index queues. A new epoch
is then a new plan in the main process; persistent workers need no message, and the DataLoader
itself discards every task still in flight when a new iterator starts. Workers return whole
batches with their provenance (:class:`Delivery`), which the loader strips before Lightning sees
the batch and keeps in order for the ledger.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Literal, NamedTuple

import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data._utils.pin_memory import pin_memory as _torch_pin_memory
from typing_extensions import Self, override

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Item, Manifest
from lightning_sharding.core.order import Order
from lightning_sharding.core.plan import BatchTask, EpochPlan, EvenBatches, RankPlan, WorkerLayout, plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import World
from lightning_sharding.mixture import COMPOSITIONS, check_blocks
from lightning_sharding.readers.base import Reader
from lightning_sharding.strategies._batches import PlannedBatches
from lightning_sharding.strategies._delivery import DeliveredLog, Delivery
from lightning_sharding.strategies._helper_deaths import reraise_if_dead, stop_workers, watch, worker_processes
from lightning_sharding.strategies._slots import SlotPool
from lightning_sharding.strategies._start import (
    leave_forkserver,
    note_started,
    slow_to_start,
    start_method,
    worker_context,
)
from lightning_sharding.strategies._worker import check_picklable, pass_through
from lightning_sharding.strategies.base import Strategy, TrainLoader, register_strategy
from lightning_sharding.strategies.options import DEFAULT_OPTIONS, LoaderOptions


class PlanSampler(Sampler[BatchTask]):
    """Yields this rank's :class:`BatchTask` s for the ledger's current epoch.

    It deliberately has no ``__len__``: after an elastic resume an epoch's batch count differs
    from the next epoch's, and Lightning caches a loader's length for the whole run.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        world: World,
        num_workers: int,
        batch_size: int,
        even_batches: EvenBatches,
        worker_layout: WorkerLayout = "runs",
        orders: Callable[[int, int], Order] | None = None,
    ) -> None:
        self.ledger = ledger
        self.world = world
        self.num_workers = num_workers
        self.batch_size = batch_size
        self.even_batches = even_batches
        self.worker_layout = worker_layout
        self.orders = orders  # (seed, epoch) -> the epoch's order; None: plain orders of the ledger's total
        self.epoch_plan: EpochPlan | None = None
        self.rank_plan: RankPlan | None = None
        # Positions of this epoch delivered to training under an earlier plan of the same pass and not
        # in the ledger yet (a mixture decision replanned the pass): never planned again.
        self.delivered = RangeSet()
        self.generation = 0  # the plans of a pass planned again are numbered; the tasks carry it
        self.change: Any = None  # what decisions changed of the epochs, which tasks carry to workers started before
        self.dealt = -1  # the generation whose every task the DataLoader has taken (-1: none yet)
        # Called with each worker's first task when a pass is planned, before the workers start (the
        # loader sets it only for a pass that starts workers): PlannedBatches.fetch_first.
        self.on_plan: Callable[[list[BatchTask]], None] | None = None

    @classmethod
    def of(
        cls,
        ledger: Ledger,
        world: World,
        options: LoaderOptions,
        worker_layout: WorkerLayout = "runs",
        orders: Callable[[int, int], Order] | None = None,
    ) -> Any:
        """The sampler of ``world.rank`` with ``options``' batching, planning the orders ``orders``
        makes of ``(seed, epoch)`` (default: plain orders of the ledger's total)."""
        return cls(
            ledger,
            world=world,
            num_workers=options.num_workers,
            batch_size=options.batch_size,
            even_batches=options.even_batches,  # type: ignore[arg-type]  # a strategy's check allowed it
            worker_layout=worker_layout,
            orders=orders,
        )

    @property
    def epoch(self) -> int:
        """The epoch being served."""
        return self.ledger.epoch

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at every epoch start: a new epoch starts with nothing consumed."""
        self.ledger.start_epoch(epoch)
        self.delivered = RangeSet()

    def plan(self) -> EpochPlan:
        """Plan what is left of the current epoch (every rank computes the same plan)."""
        ledger = self.ledger
        order = ledger.total if self.orders is None else self.orders(ledger.seed, ledger.epoch)
        if not isinstance(order, int) and order.total != ledger.total:
            raise RuntimeError(
                f"epoch {ledger.epoch}'s order has {order.total} positions but the ledger counts {ledger.total}: "
                "the loader was built for other data than the ledger's"
            )
        return plan_epoch(
            order,
            ledger.settled | self.delivered,
            epoch=ledger.epoch,
            world_size=self.world.data_size,
            num_workers=self.num_workers,
            batch_size=self.batch_size,
            even_batches=self.even_batches,
            worker_layout=self.worker_layout,
        )

    def __iter__(self) -> Iterator[BatchTask]:
        self.epoch_plan = self.plan()
        self.rank_plan = self.epoch_plan.rank(self.world.data_rank)
        tasks = self._tasks()
        # Once a pass: PyTorch's iterator asks for the sampler's iterator again once its workers started.
        on_plan, self.on_plan = self.on_plan, None
        if on_plan is None or not self.num_workers:
            return tasks
        # The DataLoader deals the first tasks one to each worker, in order.
        first = list(itertools.islice(tasks, self.num_workers))
        on_plan(first)
        return itertools.chain(first, tasks)

    def _tasks(self) -> Iterator[BatchTask]:
        """The plan's tasks; after :meth:`switch` mid-pass, the new plan's (the DataLoader asks for
        the next task as it goes, so none of the old plan is dealt after the switch)."""
        generation = self.generation
        assert self.rank_plan is not None
        tasks = self.rank_plan.tasks()
        while True:
            if generation != self.generation:
                generation = self.generation
                tasks = self.rank_plan.tasks()
            task = next(tasks, None)
            if task is None:
                self.dealt = generation
                return
            if generation or self.change is not None:
                task = replace(task, generation=generation, change=self.change)
            yield task

    def switch(self, change: Any, orders: Callable[[int, int], Order], delivered: RangeSet | None) -> None:
        """Order epochs by ``orders`` from now on (made by ``change``, which tasks carry to the workers);
        ``delivered``: this pass goes on under a new plan (generation) without those positions, delivered already."""
        self.orders = orders
        self.change = change
        if delivered is not None:
            self.delivered = self.delivered | delivered
            self.generation += 1
            self.epoch_plan = self.plan()
            self.rank_plan = self.epoch_plan.rank(self.world.data_rank)


def delivered_positions(plan: EpochPlan, batches: int) -> tuple[RangeSet, int]:
    """Of a plan in time order whose ranks have each delivered ``batches``: the positions all ranks
    delivered (its first ``batches`` windows), and the first position none delivered with no position
    after it delivered or consumed (the epoch's total when there is none: the rest of the epoch is
    already planned in its last, partial window, or holds gaps)."""
    if not plan.in_time:
        raise ValueError("only a plan in time order knows what every rank delivered from its own count")
    window = plan.world_size * plan.batch_size
    remaining = plan.remaining
    taken = min(batches * window, len(remaining))
    delivered = remaining.select(0, taken)
    rest = remaining.select(taken, len(remaining))
    full_windows = len(remaining) // window
    if batches >= full_windows or len(rest.starts) != 1 or int(rest.ends[0]) != plan.total:
        return delivered, plan.total
    return delivered, int(rest.starts[0])


TRANSPORTS: tuple[str, ...] = ("pool", "torch")
Transport = Literal["pool", "torch"]


def check_transport(transport: Any, owner: str) -> None:
    """Refuse a transport that is not one, naming ``owner``."""
    if transport not in TRANSPORTS:
        raise ValueError(f"`{owner}(transport={transport!r})` must be one of {list(TRANSPORTS)}")


class LoaderRequest(NamedTuple):
    """What a loader of one rank is built from (``prefetch_items``: the broadcast strategy's setting)."""

    reader: Reader
    manifest: Manifest
    ledger: Ledger
    world: World
    options: LoaderOptions
    worker_layout: WorkerLayout
    prefetch_items: int = 1


class ShardedLoader(TrainLoader):
    """The loader of one rank under ``shard``: a DataLoader over planned tasks, deliveries unpacked.

    ``sampler`` is exposed so that Lightning's ``set_epoch`` reaches the plan. When ``track`` is set,
    the provenance of every delivered batch is kept in ``delivered`` for the ledger, oldest first.
    ``transport``: how the workers hand batches over (see :class:`ShardStrategy`).
    """

    def __init__(
        self,
        dataset: PlannedBatches,
        sampler: PlanSampler,
        options: LoaderOptions,
        *,
        track: bool,
        transport: Transport = "pool",
    ) -> None:
        self.sampler = sampler
        self.delivered = DeliveredLog(padding_key=options.padding_key, track=track, pin_memory=options.pin_memory)
        self._iterator: Iterator[Any] | None = None
        self._options = options
        self._dataset = dataset
        self._yielded = 0  # batches yielded under the current plan
        workers = options.num_workers
        method = start_method(options.multiprocessing_context)
        if workers > 0 and method in ("spawn", "forkserver"):
            check_picklable(
                f"DataLoader workers started with {method}",
                "",
                reader=dataset.reader,
                transform=dataset.transform,
                batch_transform=dataset.batch_transform,
                collate_fn=dataset.collate_fn,
            )
        context = None
        if workers > 0:
            used = (dataset, dataset.reader, dataset.transform, dataset.batch_transform, dataset.collate_fn)
            context = worker_context(options.multiprocessing_context, *used)
        self._pool: SlotPool | None = None
        if context is not None and transport == "pool":
            self._pool = SlotPool(workers, options.prefetch_factor, context, options.pin_memory)
            dataset.slot_states = self._pool.states
        self._loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=workers,
            collate_fn=pass_through,
            worker_init_fn=leave_forkserver,
            multiprocessing_context=context,
            **options.dataloader_kwargs(),
        )

    @classmethod
    def build(
        cls,
        reader: Reader,
        items: Sequence[Item] | Manifest,
        ledger: Ledger,
        *,
        world: World,
        options: LoaderOptions = DEFAULT_OPTIONS,
        track: bool = False,
        worker_layout: WorkerLayout = "runs",
        transport: Transport = "pool",
        prefetch_items: int = 1,
    ) -> Self:
        """The loader of ``world.rank`` for ``ledger``'s epoch; use it directly to shard outside Lightning.

        ``worker_layout`` is how the rank's batches go to its workers (see :mod:`lightning_sharding.core.plan`);
        ``transport`` and ``prefetch_items`` are the strategies' settings (:class:`ShardStrategy`,
        :class:`~lightning_sharding.strategies.broadcast.BroadcastStrategy`).
        """
        check_transport(transport, cls.__name__)
        manifest = items if isinstance(items, Manifest) else Manifest.from_items(items)
        request = LoaderRequest(reader, manifest, ledger, world, options, worker_layout, prefetch_items)
        dataset, sampler = cls._parts(request)
        return cls(dataset, sampler, options, track=track, transport=transport)

    @classmethod
    def _parts(cls, request: LoaderRequest) -> tuple[Any, Any]:
        """The dataset the workers index and the sampler that plans their tasks."""
        r = request
        check_blocks(r.manifest, r.options.batch_size)
        dataset = PlannedBatches(r.reader, r.manifest, seed=r.ledger.seed, world=r.world, options=r.options)
        shuffle = r.options.shuffle
        orders = partial(r.manifest.order, shuffle=shuffle)
        return dataset, PlanSampler.of(r.ledger, r.world, r.options, r.worker_layout, orders)

    def __iter__(self) -> Iterator[Any]:
        self._yielded = 0
        self.batches_before_plan = 0
        self.delivered.clear()
        self.sampler.delivered = RangeSet()
        while True:
            loader = self._loader
            starts = loader.num_workers > 0 and not (loader.persistent_workers and loader._iterator is not None)
            method = start_method(self._options.multiprocessing_context)
            # Workers that wait on imports before they run (spawned, or a forkserver's first): the reader
            # may fetch their first batches in the meantime (Reader.first_reads).
            ahead = starts and slow_to_start(method)
            self.sampler.on_plan = self._dataset.fetch_first if ahead else None
            try:
                batches = passes(loader)  # the workers start here, each with the reader's state
            finally:
                self.sampler.on_plan = None
                self._dataset.reader.drop_first_reads()
            if starts:
                note_started(method)
            for delivery in self._guarded(batches):
                if self._pool is not None:
                    delivery = delivery._replace(batch=self._pool.unpack(delivery.batch))
                if delivery.generation < self.sampler.generation:
                    continue  # prepared ahead under a plan a decision replaced: never delivered (its slot goes free)
                self._yielded += 1
                yield self.delivered.accept(delivery, self.sampler.epoch)
            if self.sampler.dealt == self.sampler.generation:
                return
            # A decision replanned the pass after the DataLoader had taken the old plan's last task: one
            # more pass of the DataLoader deals the new plan's (the same plan: nothing else changed).

    def decision_point(self) -> tuple[int, int]:
        """``(position, batches)``: the first epoch position of the current pass no rank has delivered
        (every rank yielded ``batches`` under the plan), from which a decision made now holds; the
        epoch's total when the rest of the epoch cannot change any more (see :func:`delivered_positions`)."""
        plan = self.sampler.epoch_plan
        if plan is None:
            return 0, 0
        return delivered_positions(plan, self._yielded)[1], self._yielded

    def switch_order(self, manifest: Manifest, *, now: bool) -> None:
        """Order epochs by ``manifest``'s (a decision changed it from :meth:`decision_point` on). ``now``:
        the rest of this pass is planned again without the positions delivered already; what the
        workers prepared ahead under the old plan is dropped when it arrives. Else from the next epoch
        (this one's order is the same). The workers learn the new order from their next task."""
        delivered = None
        if now:
            assert self.sampler.epoch_plan is not None
            delivered, _ = delivered_positions(self.sampler.epoch_plan, self._yielded)
            self.batches_before_plan += self._yielded
            self._yielded = 0
        self._dataset.manifest = manifest  # loading in this process, and workers started from now on
        self._dataset.reorder()
        change = manifest.epochs.for_tasks()  # type: ignore[union-attr]  # a ControlledMixture's decisions
        self.sampler.switch(change, partial(manifest.order, shuffle=self._options.shuffle), delivered)

    def _guarded(self, iterator: Iterator[Delivery]) -> Iterator[Delivery]:
        """The DataLoader iterator's output; a dead worker is re-raised naming this rank, the worker and its pid."""
        self._iterator = iterator
        watch(iterator, self.sampler.world.rank)
        try:
            yield from iterator
        except Exception as err:
            reraise_if_dead(
                self.helper_processes, self.sampler.world.rank, iterator, err, "the training process waited for batches"
            )
            raise

    def close(self) -> None:
        """Stop the worker processes now (teardown, a dead worker) rather than when garbage collected."""
        stop_workers(self._iterator)
        if self._pool is not None:
            self._pool.close()
        self._iterator = None
        self._loader._iterator = None  # persistent workers: the next pass must start new ones, not reuse these

    def helper_processes(self) -> dict[str, Any]:
        """This rank's worker processes (``.pid``, ``.exitcode``) by name: ``"DataLoader worker 0"``..."""
        return worker_processes(self._iterator)


_pin_memory: Any = _torch_pin_memory  # (untyped in PyTorch)


def passes(loader: DataLoader[Any]) -> Iterator[Any]:
    """One pass of ``loader`` (a DataLoader over a map-style dataset, its sampler, ``batch_size=None``):
    its own iterator with workers; at 0 workers the same steps in a plain loop, as PyTorch's
    single-process iterator takes them (the sampler's iterator and one draw from torch's random
    generator when the pass starts, then each task's item, collated, pinned with ``pin_memory`` where
    there is an accelerator), less its frame around each batch: a profiler range, the fetcher and
    its checks, about 25 us a batch (of the 150 a packed batch of 8 x 2048 tokens takes)."""
    if loader.num_workers > 0 or loader.batch_size is not None:
        return iter(loader)
    tasks = iter(loader.sampler)
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)  # PyTorch's iterator's base seed
    return _in_process(loader, tasks, bool(loader.pin_memory) and torch.cuda.is_available())


def _in_process(loader: DataLoader[Any], tasks: Iterator[Any], pin: bool) -> Iterator[Any]:
    dataset, collate = loader.dataset, loader.collate_fn
    for task in tasks:
        batch = collate(dataset[task])
        yield _pin_memory(batch) if pin else batch


@register_strategy
class ShardStrategy(Strategy):
    """Each DataLoader worker reads its own run of the rank's batches; bad samples may be skipped.

    Args:
        transport: how DataLoader workers hand batches over: ``"pool"`` (a few reusable shared-memory
            slots per worker, one copy per batch; see ``strategies/_slots.py``) or ``"torch"``
            (PyTorch's own path, a new shared-memory file per tensor per batch).
    """

    name = "shard"

    @classmethod
    @override
    def refusal(cls, setting: str, value: Any) -> str | None:
        # Every option applies, batch_transform and on_error="skip" too; a mixture of any composition,
        # packed sequences (its workers' PlannedBatches hand a packing reader the order's positions) and
        # a MixtureController's replans (ShardedLoader.switch_order deals the new plan's tasks).
        if setting == "streams" and value not in COMPOSITIONS:
            return f"plans only {list(COMPOSITIONS)} batches"
        return None if setting != "even_batches" else super().refusal(setting, value)

    def __init__(self, *, transport: Transport = "pool") -> None:
        check_transport(transport, type(self).__name__)
        self.transport: Transport = transport

    @override
    def settings(self) -> dict[str, Any]:
        return {"transport": self.transport}

    @override
    def build(
        self, data: Any, manifest: Manifest, ledger: Ledger, world: World, options: LoaderOptions, *, track: bool
    ) -> ShardedLoader:
        layout = self.worker_layout
        return ShardedLoader.build(
            data,
            manifest,
            ledger,
            world=world,
            options=options,
            track=track,
            worker_layout=layout,
            transport=self.transport,
        )
