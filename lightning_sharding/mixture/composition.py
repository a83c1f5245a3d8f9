"""Batch composition of a mixture: which stream each epoch position draws from, batch by batch.

``mixed`` (the default) is the :class:`~lightning_sharding.mixture.interleave.Interleave`: streams spread
through the epoch at their shares, batches cut wherever the plan cuts them. The other two cut the
epoch into *blocks* of ``batch_size`` positions, and the plan serves each block as one batch
(:class:`Blocks`, ``plan_epoch(blocks=...)``), so a block's composition is a batch's:

- ``stratified``: every full block holds ``floor(q)`` or ``ceil(q)`` samples of each stream, ``q``
  being the stream's share of the full blocks (its draws less what the last, short block takes,
  over the number of full blocks). Each stream takes ``floor(q)`` of every block; the ``e`` blocks
  where it takes one more are found by wrapping the streams' extras around the blocks (McNaughton's
  rule: extra ``j`` goes to block ``j mod F``), so no block gets two extras of one stream. Inside a
  block the streams are interleaved.
- ``per_stream``: every block comes from one stream. A stream of ``d`` draws has ``d // B`` full
  blocks, spread through the epoch at the streams' shares of full blocks (an interleave of blocks),
  and its ``d % B`` leftover draws make one short block at the end of the epoch.

Like the interleave, both map a position to ``(stream, draw)`` with a few integer operations per
block, never by walking the epoch, and depend only on the draws and the batch size (so the order
is the same on every topology, and a changed batch size is a changed mixture).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.blocks import Blocks
from lightning_sharding.mixture.interleave import Interleave

Int64Array = npt.NDArray[np.int64]
COMPOSITIONS: tuple[str, ...] = ("mixed", "stratified", "per_stream")


class Layout(Protocol):
    """Where each stream's draws sit in the epoch: ``streams(positions)`` gives ``(stream, draw)`` of
    each position, ``prefix(p)`` each stream's draws among the first ``p`` positions."""

    draws: tuple[int, ...]
    total: int

    def streams(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Stream and draw of each position, shape ``(n,)`` each."""
        ...

    def prefix(self, position: int) -> list[int]:
        """Each stream's draws among the first ``position`` positions."""
        ...


class Stratified:
    """Blocks of ``batch_size`` positions, each holding every stream at its share within one sample."""

    def __init__(self, draws: Sequence[int], batch_size: int) -> None:
        self.draws = tuple(int(d) for d in draws)
        self.total = sum(self.draws)
        self.batch_size = int(batch_size)
        full, short = divmod(self.total, self.batch_size)
        self.full = full
        # The short last block takes each stream's share of it; the full blocks share the rest.
        self.last = apportion(short, self.draws) if short else [0] * len(self.draws)
        left = [d - x for d, x in zip(self.draws, self.last, strict=True)]
        self.floor = [x // full if full else 0 for x in left]
        self.extra = [x - full * f for x, f in zip(left, self.floor, strict=True)]  # each < full
        self.extra_start = np.concatenate(([0], np.cumsum(self.extra)[:-1])).astype(np.int64)
        self.blocks = Blocks(self.batch_size, full * self.batch_size, (self.total,) if short else ())

    def block_counts(self, block: int) -> list[int]:
        """Each stream's samples in ``block``."""
        if block >= self.full:
            return list(self.last)
        starts = self.extra_start.tolist()
        return [
            f + (1 if (block - a) % self.full < e else 0)
            for f, a, e in zip(self.floor, starts, self.extra, strict=True)
        ]

    def before(self, block: int) -> list[int]:
        """Each stream's samples in the blocks before ``block``."""
        if block >= self.full:
            return self._full()
        return [
            f * block + _wrapped(a, e, self.full, block)
            for f, a, e in zip(self.floor, self.extra_start.tolist(), self.extra, strict=True)
        ]

    def _full(self) -> list[int]:
        return [d - x for d, x in zip(self.draws, self.last, strict=True)]

    def prefix(self, position: int) -> list[int]:
        """Each stream's draws among the first ``position`` positions."""
        _check(position, self.total)
        block, offset = divmod(position, self.batch_size)
        counts = self.before(block)
        if offset:
            inside = _inner(tuple(self.block_counts(block))).prefix(offset)
            counts = [c + i for c, i in zip(counts, inside, strict=True)]
        return counts

    def streams(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Stream and draw of each position, shape ``(n,)`` each."""
        pos = np.asarray(positions, dtype=np.int64)
        _check_all(pos, self.total)
        stream, draw = np.empty_like(pos), np.empty_like(pos)
        block_of = pos // self.batch_size
        for block in np.unique(block_of).tolist():
            at = block_of == block
            counts = self.block_counts(block)
            s, k = _inner(tuple(counts)).streams(pos[at] - block * self.batch_size)
            stream[at], draw[at] = s, k + np.asarray(self.before(block), dtype=np.int64)[s]
        return stream, draw


class PerStream:
    """Blocks of ``batch_size`` positions from one stream each: full blocks interleaved at the
    streams' shares, then one short block per stream whose draws do not fill a whole number."""

    def __init__(self, draws: Sequence[int], batch_size: int) -> None:
        self.draws = tuple(int(d) for d in draws)
        self.total = sum(self.draws)
        self.batch_size = int(batch_size)
        self.full_blocks = [d // self.batch_size for d in self.draws]
        self.rest = [d % self.batch_size for d in self.draws]
        self.full = sum(self.full_blocks)
        self.order = Interleave(self.full_blocks) if self.full else None
        aligned = self.full * self.batch_size
        self.tail_streams = [s for s, r in enumerate(self.rest) if r]
        self.tail_starts = np.concatenate(([aligned], aligned + np.cumsum([self.rest[s] for s in self.tail_streams])))
        self.blocks = Blocks(self.batch_size, aligned, tuple(int(x) for x in self.tail_starts[1:]))

    def prefix(self, position: int) -> list[int]:
        """Each stream's draws among the first ``position`` positions."""
        _check(position, self.total)
        if position < self.blocks.aligned:
            assert self.order is not None
            block, offset = divmod(position, self.batch_size)
            counts = [b * self.batch_size for b in self.order.prefix(block)]
            if offset:
                counts[int(self.order.streams([block])[0][0])] += offset
            return counts
        counts = [b * self.batch_size for b in self.full_blocks]
        for s, start, end in zip(self.tail_streams, self.tail_starts[:-1], self.tail_starts[1:], strict=True):
            counts[s] += max(0, min(position, int(end)) - int(start))
        return counts

    def streams(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Stream and draw of each position, shape ``(n,)`` each."""
        pos = np.asarray(positions, dtype=np.int64)
        _check_all(pos, self.total)
        stream, draw = np.empty_like(pos), np.empty_like(pos)
        head = pos < self.blocks.aligned
        if head.any():
            assert self.order is not None
            block, offset = np.divmod(pos[head], self.batch_size)
            s, k = self.order.streams(block)
            stream[head], draw[head] = s, k * self.batch_size + offset
        if not head.all():
            tail = pos[~head]
            which = np.searchsorted(self.tail_starts, tail, side="right") - 1
            s = np.asarray(self.tail_streams, dtype=np.int64)[which]
            stream[~head] = s
            draw[~head] = np.asarray(self.full_blocks, dtype=np.int64)[s] * self.batch_size + (
                tail - self.tail_starts[which]
            )
        return stream, draw


def layout(draws: Sequence[int], composition: str = "mixed", batch_size: int | None = None) -> Layout:
    """The layout of streams of ``draws`` under ``composition`` (blocked ones need ``batch_size``)."""
    if composition == "mixed":
        return Interleave(draws)
    if composition not in COMPOSITIONS:
        raise ValueError(f"batch_composition={composition!r} is not one of {list(COMPOSITIONS)}")
    if batch_size is None or batch_size < 1:
        raise ValueError(f"batch_composition={composition!r} needs the batch size, got {batch_size!r}")
    return Stratified(draws, batch_size) if composition == "stratified" else PerStream(draws, batch_size)


def check_blocks(manifest: Any, batch_size: int) -> None:
    """Raise when a stratified or per_stream mixture's blocks are not ``batch_size`` (the batch size
    changed after ``setup``, as Lightning's batch-size finder does)."""
    mixture = getattr(manifest.epochs, "mixture", None)  # mixture.order.mixture_of, which imports this module
    blocks = mixture.blocks if mixture is not None else None
    if mixture is not None and blocks is not None and blocks.size != batch_size:
        raise ValueError(
            f"batch_composition={mixture.composition!r} cut the epoch into batches of {blocks.size} at "
            f"setup, but batch_size is now {batch_size}: set batch_size before fit() (the batch-size finder "
            "cannot change it for a stratified or per_stream mixture)"
        )


def blocks_of(layout: Layout) -> Blocks | None:
    """The blocks a layout's batches must follow (``None``: the plan cuts batches anywhere)."""
    return getattr(layout, "blocks", None)


@lru_cache(maxsize=256)
def _inner(counts: tuple[int, ...]) -> Interleave:
    """The interleave inside one block of ``counts``."""
    return Interleave(counts)


def _wrapped(start: int, length: int, period: int, block: int) -> int:
    """How many of ``start .. start+length-1`` fall in blocks before ``block``, taken ``mod period``."""

    def upto(x: int) -> int:
        return (x // period) * block + min(x % period, block)

    return upto(start + length) - upto(start)


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` by largest remainders (ties: the earlier first);
    every share is within one of its exact quota and the shares add up to ``total``."""
    whole = sum(weights)
    quotas = [total * w / whole for w in weights]
    shares = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - shares[i]), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def _check(position: int, total: int) -> None:
    if not 0 <= position <= total:
        raise ValueError(f"mixture position {position} is outside [0, {total}]")


def _check_all(pos: Int64Array, total: int) -> None:
    if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= total):
        bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
        raise ValueError(f"epoch position {bad} is outside [0, {total})")
