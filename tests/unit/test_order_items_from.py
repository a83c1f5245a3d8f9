"""What a worker reads next (``Order.items_from``), checked against where
the epoch order puts every later position (``locate``): for a plain epoch and for a mixture under
every composition, with streams drawn more than once (passes) and less than once (cycle chunks),
the items told are the start of the sequence of items the positions after the last one read, run
after run, each stream on its own."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sharding.core.order import EpochOrder
from lightning_sharding.mixture.order import MixtureOrder
from tests.unit.test_mixture import drawn, mixtures


def runs(ids: np.ndarray) -> list[int]:
    """The items of consecutive reads, one per run."""
    ids = np.asarray(ids)
    return ids[np.concatenate(([True], ids[1:] != ids[:-1]))].tolist() if ids.size else []


def told_is_a_prefix_of_what_is_read(told: np.ndarray, read: np.ndarray, count: int) -> None:
    """``told`` (at most ``count`` items) starts the run sequence of ``read``, and stops early only
    at its end (runs split across a pass boundary are counted once on both sides)."""
    got, want = runs(told), runs(read)
    assert told.size <= count
    assert got == want[: len(got)], (got, want)
    assert told.size == count or got == want, (told, want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=12), st.integers(0, 2**31), st.integers(1, 7), st.data())
def test_a_plain_epoch_tells_the_items_from_the_last_position_on(counts, seed, count, data) -> None:
    order = EpochOrder(np.array(counts), seed, 2)
    last = data.draw(st.integers(0, order.total - 1))
    told = order.items_from(last, count)
    told_is_a_prefix_of_what_is_read(told, order.locate(np.arange(last, order.total))[0], count)


@settings(max_examples=80, deadline=None)
@given(
    mixtures,
    st.integers(0, 2**31),
    st.integers(0, 5),
    st.integers(1, 7),
    st.sampled_from(["mixed", "stratified", "per_stream"]),
    st.data(),
)
def test_a_mixture_tells_each_stream_its_items_from_its_next_draw_on(
    mixture, seed, epoch, count, composition, data
) -> None:
    plain, _ = drawn(mixture, seed, epoch)
    order = MixtureOrder(
        plain.names,
        plain.counts,
        np.diff(plain.item_offsets).tolist(),
        plain.draws,
        seed,
        epoch,
        composition=composition,
        batch_size=None if composition == "mixed" else 4,
    )
    last = data.draw(st.integers(0, order.total - 1))
    told = order.items_from(last, count)
    later = np.arange(last, order.total)
    streams, _ = order.streams(later)
    items, _ = order.locate(later)
    for s in range(len(order.names)):
        lo, hi = int(order.item_offsets[s]), int(order.item_offsets[s + 1])
        mine = told[(told >= lo) & (told < hi)]
        told_is_a_prefix_of_what_is_read(mine, items[streams == s], count)
