"""The interleave of a mixture: which stream each position of the epoch draws from.

Draw ``k`` of stream ``s`` sits at time ``(k + 1/2) / draws[s]``; the epoch is every draw sorted by
time, ties to the lower stream. Stream ``s`` then has ``floor(T * draws[s] + 1/2)`` draws up to
time ``T`` (within half a draw of its share), so any prefix of the epoch holds each stream within
2 draws of its share: within 1 of its share of the prefix's time, plus draws tied at that time.
Random mixtures measure at most 1.1. A position's stream is computed with integers from the
position alone (an estimate from the share, corrected draw by draw), never by walking the epoch;
it depends only on the draws, so the audit can count streams from positions.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]


class Interleave:
    """The order of the draws of streams that draw ``draws[s]`` samples an epoch each."""

    def __init__(self, draws: Sequence[int]) -> None:
        self.draws = tuple(int(d) for d in draws)
        if not self.draws or min(self.draws) < 0 or sum(self.draws) < 1:
            raise ValueError(f"Interleave needs draws of 0 or more with at least one draw, got {self.draws}")
        self.total = sum(self.draws)

    def _before(self, s: int, k: int, t: int, j: int) -> bool:
        """Whether draw ``k`` of stream ``s`` comes before draw ``j`` of stream ``t``."""
        left, right = (2 * k + 1) * self.draws[t], (2 * j + 1) * self.draws[s]
        return left < right or (left == right and s < t)

    def prefix(self, position: int) -> list[int]:
        """Draws of each stream among the first ``position`` positions of the epoch."""
        if not 0 <= position <= self.total:
            raise ValueError(f"mixture position {position} is outside [0, {self.total}]")
        live = [s for s, d in enumerate(self.draws) if d]
        counts = [0] * len(self.draws)
        for s in live:  # the time position/total, within a draw of the exact prefix for every stream
            counts[s] = min(self.draws[s], max(0, (2 * position * self.draws[s] + self.total) // (2 * self.total)))
        while sum(counts) > position:  # drop the latest draw taken
            s = max((s for s in live if counts[s]), key=lambda s: _Key(self, s, counts[s] - 1))
            counts[s] -= 1
        while sum(counts) < position:  # take the earliest draw not taken
            s = min((s for s in live if counts[s] < self.draws[s]), key=lambda s: _Key(self, s, counts[s]))
            counts[s] += 1
        return counts

    def streams(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Stream and draw number of each position, shape ``(n,)`` each (positions in any order)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.total):
            bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
            raise ValueError(f"epoch position {bad} is outside [0, {self.total})")
        stream = np.empty_like(pos)
        draw = np.empty_like(pos)
        order = np.argsort(pos, kind="stable")
        sorted_pos = pos[order]
        cuts = np.flatnonzero(np.diff(sorted_pos) != 1) + 1
        for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [pos.size])), strict=True):
            if lo == hi:
                continue
            ss, kk = self._run(int(sorted_pos[lo]), int(hi - lo))
            stream[order[lo:hi]], draw[order[lo:hi]] = ss, kk
        return stream, draw

    def _run(self, start: int, length: int) -> tuple[list[int], list[int]]:
        """Streams and draws of positions ``start .. start+length-1``: a merge of the streams' next draws."""
        counts = self.prefix(start)
        heap = [_Key(self, s, counts[s]) for s, d in enumerate(self.draws) if counts[s] < d]
        heapq.heapify(heap)
        streams, draws = [], []
        for _ in range(length):
            key = heapq.heappop(heap)
            streams.append(key.s)
            draws.append(key.k)
            if key.k + 1 < self.draws[key.s]:
                heapq.heappush(heap, _Key(self, key.s, key.k + 1))
        return streams, draws


@dataclass(frozen=True, order=False)
class _Key:
    """Draw ``k`` of stream ``s``, ordered by its time in the epoch (exactly, in integers)."""

    order: Interleave
    s: int
    k: int

    def __lt__(self, other: _Key) -> bool:
        return self.order._before(self.s, self.k, other.s, other.k)

    def __gt__(self, other: _Key) -> bool:
        return other.order._before(other.s, other.k, self.s, self.k)
