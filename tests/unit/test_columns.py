"""Batch-level reads: a reader that reads columns (``read_columns``) makes the batch with no per-sample
object, and the batch is exactly what the per-sample path collates, for every reader that reads
columns, across items and with padding; anything per sample (a transform, a collate_fn, a subclass
that changes ``read_batch``) keeps the per-sample path, and a failing read still names its sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_sharding import SyntheticReader
from lightning_sharding.core.plan import BatchTask
from lightning_sharding.core.world import World
from lightning_sharding.mixture.streams import MixtureReader, Stream
from lightning_sharding.readers import NpyReader
from lightning_sharding.readers.base import Reader
from lightning_sharding.recipes.synthetic_files import write_regression
from lightning_sharding.strategies._batches import PlannedBatches
from lightning_sharding.strategies._samples import SampleError
from lightning_sharding.strategies.options import LoaderOptions


def batches(reader: Reader, **options: Any) -> PlannedBatches:
    return PlannedBatches(reader, reader.manifest(), seed=3, world=World(), options=LoaderOptions(**options))


def both_ways(reader: Reader, positions: list[int], padding: int = 0) -> tuple[Any, Any]:
    """The batch of ``positions`` through the columns, and through the per-sample path."""
    dataset = batches(reader)
    assert dataset.columnar, f"{type(reader).__name__} should read columns"
    task = BatchTask(0, 0, 0, np.asarray(positions, dtype=np.int64), padding)

    def no_samples(*args: Any) -> Any:
        raise AssertionError("the columnar path read samples")

    reader.read_batch = reader.read = no_samples  # type: ignore[method-assign]
    columns = dataset[task]
    del reader.read_batch, reader.read
    dataset.columnar = False
    return columns.batch, dataset[task].batch


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
        return
    assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture
def npy(tmp_path: Path) -> str:
    write_regression(str(tmp_path), "npy", [7, 5, 9], dim=4)
    return str(tmp_path / "*.npy")


def test_synthetic_npy_and_mixture_columns_are_the_collated_samples(npy: str) -> None:
    positions = [0, 1, 2, 7, 11, 12, 19, 0]  # runs over three items, the last position a padding repeat
    for reader in (
        SyntheticReader(3, 7, dim=5),
        NpyReader(npy),
        NpyReader(npy, key=None),
        MixtureReader([Stream("a", SyntheticReader(2, 6, dim=5)), Stream("b", SyntheticReader(1, 9, dim=5))], 20),
    ):
        assert_same(*both_ways(reader, positions, padding=1))


@pytest.mark.needs("pyarrow")
def test_parquet_columns_are_the_collated_samples_and_text_columns_read_samples(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_sharding.readers import ParquetReader

    write_regression(str(tmp_path / "numeric"), "parquet", [7, 5, 9], dim=4, row_group_size=4)
    reader = ParquetReader(str(tmp_path / "numeric" / "*.parquet"))
    assert_same(*both_ways(reader, [0, 1, 2, 7, 11, 12, 19, 0], padding=1))
    # A text column cannot be a tensor: the batch is read sample by sample, as the collate makes it.
    (tmp_path / "text").mkdir()
    table = pa.table({"id": np.arange(6), "caption": [f"c{i}" for i in range(6)]})
    pq.write_table(table, tmp_path / "text" / "a.parquet", row_group_size=3)
    text = ParquetReader(str(tmp_path / "text" / "*.parquet"))
    task = BatchTask(0, 0, 0, np.asarray([0, 4, 5], dtype=np.int64), 0)
    batch = batches(text)[task].batch
    assert sorted(batch["caption"]) == sorted(f"c{i}" for i in batch["id"].tolist())


def test_anything_per_sample_keeps_the_per_sample_path() -> None:
    class Shifted(SyntheticReader):  # changes read_batch below the class that reads columns
        def read_batch(self, item: Any, indices: Any, ctx: Any) -> list[Any]:
            samples = super().read_batch(item, indices, ctx)
            for s in samples:
                s["id"] = s["id"] + 100
            return samples

    assert not Shifted().columnar and not MixtureReader([Stream("a", Shifted())]).columnar
    assert batches(Shifted()).columnar is False
    assert batches(SyntheticReader(), transform=lambda s, ctx: s).columnar is False
    assert batches(SyntheticReader(), collate_fn=lambda samples: samples).columnar is False
    task = BatchTask(0, 0, 0, np.arange(4, dtype=np.int64), 0)
    assert (batches(Shifted())[task].batch["id"] >= 100).all(), "the subclass's samples are served"


def test_columns_that_do_not_line_up_fall_back_and_name_the_sample() -> None:
    # Two streams of other widths: the columns do not concatenate, the per-sample path names the misfit.
    mixture = MixtureReader([Stream("a", SyntheticReader(1, 6, dim=5)), Stream("b", SyntheticReader(1, 2, dim=3))])
    dataset = batches(mixture)
    assert dataset.columnar
    with pytest.raises(SampleError, match=r"of item 'b/synthetic-00000' .* does not fit in a batch"):
        dataset[BatchTask(0, 0, 0, np.arange(8, dtype=np.int64), 0)]


def test_a_failing_column_read_is_read_again_sample_by_sample_and_named() -> None:
    class Broken(SyntheticReader):
        def read_columns(self, item: Any, indices: Any, ctx: Any) -> Any:
            raise OSError("disk gone")

        def read_batch(self, item: Any, indices: Any, ctx: Any) -> list[Any]:
            raise OSError("disk gone")

        def read(self, item: Any, index: int, ctx: Any) -> Any:
            raise ValueError(f"bad sample {index}")

    dataset = batches(Broken(1, 4))
    assert dataset.columnar
    with pytest.raises(SampleError, match=r"cannot read sample \d of item 'synthetic-00000'"):
        dataset[BatchTask(0, 0, 0, np.arange(4, dtype=np.int64), 0)]


def test_a_reader_without_columns_is_not_columnar() -> None:
    class Plain(Reader):
        def items(self) -> list[Any]:
            return SyntheticReader(1, 3).items()

        def read(self, item: Any, index: int, ctx: Any) -> Any:
            return {"x": torch.tensor([float(index)])}

    assert not Plain().columnar and batches(Plain()).columnar is False
    batch = batches(Plain())[BatchTask(0, 0, 0, np.arange(3, dtype=np.int64), 0)].batch
    assert batch["x"].shape == (3, 1) and sorted(batch["x"][:, 0].tolist()) == [0.0, 1.0, 2.0]
