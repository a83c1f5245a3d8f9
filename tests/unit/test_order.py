"""EpochOrder: a bijection from epoch positions to (item, index), a function of (counts, seed, epoch) only."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sharding.core.order import (
    EpochOrder,
    _permutation_tail,
    _rng,
    _tails_exact,
    derive_seed,
    derive_seeds,
)
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet

SETTINGS = settings(max_examples=200, deadline=None)

counts_st = st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda c: sum(c) > 0)
seeds = st.integers(-(2**63), 2**64 - 1)
epochs = st.integers(0, 1000)


def pairs(order: EpochOrder, positions: np.ndarray) -> list[tuple[int, int]]:
    items, index = order.locate(positions)
    assert items.shape == index.shape == positions.shape
    return list(zip(items.tolist(), index.tolist(), strict=True))


@SETTINGS
@given(counts_st, seeds, epochs, st.booleans())
def test_locate_is_a_bijection_onto_item_index_pairs(counts: list[int], seed: int, epoch: int, shuffle: bool) -> None:
    order = EpochOrder(counts, seed, epoch, shuffle=shuffle)
    assert order.total == sum(counts)
    got = pairs(order, np.arange(order.total))
    expected = [(item, i) for item, c in enumerate(counts) for i in range(c)]
    assert len(set(got)) == len(got)
    assert sorted(got) == expected


@settings(max_examples=100, deadline=None)
@given(counts_st, seeds, epochs, st.integers(1, 3), st.randoms(use_true_random=False))
def test_locate_does_not_depend_on_query_order_or_cache(
    counts: list[int], seed: int, epoch: int, cache_items: int, rnd: random.Random
) -> None:
    reference = pairs(EpochOrder(counts, seed, epoch), np.arange(sum(counts)))
    order = EpochOrder(counts, seed, epoch, cache_items=cache_items)
    queries = list(range(sum(counts)))
    rnd.shuffle(queries)
    # Ask in small random chunks, so the small LRU cache evicts and recomputes item permutations.
    for lo in range(0, len(queries), 3):
        chunk = np.array(queries[lo : lo + 3], dtype=np.int64)
        assert pairs(order, chunk) == [reference[q] for q in chunk.tolist()]


@SETTINGS
@given(counts_st, seeds, epochs)
def test_same_seed_and_epoch_give_the_same_order(counts: list[int], seed: int, epoch: int) -> None:
    positions = np.arange(sum(counts))
    a, b = EpochOrder(counts, seed, epoch), EpochOrder(counts, seed, epoch)
    assert np.array_equal(a.item_order, b.item_order)
    assert pairs(a, positions) == pairs(b, positions)


big_counts = st.lists(st.integers(1, 40), min_size=3, max_size=12).filter(lambda c: sum(c) >= 50)


@SETTINGS
@given(big_counts, seeds, epochs, st.integers(1, 1000))
def test_different_epochs_give_different_orders(counts: list[int], seed: int, epoch: int, step: int) -> None:
    positions = np.arange(sum(counts))
    assert pairs(EpochOrder(counts, seed, epoch), positions) != pairs(EpochOrder(counts, seed, epoch + step), positions)


@SETTINGS
@given(big_counts, seeds, epochs)
def test_different_seeds_give_different_orders(counts: list[int], seed: int, epoch: int) -> None:
    positions = np.arange(sum(counts))
    assert pairs(EpochOrder(counts, seed, epoch), positions) != pairs(EpochOrder(counts, seed + 1, epoch), positions)


@SETTINGS
@given(counts_st, seeds, epochs)
def test_no_shuffle_is_manifest_order(counts: list[int], seed: int, epoch: int) -> None:
    order = EpochOrder(counts, seed, epoch, shuffle=False)
    expected = [(item, i) for item, c in enumerate(counts) for i in range(c)]
    assert pairs(order, np.arange(sum(counts))) == expected


@SETTINGS
@given(counts_st, seeds, epochs)
def test_items_are_read_in_contiguous_runs(counts: list[int], seed: int, epoch: int) -> None:
    """Shuffling permutes items, then samples inside items: each item is one contiguous run."""
    items, _ = EpochOrder(counts, seed, epoch).locate(np.arange(sum(counts)))
    runs = [int(items[0])] + [int(b) for a, b in zip(items[:-1], items[1:], strict=True) if a != b]
    assert len(runs) == len(set(runs)) == sum(1 for c in counts if c > 0)


def served_pairs(
    order: EpochOrder, total: int, world_size: int, num_workers: int, batch_size: int
) -> list[tuple[int, int, int]]:
    """Every real position any (rank, worker) produces, as (position, item, index), sorted by position."""
    plan = plan_epoch(
        total, RangeSet(), epoch=order.epoch, world_size=world_size, num_workers=num_workers, batch_size=batch_size
    )
    served: list[int] = []
    for r in range(world_size):
        for task in plan.rank(r).tasks():
            real = task.positions[: len(task.positions) - task.num_padding]
            served.extend(real.tolist())
    served.sort()
    items, index = order.locate(np.array(served, dtype=np.int64))
    return list(zip(served, items.tolist(), index.tolist(), strict=True))


@settings(max_examples=150, deadline=None)
@given(counts_st, seeds, epochs, st.integers(1, 16), st.integers(0, 4), st.integers(1, 16))
def test_epoch_order_does_not_depend_on_topology(
    counts: list[int], seed: int, epoch: int, world_size: int, num_workers: int, batch_size: int
) -> None:
    order = EpochOrder(counts, seed, epoch)
    total = sum(counts)
    single = served_pairs(order, total, 1, 0, batch_size)
    assert [p for p, _, _ in single] == list(range(total))
    assert served_pairs(order, total, world_size, num_workers, batch_size) == single


@pytest.mark.parametrize("positions", [[-1], [0, 10], [3, 10**9]])
def test_locate_rejects_positions_outside_the_epoch(positions: list[int]) -> None:
    order = EpochOrder([4, 6], seed=1, epoch=0)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        order.locate(positions)


@pytest.mark.parametrize("counts", [[], [[1, 2]]])
def test_order_rejects_bad_counts(counts: list[object]) -> None:
    with pytest.raises(ValueError, match="non-empty 1-d"):
        EpochOrder(counts, seed=0, epoch=0)


@SETTINGS
@given(seeds, st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4))
def test_derive_seed_is_deterministic_and_63_bit(seed: int, words: list[int]) -> None:
    a = derive_seed(seed, *words)
    assert a == derive_seed(seed, *words)
    assert isinstance(a, int) and 0 <= a < 2**63


@SETTINGS
@given(seeds, st.integers(0, 2**32), st.integers(0, 2**32), st.integers(0, 2**32))
def test_derive_seed_separates_nearby_inputs(seed: int, epoch: int, rank: int, worker: int) -> None:
    base = derive_seed(seed, epoch, rank, worker)
    assert base != derive_seed(seed, epoch + 1, rank, worker)
    assert base != derive_seed(seed, epoch, rank + 1, worker)
    assert base != derive_seed(seed, epoch, rank, worker + 1)
    assert base != derive_seed(seed + 1, epoch, rank, worker)
    assert base != derive_seed(seed, rank, epoch, worker) or epoch == rank


@SETTINGS
@given(
    seeds,
    st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4),
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=20),
)
def test_derive_seeds_is_derive_seed_over_an_array(seed: int, words: list[int], last: list[int]) -> None:
    """The vectorised hash gives SeedSequence's values bit for bit, for few and many words, and for
    last words of one and of two 32-bit words."""
    got = derive_seeds(seed, tuple(words), np.array(last, dtype=np.uint64))
    assert got.dtype == np.uint64
    assert got.tolist() == [derive_seed(seed, *words, p) for p in last]


def test_derive_seeds_at_the_word_edges() -> None:
    edges = [0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63 - 1, 2**64 - 1]
    for seed, words in ((0, ()), (0, (0x5A3C, 0)), (-1, (0x5A3C, 3)), (2**40, (7, 2**33, 0))):
        got = derive_seeds(seed, words, np.array(edges, dtype=np.uint64)).tolist()
        assert got == [derive_seed(seed, *words, p) for p in edges]
    positions = np.arange(10**6, 10**6 + 64, dtype=np.int64)  # a batch's positions, as the loader passes them
    expected = [derive_seed(5, 0x5A3C, 2, p) for p in positions.tolist()]
    assert derive_seeds(5, (0x5A3C, 2), positions).tolist() == expected
    with pytest.raises(ValueError, match="non-negative"):
        derive_seeds(0, (), np.array([3, -1]))


def test_derive_seed_and_order_are_pinned() -> None:
    """Checkpoints rely on the order being reproducible across releases and platforms: pin a few values."""
    assert derive_seed(0) == PINNED_SEED_0
    assert derive_seed(1234, 5, 6, 7) == PINNED_SEED_1234
    items, index = EpochOrder([3, 0, 2, 4], seed=42, epoch=1).locate(np.arange(9))
    assert list(zip(items.tolist(), index.tolist(), strict=True)) == PINNED_ORDER


def test_random_streams_never_share_a_seed() -> None:
    """SeedSequence pads with zeros; tags and word counts keep the item, sample and derived streams apart."""
    from lightning_sharding.core.world import SampleContext, WorkerContext

    ctx = WorkerContext(data_rank=0, data_size=1, worker_id=0, num_workers=2, epoch=3, seed=9)
    assert derive_seed(9, 3, 0) != derive_seed(9, 3, 0, 0)
    worker_seeds = {WorkerContext(r, 4, w, 2, 3, 9).worker_seed for r in range(4) for w in range(2)}
    sample_seeds = {SampleContext(ctx, p, 0, p).sample_seed for p in range(200)}
    assert len(worker_seeds) == 8 and len(sample_seeds) == 200 and worker_seeds.isdisjoint(sample_seeds)


PINNED_SEED_0 = 1092475843471438364
PINNED_SEED_1234 = 4561600955283093070
PINNED_ORDER = [(0, 2), (0, 1), (0, 0), (3, 1), (3, 3), (3, 0), (3, 2), (2, 1), (2, 0)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.data(), seeds)
def test_a_permutations_tail_is_the_whole_permutations_tail(count: int, data: st.DataObject, seed: int) -> None:
    """``_permutation_tail`` draws only the last swaps of NumPy's shuffle: the same values."""
    first = data.draw(st.integers(0, count - 1))
    whole = _rng(0x5A3B, seed, 1, 2).permutation(count)
    assert np.array_equal(_permutation_tail(_rng(0x5A3B, seed, 1, 2), count, first), whole[first:])


@pytest.mark.parametrize("count", [2**16, 2**16 + 1, 200_003, 2**20 + 5])
def test_a_large_items_tail_is_located_as_the_whole_permutation_places_it(count: int) -> None:
    """A resume whose first batch lies in the last samples of a large item draws only their tail; a
    later batch further back in the item draws the whole permutation: every position where the
    whole permutation puts it (the check once a process passes on this NumPy)."""
    assert _tails_exact()
    counts = [3, count, 5]
    reference = EpochOrder(counts, 7, 1, cache_items=8)
    slot = int(np.flatnonzero(reference.item_order == 1)[0])
    start, end = int(reference.starts[slot]), int(reference.starts[slot + 1])
    whole = _rng(0x5A3B, 7, 1, 1).permutation(count)
    order = EpochOrder(counts, 7, 1)
    tail = np.arange(end - 300, min(end + 2, order.total))
    items, index = order.locate(tail)
    inside = items == 1
    assert np.array_equal(index[inside], whole[tail[inside] - start])
    assert order._cache[1][0] == count - 300  # only the tail was drawn
    back = np.arange(start + count // 2, start + count // 2 + 50)
    assert np.array_equal(order.locate(back)[1], whole[count // 2 : count // 2 + 50])
    assert order._cache[1][0] == 0
    assert np.array_equal(order.locate(tail)[1], reference.locate(tail)[1])
