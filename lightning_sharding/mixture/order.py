"""Mixtures: the epoch order of several weighted streams, a pure function like :mod:`order`.

A mixture's epoch has ``samples_per_epoch`` positions. Each stream contributes ``draws`` of them
(from its ``weight``, ``proportion``, ``repeat`` or ``choose``), and position ``p`` maps to
``(stream, draw)`` and then to ``(item, index)`` of that stream, without an array of size N:

1. **Draws.** Fixed streams (``proportion``, ``repeat``, ``choose``) take what they ask for; weighted
   streams share the rest by largest remainders. Nothing depends on the topology.
2. **A stream's draws in epoch e.** ``f`` whole passes (each a fresh :class:`EpochOrder` of the
   stream) and, for a remainder ``r``, one chunk of a *cycle*: cycle ``c`` is one more order of the
   stream cut into chunks of ``r`` served in epochs ``c*m .. c*m+m-1`` (``m = ceil(n / r)``); the
   last chunk is topped up from the cycle's first. So an up-sampled stream repeats whole passes
   before partial ones, and a down-sampled one serves a different subset each epoch and all of
   itself over ``m`` epochs, never a sample twice in one epoch.
3. **Layout.** The draws are placed in the epoch by the batch composition (:mod:`composition`;
   ``mixed`` is the :mod:`interleave`, every stream within 2 of its share in any prefix), mapped
   from a position exactly, with integers, without walking the epoch.

Streams are seeded by their names, so adding a stream leaves the others' orders as they were.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.blocks import Blocks
from lightning_sharding.core.order import EpochOrder, derive_seed
from lightning_sharding.mixture.composition import apportion, blocks_of, layout
from lightning_sharding.mixture.schedule import Phased, schedule_changes

Int64Array = npt.NDArray[np.int64]

_PASS_SEEDS = 0x9A55
_CYCLE_SEEDS = 0xC7C1
_RUN_SEEDS = 0x2C0A
SHARES = ("weight", "proportion", "repeat", "choose")


@dataclass(frozen=True)
class StreamSpec:
    """One stream's share of a mixture: exactly one of ``weight`` (relative share of what the fixed
    streams leave of the epoch), ``proportion`` (a fraction up to 1 of the stream per epoch),
    ``repeat`` (passes per epoch: 2.0 twice, 0.5 half) or ``choose`` (samples per epoch)."""

    name: str
    weight: float | None = None
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def __post_init__(self) -> None:
        where = f"stream {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a stream needs a non-empty name, got {self.name!r}")
        given = [key for key in SHARES if getattr(self, key) is not None]
        if len(given) > 1:
            raise ValueError(f"{where} sets {' and '.join(given)}; give one of {', '.join(SHARES)}")
        for key in given:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{where}: {key}={value!r} must be a number")
            if value <= 0:
                raise ValueError(f"{where}: {key}={value!r} must be greater than 0")
        if self.proportion is not None and self.proportion > 1:
            raise ValueError(f"{where}: proportion={self.proportion} is above 1; use repeat= to up-sample a stream")
        if self.choose is not None and (not isinstance(self.choose, int) or isinstance(self.choose, bool)):
            raise ValueError(f"{where}: choose={self.choose!r} must be a whole number of samples")

    @property
    def weighted(self) -> bool:
        """Whether the stream shares the epoch by weight (also when it names no share at all)."""
        return self.proportion is None and self.repeat is None and self.choose is None

    def fixed_draws(self, size: int) -> int:
        """Samples per epoch a fixed stream of ``size`` samples asks for (at least 1)."""
        if self.choose is not None:
            return int(self.choose)
        factor = self.proportion if self.proportion is not None else self.repeat
        assert factor is not None
        return max(1, round(factor * size))

    def describe(self) -> str:
        """``weight=0.7``, ``repeat=2.0``... (``weight=1`` for a stream that names no share)."""
        for key in SHARES:
            if getattr(self, key) is not None:
                return f"{key}={getattr(self, key)}"
        return "weight=1"


def plan_draws(specs: Sequence[StreamSpec], sizes: Sequence[int], samples_per_epoch: int | None = None) -> list[int]:
    """Samples each stream contributes to one epoch.

    Without ``samples_per_epoch``, the epoch is what the fixed streams ask for plus one pass over
    the weighted streams; with it, the weighted streams share what the fixed ones leave (or, with
    no weighted stream, the fixed streams are scaled to it).
    """
    for spec, size in zip(specs, sizes, strict=True):
        if size < 1:
            raise ValueError(f"stream {spec.name!r} has no samples; remove it or check its data")
    if samples_per_epoch is not None and (
        isinstance(samples_per_epoch, bool) or not isinstance(samples_per_epoch, int) or samples_per_epoch < 1
    ):
        raise ValueError(f"samples_per_epoch={samples_per_epoch!r} must be a whole number of 1 or more")
    draws = [0 if spec.weighted else spec.fixed_draws(size) for spec, size in zip(specs, sizes, strict=True)]
    weighted = [i for i, spec in enumerate(specs) if spec.weighted]
    fixed = sum(draws)
    if not weighted:
        if samples_per_epoch is None or samples_per_epoch == fixed:
            return draws
        return apportion(samples_per_epoch, draws)
    left = (fixed + sum(sizes[i] for i in weighted) if samples_per_epoch is None else samples_per_epoch) - fixed
    if left < 1:
        names = ", ".join(repr(specs[i].name) for i in weighted)
        raise ValueError(
            f"samples_per_epoch={samples_per_epoch} leaves nothing for the weighted stream(s) {names}: the other "
            f"streams take {fixed}. Raise samples_per_epoch or lower the other streams' shares."
        )
    for i, share in zip(weighted, apportion(left, [specs[i].weight or 1.0 for i in weighted]), strict=True):
        draws[i] = share
    return draws


def stream_seed(seed: int, name: str, kind: int) -> int:
    """The seed of one stream's passes or cycles: from its name, so other streams do not move it."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return derive_seed(seed, kind, digest)


@dataclass(frozen=True)
class Portion:
    """``[lo, hi)`` of one order of a stream that an epoch draws from: a whole pass (``kind``
    _PASS_SEEDS) or a chunk of a cycle's order (_CYCLE_SEEDS); ``key`` numbers the pass or cycle."""

    kind: int
    key: int
    lo: int
    hi: int


def stream_portions(size: int, draws: int, epoch: int) -> list[Portion]:
    """The orders and ranges a stream of ``size`` samples serves its ``draws`` of ``epoch`` from."""
    passes, rest = divmod(draws, size)
    portions = [Portion(_PASS_SEEDS, epoch * passes + i, 0, size) for i in range(passes)]
    if rest:
        per_cycle = -(-size // rest)  # epochs per cycle; at least 2, since rest < size
        cycle, turn = divmod(epoch, per_cycle)
        lo = turn * rest
        if turn < per_cycle - 1:
            portions.append(Portion(_CYCLE_SEEDS, cycle, lo, lo + rest))
        else:  # the cycle's last chunk is short: topped up with the cycle's first samples
            portions.append(Portion(_CYCLE_SEEDS, cycle, lo, size))
            portions.append(Portion(_CYCLE_SEEDS, cycle, 0, rest - (size - lo)))
    return portions


def running_portions(size: int, draws: int, epoch: int) -> list[Portion]:
    """The passes a stream of ``size`` samples serves ``draws`` of ``epoch`` from when its draws may
    still grow (a mixture under online control): fresh passes one after the other, the last cut
    short, each keyed by ``(epoch, pass)`` alone, so draw ``k`` is the same sample however many
    draws the epoch ends up taking."""
    passes, rest = divmod(draws, size)
    keys = [derive_seed(epoch, i) for i in range(passes + (1 if rest else 0))]
    return [Portion(_RUN_SEEDS, key, 0, size if i < passes else rest) for i, key in enumerate(keys)]


class StreamOrder:
    """One stream's ``draws`` of one epoch, mapped to ``(item, index)`` of the stream's own items
    (``counts``, its items' sample counts): its passes and its cycle chunk (:func:`stream_portions`),
    or, ``running``, fresh passes whose draws do not depend on how many there are (:func:`running_portions`).

    ``epochs``: the stream's own epochs when they are not plain (packed token sequences): its
    samples are then their positions, and each pass or cycle is one of their orders."""

    def __init__(
        self,
        counts: npt.ArrayLike,
        name: str,
        draws: int,
        seed: int,
        epoch: int,
        *,
        shuffle: bool = True,
        epochs: Any = None,
        running: bool = False,
    ) -> None:
        self.counts: Int64Array = np.asarray(counts, dtype=np.int64)
        self.name = name
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epochs = epochs
        self.size = int(self.counts.sum()) if epochs is None else int(epochs.total)
        portions = running_portions if running else stream_portions
        self.portions = portions(self.size, int(draws), int(epoch)) if draws else []
        self.starts = np.cumsum([0] + [g.hi - g.lo for g in self.portions]).astype(np.int64)
        self._orders: OrderedDict[tuple[int, int], Any] = OrderedDict()

    def portion_order(self, portion: Portion) -> Any:
        """The order of the pass or cycle chunk ``portion`` draws from (the newest few are kept):
        an :class:`EpochOrder`, or the stream's own epochs' order."""
        key = (portion.kind, portion.key)
        order = self._orders.get(key)
        if order is None:
            seed = stream_seed(self.seed, self.name, portion.kind)
            if self.epochs is None:
                order = EpochOrder(self.counts, seed, portion.key, shuffle=self.shuffle)
            else:
                order = self.epochs.order(self.counts, seed, portion.key, shuffle=self.shuffle)
            self._orders[key] = order
            if len(self._orders) > 4:
                self._orders.popitem(last=False)
        return order

    def portions_of(self, draws: npt.ArrayLike) -> list[tuple[Int64Array, Any, Int64Array]]:
        """The draws grouped by the pass or cycle chunk they come from: ``(where, order, positions)``
        for each, ``where`` indexing ``draws`` and ``positions`` their positions in ``order``."""
        draw = np.asarray(draws, dtype=np.int64)
        which = np.searchsorted(self.starts, draw, side="right") - 1
        out = []
        for g in np.unique(which).tolist():
            where = np.flatnonzero(which == g)
            portion = self.portions[g]
            out.append((where, self.portion_order(portion), draw[where] - self.starts[g] + portion.lo))
        return out

    def items_from(self, draw: int, count: int) -> Int64Array:
        """The stream's items (0-based in the stream) from the one holding ``draw`` on, in draw order,
        at most ``count``: an item recurs when a later pass draws it again; none past the epoch's end."""
        found: list[Int64Array] = []
        left = count
        g = int(np.searchsorted(self.starts, draw, side="right")) - 1
        while 0 <= g < len(self.portions) and left > 0:
            portion = self.portions[g]
            order = self.portion_order(portion)
            lo = portion.lo + max(draw - int(self.starts[g]), 0)
            if self.epochs is not None:  # another kind of order: its own look-ahead
                found.append(order.items_from(lo, left))
                left -= found[-1].size
                g += 1
                continue
            first = int(np.searchsorted(order.starts, lo, side="right")) - 1
            end = int(np.searchsorted(order.starts, portion.hi, side="left"))
            found.append(order.item_order[first : min(end, first + left)])
            left -= found[-1].size
            g += 1
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    def locate(self, draws: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """The stream's item (0-based in the stream) and sample index of each draw, shape ``(n,)`` each."""
        draw = np.asarray(draws, dtype=np.int64)
        items, index = np.empty_like(draw), np.empty_like(draw)
        for where, order, positions in self.portions_of(draw):
            items[where], index[where] = order.locate(positions)
        return items, index


class MixtureOrder:
    """Maps a mixture's epoch positions to ``(item, index)`` and to streams, for one ``(seed, epoch)``.

    ``counts`` holds every stream's item counts, stream after stream; ``stream_items[s]`` is how many
    items stream ``s`` has; ``draws`` the samples per epoch of each stream (:func:`plan_draws`);
    ``composition`` and ``batch_size`` place the draws in the epoch (:mod:`~lightning_sharding.mixture.composition`).
    """

    def __init__(
        self,
        names: Sequence[str],
        counts: npt.ArrayLike,
        stream_items: Sequence[int],
        draws: Sequence[int],
        seed: int,
        epoch: int,
        *,
        shuffle: bool = True,
        composition: str = "mixed",
        batch_size: int | None = None,
        stream_epochs: Sequence[Any] = (),
        phases: Sequence[Sequence[int]] = (),
        controlled: Phased | None = None,
    ) -> None:
        # ``controlled``: the layout of an epoch under online control (:mod:`~lightning_sharding.mixture.control`),
        # whose draws it fixes and whose streams draw running passes.
        if controlled is not None:
            draws = controlled.draws
        self.names = tuple(names)
        self.composition = composition
        self.counts: Int64Array = np.asarray(counts, dtype=np.int64)
        self.draws = tuple(int(d) for d in draws)
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.shuffle = bool(shuffle)
        self.total = sum(self.draws)
        self.item_offsets = np.concatenate(([0], np.cumsum(stream_items))).astype(np.int64)
        if int(self.item_offsets[-1]) != self.counts.size or len(self.names) != len(self.draws):
            raise ValueError("MixtureOrder: the streams' item counts, names and draws do not line up")
        epochs = tuple(stream_epochs) or (None,) * len(self.names)
        self.stream_orders = [
            StreamOrder(
                self.counts[a:b],
                name,
                d,
                self.seed,
                self.epoch,
                shuffle=self.shuffle,
                epochs=e,
                running=controlled is not None,
            )
            for name, a, b, d, e in zip(
                self.names, self.item_offsets[:-1], self.item_offsets[1:], self.draws, epochs, strict=True
            )
        ]
        self.sizes = [s.size for s in self.stream_orders]
        self.interleave = controlled or (Phased(phases) if phases else layout(self.draws, composition, batch_size))
        self.prefix = self.interleave.prefix
        self.streams = self.interleave.streams
        self.blocks: Blocks | None = blocks_of(self.interleave)
        # A share schedule's phases are trained one after the other: the plan serves it in time order.
        self.in_time_order = isinstance(self.interleave, Phased)

    def locate(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Item ids (over all streams) and sample indices of epoch positions, shape ``(n,)`` each."""
        return locate_streams(self.streams(positions), self.stream_orders, self.item_offsets)

    def items_from(self, position: int, count: int) -> Int64Array:
        """Each stream's next items from its draw at ``position`` on, at most ``count`` of each,
        stream after stream: a worker reading on from ``position`` reads them next."""
        streams = zip(self.stream_orders, self.prefix(position), self.item_offsets[:-1].tolist(), strict=True)
        return np.concatenate([s.items_from(draw, count) + offset for s, draw, offset in streams])

    def record(self) -> dict[str, Any]:
        """Nothing beyond the manifest's summary (its streams and composition), seed and epoch."""
        return {}


def locate_streams(
    stream_draw: tuple[Int64Array, Int64Array], orders: Sequence[Any], item_offsets: Int64Array
) -> tuple[Int64Array, Int64Array]:
    """Item ids (over all streams) and sample indices of ``(stream, draw)`` pairs, each stream's
    draws located by ``orders[stream].locate``; shape ``(n,)`` each."""
    stream, draw = stream_draw
    items, index = np.empty_like(stream), np.empty_like(stream)
    for s in np.unique(stream).tolist():
        mask = stream == s
        local_items, index[mask] = orders[s].locate(draw[mask])
        items[mask] = local_items + item_offsets[s]
    return items, index


@dataclass(frozen=True)
class Mixture:
    """What a manifest of several streams adds to its items: each stream's name, share, number of
    items (its items come stream after stream) and samples per epoch, and the batch composition
    (with the batch size it cuts blocks of, for ``stratified`` and ``per_stream``)."""

    names: tuple[str, ...]
    shares: tuple[str, ...]
    stream_items: tuple[int, ...]
    draws: tuple[int, ...]
    composition: str = "mixed"
    batch_size: int | None = None
    # Each stream's own epochs when they are not plain (packed token sequences); () for none.
    stream_epochs: tuple[Any, ...] = ()
    # A share schedule (mixture.schedule): each phase's start, shares and draws; () for fixed shares.
    schedule: tuple[dict[str, Any], ...] = ()
    # A share schedule over training (mixture.control): each phase's samples since the start and shares.
    training: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        layout(self.draws, self.composition, self.batch_size)  # checks the composition
        if (self.schedule or self.training) and self.composition != "mixed":
            raise ValueError(
                f"a share schedule needs batch_composition='mixed', not {self.composition!r}: its phases cut "
                "the epoch where their fractions say, not at batch blocks"
            )

    @property
    def phases(self) -> tuple[tuple[int, ...], ...]:
        """Each phase's draws of each stream (``()`` without a schedule)."""
        return tuple(tuple(int(d) for d in p["draws"]) for p in self.schedule)

    def order(self, counts: npt.ArrayLike, seed: int, epoch: int, *, shuffle: bool = True) -> MixtureOrder:
        """The epoch order of this mixture over items of sample ``counts``."""
        mix: dict[str, Any] = {"shuffle": shuffle, "composition": self.composition, "batch_size": self.batch_size}
        mix["stream_epochs"] = self.stream_epochs
        mix["phases"] = self.phases
        return MixtureOrder(self.names, counts, self.stream_items, self.draws, seed, epoch, **mix)

    @property
    def total(self) -> int:
        """Positions of an epoch: the streams' draws."""
        return sum(self.draws)

    @property
    def mixture(self) -> Mixture:
        """Itself: epochs that follow a mixture name it as ``mixture`` (see :func:`mixture_of`)."""
        return self

    @property
    def blocks(self) -> Blocks | None:
        """The blocks every batch must follow (``None`` for ``mixed``, scheduled or not)."""
        return None if self.schedule else blocks_of(layout(self.draws, self.composition, self.batch_size))

    def blocks_at(self, epoch: int) -> Blocks | None:
        """The blocks of any epoch's batches: :attr:`blocks`."""
        return self.blocks

    def composition_summary(self) -> dict[str, object]:
        """The composition as a checkpoint keeps it (empty for ``mixed``, as before compositions),
        and the share schedule (absent without one, as before schedules)."""
        if self.schedule:
            return {"schedule": [dict(p) for p in self.schedule]}
        if self.training:
            return {"training_schedule": [dict(p) for p in self.training]}
        if self.composition == "mixed":
            return {}
        return {"composition": self.composition, "batch_size": self.batch_size}

    def stream_summary(self, counts: npt.ArrayLike) -> list[dict[str, object]]:
        """Per stream: name, share, samples and draws per epoch (what a checkpoint keeps of the spec)."""
        counts = np.asarray(counts, dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(self.stream_items))).astype(np.int64)
        rows: list[dict[str, object]] = [
            {"name": name, "share": share, "samples": int(counts[a:b].sum()), "draws": draws}
            for name, share, a, b, draws in zip(
                self.names, self.shares, offsets[:-1], offsets[1:], self.draws, strict=True
            )
        ]
        for row, epochs in zip(rows, self.stream_epochs, strict=False):
            if epochs is not None:  # a packed stream: its samples are sequences, from its documents
                row["samples"] = int(epochs.total)
                row["packing"] = epochs.identity_summary()
        return rows

    def identity(self, counts: npt.NDArray[np.int64]) -> list[Any]:
        """What the manifest's fingerprint hashes of the mixture: its streams, then a blocked composition."""
        composition = self.composition_summary()
        return [self.stream_summary(counts), *([composition] if composition else [])]

    def stream_fingerprints(self, items: Sequence[Any], *, by_path: bool = False) -> list[str]:
        """A SHA-256 of each stream's items (names without the ``"<stream>/"`` prefix, counts,
        content ids), in stream order: the same data under another stream name, root or mount
        has the same one. ``by_path``: of their keys and fingerprints instead, as 0.1 kept them."""
        found, start = [], 0
        for name, size in zip(self.names, self.stream_items, strict=True):
            digest = hashlib.sha256()
            for it in items[start : start + size]:
                key, content = (it.key, it.fingerprint) if by_path else it.identity
                # JSON-encoded, so a tab or newline inside a key or an ETag cannot forge another item list.
                digest.update(json.dumps([key[len(name) + 1 :], int(it.num_samples), content]).encode())
                digest.update(b"\n")
            found.append(digest.hexdigest())
            start += size
        return found

    def summary(self, items: Sequence[Any], counts: npt.NDArray[np.int64]) -> dict[str, Any]:
        """The streams with their data's fingerprint (outside the manifest's fingerprint, which
        predates it: a mixture change checks that a kept stream's data is the same), and a blocked
        composition."""
        streams = self.stream_summary(counts)
        data = self.stream_fingerprints(items)
        by_path = self.stream_fingerprints(items, by_path=True)
        rows = [
            {**s, "data": f, **({"data_by_path": p} if p != f else {})}
            for s, f, p in zip(streams, data, by_path, strict=True)
        ]
        return {
            "streams": rows,
            **self.composition_summary(),
        }

    def explain(self, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
        """How the streams and the composition of two manifest summaries differ, one phrase each."""
        diffs = _stream_changes(before.get("streams") or [], after.get("streams") or [])
        for name in ("composition", "batch_size"):  # a stratified or per_stream mixture's blocks
            default = "mixed" if name == "composition" else None
            was, now = before.get(name, default), after.get(name, default)
            if before.get("streams") and after.get("streams") and was != now:
                diffs.append(f"the mixture's {name} was {was!r}, now {now!r}")
        if before.get("streams") and after.get("streams"):
            diffs += schedule_changes(before.get("schedule") or [], after.get("schedule") or [])
            was, now = before.get("training_schedule") or [], after.get("training_schedule") or []
            if was != now:
                diffs.append(f"the mixture's schedule over training was {_phases_shown(was)}, now {_phases_shown(now)}")
        return diffs


class OnMixture:
    """Epochs that keep a ``mixture``'s data and identity and order some epochs their own way (a
    change on resume, online decisions): their size, identity, summary and explanations are the
    mixture's. Subclasses are frozen dataclasses with a ``mixture`` field."""

    mixture: Mixture

    @property
    def total(self) -> int:
        """Positions of an epoch of the mixture."""
        return self.mixture.total

    def identity(self, counts: npt.NDArray[np.int64]) -> list[Any]:
        """The mixture's: the data and the mixture are its."""
        return self.mixture.identity(counts)

    def summary(self, items: Sequence[Any], counts: npt.NDArray[np.int64]) -> dict[str, Any]:
        """The mixture's."""
        return self.mixture.summary(items, counts)

    def explain(self, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
        """The mixture's."""
        return self.mixture.explain(before, after)


def _phases_shown(phases: list[dict[str, Any]]) -> str:
    return "; ".join(f"from sample {p['samples']}: {dict(p['shares'])}" for p in phases) or "none"


def _stream_changes(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """How a mixture's streams changed, one phrase per stream: added, removed, or its share or size."""
    old = {s["name"]: s for s in before}
    new = {s["name"]: s for s in after}
    changes = [f"stream {name!r} was removed" for name in old if name not in new]
    changes += [f"stream {name!r} was added" for name in new if name not in old]
    for name in (n for n in new if n in old):
        if old[name].get("data", new[name].get("data")) != new[name].get("data"):
            changes.append(f"stream {name!r} holds other data (its items or their fingerprints changed)")
        if old[name].get("packing") != new[name].get("packing"):
            was, now = old[name].get("packing") or {}, new[name].get("packing") or {}
            fields = [f"{k} was {was.get(k)!r}, now {now.get(k)!r}" for k in {**was, **now} if was.get(k) != now.get(k)]
            changes.append(f"stream {name!r} packing: {', '.join(fields)}")
        for key in ("share", "samples", "draws"):
            if old[name][key] != new[name][key]:
                changes.append(f"stream {name!r} {key} was {old[name][key]!r}, now {new[name][key]!r}")
    return changes


def mixture_of(manifest: Any) -> Mixture | None:
    """The mixture a manifest's epochs follow (``None``: not a mixture). A mixture's epochs, changed
    or not, name it as their ``mixture``."""
    mixture: Mixture | None = getattr(manifest.epochs, "mixture", None)
    return mixture


def change_of(manifest: Any) -> Any:
    """The :class:`~lightning_sharding.mixture.change.MixtureChange` of a manifest resumed under
    another mixture in the middle of an epoch (``None``: none)."""
    return getattr(manifest.epochs, "change", None)
