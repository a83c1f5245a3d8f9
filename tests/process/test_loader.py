"""The sharded loader without Lightning: plan vs. real yield, WorkerContext in real workers, epoch switches."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from lightning_sharding import Reader, SyntheticReader
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Item, Manifest
from lightning_sharding.core.world import WorkerContext, World
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import ShardedLoader


class ContextReader(Reader):
    """Every sample says which item and index it is and which worker produced it (module level: picklable)."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = list(sizes)

    def items(self) -> Sequence[Item]:
        return [Item(f"part-{i}", n) for i, n in enumerate(self.sizes)]

    def read(self, item: Item, index: int, ctx: WorkerContext) -> Any:
        first = sum(self.sizes[: int(item.key.split("-")[1])])
        return {
            "id": first + index,
            "rank": ctx.data_rank,
            "world_size": ctx.data_size,
            "worker": ctx.worker_id,
            "num_workers": ctx.num_workers,
            "epoch": ctx.epoch,
            "torch_draw": torch.randint(0, 2**30, ()).item(),
        }


def make_loader(
    reader: Reader,
    *,
    rank: int,
    world_size: int,
    num_workers: int,
    batch_size: int,
    ledger: Ledger | None = None,
    seed: int = 7,
    persistent: bool = False,
    even_batches: str = "pad",
) -> ShardedLoader:
    manifest = Manifest.from_items(reader.items())
    ledger = ledger or Ledger(seed=seed, total=manifest.total, manifest=manifest.summary())
    return ShardedLoader.build(
        reader,
        manifest.items,
        ledger,
        world=World(rank=rank, world_size=world_size),
        track=True,
        options=LoaderOptions(
            batch_size=batch_size,
            num_workers=num_workers,
            even_batches=even_batches,
            persistent_workers=persistent,
        ),
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("batch_size", [1, 4, 7])
def test_every_rank_yields_the_batches_the_plan_predicts(world_size: int, batch_size: int) -> None:
    sizes = [5, 0, 9, 13, 2]
    reader = ContextReader(sizes)
    served: Counter[int] = Counter()
    for rank in range(world_size):
        loader = make_loader(reader, rank=rank, world_size=world_size, num_workers=0, batch_size=batch_size)
        batches = list(loader)
        plan = loader.sampler.rank_plan
        assert plan is not None
        assert len(batches) == plan.num_batches
        for batch in batches:
            served.update(batch["id"][~batch["is_padding"]].tolist())
            assert set(batch["rank"].tolist()) == {rank}
    assert served == Counter(range(sum(sizes)))


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_real_workers_get_their_shard_context_and_planned_batches() -> None:
    reader = ContextReader([11, 17, 8, 21])
    loader = make_loader(reader, rank=1, world_size=2, num_workers=2, batch_size=4)
    batches = list(loader)
    plan = loader.sampler.rank_plan
    assert plan is not None and len(batches) == plan.num_batches
    produced_by = [set(b["worker"].tolist()) for b in batches]
    assert all(len(w) == 1 for w in produced_by)
    # Batches arrive in plan order; each was produced by the worker the plan dealt it to, and
    # that worker's batches are one contiguous run of the rank's batches.
    planned = list(plan.tasks())
    assert [w.pop() for w in produced_by] == [t.worker for t in planned]
    for worker in (0, 1):
        assert sorted(t.index for t in planned if t.worker == worker) == list(plan.worker_batches(worker))
    for b in batches:
        assert set(b["rank"].tolist()) == {1} and set(b["world_size"].tolist()) == {2}
        assert set(b["num_workers"].tolist()) == {2}
    # Workers are seeded from (seed, epoch, rank, worker): two workers never draw the same stream.
    draws = {
        w: [d for b in batches if set(b["worker"].tolist()) == {w} for d in b["torch_draw"].tolist()] for w in (0, 1)
    }
    assert draws[0][:3] != draws[1][:3]


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_persistent_workers_never_deliver_a_stale_epoch_batch() -> None:
    """Stop epoch 0 early with batches still in flight, then run epoch 1 on the same workers."""
    reader = ContextReader([40, 40, 40])
    loader = make_loader(reader, rank=0, world_size=1, num_workers=2, batch_size=3, persistent=True)
    it = iter(loader)
    first = [next(it) for _ in range(3)]  # 2 workers x prefetch 2 leaves tasks of epoch 0 in flight
    assert {int(e) for b in first for e in b["epoch"]} == {0}
    loader.sampler.set_epoch(1)
    epoch1 = list(loader)
    assert {int(e) for b in epoch1 for e in b["epoch"]} == {1}
    ids = [i for b in epoch1 for i in b["id"][~b["is_padding"]].tolist()]
    assert sorted(ids) == list(range(120))
    del it


def test_resumed_ledger_plans_only_the_rest_on_another_topology() -> None:
    reader = SyntheticReader(sizes=[13, 29, 7])
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=3, total=manifest.total, manifest=manifest.summary())
    # Two ranks consume three batches each, then the job "resumes" on three ranks.
    for rank in range(2):
        loader = make_loader(reader, rank=rank, world_size=2, num_workers=0, batch_size=4, ledger=ledger)
        for _, _ in zip(range(3), loader, strict=False):
            ledger.record(loader.pop_delivered().real_positions)
    ledger.commit()
    before = {i for i in range(manifest.total) if i in ledger.consumed}
    served: list[int] = []
    for rank in range(3):
        loader = make_loader(reader, rank=rank, world_size=3, num_workers=0, batch_size=5, ledger=ledger)
        for batch in loader:
            served += batch["id"][~batch["is_padding"]].tolist()
    assert len(before) == 24
    assert len(served) == len(set(served)) == manifest.total - 24


def test_padding_is_flagged_in_dict_batches_and_absent_otherwise() -> None:
    reader = ContextReader([3])  # 3 samples over 2 ranks in batches of 1: rank 1 pads once
    flags = []
    for rank in range(2):
        loader = make_loader(reader, rank=rank, world_size=2, num_workers=0, batch_size=1)
        flags.append([b["is_padding"].tolist() for b in loader])
    assert flags == [[[False], [False]], [[False], [True]]]
    loader = make_loader(reader, rank=0, world_size=1, num_workers=0, batch_size=2)
    loader.delivered.padding_key = None
    assert all("is_padding" not in b for b in loader)


def test_sample_seed_is_the_same_whatever_the_topology() -> None:
    """Per-sample randomness depends on (seed, epoch, position) only."""
    from lightning_sharding.core.world import SampleContext

    seen: dict[int, dict[int, int]] = {}
    pairs: list[tuple[int, int]] = []
    for world_size in (1, 3):
        reader = ContextReader([6, 9])
        manifest = Manifest.from_items(reader.items())
        for rank in range(world_size):
            loader = make_loader(reader, rank=rank, world_size=world_size, num_workers=0, batch_size=2)

            def transform(sample: Any, ctx: SampleContext) -> Any:
                alone = SampleContext(ctx.worker, ctx.position, ctx.item, ctx.index)  # no seed given: derived here
                pairs.append((ctx.sample_seed, alone.sample_seed))
                return {**sample, "seed": ctx.sample_seed % 2**31}

            loader._loader.dataset.transform = transform  # type: ignore[attr-defined]
            for batch in loader:
                for i, s in zip(batch["id"].tolist(), batch["seed"].tolist(), strict=True):
                    seen.setdefault(world_size, {})[i] = s
        assert len(seen[world_size]) == manifest.total
    assert seen[1] == seen[3]
    assert len(set(seen[1].values())) == len(seen[1])
    # The loader derives a batch's seeds at once; each is the one the sample's context derives alone.
    assert len(pairs) == 2 * manifest.total and all(a == b for a, b in pairs)


def test_order_mapping_is_vectorised_over_a_batch() -> None:
    """A batch spanning several items reads each item with one read_batch call."""
    calls: list[int] = []

    class CountingReader(SyntheticReader):
        def read_batch(self, item: Item, indices: np.ndarray, ctx: WorkerContext) -> list[Any]:
            calls.append(len(indices))
            return super().read_batch(item, indices, ctx)

    loader = make_loader(CountingReader(sizes=[3, 3, 3]), rank=0, world_size=1, num_workers=0, batch_size=9)
    (batch,) = list(loader)
    assert sorted(calls) == [3, 3, 3] and sorted(batch["id"].tolist()) == list(range(9))


class IsPaddingReader(ContextReader):
    def read(self, item: Item, index: int, ctx: WorkerContext) -> Any:
        return {**super().read(item, index, ctx), "is_padding": False}


def test_a_batch_key_that_collides_with_the_padding_key_is_an_error() -> None:
    loader = make_loader(IsPaddingReader([4]), rank=0, world_size=1, num_workers=0, batch_size=2)
    with pytest.raises(KeyError, match="already has a key 'is_padding'"):
        list(loader)


def scaled_in_worker(batch: dict[str, torch.Tensor], ctx: Any) -> dict[str, torch.Tensor]:
    """A vectorised batch transform (module level: spawned workers import it)."""
    import os

    return dict(batch, x=batch["x"] * 2, pid=torch.full((len(ctx.positions),), os.getpid()))


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_a_batch_transform_runs_in_real_workers_on_every_batch_once() -> None:
    import os

    from lightning_sharding.readers.synthetic import regression_arrays

    reader = SyntheticReader(4, 25, dim=3)
    manifest = Manifest.from_items(reader.items())
    served: Counter[int] = Counter()
    for rank in range(2):
        ledger = Ledger(seed=7, total=manifest.total, manifest=manifest.summary())
        options = LoaderOptions(batch_size=8, num_workers=2, batch_transform=scaled_in_worker)
        loader = ShardedLoader.build(reader, manifest, ledger, world=World(rank=rank, world_size=2), options=options)
        for batch in loader:
            real = ~batch["is_padding"]
            ids = batch["id"][real]
            served.update(ids.tolist())
            x, _ = regression_arrays(ids.numpy(), 3)
            assert torch.equal(batch["x"][real], torch.from_numpy(x) * 2)
            assert os.getpid() not in batch["pid"].tolist(), "the batch transform ran in the training process"
    assert served == Counter(range(100))
