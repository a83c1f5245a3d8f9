"""The data-parallel view of the world: where it comes from, what it checks, how replicas' ledgers merge."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_sharding import ShardedDataModule, SyntheticReader
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import World
from lightning_sharding.loading.agreement import check_views
from lightning_sharding.loading.keeper import ReplicaMismatchError, one_ledger_per_replica
from lightning_sharding.loading.summary import format_summary
from lightning_sharding.recipes.models import Regressor
from lightning_sharding.strategies.options import LoaderOptions
from tests.support.harness import cpu_trainer


def trainer(rank: int, world_size: int, sampler_kwargs: dict[str, int] | None) -> Any:
    """What World.from_trainer reads of a trainer; a strategy without ``distributed_sampler_kwargs``
    (a single device) when ``sampler_kwargs`` is None."""
    strategy = (
        SimpleNamespace() if sampler_kwargs is None else SimpleNamespace(distributed_sampler_kwargs=sampler_kwargs)
    )
    return SimpleNamespace(
        global_rank=rank, world_size=world_size, local_rank=rank % 2, node_rank=rank // 2, strategy=strategy
    )


def test_the_data_parallel_view_comes_from_the_strategys_sampler_kwargs() -> None:
    world = World.from_trainer(trainer(3, 4, {"num_replicas": 2, "rank": 1}))
    assert (world.rank, world.world_size, world.data_rank, world.data_size, world.replica_size) == (3, 4, 1, 2, 2)
    assert world.describe() == "rank 3 = node 1 local 1 data 1"
    plain = World.from_trainer(trainer(1, 2, {"num_replicas": 2, "rank": 1}))
    assert (plain.data_rank, plain.data_size, plain.replica_size) == (1, 2, 1)
    assert plain.describe() == "rank 1 = node 0 local 1"
    single = World.from_trainer(trainer(0, 1, None))
    assert (single.data_rank, single.data_size) == (0, 1)


def test_an_override_wins_and_may_be_a_function_of_the_trainer() -> None:
    t = trainer(2, 4, {"num_replicas": 4, "rank": 2})
    assert World.from_trainer(t, (0, 1)).data_size == 1
    world = World.from_trainer(t, lambda tr: (tr.global_rank // 2, tr.world_size // 2))
    assert (world.data_rank, world.data_size) == (1, 2)


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ((0, 3), "data-parallel size of 3, which does not divide the world of 4 rank(s)"),
        ((2, 2), "data-parallel rank 2, outside 0..1"),
        ((0, 0), "data-parallel size of 0; it must be at least 1"),
        ("2", "it must be a pair of integers"),
    ],
)
def test_a_bad_data_parallel_view_is_named(pair: Any, message: str) -> None:
    with pytest.raises(ValueError, match=r"ShardedDataModule\(data_parallel=<lambda>\) on rank 0 of 4 gave") as err:
        World.from_trainer(trainer(0, 4, None), lambda _: pair)
    assert message in str(err.value)
    if isinstance(pair, tuple):  # a pair given as it is is named by its value
        with pytest.raises(ValueError, match=re.escape(f"data_parallel={pair!r}) on rank 0 of 4 gave")):
            World.from_trainer(trainer(0, 4, None), pair)
    with pytest.raises(ValueError, match="the strategy's distributed_sampler_kwargs gave"):
        World.from_trainer(trainer(0, 4, {"num_replicas": 3, "rank": 0}))


def test_setup_names_an_override_that_does_not_divide_the_world() -> None:
    dm = ShardedDataModule(SyntheticReader(sizes=[8]), batch_size=4, data_parallel=(0, 2))
    with pytest.raises(
        ValueError,
        match=r"data_parallel=\(0, 2\)\) on rank 0 of 1 gave a data-parallel size of 2, which does not divide",
    ):
        cpu_trainer().fit(Regressor(dim=8, hidden=4, learning_rate=0.01), datamodule=dm)


def test_the_constructor_names_an_override_of_the_wrong_shape() -> None:
    for bad, message in [((1, 1), "rank 1, outside 0..0"), ((0,), "pair of integers"), ((0, -2), "at least 1")]:
        with pytest.raises(ValueError, match=r"ShardedDataModule\(data_parallel=") as err:
            ShardedDataModule(SyntheticReader(sizes=[8]), data_parallel=bad)
        assert message in str(err.value)


def views(**changes: Any) -> list[dict[str, Any]]:
    """Four ranks in 2 replicas of 2, all alike; ``changes`` maps a rank to the keys it has otherwise."""
    base = {"manifest": {"fingerprint": "f"}, "seed": 1, "batch_size": 8, "even_batches": "pad", "shuffle": True}
    out = [{**base, "data_rank": r // 2, "data_size": 2} for r in range(4)]
    for rank, keys in changes.items():
        out[int(rank[1:])].update(keys)
    return out


def test_every_rank_must_plan_alike() -> None:
    check_views(views())
    with pytest.raises(ValueError, match="rank 1 has seed=7 but rank 0 has seed=1"):
        check_views(views(r1={"seed": 7}))
    with pytest.raises(ValueError, match="rank 3 has batch_size=4 but rank 0 has batch_size=8"):
        check_views(views(r3={"batch_size": 4}))
    with pytest.raises(
        ValueError, match=r"does not cut the 4 ranks into 2 replicas of 2: .*\{0: \[0, 1, 2\], 1: \[3\]\}"
    ):
        check_views(views(r2={"data_rank": 0}))


def test_one_ledger_per_replica_and_a_disagreeing_replica_is_named() -> None:
    a, b = RangeSet.from_ranges([(0, 8)]), RangeSet.from_ranges([(8, 16)])
    gathered = [(0, 0, a.to_state()), (0, 0, a.to_state()), (1, 0, b.to_state()), (1, 0, b.to_state())]
    assert one_ledger_per_replica(gathered) == [a, b]
    gathered[3] = (1, 0, RangeSet.from_ranges([(8, 15)]).to_state())
    with pytest.raises(ReplicaMismatchError, match=r"ranks 2 and 3 are one model replica \(data-parallel rank 1\)"):
        one_ledger_per_replica(gathered)


def test_the_summary_shows_the_replicas() -> None:
    worlds = [World(r, 4, data_rank=r // 2, data_size=2) for r in range(4)]
    text = format_summary([], LoaderOptions(), 3, worlds)
    assert "world 4 rank(s) in 2 data-parallel replicas of 2 x 0 worker(s)" in text
    assert "rank 2 = node 0 local 0 data 1" in text
