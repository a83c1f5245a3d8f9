"""A batch's sample contexts: their seeds, derived for the batch at once, are each sample's own."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_sharding.core.world import SampleContext, WorkerContext, sample_contexts

WORKER = WorkerContext(1, 2, 0, 2, epoch=3, seed=-7)


@pytest.mark.parametrize("size", [1, 3, 4, 64])
def test_each_context_of_a_batch_has_the_seed_its_sample_derives_alone(size: int) -> None:
    positions = np.arange(10**6, 10**6 + 2 * size, 2, dtype=np.int64)
    contexts = sample_contexts(WORKER, positions, list(range(size)), list(range(size)))
    alone = [SampleContext(WORKER, p, i, i).sample_seed for i, p in enumerate(positions.tolist())]
    assert [c.sample_seed for c in contexts] == alone
    assert [c.position for c in contexts] == positions.tolist() and contexts[0].stream is None


def test_seeds_are_derived_only_when_a_sample_asks() -> None:
    contexts = sample_contexts(WORKER, np.arange(8, dtype=np.int64), [0] * 8, list(range(8)), ["web"] * 8)
    batch_seeds = contexts[0]._batch_seeds
    assert batch_seeds is not None and batch_seeds[0]._values is None  # a transform that draws none pays nothing
    assert contexts[5].stream == "web"
    assert contexts[5].sample_seed == SampleContext(WORKER, 5, 0, 5, "web").sample_seed
    assert batch_seeds[0]._values is not None


def test_a_context_replaced_to_another_position_has_that_positions_seed() -> None:
    (ctx,) = sample_contexts(WORKER, np.array([10], dtype=np.int64), [0], [10])
    moved = dataclasses.replace(ctx, position=11)
    assert moved.sample_seed == SampleContext(WORKER, 11, 0, 10).sample_seed != ctx.sample_seed
    assert ctx == SampleContext(WORKER, 10, 0, 10), "the batch's seeds take no part in equality"
