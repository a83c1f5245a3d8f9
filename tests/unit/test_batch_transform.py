"""``batch_transform``: a vectorised transform of the whole batch, run in the worker after the columns
are read (or the samples collated); it keeps the columnar path free of per-sample objects, sees the
batch's positions and per-row seeds, and a failure or a changed number of rows names the batch.
The process test (real workers, spawn) is in tests/process/test_loader.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lightning_sharding import BatchContext, ShardedDataModule, SyntheticReader
from lightning_sharding.core.plan import BatchTask
from lightning_sharding.core.world import WorkerContext, World
from lightning_sharding.strategies._batches import PlannedBatches
from lightning_sharding.strategies._samples import SampleError
from lightning_sharding.strategies.options import LoaderOptions


def scale(batch: dict[str, torch.Tensor], ctx: BatchContext) -> dict[str, torch.Tensor]:
    """Doubles x and keeps each row's position and seed, to check what the transform saw."""
    out = dict(batch, x=batch["x"] * 2)
    out["position"] = torch.from_numpy(ctx.positions)
    out["seed"] = torch.from_numpy(ctx.sample_seeds.astype(np.int64))
    return out


def dataset(batch_transform: Any, **options: Any) -> PlannedBatches:
    reader = SyntheticReader(3, 7, dim=4)
    opts = LoaderOptions(batch_transform=batch_transform, **options)
    return PlannedBatches(reader, reader.manifest(), seed=3, world=World(), options=opts)


def test_the_batch_transform_runs_on_the_columns_without_reading_samples() -> None:
    data = dataset(scale)
    assert data.columnar
    data.reader.read_batch = data.reader.read = None  # type: ignore[assignment,method-assign]  # must not be called
    task = BatchTask(0, 0, 0, np.array([4, 5, 6, 4], dtype=np.int64), 1)
    got = data[task]
    plain = dataset(None)[task].batch
    assert torch.equal(got.batch["x"], plain["x"] * 2) and torch.equal(got.batch["id"], plain["id"])
    assert got.batch["position"].tolist() == [4, 5, 6, 4] and got.num_padding == 1
    seeds = got.batch["seed"].tolist()
    assert seeds[0] == seeds[3] != seeds[1], "a row's seed is its position's"


def test_the_batch_transform_runs_after_a_per_sample_transform_and_collate() -> None:
    def tag(sample: dict[str, Any], ctx: Any) -> dict[str, Any]:
        return dict(sample, tag=np.float32(ctx.position))

    data = dataset(scale, transform=tag)
    assert not data.columnar
    got = data[BatchTask(0, 0, 0, np.array([0, 1, 2], dtype=np.int64), 0)].batch
    assert got["tag"].tolist() == [0.0, 1.0, 2.0] and got["position"].tolist() == [0, 1, 2]


def test_row_seeds_depend_only_on_seed_epoch_and_position() -> None:
    positions = np.array([3, 9, 3], dtype=np.int64)
    a = BatchContext(WorkerContext(0, 2, 1, 2, epoch=1, seed=5), positions, 0).sample_seeds
    b = BatchContext(WorkerContext(1, 4, 0, 0, epoch=1, seed=5), positions, 0).sample_seeds
    c = BatchContext(WorkerContext(0, 2, 1, 2, epoch=2, seed=5), positions, 0).sample_seeds
    assert a.tolist() == b.tolist() and a[0] == a[2] != a[1] and a.tolist() != c.tolist()
    assert a.dtype == np.uint64 and int(a.max()) < 2**63


def test_a_failing_or_row_changing_batch_transform_names_the_batch() -> None:
    task = BatchTask(0, 7, 0, np.array([0, 1, 2], dtype=np.int64), 0)

    def broken(batch: Any, ctx: BatchContext) -> Any:
        raise KeyError("nope")

    with pytest.raises(SampleError, match=r"batch_transform failed on batch 7 \(epoch 0, rank 0, worker 0\): KeyError"):
        dataset(broken, on_error="skip")[task]
    with pytest.raises(SampleError, match=r"returned \[2\] rows for batch 7 .* of 3 samples"):
        dataset(lambda batch, ctx: {k: v[:2] for k, v in batch.items()})[task]


def test_strategies_that_do_not_run_it_refuse_it_by_name() -> None:
    with pytest.raises(
        ValueError,
        match=r"batch_transform=.*\)`: strategy 'broadcast' does not run a batch transform; use sharding='shard'",
    ):
        ShardedDataModule(batch_transform=scale, sharding="broadcast")
    with pytest.raises(ValueError, match=r"`ShardedDataModule\(batch_transform=3\)` must be a function"):
        ShardedDataModule(SyntheticReader(1, 4), batch_transform=3)  # type: ignore[arg-type]
    assert ShardedDataModule(SyntheticReader(1, 4), batch_transform=scale).options.batch_transform is scale
