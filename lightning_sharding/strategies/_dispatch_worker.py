"""The worker side of strategy ``dispatch``: tasks by generation, batches from the worker's own queue.

Every new iterator is a new *generation*. Workers drop messages of older generations, so nothing
of one epoch is served in another; a worker that meets a message of a newer generation keeps it
for its next task.
"""

from __future__ import annotations

import itertools
import pickle
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from torch.utils.data import Dataset, Sampler

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.plan import EpochPlan
from lightning_sharding.core.world import SampleContext, WorkerContext, World
from lightning_sharding.strategies._delivery import NO_POSITIONS, Delivery
from lightning_sharding.strategies._dispatch_process import POLL_SECONDS, Chunk, End, Failure, SourceError
from lightning_sharding.strategies._samples import SampleError
from lightning_sharding.strategies._worker import WorkerContexts
from lightning_sharding.strategies.options import LoaderOptions, Transform


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


def make_batch(chunk: Chunk, ctx: WorkerContext, transform: Transform | None, collate_fn: Callable[..., Any]) -> Any:
    """Transform every element of ``chunk`` (with its :class:`SampleContext`) and collate them."""
    elements = chunk.elements
    if transform is not None:
        elements = [_transform(transform, e, ctx, p) for e, p in zip(elements, chunk.positions.tolist(), strict=True)]
    try:
        return collate_fn(elements)
    except Exception as err:
        raise SampleError(
            f"rank {ctx.data_rank}, worker {ctx.worker_id}: collate_fn failed on the batch of positions "
            f"{chunk.positions.tolist()} (epoch {ctx.epoch}): {type(err).__name__}: {err}"
        ) from err


def _transform(transform: Transform, element: Any, ctx: WorkerContext, position: int) -> Any:
    try:
        return transform(element, SampleContext(ctx, position, 0, position))
    except Exception as err:
        raise SampleError(
            f"rank {ctx.data_rank}, worker {ctx.worker_id}: the transform failed on the element at position {position} "
            f"of epoch {ctx.epoch}: {type(err).__name__}: {err}. Fix the source's data or the transform "
            "(strategy 'dispatch' cannot skip elements)."
        ) from err


class DispatchedBatches(Dataset[Delivery]):
    """Runs in each worker: takes the next batch of its own queue, transforms and collates it.

    Returns a :class:`Delivery`; one with ``end`` set when the source has no more batches.
    """

    def __init__(
        self,
        queues: list[Any],
        alive: Any,
        *,
        world: World,
        seed: int,
        options: LoaderOptions,
        source_name: str,
        dispatcher_pid: int,
    ) -> None:
        self.queues = queues
        self.alive = alive
        self.world = world
        self.transform = options.transform
        self.collate_fn = options.collate_fn
        self.source_name = source_name
        self.dispatcher_pid = dispatcher_pid
        self.context = WorkerContexts(world, options.num_workers, seed)
        self._ended = -1  # the generation whose End this worker has seen
        self._stash: Chunk | End | Failure | None = None

    def __len__(self) -> int:
        raise TypeError("DispatchedBatches is indexed by DispatchTask and has no length")

    def __getitem__(self, task: DispatchTask) -> Delivery:
        ctx = self.context(task.epoch)
        message = self._next(task, ctx.worker_id)
        if isinstance(message, End):
            return Delivery(None, task.epoch, NO_POSITIONS, 0, end=True)
        if message.index != task.index:
            raise RuntimeError(
                f"rank {self.world.rank} worker {ctx.worker_id} got batch {message.index} for task {task.index}; "
                "this is a bug in lightning_sharding, please report it"
            )
        batch = make_batch(message, ctx, self.transform, self.collate_fn)
        return Delivery(batch, task.epoch, message.positions, message.num_padding)

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
