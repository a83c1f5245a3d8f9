"""``plan``'s report: per rank and per (rank, worker), samples, batches, padding, dropped, items."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lightning_sharding.cli._common import _plural
from lightning_sharding.rangeset import RangeSet

if TYPE_CHECKING:
    from lightning_sharding.order import EpochOrder
    from lightning_sharding.plan import EpochPlan, RankPlan

# World sizes above this print the first and last RANKS_SHOWN // 2 ranks only; likewise workers.
MAX_RANKS = 16
RANKS_SHOWN = 16
MAX_WORKERS = 8
WORKERS_SHOWN = 8


@dataclass(frozen=True)
class _Row:
    """One printed row: a rank (``worker`` None) or one of its workers."""

    rank: int
    worker: int | None
    samples: int
    batches: int
    padding: int
    dropped: int | None
    items: int


def _nonempty_slots(order: EpochOrder) -> RangeSet:
    """The slots of the epoch order (item ``order.item_order[slot]``) that hold samples."""
    return RangeSet.from_positions(np.flatnonzero(order.counts[order.item_order] > 0))


def _slots(order: EpochOrder, positions: RangeSet, nonempty: RangeSet) -> RangeSet:
    """The slots of the epoch order that ``positions`` fall in.

    Works on ranges, never on single positions: the same result as the distinct items of
    ``order.locate(positions.to_array())``, at the cost of the number of ranges.
    """
    if not positions:
        return RangeSet()
    first = np.searchsorted(order.starts, positions.starts, side="right") - 1
    last = np.searchsorted(order.starts, positions.ends - 1, side="right") - 1
    # A range spanning an empty item would list its slot: keep only slots that hold samples.
    return RangeSet(first, last + 1).intersection(nonempty)


def _worker_positions(rank: RankPlan, worker: int) -> tuple[RangeSet, int]:
    """The real positions of ``worker``'s batches and its padding samples."""
    run = rank.worker_batches(worker)
    if not run:
        return RangeSet(), 0
    lo, hi = rank.bounds(run[0])[0], rank.bounds(run[-1])[1]
    padding = rank.num_padding if run[-1] == rank.num_batches - 1 else 0
    return rank.positions.select(lo, hi), padding


def _shown(count: int, limit: int, shown: int) -> list[int | None]:
    """Indices to print, with ``None`` where a ``...`` line stands for the ones left out."""
    if count <= limit:
        return list(range(count))
    half = shown // 2
    return [*range(half), None, *range(count - half, count)]


def _plan_rows(plan: EpochPlan, order: EpochOrder) -> tuple[list[_Row | None], list[RangeSet]]:
    """Printed rows (``None`` for ``...``) and every rank's slots, for the totals."""
    rank_slots: list[RangeSet] = []
    rows: list[_Row | None] = []
    nonempty = _nonempty_slots(order)
    shown = set(_shown(plan.world_size, MAX_RANKS, RANKS_SHOWN))
    for r in range(plan.world_size):
        rank = plan.rank(r)
        served = rank.positions.select(0, rank.num_served)
        rank_slots.append(_slots(order, served, nonempty))
        if r not in shown:
            if r - 1 in shown:
                rows.append(None)
            continue
        rows.append(
            _Row(r, None, rank.num_served, rank.num_batches, rank.num_padding, rank.num_dropped, len(rank_slots[-1]))
        )
        if plan.num_workers == 0:
            continue
        for w in _shown(plan.num_workers, MAX_WORKERS, WORKERS_SHOWN):
            if w is None:
                rows.append(None)
                continue
            positions, padding = _worker_positions(rank, w)
            items = len(_slots(order, positions, nonempty))
            rows.append(_Row(r, w, len(positions), len(rank.worker_batches(w)), padding, None, items))
    return rows, rank_slots


def format_plan(plan: EpochPlan, order: EpochOrder, *, fingerprint: str = "", strategy: str = "shard") -> str:
    """The ``plan`` table: a header, one row per rank and per (rank, worker), and a totals line."""
    rows, rank_slots = _plan_rows(plan, order)
    items = int(np.count_nonzero(order.counts))
    workers = _plural(plan.num_workers, "worker") if plan.num_workers else "0 workers (loading in the rank's process)"
    shuffle = "shuffled" if order.shuffle else "not shuffled"
    lines = [
        f"epoch {plan.epoch}, seed {order.seed}, {shuffle}: "
        f"{_plural(plan.total, 'sample')} in {_plural(order.counts.size, 'item')}"
        + (f" (data fingerprint {fingerprint[:16]})" if fingerprint else ""),
        f"world {_plural(plan.world_size, 'rank')} x {workers}, batch size {plan.batch_size}, "
        f"even_batches={plan.even_batches}, strategy {strategy}",
        "",
        f"{'rank':>6} {'worker':>6} {'samples':>9} {'batches':>8} {'padding':>8} {'dropped':>8} {'items':>6}",
    ]
    for row in rows:
        if row is None:
            lines.append(f"{'...':>6}")
            continue
        worker = "all" if row.worker is None else str(row.worker)
        dropped = "-" if row.dropped is None else str(row.dropped)
        lines.append(
            f"{row.rank:>6} {worker:>6} {row.samples:>9} {row.batches:>8} {row.padding:>8} {dropped:>8} {row.items:>6}"
        )
    # Items read by two ranks or more: count, per slot, the ranks whose slots cover it.
    cover = np.zeros(order.counts.size + 1, dtype=np.int64)
    for slots in rank_slots:
        np.add.at(cover, slots.starts, 1)
        np.add.at(cover, slots.ends, -1)
    shared = int(np.count_nonzero(np.cumsum(cover)[:-1] >= 2))
    served = int(plan.rank_counts.sum() - plan.dropped_per_rank.sum())
    touched = _union_len(rank_slots)
    dropped_total = int(plan.dropped_per_rank.sum())
    lines.append(
        f"{'total':>6} {'':>6} {served:>9} {plan.num_batches * plan.world_size:>8} "
        f"{int(plan.padding_per_rank.sum()):>8} {dropped_total:>8} {touched:>6}"
    )
    per_rank = f"{plan.num_batches} {'batch' if plan.num_batches == 1 else 'batches'} per rank"
    lines.append(
        f"{per_rank}; {served} served + {dropped_total} dropped = {plan.total} samples; "
        f"{shared} of {_plural(items, 'item')} read by more than one rank"
    )
    return "\n".join(lines)


def _union_len(sets: Sequence[RangeSet]) -> int:
    if not sets:
        return 0
    starts = np.concatenate([s.starts for s in sets])
    ends = np.concatenate([s.ends for s in sets])
    return len(RangeSet(starts, ends))
