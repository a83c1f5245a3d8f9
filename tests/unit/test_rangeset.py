"""RangeSet checked against a plain Python ``set`` of integers as the model."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sharding.core.rangeset import RangeSet, is_run

BOUND = 300  # small enough that set models stay cheap, big enough for many ranges

SETTINGS = settings(max_examples=200, deadline=None)


@st.composite
def range_sets(draw: st.DrawFn, bound: int = BOUND) -> tuple[RangeSet, set[int]]:
    """A RangeSet built from random, possibly overlapping or empty ranges, and its model set."""
    pairs = draw(
        st.lists(
            st.tuples(st.integers(0, bound), st.integers(0, 40)).map(lambda p: (p[0], min(p[0] + p[1], bound))),
            max_size=12,
        )
    )
    model = {x for s, e in pairs for x in range(s, e)}
    return RangeSet.from_ranges(pairs), model


def assert_canonical(rs: RangeSet) -> None:
    """Sorted, non-empty, disjoint and non-touching int64 ranges."""
    assert rs.starts.dtype == np.int64 and rs.ends.dtype == np.int64
    assert rs.starts.shape == rs.ends.shape == (rs.num_ranges,)
    assert np.all(rs.ends > rs.starts)
    assert np.all(rs.starts[1:] > rs.ends[:-1])


def assert_matches(rs: RangeSet, model: set[int]) -> None:
    assert_canonical(rs)
    assert rs.to_array().tolist() == sorted(model)
    assert list(rs) == sorted(model)
    assert len(rs) == len(model)
    assert bool(rs) == bool(model)


@SETTINGS
@given(st.lists(st.integers(0, BOUND), max_size=200))
def test_from_positions_matches_set(positions: list[int]) -> None:
    rs = RangeSet.from_positions(np.array(positions, dtype=np.int64))
    assert_matches(rs, set(positions))


@SETTINGS
@given(range_sets())
def test_from_ranges_matches_set(pair: tuple[RangeSet, set[int]]) -> None:
    rs, model = pair
    assert_matches(rs, model)


@SETTINGS
@given(range_sets(), range_sets())
def test_set_algebra_matches_set(a: tuple[RangeSet, set[int]], b: tuple[RangeSet, set[int]]) -> None:
    (ra, ma), (rb, mb) = a, b
    assert_matches(ra.union(rb), ma | mb)
    assert_matches(ra | rb, ma | mb)
    assert_matches(ra.intersection(rb), ma & mb)
    assert_matches(ra.difference(rb), ma - mb)
    assert_matches(rb.difference(ra), mb - ma)
    assert ra.isdisjoint(rb) == ma.isdisjoint(mb)


@SETTINGS
@given(range_sets(), st.integers(0, BOUND + 20))
def test_complement_matches_set(pair: tuple[RangeSet, set[int]], total: int) -> None:
    rs, model = pair
    assert_matches(rs.complement(total), set(range(total)) - model)


def test_complement_rejects_negative_total() -> None:
    with pytest.raises(ValueError, match="-1"):
        RangeSet.interval(0, 3).complement(-1)


@SETTINGS
@given(range_sets(), st.integers(-5, BOUND + 5), st.integers(-5, BOUND + 5))
def test_select_is_slice_of_sorted_elements(pair: tuple[RangeSet, set[int]], lo: int, hi: int) -> None:
    rs, model = pair
    ordered = sorted(model)
    n = len(ordered)
    clo, chi = max(0, min(lo, n)), max(0, min(hi, n))
    assert_matches(rs.select(lo, hi), set(ordered[clo:chi]))


@SETTINGS
@given(range_sets(), st.integers(1, 8))
def test_select_chunks_partition_the_set(pair: tuple[RangeSet, set[int]], parts: int) -> None:
    rs, model = pair
    n = len(rs)
    cuts = [n * i // parts for i in range(parts + 1)]
    chunks = [rs.select(cuts[i], cuts[i + 1]).to_array().tolist() for i in range(parts)]
    assert [x for chunk in chunks for x in chunk] == sorted(model)


@SETTINGS
@given(range_sets(), st.lists(st.integers(-3, BOUND + 3), max_size=30))
def test_contains_matches_set(pair: tuple[RangeSet, set[int]], probes: list[int]) -> None:
    rs, model = pair
    for x in [*probes, *model]:
        assert (x in rs) == (x in model)
        assert (np.int64(x) in rs) == (x in model)
    assert "1" not in rs
    assert 1.0 not in rs


@SETTINGS
@given(range_sets())
def test_state_round_trip(pair: tuple[RangeSet, set[int]]) -> None:
    rs, model = pair
    state = rs.to_state()
    assert state.dtype == np.int64
    assert state.shape == (rs.num_ranges, 2)
    assert RangeSet.from_state(state) == rs
    assert RangeSet.from_state(state.tolist()) == rs
    assert_matches(RangeSet.from_state(state), model)


@SETTINGS
@given(range_sets(), st.randoms(use_true_random=False))
def test_equal_sets_have_equal_arrays(pair: tuple[RangeSet, set[int]], rnd: random.Random) -> None:
    rs, model = pair
    # Rebuild the same set three different ways: singletons shuffled, overlapping ranges, positions.
    singles = [(x, x + 1) for x in model]
    rnd.shuffle(singles)
    overlapping = [*rs.ranges(), *singles, *((s, s) for s, _ in singles)]  # with empty ranges too
    rnd.shuffle(overlapping)
    for other in (
        RangeSet.from_ranges(singles),
        RangeSet.from_ranges(overlapping),
        RangeSet.from_positions(list(model) * 2),
    ):
        assert np.array_equal(other.starts, rs.starts)
        assert np.array_equal(other.ends, rs.ends)
        assert other == rs
        assert hash(other) == hash(rs)


@SETTINGS
@given(range_sets(), range_sets())
def test_equality_matches_set_equality(a: tuple[RangeSet, set[int]], b: tuple[RangeSet, set[int]]) -> None:
    (ra, ma), (rb, mb) = a, b
    assert (ra == rb) == (ma == mb)


def test_arrays_are_read_only() -> None:
    rs = RangeSet.interval(2, 5)
    with pytest.raises(ValueError):
        rs.starts[0] = 0
    with pytest.raises(ValueError):
        rs.ends[0] = 9
    assert rs.ranges() == [(2, 5)]


def test_touching_ranges_merge() -> None:
    rs = RangeSet.from_ranges([(5, 8), (0, 2), (2, 5), (10, 10)])
    assert rs.ranges() == [(0, 8)]
    assert rs.num_ranges == 1


@pytest.mark.parametrize(
    "build",
    [
        lambda: RangeSet([-1], [3]),
        lambda: RangeSet.from_ranges([(0, 2), (-4, -1)]),
        lambda: RangeSet.from_positions([3, -2, 5]),
        lambda: RangeSet.from_state([[-1, 2]]),
    ],
    ids=["init", "from_ranges", "from_positions", "from_state"],
)
def test_negative_start_is_rejected(build: Callable[[], RangeSet]) -> None:
    with pytest.raises(ValueError, match="non-negative"):
        build()


@pytest.mark.parametrize(
    ("starts", "ends"),
    [([0, 1], [2]), ([[0]], [[1]]), (np.zeros((2, 2), np.int64), np.ones((2, 2), np.int64))],
    ids=["unequal-length", "nested", "2d"],
)
def test_init_rejects_bad_shapes(starts: Any, ends: Any) -> None:
    with pytest.raises(ValueError, match="1-d arrays"):
        RangeSet(starts, ends)


@pytest.mark.parametrize(
    "state",
    [
        np.array([0, 1, 2]),
        np.array([[0, 1, 2]]),
        np.zeros((2, 2, 2), np.int64) + 1,
        [[0, 3], [5, 4]],
    ],
    ids=["1-d", "three-columns", "3-d", "end-before-start"],
)
def test_from_state_rejects_malformed(state: Any) -> None:
    with pytest.raises(ValueError, match="malformed range state"):
        RangeSet.from_state(state)


def test_from_state_rejects_ragged_list() -> None:
    with pytest.raises(ValueError):
        RangeSet.from_state([[0, 1], [2]])


def test_empty_state_round_trips() -> None:
    empty = RangeSet()
    assert empty.to_state().shape == (0, 2)
    assert RangeSet.from_state(empty.to_state()) == empty
    assert RangeSet.from_state([]) == empty
    assert len(empty) == 0 and not empty and empty.to_array().shape == (0,)


@SETTINGS
@given(
    start=st.integers(-(2**40), 2**40),
    size=st.integers(0, 200),
    change=st.none() | st.tuples(st.integers(0, 199), st.sampled_from([-1, 1, 2, -(2**33)])),
)
def test_is_run_says_whether_positions_count_up_by_one(start: int, size: int, change: Any) -> None:
    """Short arrays are compared as lists, long ones as arrays: both against the plain definition."""
    positions = np.arange(start, start + size, dtype=np.int64)
    if change is not None and size:
        at, by = change
        positions[at % size] += by
    listed = positions.tolist()
    assert is_run(positions) == all(b - a == 1 for a, b in zip(listed[:-1], listed[1:], strict=True))
