"""Strategy ``dispatch`` on the training side: one dispatch process per rank, workers transform.

Layout of one rank::

    source --(dispatch process: read, deal batch i to worker i % W)--> bounded queue per worker
           --(DataLoader worker: per-sample transform, collate)--> training process (provenance
           stripped, kept for the ledger, as in every strategy)

Every new iterator is a new *generation*. The training process first lets the DataLoader finish
the old generation's tasks (persistent workers) or shuts the old workers down, then announces the
new generation to the dispatcher, which abandons the old one even while blocked on a full queue.
Workers drop messages of older generations, so nothing of one epoch is served in another and the
reset cannot deadlock. With ``num_workers=0`` the same dealing runs in the training process.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.spelling import option
from lightning_sharding.core.world import WorkerContext, World
from lightning_sharding.distributed.collectives import all_true, cpu_group, gather_counts
from lightning_sharding.readers.sources import Source, source_manifest
from lightning_sharding.strategies._delivery import NO_POSITIONS, DeliveredLog, Delivery
from lightning_sharding.strategies._dispatch_process import End, SourceError, Spec, deal, failure_message
from lightning_sharding.strategies._dispatch_process import run_dispatcher as _run_dispatcher
from lightning_sharding.strategies._dispatch_worker import (
    DispatchedBatches,
    DispatchError,
    DispatchSampler,
    SyncOutcome,
    make_batch,
)
from lightning_sharding.strategies._helper_deaths import how_it_ended, reraise_if_dead, watch, worker_processes
from lightning_sharding.strategies._start import leave_forkserver, note_started, start_method, worker_context
from lightning_sharding.strategies._worker import check_picklable, pass_through
from lightning_sharding.strategies.base import Strategy, TrainLoader, register_strategy
from lightning_sharding.strategies.options import DEFAULT_OPTIONS, LoaderOptions
from lightning_sharding.strategies.shard import ShardStrategy


class DispatchLoader(TrainLoader[DispatchSampler]):
    """The iterable Lightning gets for one rank under ``sharding="dispatch"``.

    Same contract as :class:`~lightning_sharding.strategies.shard.ShardedLoader`: batches with provenance
    stripped (kept in ``delivered`` when ``track``), padding flagged, ``sampler.set_epoch``.
    Call :meth:`close` to stop the dispatch process (the datamodule does at teardown).
    """

    def __init__(
        self,
        source: Source,
        ledger: Ledger,
        *,
        world: World,
        options: LoaderOptions = DEFAULT_OPTIONS,
        track: bool = False,
        queue_size: int = 4,
    ) -> None:
        DispatchStrategy().check(options, source, owner="DispatchLoader")
        if source.length() is None and options.even_batches != "sync":
            raise ValueError(
                f"{source.describe()} has no known length (length() is None), so the ranks cannot plan equal "
                f"batch counts with even_batches={options.even_batches!r}; use {option('even_batches', 'sync')}"
            )
        if queue_size < 1:
            raise ValueError(f"DispatchLoader(queue_size={queue_size}) must be at least 1")
        self.source = source
        self.ledger = ledger
        self.world = world
        self.options = options
        self.queue_size = queue_size
        self._start_method = options.multiprocessing_context
        self.sampler = DispatchSampler(ledger)
        self.delivered = DeliveredLog(padding_key=options.padding_key, track=track, pin_memory=options.pin_memory)
        self._group = cpu_group(world.world_size) if self.sync else None
        self._process: Any = None
        self._loader: DataLoader[Any] | None = None
        self._iterator: Any = None
        self._control: Any = None
        self._pending_commit: tuple[int, int] | None = None
        if options.num_workers > 0:
            check_picklable(
                "the dispatch process and the DataLoader workers",
                ", and keep open handles out of it (open them in Source.open)",
                source=source,
                transform=options.transform,
                batch_transform=options.batch_transform,
                collate_fn=options.collate_fn,
            )

    @property
    def sync(self) -> bool:
        """Whether ranks agree every step that all still have data (policy ``sync``)."""
        return self.options.even_batches == "sync"

    def _spec(self) -> Spec:
        ledger = self.ledger
        world = self.world
        ctx = WorkerContext(world.data_rank, world.data_size, 0, self.options.num_workers, ledger.epoch, ledger.seed)
        plan = None
        self.sampler.epoch_plan, self.sampler.num_batches = None, None
        if not self.sync:
            epoch_plan = plan_epoch(
                ledger.total,
                ledger.settled,
                epoch=ledger.epoch,
                world_size=world.data_size,
                num_workers=self.options.num_workers,
                batch_size=self.options.batch_size,
                even_batches=self.options.even_batches,  # type: ignore[arg-type]  # "pad" or "drop" here
            )
            plan = epoch_plan.rank(world.data_rank)
            self.sampler.epoch_plan, self.sampler.num_batches = epoch_plan, plan.num_batches
        self.sampler.generation += 1
        return Spec(self.sampler.generation, ctx, self.options.batch_size, plan, ledger.settled)

    def __iter__(self) -> Iterator[Any]:
        self.delivered.clear()
        spec = self._spec()
        results = self._from_workers(spec) if self.options.num_workers > 0 else self._in_process(spec)
        served = 0
        for delivery in results:
            if self.sync and not all_true(not delivery.end, self._group):
                self._stop_sync(delivery, served)
                return
            if delivery.end:
                return
            served += 1
            yield self.delivered.accept(delivery, self.sampler.epoch)

    def _stop_sync(self, delivery: Delivery, served: int) -> None:
        unserved = 0 if delivery.end else len(delivery.positions) - delivery.num_padding
        counts = np.array(gather_counts(unserved, self._group), dtype=np.int64)
        if self.world.replica_size > 1:  # the ranks of a replica fetched alike: count each replica once
            data_ranks = gather_counts(self.world.data_rank, self._group)
            first = {d: i for i, d in reversed(list(enumerate(data_ranks)))}
            counts = counts[[first[d] for d in range(self.world.data_size)]]
        self.sampler.epoch_plan = SyncOutcome(served, np.zeros_like(counts), counts)
        if counts.any() and self.world.rank == 0:
            warnings.warn(
                f"even_batches='sync': a rank ran out of data after {served} batches, so every rank stopped; "
                f"samples fetched but not served per rank: {counts.tolist()} (they stay unconsumed, and the "
                "sources of the ranks that still had data were not read to their end)",
                stacklevel=2,
            )

    def _in_process(self, spec: Spec) -> Iterator[Delivery]:
        messages = deal(self.source, spec)
        while True:
            try:
                message = next(messages)
            except StopIteration:
                return
            except Exception as err:  # noqa: BLE001 - reported with the rank and the source
                raise SourceError(failure_message(spec.ctx, self.source, err)) from err
            if isinstance(message, End):
                yield Delivery(None, spec.ctx.epoch, NO_POSITIONS, 0, end=True)
                return
            batch = make_batch(message, spec.ctx, self.options.transform, self.options.collate_fn)
            yield Delivery(batch, spec.ctx.epoch, message.positions, message.num_padding)

    def _from_workers(self, spec: Spec) -> Iterator[Delivery]:
        loader = self._start()
        if self._iterator is not None and self.options.persistent_workers:
            # iter() first lets the persistent workers finish the old generation's tasks (the
            # dispatcher still serves it); only then may the dispatcher move on.
            self._iterator = iter(loader)
            self._control.put(spec)
        else:
            # Old workers may still hold tasks of the old generation: stop them before the
            # dispatcher moves on, or they would take the new generation's batches.
            shutdown = getattr(self._iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._control.put(spec)  # before iter(): the source opens while workers start
            self._iterator = iter(loader)
        watch(self._iterator, self.world.rank)
        try:
            yield from self._iterator
        except Exception as err:
            code = self._process.exitcode
            if code is None or code == 0:
                helpers = self.helper_processes
                reraise_if_dead(
                    helpers, self.world.rank, self._iterator, err, "the training process waited for batches"
                )
                raise
            raise DispatchError(
                f"rank {self.world.rank}: the dispatch process (pid {self._process.pid}) reading "
                f"{self.source.describe()} {how_it_ended(code)}; training cannot continue without it"
            ) from err

    def _start(self) -> DataLoader[Any]:
        if self._loader is not None:
            if self._process.exitcode is not None:
                raise DispatchError(
                    f"rank {self.world.rank}: the dispatch process reading {self.source.describe()} "
                    f"is gone (exit code {self._process.exitcode})"
                )
            return self._loader
        mp: Any = worker_context(self._start_method, self.source, self.options.transform, self.options.collate_fn)
        queues = [mp.Queue(maxsize=self.queue_size) for _ in range(self.options.num_workers)]
        self._control = mp.Queue()
        alive_r, alive_w = mp.Pipe(duplex=False)
        self._process = mp.Process(
            target=_run_dispatcher,
            args=(self.source, self._control, queues, alive_w),
            daemon=True,
            name=f"lightning_sharding-dispatcher-rank{self.world.rank}",
        )
        self._process.start()
        note_started(start_method(self._start_method))  # a forkserver's imports are done from now on
        alive_w.close()  # only the dispatcher holds it now: its exit is end-of-file for the workers
        dataset = DispatchedBatches(
            queues,
            alive_r,
            world=self.world,
            seed=self.ledger.seed,
            options=self.options,
            source_name=self.source.describe(),
            dispatcher_pid=self._process.pid,
        )
        self._loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=self.sampler,
            num_workers=self.options.num_workers,
            collate_fn=pass_through,
            worker_init_fn=leave_forkserver,
            multiprocessing_context=mp,
            **self.options.dataloader_kwargs(),
        )
        return self._loader

    def helper_processes(self) -> dict[str, Any]:
        """This rank's dispatch process and DataLoader workers (``.pid``, ``.exitcode``) by name."""
        found = {} if self._process is None else {"dispatch process": self._process}
        return {**found, **worker_processes(self._iterator)}

    def note_checkpoint(self, ledger: Ledger) -> None:
        """A checkpoint is being written with ``ledger`` as it is now: commit it once it is saved."""
        consumed = ledger.consumed
        watermark = int(consumed.ends[0]) if consumed and int(consumed.starts[0]) == 0 else 0
        self._pending_commit = (watermark, ledger.epoch)

    def flush_commit(self) -> None:
        """Tell the source the position of the last saved checkpoint (see :meth:`Source.commit`)."""
        if self._pending_commit is not None:
            position, epoch = self._pending_commit
            self._pending_commit = None
            self.source.commit(position, epoch=epoch)

    def close(self) -> None:
        """Stop the workers and the dispatch process."""
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iterator = None
        if self._process is not None and self._process.is_alive():
            self._control.put(None)
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join()


@register_strategy
class DispatchStrategy(Strategy):
    """One dispatch process per rank reads a non-replicable source and deals batches to the workers."""

    name = "dispatch"
    takes = "source"
    shuffles = False

    @classmethod
    @override
    def refusal(cls, setting: str, value: Any) -> str | None:
        if setting == "even_batches" and value == "sync":  # the ranks end an epoch together (see deal)
            return None
        if setting == "on_error" and value != "raise":
            return "cannot skip a sample: an element of a source cannot be read again to fill its place"
        return super().refusal(setting, value)

    @override
    def manifest(self, data: Any, batch_size: int | None = None) -> Manifest:
        return source_manifest(data)

    @override
    def build(
        self, data: Any, manifest: Manifest, ledger: Ledger, world: World, options: LoaderOptions, *, track: bool
    ) -> DispatchLoader:
        return DispatchLoader(data, ledger, world=world, options=options, track=track)

    @override
    def build_eval(self, reader: Any, manifest: Manifest, ledger: Ledger, world: World, options: LoaderOptions) -> Any:
        # Evaluation data comes from readers: they are sharded like strategy "shard".
        evaluation = options.replace(even_batches="pad")
        return ShardStrategy().build_eval(reader, manifest, ledger, world, evaluation)

    @override
    def release(self, loader: TrainLoader | None) -> None:
        # A reloaded train loader starts its own dispatch process: the previous one goes first.
        if loader is not None:
            loader.close()
