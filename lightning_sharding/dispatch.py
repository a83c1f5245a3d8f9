"""The ``dispatch`` strategy on the training side: one dispatch process per rank, workers transform.

Layout of one rank::

    source --(dispatch process: read, deal batch i to worker i % W)--> bounded queue per worker
           --(DataLoader worker: per-sample transform, collate)--> training process (provenance
           stripped, kept for the ledger, as in ShardedLoader)

Every new iterator is a new *generation*. The training process first lets the DataLoader finish
the old generation's tasks (persistent workers) or shuts the old workers down, then announces the
new generation to the dispatcher, which abandons the old one even while blocked on a full queue.
Workers drop messages of older generations, so nothing of one epoch is served in another and the
reset cannot deadlock. With ``num_workers=0`` the same dealing runs in the training process.
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import queue
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate, get_worker_info

from lightning_sharding._distributed import all_true, cpu_group, gather_counts
from lightning_sharding.dispatcher import POLL_SECONDS, Chunk, End, Failure, SourceError, Spec, deal, failure_message
from lightning_sharding.dispatcher import run_dispatcher as _run_dispatcher
from lightning_sharding.ledger import Ledger
from lightning_sharding.loader import Provenance, SampleError, Transform, flag_padding, pop_delivered, seed_rngs
from lightning_sharding.plan import EpochPlan, plan_epoch
from lightning_sharding.processes import how_it_ended, reraise_if_dead, watch, worker_processes
from lightning_sharding.sources import Source
from lightning_sharding.world import SampleContext, ShardContext, World

DISPATCH_EVEN_BATCHES = ("pad", "drop", "sync")
_EMPTY = np.empty(0, dtype=np.int64)


class DispatchError(RuntimeError):
    """A rank's dispatch process died or its source failed."""


@dataclass(frozen=True)
class DispatchTask:
    """What the training process asks a worker for: batch ``index`` of ``generation``."""

    generation: int
    epoch: int
    index: int


@dataclass(frozen=True)
class SyncOutcome:
    """How an epoch under ``even_batches="sync"`` ended (the fields the epoch report reads).

    ``dropped_per_rank`` (shape ``(world_size,)``) counts samples a rank had fetched but did not
    serve because another rank ran out first; they stay unconsumed in the ledger.
    """

    num_batches: int
    padding_per_rank: npt.NDArray[np.int64]
    dropped_per_rank: npt.NDArray[np.int64]


class DispatchSampler(Sampler[DispatchTask]):
    """The tasks of the current generation; also the ``sampler`` Lightning calls ``set_epoch`` on."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.generation = 0
        self.num_batches: int | None = None  # None: as many as the source has (policy sync)
        self.epoch_plan: EpochPlan | SyncOutcome | None = None

    @property
    def epoch(self) -> int:
        """The epoch being served."""
        return self.ledger.epoch

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at every epoch start: a new epoch starts with nothing consumed."""
        self.ledger.start_epoch(epoch)

    def __iter__(self) -> Iterator[DispatchTask]:
        indices = itertools.count() if self.num_batches is None else range(self.num_batches)
        return (DispatchTask(self.generation, self.epoch, i) for i in indices)


def make_batch(chunk: Chunk, ctx: ShardContext, transform: Transform | None, collate_fn: Callable[..., Any]) -> Any:
    """Transform every element of ``chunk`` (with its :class:`SampleContext`) and collate them."""
    elements = chunk.elements
    if transform is not None:
        elements = [_transform(transform, e, ctx, p) for e, p in zip(elements, chunk.positions.tolist(), strict=True)]
    try:
        return collate_fn(elements)
    except Exception as err:
        raise SampleError(
            f"rank {ctx.rank}, worker {ctx.worker_id}: collate_fn failed on the batch of positions "
            f"{chunk.positions.tolist()} (epoch {ctx.epoch}): {type(err).__name__}: {err}"
        ) from err


def _transform(transform: Transform, element: Any, ctx: ShardContext, position: int) -> Any:
    try:
        return transform(element, SampleContext(ctx, position, 0, position))
    except Exception as err:
        raise SampleError(
            f"rank {ctx.rank}, worker {ctx.worker_id}: the transform failed on the element at position {position} "
            f"of epoch {ctx.epoch}: {type(err).__name__}: {err}. Fix the source's data or the transform "
            "(strategy 'dispatch' cannot skip elements)."
        ) from err


class DispatchedBatches(Dataset[tuple[str, int, npt.NDArray[np.int64], int, Any]]):
    """Runs in each worker: takes the next batch of its own queue, transforms and collates it.

    Returns ``(kind, epoch, positions, num_padding, batch)``, kind ``"batch"`` or ``"end"``.
    """

    def __init__(
        self,
        queues: list[Any],
        alive: Any,
        *,
        world: World,
        num_workers: int,
        seed: int,
        transform: Transform | None,
        collate_fn: Callable[..., Any],
        source_name: str,
        dispatcher_pid: int,
    ) -> None:
        self.queues, self.alive = queues, alive
        self.world, self.num_workers, self.seed = world, num_workers, seed
        self.transform, self.collate_fn = transform, collate_fn
        self.source_name, self.dispatcher_pid = source_name, dispatcher_pid
        self._ended = -1  # the generation whose End this worker has seen
        self._stash: Chunk | End | Failure | None = None
        self._context: ShardContext | None = None

    def __len__(self) -> int:
        raise TypeError("DispatchedBatches is indexed by DispatchTask and has no length")

    def _worker_context(self, epoch: int) -> ShardContext:
        if self._context is None or self._context.epoch != epoch:
            info = get_worker_info()
            self._context = ShardContext(
                self.world.rank, self.world.world_size, info.id if info else 0, self.num_workers, epoch, self.seed
            )
            if info is not None:  # never reseed the training process itself (num_workers=0)
                seed_rngs(self._context.worker_seed)
        return self._context

    def __getitem__(self, task: DispatchTask) -> tuple[str, int, npt.NDArray[np.int64], int, Any]:
        ctx = self._worker_context(task.epoch)
        message = self._next(task, ctx.worker_id)
        if isinstance(message, End):
            return "end", task.epoch, _EMPTY, 0, None
        if message.index != task.index:
            raise RuntimeError(
                f"rank {self.world.rank} worker {ctx.worker_id} got batch {message.index} for task {task.index}; "
                "this is a bug in lightning_sharding, please report it"
            )
        batch = make_batch(message, ctx, self.transform, self.collate_fn)
        return "batch", task.epoch, message.positions, message.num_padding, batch

    def _next(self, task: DispatchTask, worker: int) -> Chunk | End:
        if self._ended == task.generation:
            return End(task.generation)
        if self._stash is not None and self._stash.generation == task.generation:
            message, self._stash = self._stash, None
        else:
            message = self._receive(task, worker)
        if message.generation > task.generation:  # a task of an abandoned generation: keep the message
            self._stash = message
            return End(task.generation)
        if isinstance(message, Failure):
            raise SourceError(message.message)
        if isinstance(message, End):
            self._ended = task.generation
        return message

    def _receive(self, task: DispatchTask, worker: int) -> Chunk | End | Failure:
        while True:
            try:
                message = pickle.loads(self.queues[worker].get(timeout=POLL_SECONDS))
            except queue.Empty:
                # The dispatcher holds the other end of `alive` open until it exits.
                if self.alive.poll():
                    raise DispatchError(
                        f"rank {self.world.rank}: the dispatch process (pid {self.dispatcher_pid}) reading "
                        f"{self.source_name} died while DataLoader worker {worker} waited for batch {task.index} "
                        f"of epoch {task.epoch} (killed, or out of memory?)"
                    ) from None
                continue
            if message.generation >= task.generation:
                return message  # type: ignore[no-any-return]


class DispatchLoader:
    """The iterable Lightning gets for one rank under ``strategy="dispatch"``.

    Same contract as :class:`~lightning_sharding.loader.ShardedLoader`: batches with provenance
    stripped (kept in ``delivered`` when ``track``), padding flagged, ``sampler.set_epoch``.
    Call :meth:`close` to stop the dispatch process (the datamodule does at teardown).
    """

    def __init__(
        self,
        source: Source,
        ledger: Ledger,
        *,
        world: World,
        batch_size: int,
        num_workers: int = 0,
        even_batches: str = "pad",
        transform: Transform | None = None,
        collate_fn: Callable[..., Any] = default_collate,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        multiprocessing_context: str | None = None,
        timeout: float = 0,
        padding_key: str | None = "is_padding",
        track: bool = False,
        queue_size: int = 4,
    ) -> None:
        if even_batches not in DISPATCH_EVEN_BATCHES:
            raise ValueError(f"even_batches={even_batches!r} must be one of {list(DISPATCH_EVEN_BATCHES)}")
        length = source.length()
        if length is None and even_batches != "sync":
            raise ValueError(
                f"{source.describe()} has no known length (length() is None), so the ranks cannot plan equal "
                f"batch counts with even_batches={even_batches!r}; use even_batches='sync'"
            )
        if queue_size < 1:
            raise ValueError(f"DispatchLoader(queue_size={queue_size}) must be at least 1")
        self.source, self.ledger, self.world = source, ledger, world
        self.batch_size, self.num_workers, self.even_batches = batch_size, num_workers, even_batches
        self.transform, self.collate_fn = transform, collate_fn
        self.padding_key, self.track = padding_key, track
        self.queue_size = queue_size
        self._options = dict(
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            pin_memory=pin_memory,
            timeout=timeout,
        )
        self._start_method = multiprocessing_context or "spawn"
        self.sampler = DispatchSampler(ledger)
        self.batch_sampler = None  # Lightning's evaluation loop reads it off any loader with a sampler
        self.delivered: deque[Provenance] = deque()
        self._group = cpu_group(world.world_size) if even_batches == "sync" else None
        self._process: Any = None
        self._loader: DataLoader[Any] | None = None
        self._iterator: Any = None
        self._control: Any = None
        self._pending_commit: tuple[int, int] | None = None
        if num_workers > 0:
            _check_picklable(source=source, transform=transform, collate_fn=collate_fn)

    def pop_delivered(self) -> Provenance:
        """Provenance of the oldest delivered batch whose step has not been accounted yet."""
        return pop_delivered(self.delivered)

    @property
    def sync(self) -> bool:
        """Whether ranks agree every step that all still have data (policy ``sync``)."""
        return self.even_batches == "sync"

    def _spec(self) -> Spec:
        ledger, world = self.ledger, self.world
        ctx = ShardContext(world.rank, world.world_size, 0, self.num_workers, ledger.epoch, ledger.seed)
        plan = None
        self.sampler.epoch_plan, self.sampler.num_batches = None, None
        if not self.sync:
            epoch_plan = plan_epoch(
                ledger.total,
                ledger.done,
                epoch=ledger.epoch,
                world_size=world.world_size,
                num_workers=self.num_workers,
                batch_size=self.batch_size,
                even_batches=self.even_batches,  # type: ignore[arg-type]  # "pad" or "drop" here
            )
            plan = epoch_plan.rank(world.rank)
            self.sampler.epoch_plan, self.sampler.num_batches = epoch_plan, plan.num_batches
        self.sampler.generation += 1
        return Spec(self.sampler.generation, ctx, self.batch_size, plan, ledger.done)

    def __iter__(self) -> Iterator[Any]:
        self.delivered.clear()
        spec = self._spec()
        results = self._from_workers(spec) if self.num_workers > 0 else self._in_process(spec)
        served = 0
        for result in results:
            if self.sync and not all_true(result is not None, self._group):
                self._stop_sync(result, served)
                return
            if result is None:
                return
            epoch, positions, num_padding, batch = result
            if epoch != self.sampler.epoch:
                raise RuntimeError(
                    f"a batch of epoch {epoch} arrived in epoch {self.sampler.epoch}; "
                    "this is a bug in lightning_sharding, please report it"
                )
            if self.track:
                self.delivered.append(Provenance(epoch, positions, num_padding))
            served += 1
            yield flag_padding(batch, len(positions), num_padding, self.padding_key)

    def _stop_sync(self, result: tuple[int, npt.NDArray[np.int64], int, Any] | None, served: int) -> None:
        unserved = 0 if result is None else len(result[1]) - result[2]
        counts = np.array(gather_counts(unserved, self._group), dtype=np.int64)
        self.sampler.epoch_plan = SyncOutcome(served, np.zeros_like(counts), counts)
        if counts.any() and self.world.rank == 0:
            warnings.warn(
                f"even_batches='sync': a rank ran out of data after {served} batches, so every rank stopped; "
                f"samples fetched but not served per rank: {counts.tolist()} (they stay unconsumed, and the "
                "sources of the ranks that still had data were not read to their end)",
                stacklevel=2,
            )

    def _in_process(self, spec: Spec) -> Iterator[tuple[int, npt.NDArray[np.int64], int, Any] | None]:
        messages = deal(self.source, spec)
        while True:
            try:
                message = next(messages)
            except StopIteration:
                return
            except Exception as err:  # noqa: BLE001 - reported with the rank and the source
                raise SourceError(failure_message(spec.ctx, self.source, err)) from err
            if isinstance(message, End):
                yield None
                return
            batch = make_batch(message, spec.ctx, self.transform, self.collate_fn)
            yield spec.ctx.epoch, message.positions, message.num_padding, batch

    def _from_workers(self, spec: Spec) -> Iterator[tuple[int, npt.NDArray[np.int64], int, Any] | None]:
        loader = self._start()
        if self._iterator is not None and self._options["persistent_workers"]:
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
            for kind, epoch, positions, num_padding, batch in self._iterator:
                yield None if kind == "end" else (epoch, positions, num_padding, batch)
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
        mp: Any = multiprocessing.get_context(self._start_method)
        queues = [mp.Queue(maxsize=self.queue_size) for _ in range(self.num_workers)]
        self._control = mp.Queue()
        alive_r, alive_w = mp.Pipe(duplex=False)
        self._process = mp.Process(
            target=_run_dispatcher,
            args=(self.source, self._control, queues, alive_w),
            daemon=True,
            name=f"lightning_sharding-dispatcher-rank{self.world.rank}",
        )
        self._process.start()
        alive_w.close()  # only the dispatcher holds it now: its exit is end-of-file for the workers
        dataset = DispatchedBatches(
            queues,
            alive_r,
            world=self.world,
            num_workers=self.num_workers,
            seed=self.ledger.seed,
            transform=self.transform,
            collate_fn=self.collate_fn,
            source_name=self.source.describe(),
            dispatcher_pid=self._process.pid,
        )
        self._loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=self.sampler,
            num_workers=self.num_workers,
            collate_fn=_pass_through,
            multiprocessing_context=mp,
            **self._options,  # type: ignore[arg-type]
        )
        return self._loader

    def helper_processes(self) -> dict[str, Any]:
        """This rank's dispatch process and DataLoader workers (``.pid``, ``.exitcode``) by name."""
        found = {} if self._process is None else {"dispatch process": self._process}
        return {**found, **worker_processes(self._iterator)}

    def note_checkpoint(self) -> None:
        """A checkpoint is being written with the ledger as it is now: commit it once it is saved."""
        consumed = self.ledger.consumed
        watermark = int(consumed.ends[0]) if consumed and int(consumed.starts[0]) == 0 else 0
        self._pending_commit = (watermark, self.ledger.epoch)

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


def _pass_through(data: Any) -> Any:
    return data


def _check_picklable(**objects: Any) -> None:
    for name, obj in objects.items():
        try:
            pickle.dumps(obj)
        except Exception as err:  # noqa: BLE001 - any pickling failure means the same thing here
            raise TypeError(
                f"the {name} {obj!r} cannot be pickled into the dispatch process and the DataLoader workers ({err}). "
                "Define it at module level (not inside a function or as a lambda), and keep open handles out of "
                "it (open them in Source.open), or use num_workers=0."
            ) from err
