"""Epoch orders: the :class:`Order` protocol the planner, the strategies and the audit take, and
:class:`EpochOrder`, the plain order of a manifest's items.

An order is a pure function of (the data, seed, epoch), never of the topology: it maps the epoch's
positions ``[0, total)`` to ``(item, index inside the item)``, says which batch boundaries it
imposes (:class:`~lightning_sharding.core.blocks.Blocks`), which items come from a position on (for
fetching ahead), and what a checkpoint records of it. The ledger counts positions, so resume and
rescale work the same for every order. A manifest's epochs are plain :class:`EpochOrder` s unless
it carries :class:`~lightning_sharding.core.manifest.Epochs` of another kind (a mixture, a changed
mixture), known to the core only through that protocol.

The plain order permutes items, then samples inside each item. Position ``g`` maps to its item
through prefix sums, so no array of size N is ever built. Ranks and workers take contiguous runs
of positions, which keeps each reader on one item at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import cache, cached_property
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.blocks import Blocks

Int64Array = npt.NDArray[np.int64]

# Every random stream starts with its own tag and its word count, so no two streams share a seed
# (SeedSequence pads its input with zeros: [s, e, 0] and [s, e, 0, 0] would otherwise collide).
_ITEM_STREAM = 0x17E3
_SAMPLE_STREAM = 0x5A3B
_DERIVED_STREAM = 0xD5E7
_MASK64 = (1 << 64) - 1


def _seed_words(tag: int, words: tuple[int, ...]) -> list[int]:
    return [tag, len(words), *(w & _MASK64 for w in words)]


def _rng(tag: int, *words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(_seed_words(tag, words))))


# A permutation's tail from ``first`` on (see _permutation_tail) is drawn swap by swap in Python, about
# as costly as _TAIL_SHARE elements of NumPy's whole shuffle: worth it only when the tail is that much
# shorter than the item, and the item large enough to be worth a second path.
_TAIL_SHARE = 64
_TAIL_MIN = 1 << 16
_LOW32 = 0xFFFFFFFF


def _permutation_tail(rng: np.random.Generator, count: int, first: int) -> Int64Array:
    """``rng.permutation(count)[first:]`` from a fresh ``rng``, in ``O(count - first)``.

    NumPy's ``Generator.permutation(n)`` shuffles ``arange(n)`` by Fisher-Yates from the end: for
    ``i = n - 1`` down to 1 it swaps places ``i`` and ``j``, ``j`` uniform in ``[0, i]`` (the next
    32-bit output, a 64-bit output giving its low half then its high half, masked to the smallest
    all-ones mask covering ``i``, drawn again while above ``i``). Place ``i`` is final after its own
    swap, so the last ``count - first`` places need only the first ``count - first`` swaps and a map
    of the places they moved. Exact only as long as NumPy shuffles so: :func:`_tails_exact` checks it.
    """
    bits = rng.bit_generator
    swaps = count - max(first, 1)  # place 0 takes no swap of its own: it is what the others leave
    moved: dict[int, int] = {}
    raw: list[int] = bits.random_raw(swaps + swaps // 2 + 8).tolist()
    at, high = 0, -1  # the next raw output; the high half left of the last one (-1: none)
    for i in range(count - 1, count - 1 - swaps, -1):
        mask = (1 << i.bit_length()) - 1
        while True:
            if high >= 0:
                j, high = high & mask, -1
            else:
                if at == len(raw):
                    raw, at = bits.random_raw(64).tolist(), 0
                j, high = raw[at] & _LOW32 & mask, raw[at] >> 32
                at += 1
            if j <= i:
                break
        moved[i], moved[j] = moved.get(j, j), moved.get(i, i)
    return np.fromiter((moved.get(k, k) for k in range(first, count)), dtype=np.int64, count=count - first)


@cache
def _tails_exact() -> bool:
    """Whether :func:`_permutation_tail` gives what this NumPy's ``permutation`` gives (checked once a
    process on a small case; where not, every permutation is drawn whole)."""
    count, first = 5000, 4700
    whole = _rng(_SAMPLE_STREAM, 1, 2, 3).permutation(count)
    return bool(np.array_equal(whole[first:], _permutation_tail(_rng(_SAMPLE_STREAM, 1, 2, 3), count, first)))


def derive_seed(seed: int, *words: int) -> int:
    """A 63-bit seed derived from ``seed`` and further integers (epoch, rank, worker, position...).

    Equal inputs give equal outputs on every platform; nearby inputs give unrelated outputs.
    """
    ss = np.random.SeedSequence(_seed_words(_DERIVED_STREAM, (seed, *words)))
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


# NumPy's SeedSequence (Melissa O'Neill's seed_seq_fe, pool of 4 words): its hash constants.
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _MASK32, _POOL = 0xCA01F9DD, 0x4973F715, 0xFFFFFFFF, 4


def derive_seeds(seed: int, words: tuple[int, ...], last: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """``derive_seed(seed, *words, p)`` for every ``p`` of ``last`` (non-negative integers), at once:
    the same values, bit for bit, from NumPy's ``SeedSequence`` hash run over the whole array (a seed
    costs about 12 us through ``SeedSequence``; a batch of 64 about 40 us this way)."""
    values = np.asarray(last).reshape(-1)
    if values.size and int(values.min()) < 0:
        raise ValueError(f"derive_seeds takes non-negative integers, got {int(values.min())}")
    values = values.astype(np.uint64)
    out = np.empty(values.size, dtype=np.uint64)
    big = values > np.uint64(_MASK32)  # two 32-bit words of entropy instead of one
    for group, two in ((np.flatnonzero(~big), False), (np.flatnonzero(big), True)):
        if group.size:
            out[group] = _derived(seed, words, values[group], two)
    return out


def _hashmix(value: int, hash_const: int) -> tuple[int, int]:
    """SeedSequence's ``hashmix`` of one 32-bit word: the word, and the next hash constant."""
    value ^= hash_const
    hash_const = hash_const * _MULT_A & _MASK32
    value = value * hash_const & _MASK32
    return value ^ (value >> 16), hash_const


def _mix(x: int, y: int) -> int:
    result = (_MIX_L * x - _MIX_R * y) & _MASK32
    return result ^ (result >> 16)


@cache
def _pool_before(seed: int, words: tuple[int, ...]) -> tuple[tuple[int, ...], int] | None:
    """SeedSequence's pool and hash constant once the entropy of ``(seed, *words)`` is mixed in, before
    the last word's (``None`` when those words are fewer than the pool: then the last word mixes first)."""
    entropy: list[int] = []
    for word in _seed_words(_DERIVED_STREAM, (seed, *words, 0))[:-1]:
        entropy.extend([0] if word == 0 else [(word >> s) & _MASK32 for s in range(0, word.bit_length(), 32)])
    if len(entropy) < _POOL:
        return None
    hash_const, pool = _INIT_A, []
    for value in entropy[:_POOL]:
        mixed, hash_const = _hashmix(value, hash_const)
        pool.append(mixed)
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                mixed, hash_const = _hashmix(pool[src], hash_const)
                pool[dst] = _mix(pool[dst], mixed)
    for value in entropy[_POOL:]:
        for dst in range(_POOL):
            mixed, hash_const = _hashmix(value, hash_const)
            pool[dst] = _mix(pool[dst], mixed)
    return tuple(pool), hash_const


def _derived(seed: int, words: tuple[int, ...], last: npt.NDArray[np.uint64], two: bool) -> npt.NDArray[np.uint64]:
    """:func:`derive_seeds` for values of ``last`` that all take one 32-bit word (``two``: two)."""
    before = _pool_before(seed, words)
    if before is None:  # few words: the slow way, each value through SeedSequence
        return np.array([derive_seed(seed, *words, int(p)) for p in last.tolist()], dtype=np.uint64)
    pool_ints, hash_const = before
    last_words = [(last & np.uint64(_MASK32)).astype(np.uint32)]
    if two:
        last_words.append((last >> np.uint64(32)).astype(np.uint32))
    shift = np.uint32(16)
    pool: list[Any] = [np.uint32(v) for v in pool_ints]
    with np.errstate(over="ignore"):  # 32-bit wrapping arithmetic is the hash
        for word in last_words:
            for dst in range(_POOL):
                value = word ^ np.uint32(hash_const)
                hash_const = hash_const * _MULT_A & _MASK32
                value *= np.uint32(hash_const)
                value ^= value >> shift
                mixed = np.uint32(_MIX_L) * pool[dst] - np.uint32(_MIX_R) * value
                pool[dst] = mixed ^ (mixed >> shift)
        state = []
        hash_const = _INIT_B
        for k in range(2):  # generate_state(1, uint64): two 32-bit words, low then high
            value = pool[k] ^ np.uint32(hash_const)
            hash_const = hash_const * _MULT_B & _MASK32
            value *= np.uint32(hash_const)
            state.append((value ^ (value >> shift)).astype(np.uint64))
    seeds: npt.NDArray[np.uint64] = (state[0] | (state[1] << np.uint64(32))) >> np.uint64(1)
    return seeds


class Order(Protocol):
    """One epoch's order: what the planner, the strategies, the look-ahead and the audit need of it.

    ``total`` is the epoch's positions; ``blocks`` the batch boundaries it imposes (``None``: the
    plan cuts batches anywhere). An order whose positions are also training time (a mixture's
    share schedule) sets an attribute ``in_time_order = True``, and the plan then serves position
    ``p`` at about step ``p / (ranks x batch size)`` on every rank (:mod:`~lightning_sharding.core.plan`);
    without it, ranks and workers read their own runs of the epoch.
    """

    @property
    def epoch(self) -> int:
        """The epoch this order is of."""
        ...

    @property
    def total(self) -> int:
        """Positions of the epoch."""
        ...

    @property
    def blocks(self) -> Blocks | None:
        """The batch boundaries the order imposes (``None``: the plan cuts batches anywhere)."""
        ...

    def locate(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Item ids (manifest order) and sample indices of ``positions`` (shape ``(n,)``), each ``(n,)``."""
        ...

    def items_from(self, position: int, count: int) -> Int64Array:
        """The ids of up to ``count`` items read from ``position`` on, in order (none: no look-ahead)."""
        ...

    def record(self) -> dict[str, Any]:
        """What a checkpoint's audit header records of this epoch's order beyond the manifest's
        summary (empty for an order that the manifest, seed and epoch describe alone)."""
        ...


class EpochOrder:
    """Maps epoch positions to ``(item, index)`` for one ``(seed, epoch)``: the plain :class:`Order`.

    ``counts`` is the manifest's int64 sample count per item, shape ``(num_items,)``. With
    ``shuffle=False`` the order is the manifest order. The item permutation is drawn when first
    needed, so an order made only to plan (its ``total`` and ``blocks``) costs nothing.
    """

    blocks: Blocks | None = None

    def __init__(
        self, counts: npt.ArrayLike, seed: int, epoch: int, *, shuffle: bool = True, cache_items: int = 8
    ) -> None:
        self.counts: Int64Array = np.asarray(counts, dtype=np.int64)
        if self.counts.ndim != 1 or self.counts.size == 0:
            raise ValueError(f"EpochOrder needs a non-empty 1-d array of counts, got shape {self.counts.shape}")
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.shuffle = bool(shuffle)
        self.total = int(self.counts.sum())
        self._cache: OrderedDict[int, tuple[int, Int64Array]] = OrderedDict()  # item -> _inner's (start, perm)
        self._cache_items = cache_items

    @cached_property
    def item_order(self) -> Int64Array:
        """The items in epoch order, shape ``(num_items,)``."""
        n = self.counts.size
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        # rng.permutation(n) shuffles arange(n): the same swaps on 4-byte integers give the same
        # order in about half the time (less memory to move), for the 10^6 items of a stream.
        order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
        _rng(_ITEM_STREAM, self.seed, self.epoch).shuffle(order)
        return order.astype(np.int64)

    @cached_property
    def starts(self) -> Int64Array:
        """Where each slot of :attr:`item_order` starts in the epoch, shape ``(num_items + 1,)``."""
        return np.concatenate((np.zeros(1, np.int64), np.cumsum(self.counts[self.item_order])))

    def record(self) -> dict[str, Any]:
        """Nothing beyond the manifest, seed and epoch."""
        return {}

    def _inner(self, item: int, first: int = 0) -> tuple[int, Int64Array]:
        """``(start, perm[start:])`` of the permutation ``perm`` of an item's sample indices (shape
        ``(counts[item],)``), with ``start <= first``: the whole (start 0), or only its tail from
        ``first`` when that is a small share of a large item (what a resume's first batch in the
        last samples of an item asks; see :func:`_permutation_tail`). The same values either way."""
        held = self._cache.get(item)
        if held is not None and held[0] <= first:
            self._cache.move_to_end(item)
            return held
        count = int(self.counts[item])
        # One sample (a token window, a row per item) has one order: no generator to seed.
        if count <= 1:
            held = (0, np.arange(count))
        elif count >= _TAIL_MIN and (count - first) * _TAIL_SHARE <= count < 2**32 and _tails_exact():
            held = (first, _permutation_tail(_rng(_SAMPLE_STREAM, self.seed, self.epoch, item), count, first))
        else:
            held = (0, _rng(_SAMPLE_STREAM, self.seed, self.epoch, item).permutation(count))
        self._cache[item] = held
        self._cache.move_to_end(item)
        if len(self._cache) > self._cache_items:
            self._cache.popitem(last=False)
        return held

    def locate(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Item ids and sample indices for epoch positions.

        ``positions`` has shape ``(n,)`` with values in ``[0, total)``; both results have shape ``(n,)``.
        """
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.total):
            bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
            raise ValueError(f"epoch position {bad} is outside [0, {self.total})")
        slots = np.searchsorted(self.starts, pos, side="right") - 1
        items = self.item_order[slots]
        local = pos - self.starts[slots]
        if not self.shuffle:
            return items, local
        index = local.copy()
        for group in self._by_item(items):
            inside = local[group]
            start, perm = self._inner(int(items[group[0]]), int(inside.min()))
            index[group] = perm[inside - start]
        return items, index

    def sample_order(self) -> Int64Array:
        """Every position's sample as one number (samples numbered item after item in manifest
        order), shape ``(total,)``: :meth:`locate` of the whole epoch, one draw per item (an order
        that lays out single samples, such as packed documents, needs them all)."""
        first = np.concatenate(([0], np.cumsum(self.counts)[:-1]))
        parts = []
        for item in self.item_order.tolist():
            count = int(self.counts[item])
            if count == 0:
                continue
            if not self.shuffle or count == 1:
                parts.append(np.arange(first[item], first[item] + count, dtype=np.int64))
            else:
                parts.append(first[item] + _rng(_SAMPLE_STREAM, self.seed, self.epoch, item).permutation(count))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def items_from(self, position: int, count: int) -> Int64Array:
        """The ids of the ``count`` items laid out from the one holding ``position`` on, in epoch
        order (fewer at the end of the epoch); shape ``(<= count,)``."""
        slot = int(np.searchsorted(self.starts, position, side="right")) - 1
        return self.item_order[slot : slot + count]

    def _by_item(self, items: Int64Array) -> list[Int64Array]:
        """Where each item of several samples occurs in ``items``, one array per item (an item of
        one sample needs no permutation: its index is its place)."""
        several = np.flatnonzero(self.counts[items] > 1)
        if several.size == 0:
            return []
        by_item = several[np.argsort(items[several], kind="stable")]
        return np.split(by_item, np.flatnonzero(np.diff(items[by_item])) + 1)

    def positions(self, items: npt.ArrayLike, index: npt.ArrayLike) -> Int64Array:
        """The epoch positions of samples ``(items, index)``, the inverse of :meth:`locate`; shape ``(n,)``."""
        items, index = np.asarray(items, dtype=np.int64), np.asarray(index, dtype=np.int64)
        slot_of = np.empty_like(self.item_order)
        slot_of[self.item_order] = np.arange(self.item_order.size)
        local = index.copy()
        for group in self._by_item(items) if self.shuffle else []:
            local[group] = np.argsort(self._inner(int(items[group[0]]))[1])[index[group]]
        positions: Int64Array = self.starts[slot_of[items]] + local
        return positions
