"""What every strategy's worker delivers, and the training process's bookkeeping of it.

A worker returns one :class:`Delivery` per batch, whatever the strategy. The training process
checks its epoch, strips the provenance before Lightning sees the batch, flags padding in dict
batches, and keeps the provenance in :class:`DeliveredLog` until the step is accounted.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

Int64Array = npt.NDArray[np.int64]
NO_POSITIONS: Int64Array = np.zeros(0, dtype=np.int64)


class Delivery(NamedTuple):
    """One batch from a worker with its provenance.

    ``positions`` (int64, ``(n,)``) are the batch's epoch positions, the last ``num_padding`` of
    them padding; ``skipped`` (``(k,)``) failed to read under ``on_error="skip"`` and are consumed
    without being in the batch; ``used`` are the items whose shared memory the batch used
    (strategy ``broadcast``); ``end`` marks that the source has no more batches (``batch`` is None);
    ``stats`` are the reader's counters since the worker's previous batch (see ``Reader.take_stats``);
    ``generation`` is the plan's of its task (see :class:`~lightning_sharding.core.plan.BatchTask`).
    """

    batch: Any
    epoch: int
    positions: Int64Array
    num_padding: int
    skipped: Int64Array = NO_POSITIONS
    used: Int64Array = NO_POSITIONS
    end: bool = False
    stats: Mapping[str, float] | None = None
    generation: int = 0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # From a worker to the training process, which unpickles every batch's: the position arrays
        # travel as their bytes, an empty one as None (NumPy's own pickling of three arrays cost the
        # training process about as much as everything else in the Delivery).
        positions, skipped, used = _bytes(self.positions), _bytes(self.skipped), _bytes(self.used)
        return _delivered, (self.batch, self.epoch, positions, skipped, used, self.num_padding, *self[6:])


def _bytes(positions: Int64Array) -> bytes | None:
    return np.ascontiguousarray(positions, dtype=np.int64).tobytes() if len(positions) else None


def _array(raw: bytes | None) -> Int64Array:
    return np.frombuffer(raw, dtype=np.int64).copy() if raw else NO_POSITIONS


def _delivered(
    batch: Any,
    epoch: int,
    positions: bytes | None,
    skipped: bytes | None,
    used: bytes | None,
    num_padding: int,
    end: bool,
    stats: Mapping[str, float] | None,
    generation: int,
) -> Delivery:
    """A :class:`Delivery` as its ``__reduce__`` sent it."""
    return Delivery(batch, epoch, _array(positions), num_padding, _array(skipped), _array(used), end, stats, generation)


class Provenance(NamedTuple):
    """Where a delivered batch came from: epoch positions (int64, shape ``(n,)``), the last
    ``num_padding`` of which are padding, and the positions ``skipped`` (shape ``(k,)``) because
    they failed to read under ``on_error="skip"``; those are consumed but not in the batch."""

    epoch: int
    positions: Int64Array
    num_padding: int
    skipped: Int64Array = NO_POSITIONS

    @property
    def real_positions(self) -> Int64Array:
        """Positions trained on, shape ``(n - num_padding,)``."""
        return self.positions[: len(self.positions) - self.num_padding] if self.num_padding else self.positions

    @property
    def consumed_positions(self) -> Int64Array:
        """Positions that count as consumed once the step completes: trained on or skipped."""
        return np.concatenate((self.real_positions, self.skipped)) if len(self.skipped) else self.real_positions


def flag_padding(batch: Any, size: int, num_padding: int, padding_key: str | None, pin_memory: bool = False) -> Any:
    """``batch`` with a boolean ``padding_key`` entry of shape ``(size,)`` when it is a dict (in pinned
    memory with ``pin_memory``, as the batch's other tensors: a copy to the GPU then waits for none)."""
    if padding_key is None or not isinstance(batch, Mapping):
        return batch
    if padding_key in batch:
        raise KeyError(
            f"the batch already has a key {padding_key!r}, where lightning_sharding puts its padding "
            "flags; pass another `padding_key=` (or None) to ShardedDataModule"
        )
    if pin_memory:
        flags = torch.zeros(size, dtype=torch.bool, pin_memory=True)
    else:  # from NumPy: made for every batch, 0.8 us against torch.zeros' 1.2
        flags = torch.from_numpy(np.zeros(size, dtype=bool))
    if num_padding:
        flags[size - num_padding :] = True
    return {**batch, padding_key: flags}


class DeliveredLog:
    """Provenance of the batches handed to training whose steps are not accounted yet, oldest first."""

    def __init__(self, *, padding_key: str | None, track: bool, pin_memory: bool = False) -> None:
        self.padding_key = padding_key
        self.track = track
        self.pin_memory = pin_memory and torch.cuda.is_available()  # the padding flags too, as the DataLoader
        self._queue: deque[Provenance] = deque()
        self._stats: Counter[str] = Counter()  # the readers' counters since take_metrics()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Provenance]:
        return iter(self._queue)

    def clear(self) -> None:
        """A new pass starts: batches of an abandoned one are never accounted."""
        self._queue.clear()

    def accept(self, delivery: Delivery, epoch: int) -> Any:
        """The batch of ``delivery`` for training in ``epoch``, provenance kept (when tracking) and
        padding flagged; a batch of another epoch is a bug and raises."""
        if delivery.epoch != epoch:
            raise RuntimeError(
                f"a batch planned for epoch {delivery.epoch} arrived in epoch {epoch}; "
                "this is a bug in lightning_sharding, please report it"
            )
        if delivery.stats:
            self._stats.update(delivery.stats)
        if self.track:
            self._queue.append(Provenance(delivery.epoch, delivery.positions, delivery.num_padding, delivery.skipped))
        positions, num_padding = len(delivery.positions), delivery.num_padding
        return flag_padding(delivery.batch, positions, num_padding, self.padding_key, self.pin_memory)

    def take_metrics(self) -> dict[str, float]:
        """The readers' figures since the last call, as logger metrics: ``data/cache_hit`` (the
        share of file reads whose local copy was there) and ``data/prefetch_wait`` (seconds the
        workers waited for files to arrive, summed); empty when no reader counts them."""
        hits = self._stats["cache_hits"]
        misses = self._stats["cache_misses"]
        waited = self._stats["fetch_wait_s"]
        self._stats.clear()
        if hits + misses == 0:
            return {}
        return {"data/cache_hit": hits / (hits + misses), "data/prefetch_wait": waited}

    def pop(self) -> Provenance:
        """The oldest delivered batch's provenance whose step has not been accounted yet."""
        if not self._queue:
            raise RuntimeError(
                "a training step ended but no batch of the sharded loader is waiting to be accounted. "
                "Return the loader from train_dataloader() as it is (no wrapping or re-batching), "
                "and do not use `training_step(dataloader_iter)`, which this accounting does not support."
            )
        return self._queue.popleft()
