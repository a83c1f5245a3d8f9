"""A worker's Delivery reaches the training process whole: pickled as multiprocessing pickles it (the
position arrays as bytes, an empty one as nothing), it unpickles to an equal Delivery of writable
int64 arrays."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

from lightning_sharding.strategies._delivery import NO_POSITIONS, Delivery


@pytest.mark.parametrize(
    "delivery",
    [
        Delivery({"x": [1, 2]}, 3, np.arange(10, 266, dtype=np.int64), 1),
        Delivery(None, 0, np.array([5, 2, 9], dtype=np.int32), 0, np.array([7]), np.array([1, 1]), True, {"a": 1.5}, 4),
        Delivery("b", 1, NO_POSITIONS, 0, end=True),
        Delivery("strided", 2, np.arange(20, dtype=np.int64)[::3], 0),
    ],
    ids=["plain", "every-field", "empty", "strided"],
)
def test_a_delivery_pickles_to_an_equal_one(delivery: Delivery) -> None:
    got = pickle.loads(ForkingPickler.dumps(delivery))
    assert type(got) is Delivery
    assert (got.batch, got.epoch, got.num_padding, got.end, got.stats, got.generation) == (
        delivery.batch,
        delivery.epoch,
        delivery.num_padding,
        delivery.end,
        delivery.stats,
        delivery.generation,
    )
    for name in ("positions", "skipped", "used"):
        sent, arrived = getattr(delivery, name), getattr(got, name)
        assert arrived.dtype == np.int64 and np.array_equal(arrived, sent), name
        assert arrived.flags.writeable or arrived is NO_POSITIONS, name
