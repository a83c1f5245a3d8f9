"""Blocks: batch boundaries an epoch order imposes on the plan.

An order whose batches must hold given runs of positions (a mixture's ``stratified`` or
``per_stream`` composition, where a block's composition is a batch's) says so with :class:`Blocks`;
the planner then serves the remaining part of each block as one batch. An order without blocks
lets the plan cut batches anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.rangeset import RangeSet

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Blocks:
    """The batches of a blocked layout: positions ``[0, aligned)`` are blocks of ``size``; after
    them come blocks ending at each of ``tail`` (the last is the epoch's end)."""

    size: int
    aligned: int
    tail: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        """Blocks in the epoch."""
        return self.aligned // self.size + len(self.tail)

    def ids(self, positions: npt.ArrayLike) -> Int64Array:
        """The block of each position, shape ``(n,)``."""
        pos = np.asarray(positions, dtype=np.int64)
        tail = np.searchsorted(np.asarray(self.tail, dtype=np.int64), pos, side="right")
        return np.where(pos < self.aligned, pos // self.size, self.aligned // self.size + tail).astype(np.int64)

    def bounds(self, ids: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Where each block starts and ends (its last position + 1), shape ``(n,)`` each."""
        ids = np.asarray(ids, dtype=np.int64)
        full = self.aligned // self.size
        edges = np.concatenate(([self.aligned], np.asarray(self.tail, dtype=np.int64)))
        in_tail = np.clip(ids - full, 0, len(edges) - 1)
        starts = np.where(ids < full, ids * self.size, edges[np.minimum(in_tail, len(edges) - 1)])
        ends = np.where(ids < full, (ids + 1) * self.size, edges[np.minimum(in_tail + 1, len(edges) - 1)])
        return starts.astype(np.int64), ends.astype(np.int64)

    def groups(self, remaining: RangeSet) -> Int64Array:
        """Samples of each non-empty intersection of ``remaining`` with a block, in order, shape ``(G,)``."""
        starts, ends = remaining.starts, remaining.ends
        if starts.size == 0:
            return np.empty(0, np.int64)
        first, last = self.ids(starts), self.ids(ends - 1)
        spans = last - first + 1
        which = np.repeat(np.arange(starts.size), spans)
        block = np.repeat(first, spans) + np.arange(which.size) - np.repeat(np.cumsum(spans) - spans, spans)
        block_starts, block_ends = self.bounds(block)
        sizes = np.minimum(ends[which], block_ends) - np.maximum(starts[which], block_starts)
        new = np.concatenate(([True], block[1:] != block[:-1]))
        return np.add.reduceat(sizes, np.flatnonzero(new)).astype(np.int64)


def fit_edges(edges: Int64Array, num_batches: int) -> Int64Array:
    """A blocked rank's batch edges from its groups' edges (one batch per group), fitted to
    ``num_batches``: a rank short of a batch splits its last group, a long one leaves it unserved."""
    groups = edges.size - 1
    if groups > num_batches:
        return edges[: num_batches + 1]
    if groups < num_batches:
        if groups and edges[-1] - edges[-2] >= 2:
            middle = edges[-2] + (edges[-1] - edges[-2] + 1) // 2
            return np.concatenate((edges[:-1], [middle], edges[-1:])).astype(np.int64)
        return np.concatenate((edges, edges[-1:])).astype(np.int64)  # an empty batch: one padding sample
    return edges
