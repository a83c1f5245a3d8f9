"""The dispatch process of one rank: it reads the source and deals batches round-robin to workers.

:func:`deal` is the whole dealing scheme as a generator, used as it is in the training process
when there are no workers. :func:`run_dispatcher` is the process: it serves one *generation*
(one iterator of the loader) at a time, stamps every message with it, and abandons a generation
as soon as the training process announces the next one, so workers can drop stale messages and
nothing of an old epoch reaches a new one. Light imports only: no torch, no Lightning.
"""

from __future__ import annotations

import pickle
import queue
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import parent_process
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.plan import RankPlan
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.readers.sources import Source
from lightning_sharding.strategies._start import leave_forkserver

POLL_SECONDS = 0.1  # how often a blocked dispatcher looks for a newer generation or a dead parent


@dataclass(frozen=True)
class Spec:
    """What a dispatcher serves in one generation.

    ``plan`` is set for a source of known length (the rank's batches, equalised across ranks);
    otherwise (policy ``sync``) the rank takes every ``world_size``-th position not in ``consumed``.
    """

    generation: int
    ctx: WorkerContext
    batch_size: int
    plan: RankPlan | None
    consumed: RangeSet


@dataclass(frozen=True)
class Chunk:
    """The raw elements of one batch: ``positions`` int64 of shape ``(n,)``, the last ``num_padding``
    of which repeat a real position; batch ``index`` goes to worker ``index % num_workers``."""

    generation: int
    index: int
    positions: npt.NDArray[np.int64]
    num_padding: int
    elements: list[Any]


@dataclass(frozen=True)
class End:
    """The rank's share of the generation is exhausted."""

    generation: int


@dataclass(frozen=True)
class Failure:
    """The source raised; ``message`` names the rank, the dispatcher and the exception."""

    generation: int
    message: str


Message = Chunk | End | Failure


class SourceError(RuntimeError):
    """The source of a rank's dispatcher raised, or broke its contract."""


class _PositionReader:
    """Reads increasing positions of a source, seeking (reopening) over gaps when it can."""

    def __init__(self, source: Source, ctx: WorkerContext) -> None:
        self.source = source
        self.ctx = ctx
        self._it: Iterator[Any] | None = None
        self._next = 0

    def _open(self, start: int) -> None:
        self._it, self._next = iter(self.source.open(self.ctx, start)), start

    def read(self, position: int) -> Any:
        if self._it is None or position < self._next or (position > self._next and self.source.seekable):
            if self._it is not None and position < self._next and not self.source.seekable:
                raise SourceError(f"{self.source.describe()} cannot seek back to position {position}")
            self._open(position)
        assert self._it is not None
        for _ in range(position - self._next):  # a non-seekable source skips forward
            self._element(position)
        return self._element(position)

    def _element(self, wanted: int) -> Any:
        assert self._it is not None
        try:
            value = next(self._it)
        except StopIteration:
            raise SourceError(
                f"{self.source.describe()} ended at position {self._next} while position {wanted} was planned; "
                "its length() is larger than what open() yields"
            ) from None
        self._next += 1
        return value


def deal(source: Source, spec: Spec) -> Iterator[Chunk | End]:
    """The rank's batches of one generation, in order, then :class:`End`."""
    if spec.plan is not None:
        yield from _deal_planned(source, spec, spec.plan)
    else:
        yield from _deal_synced(source, spec)
    yield End(spec.generation)


def _deal_planned(source: Source, spec: Spec, plan: RankPlan) -> Iterator[Chunk]:
    reader = _PositionReader(source, spec.ctx)
    pad_element: list[Any] = []
    for index in range(plan.num_batches):
        task = plan.batch(index)
        real = task.positions[: len(task.positions) - task.num_padding]
        elements = [reader.read(int(p)) for p in real]
        if task.num_padding:
            if not pad_element:  # padding repeats one real position, read once on its own
                pad_element.append(_PositionReader(source, spec.ctx).read(plan.pad_position))
            elements += pad_element * task.num_padding
        yield Chunk(spec.generation, index, task.positions, task.num_padding, elements)


def _deal_synced(source: Source, spec: Spec) -> Iterator[Chunk]:
    """Unknown length: the k-th position not yet consumed goes to rank ``k % world_size``."""
    consumed = spec.consumed
    ctx = spec.ctx
    start = int(consumed.ends[0]) if consumed and int(consumed.starts[0]) == 0 else 0
    skip_ranges = [(s, e) for s, e in consumed.ranges() if e > start]
    position = start  # of the element at hand
    k = 0  # elements not consumed before seen so far: the k-th goes to rank k % world_size
    index = 0  # of the next chunk
    r = 0  # the first range of skip_ranges not behind position
    positions: list[int] = []
    elements: list[Any] = []
    for element in source.open(ctx, start):
        while r < len(skip_ranges) and skip_ranges[r][1] <= position:
            r += 1
        done = r < len(skip_ranges) and skip_ranges[r][0] <= position
        if not done:
            if k % ctx.data_size == ctx.data_rank:
                positions.append(position)
                elements.append(element)
            k += 1
        position += 1
        if len(positions) == spec.batch_size:
            yield Chunk(spec.generation, index, np.array(positions, dtype=np.int64), 0, elements)
            index, positions, elements = index + 1, [], []
    if positions:
        yield Chunk(spec.generation, index, np.array(positions, dtype=np.int64), 0, elements)


def failure_message(ctx: WorkerContext, source: Source, err: BaseException) -> str:
    """The error text workers raise: the rank, the dispatcher, the source and its exception."""
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return (
        f"rank {ctx.data_rank}: the dispatcher reading {source.describe()} failed in epoch {ctx.epoch}: "
        f"the source raised {type(err).__name__}: {err}\n--- traceback in the dispatch process ---\n{trace}"
    )


def run_dispatcher(source: Source, control: Any, queues: list[Any], alive: Connection) -> None:
    """The dispatch process: serve each generation announced on ``control`` until ``None`` arrives.

    ``queues`` are the workers' bounded queues (pickled messages); ``alive`` is held open for the
    process's lifetime so that workers see its end as end-of-file on the other side.
    """
    leave_forkserver()  # the server then ends with the rank, and this process with the server
    spec: Spec | None = _wait_command(control)
    while spec is not None:
        interrupted, following = _serve(source, spec, control, queues)
        spec = following if interrupted else _wait_command(control)
    for q in queues:  # undelivered batches are of no use now: do not wait at exit to flush them
        q.cancel_join_thread()
    alive.close()


def _parent_gone() -> bool:
    parent = parent_process()
    return parent is not None and not parent.is_alive()


def _wait_command(control: Any) -> Spec | None:
    while True:
        try:
            return control.get(timeout=POLL_SECONDS)  # type: ignore[no-any-return]
        except queue.Empty:
            if _parent_gone():
                return None


class _NewCommand(Exception):
    def __init__(self, spec: Spec | None) -> None:
        self.spec = spec


def _put(q: Any, data: bytes, control: Any) -> None:
    """Put into a bounded queue; while it is full, give way to a newer generation or a dead parent."""
    while True:
        try:
            q.put(data, timeout=POLL_SECONDS)
            return
        except queue.Full:
            try:
                raise _NewCommand(control.get_nowait())
            except queue.Empty:
                pass
            if _parent_gone():
                raise _NewCommand(None) from None


def _serve(source: Source, spec: Spec, control: Any, queues: list[Any]) -> tuple[bool, Spec | None]:
    """Deal one generation; returns ``(True, next command)`` when a command interrupted it."""
    try:
        try:
            for message in deal(source, spec):
                data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
                targets = [queues[message.index % len(queues)]] if isinstance(message, Chunk) else queues
                for q in targets:
                    _put(q, data, control)
        except _NewCommand:
            raise
        except Exception as err:  # noqa: BLE001 - any source failure is reported to the workers
            data = pickle.dumps(Failure(spec.generation, failure_message(spec.ctx, source, err)))
            for q in queues:
                _put(q, data, control)
    except _NewCommand as new:
        return True, new.spec
    return False, None
