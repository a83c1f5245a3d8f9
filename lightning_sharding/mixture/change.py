"""A mixture changed on resume: the rest of the epoch at the new shares, nothing consumed served again.

A checkpoint written mid-epoch under one mixture resumes under another (new weights, a stream added
or removed) with ``ShardedDataModule(allow_mixture_change=True)``. That epoch is *changed*:

- the ``c`` positions the checkpoint consumed stay consumed; the old epoch's other positions are
  never served (each stream's report says how many samples it had left);
- the rest of the epoch, ``R = max(0, samples_per_epoch - c)`` samples, is split over the new
  streams at the new shares (largest remainders over the new draws, so within one sample) and laid
  out by the new composition;
- each stream's rest comes first from its samples *not consumed this epoch*, in a fresh shuffled
  order, and only when its new share asks for more than it has left from those consumed once (a
  stream that repeats), and so on, then from whole fresh passes: a sample's servings in the epoch
  stay within one of the others'.

The changed epoch has ``R + c`` positions: ``[0, R)`` the rest, ``[R, R + c)`` standing for the ``c``
positions consumed before the change (consumed in the ledger, never served). Like every order, it
is a pure function: of the checkpoint's ledger (kept in the new ledger as ``change``) and the data,
never of the topology, so resuming it again on any topology serves the same rest. The next epoch is
an ordinary epoch of the new mixture. A kept stream must hold the same data (its items' fingerprint).

Packed token streams (``packing=``) change alike, their samples being sequences, and a share in
``tokens`` is honoured through the draws it sets. A kept stream must keep its packing (another
``seq_len``, mode or window is refused by name: its sequences differ). What names a sequence across
orders depends on the mode: ``best_fit`` packs the same sequences every epoch and ``none`` holds one
document each, so their rest draws from a fresh packed order, its consumed sequences found by their
packed sequence or document; ``concat`` cuts every order into other sequences, so its rest goes on in
the very order the stream consumed from (its positions not consumed, in order), and a ``concat``
stream that had drawn from two of its orders (drawn more than once an epoch) is refused by name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.blocks import Blocks
from lightning_sharding.core.order import EpochOrder, derive_seed
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.spelling import option
from lightning_sharding.mixture.composition import Layout, apportion, blocks_of, layout
from lightning_sharding.mixture.control import layout_of_summary
from lightning_sharding.mixture.order import (
    Mixture,
    MixtureOrder,
    OnMixture,
    StreamOrder,
    locate_streams,
    mixture_of,
    stream_seed,
)

Int64Array = npt.NDArray[np.int64]
_REST_SEEDS = 0x4E57
_CHUNK = 1 << 20  # consumed positions located at a time
_NONE = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # a stream that consumed nothing: no places, no times


class MixtureChangeError(ValueError):
    """A checkpoint's mixture cannot continue under the new one (named stream, what to do)."""


def rest_order(counts: Int64Array, name: str, seed: int, epoch: int, *, shuffle: bool, epochs: Any = None) -> Any:
    """The fresh order a stream's rest draws from when none is given (:class:`RestStream`'s ``base``)."""
    rest_seed = stream_seed(seed, name, _REST_SEEDS)
    if epochs is None:
        return EpochOrder(counts, rest_seed, epoch, shuffle=shuffle)
    return epochs.order(counts, rest_seed, epoch, shuffle=shuffle)


class RestStream:
    """One stream's draws in the rest of a changed epoch, fewest servings first: its samples not
    consumed this epoch, in a fresh order, then (a stream that repeats) those consumed once, and so
    on, then whole fresh passes. ``consumed``: the places in that fresh order of the samples consumed
    this epoch, sorted and unique, and ``times``: how often each was. So a stream's servings over the
    whole epoch stay within one of each other, as a repeat asks.

    A stream of packed token sequences (``epochs``, its packed epochs) draws sequences: the fresh
    order is one of its packed orders (``base``, when given, else a fresh one), whose positions are
    the places, and each whole pass one more of them."""

    def __init__(
        self,
        counts: Int64Array,
        name: str,
        seed: int,
        epoch: int,
        consumed: Int64Array,
        times: Int64Array,
        *,
        shuffle: bool,
        epochs: Any = None,
        base: Any = None,
    ) -> None:
        self.counts = counts
        self.epochs = epochs
        self.size = int(counts.sum()) if epochs is None else int(epochs.total)
        self.epoch = int(epoch)
        self.shuffle = shuffle
        self.name, self.base_seed = name, int(seed)
        self.fresh = base if base is not None else rest_order(counts, name, seed, epoch, shuffle=shuffle, epochs=epochs)
        # Level p serves, in the fresh order, the samples consumed at most p times; its k-th draw is
        # place k + #(skip <= k) where ``skip`` holds the places of the others, shifted by their rank.
        self.skips = []
        for p in range(max(1, int(times.max()) if times.size else 0)):
            over = consumed[times > p]
            self.skips.append(over - np.arange(over.size, dtype=np.int64))
        self.ends = np.cumsum([self.size - s.size for s in self.skips], dtype=np.int64)
        self.levelled = int(self.ends[-1]) if self.ends.size else 0  # draws before the whole passes
        self.left = self.size - int(consumed.size)
        self._passes: OrderedDict[int, Any] = OrderedDict()  # the newest few whole passes' orders

    def portions_of(self, draws: npt.ArrayLike) -> list[tuple[Int64Array, Any, Int64Array]]:
        """The draws grouped by the order they come from, as :meth:`StreamOrder.portions_of` gives
        them: ``(where, order, positions)``, ``where`` indexing ``draws``."""
        draw = np.asarray(draws, dtype=np.int64)
        out: list[tuple[Int64Array, Any, Int64Array]] = []
        level = np.searchsorted(self.ends, draw, side="right")
        levelled = draw < self.levelled
        if levelled.any():
            places = np.empty_like(draw)
            for p in np.unique(level[levelled]).tolist():
                at = levelled & (level == p)
                k = draw[at] - (int(self.ends[p - 1]) if p else 0)
                places[at] = k + np.searchsorted(self.skips[p], k, side="right")
            where = np.flatnonzero(levelled)
            out.append((where, self.fresh, places[where]))
        later = np.flatnonzero(~levelled)
        passes, offsets = np.divmod(draw[later] - self.levelled, self.size)
        for p in np.unique(passes).tolist():
            at = passes == p
            out.append((later[at], self.pass_order(derive_seed(self.epoch, p + 1)), offsets[at]))
        return out

    def pass_order(self, key: int) -> Any:
        """The stream's order keyed ``key`` under the rest's seed: an :class:`EpochOrder`, or a packed
        order; the newest few are kept, as :meth:`StreamOrder.portion_order` keeps them (a batch asks
        for its pass's order, and building one is a permutation of the stream; a packed reader's
        stretch of sequences lasts as long as its order)."""
        order = self._passes.get(key)
        if order is None:
            order = rest_order(self.counts, self.name, self.base_seed, key, shuffle=self.shuffle, epochs=self.epochs)
            self._passes[key] = order
            if len(self._passes) > 4:
                self._passes.popitem(last=False)
        return order

    def locate(self, draws: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """The stream's item and sample index of each draw of the rest, shape ``(n,)`` each."""
        draw = np.asarray(draws, dtype=np.int64)
        items, index = np.empty_like(draw), np.empty_like(draw)
        for where, order, positions in self.portions_of(draw):
            items[where], index[where] = order.locate(positions)
        return items, index


@dataclass(frozen=True)
class StreamReport:
    """What a change did to one stream: samples ``consumed`` this epoch before it, samples it had
    ``left`` (not consumed; ``None`` for a removed stream), and the draws ``planned`` for the rest."""

    name: str
    consumed: int
    left: int | None
    planned: int


class MixtureChange:
    """The order of a changed epoch (see the module): ``locate``, ``streams`` and ``blocks`` like a
    :class:`~lightning_sharding.mixture.order.MixtureOrder`, over ``total = rest + before`` positions."""

    def __init__(
        self,
        epoch: int,
        names: Sequence[str],
        rest_draws: Sequence[int],
        streams: Sequence[RestStream],
        item_offsets: Int64Array,
        before: int,
        composition: str,
        batch_size: int | None,
        report: Sequence[StreamReport],
        unit: str = "samples",
    ) -> None:
        self.epoch = int(epoch)
        self.unit = unit  # what a position is: "samples", or "sequences" of packed token streams
        self.names = tuple(names)
        self.draws = tuple(int(d) for d in rest_draws)
        self.rest = sum(self.draws)
        self.before = int(before)
        self.total = self.rest + self.before
        self.report = tuple(report)
        self.rest_streams = list(streams)
        self.stream_orders = self.rest_streams  # as a MixtureOrder names them: a packed mixture reads through them
        self.item_offsets = item_offsets
        self.layout: Layout | None = layout(self.draws, composition, batch_size) if self.rest else None
        blocks = blocks_of(self.layout) if self.layout is not None else None
        if composition != "mixed" and batch_size is not None and blocks is None:  # nothing left to plan
            blocks = Blocks(int(batch_size), 0, ())
        # The positions consumed before the change are one last block: never planned, all consumed.
        self.blocks = (
            blocks
            if blocks is None or not self.before
            else Blocks(blocks.size, blocks.aligned, (*blocks.tail, self.total))
        )

    def streams(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Stream and draw of each rest position (``[0, rest)``), shape ``(n,)`` each."""
        if self.layout is None:
            raise ValueError(f"epoch {self.epoch} changed its mixture with nothing left to serve")
        return self.layout.streams(positions)

    def prefix(self, position: int) -> list[int]:
        """Each stream's draws among the first ``position`` rest positions."""
        return self.layout.prefix(position) if self.layout is not None else [0] * len(self.names)

    def locate(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Item ids (over all streams) and sample indices of rest positions, shape ``(n,)`` each."""
        return locate_streams(self.streams(positions), self.rest_streams, self.item_offsets)

    def items_from(self, position: int, count: int) -> Int64Array:
        """None: the rest of a changed epoch has no look-ahead, its workers fetch what they read."""
        return np.empty(0, dtype=np.int64)

    def record(self) -> dict[str, Any]:
        """The change: its epoch, the positions consumed before it, each stream's rest draws."""
        return self.summary()

    def describe(self) -> str:
        """The change and what it did, per stream, for the log of rank 0."""
        rows = [
            f"  {r.name!r}: {r.consumed} consumed this epoch, "
            + (f"{r.left} left, {r.planned} planned for the rest" if r.left is not None else "removed")
            for r in self.report
        ]
        return (
            f"the mixture changed in epoch {self.epoch}: its {self.before} consumed {self.unit} stay consumed and "
            f"the rest of the epoch, {self.rest} {self.unit}, is drawn at the new shares:\n" + "\n".join(rows)
        )

    def summary(self) -> dict[str, Any]:
        """What the audit header keeps: the change's epoch, rest and streams' rest draws."""
        return {
            "epoch": self.epoch,
            "before": self.before,
            "streams": [{"name": n, "draws": d} for n, d in zip(self.names, self.draws, strict=True)],
        }


@dataclass(frozen=True)
class ChangedMixture(OnMixture):
    """The epochs of a manifest whose checkpoint's mixture changed in epoch ``change.epoch``: that
    epoch is the :class:`MixtureChange`, every other one an epoch of ``mixture`` (the new one, whose
    data, identity and size these epochs have)."""

    mixture: Mixture
    change: MixtureChange

    def order(
        self, counts: npt.NDArray[np.int64], seed: int, epoch: int, *, shuffle: bool = True
    ) -> MixtureOrder | MixtureChange:
        """The changed epoch's order, or an ordinary epoch's."""
        if epoch == self.change.epoch:
            return self.change
        return self.mixture.order(counts, seed, epoch, shuffle=shuffle)

    def blocks_at(self, epoch: int) -> Blocks | None:
        """The changed epoch's blocks, or the mixture's."""
        return self.change.blocks if epoch == self.change.epoch else self.mixture.blocks


def change_mixture(before: Mapping[str, Any], manifest: Any, *, shuffle: bool) -> MixtureChange:
    """The changed epoch from ``before`` (the state of a checkpoint's ledger, written under another
    mixture) onto the mixture of ``manifest`` (a :class:`~lightning_sharding.core.manifest.Manifest`);
    raises :class:`MixtureChangeError` naming the stream."""
    saved = before["manifest"]
    mixture = mixture_of(manifest)
    old = saved.get("streams")
    if mixture is None or not old:
        raise MixtureChangeError(
            "allow_mixture_change continues a mixture under new streams or shares, but "
            f"{'the data is' if mixture is None else 'the checkpoint holds'} no mixture; "
            f"use {option('allow_data_change', True)}"
        )
    if mixture.training or saved.get("training_schedule"):
        raise MixtureChangeError(
            "allow_mixture_change does not yet go on with a share schedule over training (Phase(samples=...)); "
            f"resume with the checkpoint's streams and schedule, or use {option('allow_data_change', True)}"
        )
    summary = manifest.summary()
    now = {s["name"]: s for s in summary["streams"]}
    _refuse_renamed(old, now)
    _refuse_repacked(old, now)
    for s in old:
        if s["name"] in now and "data" not in s:
            raise MixtureChangeError(
                f"the checkpoint was written by an earlier lightning_sharding that kept no fingerprint of stream "
                f"{s['name']!r}'s data, so a change cannot prove it unchanged; use {option('allow_data_change', True)}"
            )
        if s["name"] in now and s["data"] not in (now[s["name"]]["data"], now[s["name"]].get("data_by_path")):
            raise MixtureChangeError(
                f"stream {s['name']!r} holds other data than in the checkpoint (its items or their fingerprints "
                "changed); a mixture change keeps each kept stream's data. Rename the stream if it is new data."
            )
    seed, epoch = int(before["seed"]), int(before["epoch"])
    offsets = np.concatenate(([0], np.cumsum(mixture.stream_items))).astype(np.int64)
    counts = [manifest.counts[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    index = {name: j for j, name in enumerate(mixture.names)}
    kept = {i: index[s["name"]] for i, s in enumerate(old) if s["name"] in index}
    # A kept packed stream's epochs are the checkpoint's: the same documents (its data) and packing.
    epochs: tuple[Any, ...] = mixture.stream_epochs or (None,) * len(mixture.names)
    old_orders = {
        i: StreamOrder(counts[j], old[i]["name"], int(old[i]["draws"]), seed, epoch, shuffle=shuffle, epochs=epochs[j])
        for i, j in kept.items()
    }
    consumed = RangeSet.from_state(np.asarray(before["consumed"]))
    taken = stream_draws(layout_of_summary(old, saved), consumed)
    base = {j: _base_order(old_orders[i], taken[i], epoch) for i, j in kept.items() if epochs[j] is not None}
    fresh = {
        j: rest_order(counts[j], mixture.names[j], seed, epoch, shuffle=shuffle, epochs=epochs[j])
        if base.get(j) is None
        else base[j]
        for j in kept.values()
    }
    places: dict[int, list[Int64Array]] = {j: [] for j in kept.values()}
    for i, j in kept.items():
        mode = epochs[j].packing.mode if epochs[j] is not None and len(taken[i]) else None
        inverse = _inverse(fresh[j], mode) if mode in ("best_fit", "none") else None
        for lo in range(0, len(taken[i]), _CHUNK):
            old_draws = taken[i].select(lo, lo + _CHUNK).to_array()
            if epochs[j] is None:
                items, sample = old_orders[i].locate(old_draws)
                places[j].append(fresh[j].positions(items, sample))
            else:
                places[j].append(_packed_places(old_orders[i], old_draws, fresh[j], inverse))
    excluded = {j: np.unique(np.concatenate(p), return_counts=True) if p else _NONE for j, p in places.items()}
    rest = max(0, manifest.total - len(consumed))
    draws = rest_draws(rest, mixture.draws)
    streams = [
        RestStream(
            counts[j], name, seed, epoch, *excluded.get(j, _NONE), shuffle=shuffle, epochs=epochs[j], base=fresh.get(j)
        )
        for j, name in enumerate(mixture.names)
    ]
    was = {s["name"]: len(t) for s, t in zip(old, taken, strict=True)}
    report = [StreamReport(n, was.get(n, 0), streams[j].left, draws[j]) for j, n in enumerate(mixture.names)]
    report += [StreamReport(s["name"], was[s["name"]], None, 0) for s in old if s["name"] not in index]
    return MixtureChange(
        epoch,
        mixture.names,
        draws,
        streams,
        offsets,
        len(consumed),
        mixture.composition,
        mixture.batch_size,
        report,
        "sequences" if mixture.stream_epochs else "samples",
    )


def _refuse_repacked(old: Sequence[Mapping[str, Any]], now: Mapping[str, Mapping[str, Any]]) -> None:
    """A kept stream packed otherwise than in the checkpoint (another ``seq_len`` or mode, or packed
    on one side only) has other sequences: what it consumed cannot be told apart in them, so the
    change is refused naming the stream and what changed."""
    for s in (s for s in old if s["name"] in now):
        was, new = s.get("packing"), now[s["name"]].get("packing")
        if was == new:
            continue
        if was is None or new is None:
            what = "it was not packed, now it is" if was is None else "it was packed, now it is not"
        else:
            what = ", ".join(
                f"{k} was {was.get(k)!r}, now {new.get(k)!r}" for k in {**was, **new} if was.get(k) != new.get(k)
            )
        raise MixtureChangeError(
            f"stream {s['name']!r} is packed otherwise than in the checkpoint ({what}): its sequences differ, so "
            "what it consumed this epoch cannot be kept apart in them. A mixture change keeps each kept stream's "
            f"packing: resume with the checkpoint's packing, or use {option('allow_data_change', True)}"
        )


def _base_order(stream: StreamOrder, taken: RangeSet, epoch: int) -> Any:
    """The packed order a kept packed stream's rest draws from first, when it must be one of the old
    epoch's: a ``concat`` stream's sequences are cut anew in every order, so its rest goes on in the
    one order it consumed from (``None``: it consumed nothing, a fresh order will do; ``best_fit``
    and ``none`` name their sequences alike in every order, so any fresh one will). A ``concat``
    stream that consumed from two of its orders (a stream drawn more than once an epoch, past its
    first pass) is refused by name: no order holds what it has left."""
    if stream.epochs.packing.mode != "concat" or not len(taken):
        return None
    used = sorted({int(g) for a, b in taken.ranges() for g in range(*_portions_between(stream, a, b))})
    orders = {(stream.portions[g].kind, stream.portions[g].key): stream.portions[g] for g in used}
    if len(orders) > 1:
        raise MixtureChangeError(
            f"stream {stream.name!r} packs with mode='concat' and had drawn from {len(orders)} passes of its "
            f"sequences in epoch {epoch} before the change (it is drawn more than once an epoch): concat cuts "
            "every pass into other sequences, so no pass holds exactly what it has left. Resume with the "
            "checkpoint's shares until the epoch ends, pack with mode='best_fit' or 'none', or use "
            f"{option('allow_data_change', True)}"
        )
    return stream.portion_order(next(iter(orders.values())))


def _portions_between(stream: StreamOrder, a: int, b: int) -> tuple[int, int]:
    """The portions ``[g0, g1)`` of ``stream`` that its draws ``[a, b)`` come from."""
    g0 = int(np.searchsorted(stream.starts, a, side="right")) - 1
    g1 = int(np.searchsorted(stream.starts, b - 1, side="right"))
    return g0, g1


def _packed_places(stream: StreamOrder, draws: Int64Array, fresh: Any, inverse: Int64Array | None) -> Int64Array:
    """The positions in ``fresh`` (a packed order of the stream) of the sequences at the old epoch's
    ``draws`` of ``stream``: a ``best_fit`` sequence is the same packed sequence in every order, a
    ``none`` sequence its document, found in ``fresh`` by ``inverse`` (:func:`_inverse`); a ``concat``
    stream's ``fresh`` is the very order its draws came from (:func:`_base_order`), ``inverse`` ``None``."""
    mode = stream.epochs.packing.mode
    found = []
    for _, order, positions in stream.portions_of(draws):
        if inverse is None:
            assert (order.seed, order.epoch) == (fresh.seed, fresh.epoch), "a concat rest goes on in its own order"
            found.append(positions)
        else:
            found.append(inverse[_named(order, mode)[positions]])
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def _named(order: Any, mode: str | None) -> Int64Array:
    """What each position of a packed ``order`` holds, named alike in every order of its stream:
    ``best_fit``'s packed sequence (the same sequences every epoch, shuffled), ``none``'s document."""
    named: Int64Array = order._sequences if mode == "best_fit" else order.documents  # the packing's own
    return named


def _inverse(order: Any, mode: str | None) -> Int64Array:
    """The position in ``order`` of each packed sequence (``best_fit``) or document (``none``)."""
    named = _named(order, mode)
    inverse = np.empty_like(named)
    inverse[named] = np.arange(named.size, dtype=np.int64)
    return inverse


def _refuse_renamed(old: Sequence[Mapping[str, Any]], now: Mapping[str, Mapping[str, Any]]) -> None:
    """A stream gone from the checkpoint's mixture whose data a new stream holds is a renamed stream:
    going on would serve again what it consumed, so the change is refused by both names."""
    names = {s["name"] for s in old}
    for s in (s for s in old if s["name"] not in now and "data" in s):
        same = [name for name, n in now.items() if name not in names and n.get("data") == s["data"]]
        if same:
            hidden = " (the one stream of a `reader=` with `samples_per_epoch`)" if s["name"] == "data" else ""
            raise MixtureChangeError(
                f"stream {same[0]!r} holds the same data as the checkpoint's stream {s['name']!r}{hidden}, which is "
                f"gone: as a new stream it would serve again what {s['name']!r} consumed this epoch. Name it "
                f"Stream({s['name']!r}, ...) to go on with what it has left, or pass "
                f"{option('allow_data_change', True)} to start the epoch afresh"
            )


def stream_draws(where: Layout, positions: RangeSet) -> list[RangeSet]:
    """Each stream's draws at ``positions`` of an epoch laid out by ``where``. A stream's draws come
    in order through the epoch, so a run of positions ``[a, b)`` holds its draws ``[prefix(a),
    prefix(b))``: a few integer steps per run, never per position."""
    bounds = sorted({p for run in positions.ranges() for p in run})
    prefix = {p: where.prefix(p) for p in bounds}
    return [
        RangeSet.from_ranges((prefix[a][s], prefix[b][s]) for a, b in positions.ranges() if prefix[b][s] > prefix[a][s])
        for s in range(len(where.draws))
    ]


def rest_draws(rest: int, draws: Sequence[int]) -> list[int]:
    """The ``rest`` of a changed epoch split over streams of ``draws`` an epoch (largest remainders)."""
    return apportion(rest, [int(d) for d in draws]) if rest else [0] * len(draws)


def changed_counts(ledger: Any) -> dict[str, tuple[int, int]]:
    """Per stream of a changed epoch's ``ledger`` (removed streams too): samples consumed this epoch
    and samples the epoch draws, before the change and after it (for ``inspect``)."""
    before, now = ledger.change["before"], ledger.manifest
    consumed = RangeSet.from_state(np.asarray(before["consumed"]))
    old = before["manifest"]["streams"]
    taken = stream_draws(layout_of_summary(old, before["manifest"]), consumed)
    was = {s["name"]: len(t) for s, t in zip(old, taken, strict=True)}
    rest = ledger.total - len(consumed)
    draws = rest_draws(rest, [s["draws"] for s in now["streams"]])
    served = [0] * len(draws)
    if rest:
        where = layout(draws, now.get("composition", "mixed"), now.get("batch_size"))
        served = [len(t) for t in stream_draws(where, ledger.consumed.intersection(RangeSet.interval(0, rest)))]
    counts = {}
    for i, s in enumerate(now["streams"]):
        before_change = was.pop(s["name"], 0)
        counts[s["name"]] = (before_change + served[i], before_change + draws[i])
    return counts | {name: (n, n) for name, n in was.items()}  # removed streams: what they served
