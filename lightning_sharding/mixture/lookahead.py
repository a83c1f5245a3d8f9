"""What a worker reads next: the items the epoch order lays out after a position, for fetching
them ahead (``Reader.ahead``). A worker reads a run of positions, so the items after its last one
are its next ones, until its run ends.

In a plain epoch those are the items from the one holding the position on. In a mixture each
stream's draws continue from the position on, so it is each stream's next items: those of its
pass or cycle chunk from the draw on (:class:`~lightning_sharding.mixture.order.StreamOrder`), then of
the next. The rest of an epoch whose mixture changed has no look-ahead: its worker fetches what
it reads, when it reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.order import EpochOrder
from lightning_sharding.mixture.order import MixtureOrder, StreamOrder

Int64Array = npt.NDArray[np.int64]


def items_from(order: Any, positions: npt.NDArray[np.int64], count: int) -> Int64Array:
    """The ids of the items laid out from the one holding the last of ``positions`` on, at most
    ``count`` (of each stream, for a mixture: stream after stream; several items of one file count
    each); none without positions, or for an order without a look-ahead."""
    if not len(positions):
        return np.empty(0, dtype=np.int64)
    position = int(positions.max())
    if isinstance(order, EpochOrder):
        return order.items_from(position, count)
    if isinstance(order, MixtureOrder):
        streams = zip(order.stream_orders, order.prefix(position), order.item_offsets[:-1].tolist(), strict=True)
        return np.concatenate([stream_items_from(s, draw, count) + offset for s, draw, offset in streams])
    return np.empty(0, dtype=np.int64)


def stream_items_from(stream: StreamOrder, draw: int, count: int) -> Int64Array:
    """The stream's items (0-based in the stream) from the one holding ``draw`` on, in draw order,
    at most ``count``: an item recurs when a later pass draws it again; none past the epoch's end."""
    found: list[Int64Array] = []
    left, g = count, int(np.searchsorted(stream.starts, draw, side="right")) - 1
    while 0 <= g < len(stream.segments) and left > 0:
        segment = stream.segments[g]
        order = stream.segment_order(segment)
        lo = segment.lo + max(draw - int(stream.starts[g]), 0)
        first = int(np.searchsorted(order.starts, lo, side="right")) - 1
        end = int(np.searchsorted(order.starts, segment.hi, side="left"))
        found.append(order.item_order[first : min(end, first + left)])
        left, g = left - found[-1].size, g + 1
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)
