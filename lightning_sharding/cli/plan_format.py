"""``plan``'s report: per rank and per (rank, worker), samples, batches, padding, dropped, items."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from lightning_sharding.cli._common import _plural
from lightning_sharding.core.rangeset import RangeSet

if TYPE_CHECKING:
    from lightning_sharding.core.order import EpochOrder
    from lightning_sharding.core.plan import EpochPlan, RankPlan
    from lightning_sharding.mixture import MixtureOrder

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
    streams: tuple[int, ...] = ()  # a mixture's samples per stream (then ``items`` is not counted)


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
    padding = rank.num_padding if run[-1] == rank.num_batches - 1 else 0
    if rank.worker_layout == "interleaved":  # every W-th batch: the union of each one's positions
        parts = [rank.positions.select(*rank.bounds(b)).to_array() for b in run]
        return RangeSet.from_positions(np.concatenate(parts)), padding
    lo, hi = rank.bounds(run[0])[0], rank.bounds(run[-1])[1]
    return rank.positions.select(lo, hi), padding


def _shown(count: int, limit: int, shown: int) -> list[int | None]:
    """Indices to print, with ``None`` where a ``...`` line stands for the ones left out."""
    if count <= limit:
        return list(range(count))
    half = shown // 2
    return [*range(half), None, *range(count - half, count)]


def _stream_counts(order: MixtureOrder, positions: RangeSet) -> tuple[int, ...]:
    """Samples of each stream among ``positions``, counted per range from the interleave's prefixes."""
    counts = np.zeros(len(order.names), dtype=np.int64)
    for a, b in zip(positions.starts.tolist(), positions.ends.tolist(), strict=True):
        counts += np.asarray(order.prefix(b), dtype=np.int64) - np.asarray(order.prefix(a), dtype=np.int64)
    return tuple(counts.tolist())


def _plan_rows(
    plan: EpochPlan,
    order: EpochOrder | MixtureOrder,
    mixture: MixtureOrder | None,
    tokens: Callable[[npt.NDArray[np.int64]], int] | None = None,
) -> tuple[list[_Row | None], list[RangeSet]]:
    """Printed rows (``None`` for ``...``) and what every rank covers, for the totals: the slots of
    its items, or for a ``mixture`` (the order itself, when it is one) or packed sequences (whose
    ``tokens`` of positions count) its served positions."""
    items_order = cast("EpochOrder", order)
    by_position = mixture is not None or tokens is not None
    nonempty = _nonempty_slots(items_order) if not by_position else RangeSet()

    def covered(positions: RangeSet) -> RangeSet:
        return positions if by_position else _slots(items_order, positions, nonempty)

    def tally(positions: RangeSet, cover: RangeSet) -> tuple[int, tuple[int, ...]]:
        """Items touched, (mixture) samples per stream, or (packed) tokens."""
        if tokens is not None:
            return tokens(positions.to_array()), ()
        return (0, _stream_counts(mixture, positions)) if mixture is not None else (len(cover), ())

    rank_cover: list[RangeSet] = []
    rows: list[_Row | None] = []
    shown = set(_shown(plan.world_size, MAX_RANKS, RANKS_SHOWN))
    for r in range(plan.world_size):
        rank = plan.rank(r)
        served = rank.positions.select(0, rank.num_served)
        rank_cover.append(covered(served))
        if r not in shown:
            if r - 1 in shown:
                rows.append(None)
            continue
        items, streams = tally(served, rank_cover[-1])
        rows.append(
            _Row(r, None, rank.num_served, rank.num_batches, rank.num_padding, rank.num_dropped, items, streams)
        )
        if plan.num_workers == 0:
            continue
        for w in _shown(plan.num_workers, MAX_WORKERS, WORKERS_SHOWN):
            if w is None:
                rows.append(None)
                continue
            positions, padding = _worker_positions(rank, w)
            items, streams = tally(positions, covered(positions))
            rows.append(_Row(r, w, len(positions), len(rank.worker_batches(w)), padding, None, items, streams))
    return rows, rank_cover


def _letters(names: Sequence[str]) -> list[str]:
    """One letter per stream for the interleave picture: its first letter, else a digit."""
    firsts = [name[:1].upper() or "?" for name in names]
    if len(set(firsts)) == len(firsts) and all(f.isalpha() for f in firsts):
        return firsts
    return [str(i % 10) for i in range(len(names))]


def _mixture_lines(order: MixtureOrder, shares: Sequence[str], width: int = 64) -> list[str]:
    """Each stream's share and draws, and a picture of the first ``width`` positions of the epoch."""
    letters = _letters(order.names)
    phased = getattr(order.interleave, "phase_draws", None)
    if phased:  # the streams' own shares only size the epoch: the phases' shares draw
        shares = [f"{share} (sizes the epoch; the phases draw)" for share in shares]
    lines = [
        f"  {letter} {name}: {share}, {draws} draws an epoch from {size} samples"
        for letter, name, share, draws, size in zip(letters, order.names, shares, order.draws, order.sizes, strict=True)
    ]
    if phased:  # a share schedule: each phase's positions, draws per stream, and its start
        bounds = getattr(order.interleave, "bounds").tolist()  # noqa: B009 - a Phased layout's, not every Layout's
        for k, row in enumerate(phased):
            draws = ", ".join(f"{name} {d}" for name, d in zip(order.names, row, strict=True) if d)
            lines.append(f"phase {k}: positions {bounds[k]}..{bounds[k + 1] - 1}: {draws or 'nothing'}")
            if bounds[k + 1] > bounds[k]:
                stream, _ = order.streams(np.arange(bounds[k], min(bounds[k] + width, bounds[k + 1])))
                lines.append(f"  its first positions: {''.join(letters[s] for s in stream.tolist())}")
        return lines
    blocks = order.blocks
    if blocks is None:
        stream, _ = order.streams(np.arange(min(width, order.total)))
        picture = "".join(letters[s] for s in stream.tolist())
        lines.append(f"interleave of positions 0..{len(picture) - 1}: {picture}")
        return lines
    if order.composition == "per_stream":
        starts, _ = blocks.bounds(np.arange(min(width, blocks.count)))
        picture = "".join(letters[s] for s in order.streams(starts)[0].tolist())
        lines.append(f"per_stream batches of {blocks.size}: the stream of batches 0..{len(picture) - 1}: {picture}")
    else:
        shares = ", ".join(
            f"{n} {blocks.size * d / order.total:.2f}" for n, d in zip(order.names, order.draws, strict=True)
        )
        lines.append(f"stratified batches of {blocks.size}, each within one sample of the shares {shares}")
    return lines


def format_plan(
    plan: EpochPlan,
    order: EpochOrder | MixtureOrder,
    *,
    fingerprint: str = "",
    strategy: str = "shard",
    replica_size: int = 1,
    shares: Sequence[str] = (),
    mixture: MixtureOrder | None = None,
    tokens: Callable[[npt.NDArray[np.int64]], int] | None = None,
    packing: Mapping[str, Any] | None = None,
) -> str:
    """The ``plan`` table: a header, one row per rank and per (rank, worker), and a totals line.

    With ``replica_size`` > 1 the plan's ranks are data-parallel ranks, each a model replica of
    ``replica_size`` global ranks that read the same batches; a ``ranks`` column names them in
    Lightning's ``ModelParallelStrategy`` layout (replica ``d`` is ranks ``d*T .. d*T+T-1``).
    For a mixture (``mixture``, the order itself, each stream's share in ``shares``) the ``items``
    column gives way to one column of samples per stream. For packed sequences (``tokens`` of
    positions, and the manifest's ``packing`` summary) the samples are sequences and the
    ``items`` column gives way to their tokens.
    """
    rows, rank_slots = _plan_rows(plan, order, mixture, tokens)
    workers = _plural(plan.num_workers, "worker") if plan.num_workers else "0 workers (loading in the rank's process)"
    shuffle = "shuffled" if order.shuffle else "not shuffled"
    replicated = replica_size > 1
    world = f"world {_plural(plan.world_size * replica_size, 'rank')}"
    if replicated:
        replicas = "replica" if plan.world_size == 1 else "replicas"
        world += f" = {plan.world_size} data-parallel {replicas} x {replica_size} ranks that read the same batches"
    if mixture is not None:
        what = f"a mixture of {_plural(len(mixture.names), 'stream')} ({_plural(order.counts.size, 'item')})"
        widths = [max(6, len(name)) for name in mixture.names]
        tail_header = " ".join(f"{name:>{w}}" for name, w in zip(mixture.names, widths, strict=True))
    elif packing is not None:
        what = (
            f"{packing['documents']:,} documents of {packing['tokens']:,} tokens, packed {packing['mode']!r} "
            f"into sequences of {packing['seq_len']} (padding {packing['padding']:,} tokens)"
        )
        widths = [9]
        tail_header = f"{'tokens':>9}"
    else:
        what = _plural(order.counts.size, "item")
        widths = [6]
        tail_header = f"{'items':>6}"

    def tail(row: _Row) -> str:
        values = row.streams if mixture is not None else (row.items,)
        return " ".join(f"{v:>{w}}" for v, w in zip(values, widths, strict=True))

    lines = [
        f"epoch {plan.epoch}, seed {order.seed}, {shuffle}: {_plural(plan.total, 'sample')} in {what}"
        + (f" (data fingerprint {fingerprint[:16]})" if fingerprint else ""),
        f"{world} x {workers}, batch size {plan.batch_size}, even_batches={plan.even_batches}, strategy {strategy}",
    ]
    if mixture is not None:
        lines += _mixture_lines(mixture, shares or ("",) * len(mixture.names))
    lines += [
        "",
        (f"{'dp rank':>7} {'ranks':>11}" if replicated else f"{'rank':>6}")
        + f" {'worker':>6} {'samples':>9} {'batches':>8} {'padding':>8} {'dropped':>8} {tail_header}",
    ]
    for row in rows:
        if row is None:
            lines.append(f"{'...':>7}" if replicated else f"{'...':>6}")
            continue
        worker = "all" if row.worker is None else str(row.worker)
        dropped = "-" if row.dropped is None else str(row.dropped)
        if replicated:
            first = row.rank * replica_size
            rank = f"{row.rank:>7} {f'{first}-{first + replica_size - 1}':>11}"
        else:
            rank = f"{row.rank:>6}"
        lines.append(f"{rank} {worker:>6} {row.samples:>9} {row.batches:>8} {row.padding:>8} {dropped:>8} {tail(row)}")
    served = int(plan.rank_counts.sum() - plan.dropped_per_rank.sum())
    dropped_total = int(plan.dropped_per_rank.sum())
    if mixture is not None:
        totals = _stream_counts(mixture, _union(rank_slots))  # a mixture's rank_slots are served positions
        total_tail = " ".join(f"{v:>{w}}" for v, w in zip(totals, widths, strict=True))
        reading = "served of planned draws: " + ", ".join(
            f"{name} {int(t)} of {d}" for name, t, d in zip(mixture.names, totals, mixture.draws, strict=True)
        )
    elif tokens is not None:
        total_tail = f"{tokens(_union(rank_slots).to_array()):>9}"
        reading = "samples are sequences, tokens the tokens they hold (not padding)"
    else:
        # Items read by two ranks or more: count, per slot, the ranks whose slots cover it.
        cover = np.zeros(order.counts.size + 1, dtype=np.int64)
        for slots in rank_slots:
            np.add.at(cover, slots.starts, 1)
            np.add.at(cover, slots.ends, -1)
        shared = int(np.count_nonzero(np.cumsum(cover)[:-1] >= 2))
        total_tail = f"{len(_union(rank_slots)):>6}"
        items = int(np.count_nonzero(order.counts))
        reading = f"{shared} of {_plural(items, 'item')} read by more than one {'replica' if replicated else 'rank'}"
    lines.append(
        (f"{'total':>7} {'':>11}" if replicated else f"{'total':>6}")
        + f" {'':>6} {served:>9} {plan.num_batches * plan.world_size:>8} "
        f"{int(plan.padding_per_rank.sum()):>8} {dropped_total:>8} {total_tail}"
    )
    batches = "batch" if plan.num_batches == 1 else "batches"
    per_rank = f"{plan.num_batches} {batches} per rank"
    if replicated:
        per_rank += f" (every rank of a replica: the same {batches})"
    lines.append(f"{per_rank}; {served} served + {dropped_total} dropped = {plan.total} samples; {reading}")
    return "\n".join(lines)


def _union(sets: Sequence[RangeSet]) -> RangeSet:
    if not sets:
        return RangeSet()
    return RangeSet(np.concatenate([s.starts for s in sets]), np.concatenate([s.ends for s in sets]))
