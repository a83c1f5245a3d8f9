"""The mixture order (``lightning_sharding.mixture.order``): draws, per-stream passes and cycles, interleave.

Properties over random mixtures: each position maps to one (stream, draw) and back; every prefix
holds each stream within two samples of its share (the bound ``interleave.py`` proves); within an
epoch a stream's samples repeat only when its draws exceed its size (then each appears floor or
ceil of draws/size times); a down-sampled stream covers all of itself over ceil(size/draws)
epochs before a sample repeats; the order depends on nothing but (streams, seed, epoch).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sharding.mixture.order import MixtureOrder, StreamSpec, apportion, plan_draws, stream_portions


def build(item_counts: list[list[int]], draws: list[int], seed: int = 3, epoch: int = 0) -> MixtureOrder:
    names = [f"s{i}" for i in range(len(item_counts))]
    counts = [c for stream in item_counts for c in stream]
    return MixtureOrder(names, counts, [len(s) for s in item_counts], draws, seed, epoch)


def sample_ids(order: MixtureOrder, positions: np.ndarray) -> np.ndarray:
    """A global id per position: the item's offset over all streams plus the index."""
    items, index = order.locate(positions)
    offsets = np.concatenate(([0], np.cumsum(order.counts)))
    return offsets[items] + index


mixtures = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=4).flatmap(
    lambda streams: st.tuples(
        st.just(streams), st.lists(st.integers(0, 3 * 36), min_size=len(streams), max_size=len(streams))
    )
)


def drawn(mixture: tuple[list[list[int]], list[int]], seed: int, epoch: int) -> tuple[MixtureOrder, list[int]]:
    """The order of a generated mixture (one that draws nothing draws one sample of its first stream)."""
    item_counts, draws = mixture
    if sum(draws) == 0:
        draws[0] = 1
    return build(item_counts, draws, seed, epoch), draws


@settings(max_examples=60, deadline=None)
@given(mixtures, st.integers(0, 2**31), st.integers(0, 6))
def test_positions_map_one_to_one_and_prefixes_hold_every_share(mixture, seed, epoch) -> None:
    order, draws = drawn(mixture, seed, epoch)
    stream, draw = order.streams(np.arange(order.total))
    for s, d in enumerate(draws):
        assert sorted(draw[stream == s].tolist()) == list(range(d))
        assert (np.diff(draw[stream == s]) > 0).all(), "a stream's draws come in order"
    for p in range(order.total + 1):
        counts = order.prefix(p)
        assert sum(counts) == p
        assert all(abs(c - p * d / order.total) < 2 for c, d in zip(counts, draws, strict=True)), (p, counts)
    # Any subset of positions, in any order, maps as the whole epoch does.
    picked = np.random.default_rng(seed).permutation(order.total)[: order.total // 2]
    whole_items, whole_index = order.locate(np.arange(order.total))
    items, index = order.locate(picked)
    assert (items == whole_items[picked]).all() and (index == whole_index[picked]).all()


@settings(max_examples=60, deadline=None)
@given(mixtures, st.integers(0, 2**31), st.integers(0, 6))
def test_a_stream_repeats_a_sample_in_an_epoch_only_when_it_draws_more_than_it_has(mixture, seed, epoch) -> None:
    order, draws = drawn(mixture, seed, epoch)
    ids = sample_ids(order, np.arange(order.total))
    stream, _ = order.streams(np.arange(order.total))
    start = 0
    for s, counts in enumerate(mixture[0]):
        size, d = sum(counts), draws[s]
        seen = Counter(ids[stream == s].tolist())
        assert all(start <= i < start + size for i in seen), "a stream serves only its own samples"
        assert set(seen.values()) <= {d // size, -(-d // size)}, (s, size, d, seen)
        assert len(seen) == (size if d >= size else d)
        start += size


@pytest.mark.parametrize(("size", "draws"), [(11, 3), (10, 5), (7, 6), (9, 1), (12, 11)])
def test_a_down_sampled_stream_covers_itself_before_any_sample_repeats(size: int, draws: int) -> None:
    cycle = -(-size // draws)
    served = [sample_ids(build([[size]], [draws], seed=9, epoch=e), np.arange(draws)).tolist() for e in range(cycle)]
    before_last = [i for ids in served[:-1] for i in ids]
    assert len(before_last) == len(set(before_last)), "no sample twice before the stream is covered"
    assert set(before_last) | set(served[-1]) == set(range(size)), f"covered within {cycle} epochs"
    assert all(len(set(ids)) == draws for ids in served), "never twice in one epoch"


def test_the_portions_of_a_cycle_tile_it() -> None:
    # 11 samples, 3 an epoch: epochs 0..3 take [0,3) [3,6) [6,9) and [9,11)+[0,1) of cycle 0.
    assert [(g.key, g.lo, g.hi) for e in range(5) for g in stream_portions(11, 3, e)] == [
        (0, 0, 3),
        (0, 3, 6),
        (0, 6, 9),
        (0, 9, 11),
        (0, 0, 1),
        (1, 0, 3),
    ]


def test_draws_from_each_kind_of_share() -> None:
    specs = [StreamSpec("web", weight=3), StreamSpec("code", weight=1), StreamSpec("books", repeat=2.0)]
    assert plan_draws(specs, [100, 40, 10], samples_per_epoch=100) == [60, 20, 20]
    assert plan_draws(specs, [100, 40, 10]) == [105, 35, 20]  # one pass over the weighted streams
    assert plan_draws([StreamSpec("a", proportion=0.25), StreamSpec("b", choose=7)], [40, 3]) == [10, 7]
    assert plan_draws([StreamSpec("a", repeat=1.0), StreamSpec("b", repeat=1.0)], [30, 10], 20) == [15, 5]
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]


@pytest.mark.parametrize(
    ("specs", "sizes", "per_epoch", "message"),
    [
        ([StreamSpec("a"), StreamSpec("b")], [5, 0], None, "stream 'b' has no samples"),
        ([StreamSpec("a")], [5], 0, "samples_per_epoch=0 must be a whole number of 1 or more"),
        ([StreamSpec("a", choose=9), StreamSpec("b", weight=1)], [5, 5], 9, "leaves nothing for the weighted stream"),
    ],
)
def test_bad_mixtures_name_the_stream(specs, sizes, per_epoch, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan_draws(specs, sizes, per_epoch)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight": 0}, "stream 'x': weight=0 must be greater than 0"),
        ({"weight": -1.5}, "weight=-1.5 must be greater than 0"),
        ({"weight": 1, "choose": 5}, "stream 'x' sets weight and choose; give one of"),
        ({"proportion": 1.5}, "proportion=1.5 is above 1; use repeat="),
        ({"choose": 2.5}, "choose=2.5 must be a whole number"),
        ({"repeat": float("nan")}, "repeat=nan must be a number"),
    ],
)
def test_a_bad_share_is_named(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        StreamSpec("x", **kwargs)


def test_adding_a_stream_leaves_the_others_orders_alone() -> None:
    two = build([[4, 6], [5]], [10, 5])
    three = MixtureOrder(["s0", "s1", "new"], [4, 6, 5, 8], [2, 1, 1], [10, 5, 8], 3, 0)
    for order, s in [(two, 0), (two, 1)]:
        stream, _ = order.streams(np.arange(order.total))
        mine = sample_ids(order, np.flatnonzero(stream == s))
        stream3, _ = three.streams(np.arange(three.total))
        assert (sample_ids(three, np.flatnonzero(stream3 == s)) == mine).all()
