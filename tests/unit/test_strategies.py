"""The strategy registry and the DataModule's view of it: names, order, clear refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sharding import ShardedDataModule, SyntheticReader
from lightning_sharding.strategies import get_strategy, register_strategy, strategy_names
from lightning_sharding.strategies.base import _REGISTRY
from lightning_sharding.strategies.shard import ShardStrategy
from tests.harness import ROOT


def test_the_built_in_strategies_come_first_in_a_fixed_order_whatever_imports_them_first() -> None:
    code = "import lightning_sharding.strategies.{}; from lightning_sharding.strategies import strategy_names; "
    code += "print(strategy_names())"
    for first in ("dali", "dispatch", "broadcast"):
        out = subprocess.run([sys.executable, "-c", code.format(first)], capture_output=True, text=True, cwd=ROOT)
        assert out.stdout.strip() == "('shard', 'broadcast', 'dispatch', 'dali')", out.stderr


def test_a_registered_strategy_is_a_name_for_the_datamodule_and_cannot_take_another_name() -> None:
    @register_strategy
    class Interleaved(ShardStrategy):
        name = "test_interleaved"
        worker_layout = "interleaved"

    try:
        assert strategy_names()[-1] == "test_interleaved"
        dm = ShardedDataModule(SyntheticReader(), strategy="test_interleaved")
        assert isinstance(dm.strategy, Interleaved) and dm.strategy == "test_interleaved"
        with pytest.raises(TypeError, match="needs a class attribute `name` of its own"):

            @register_strategy
            class Nameless(ShardStrategy):  # inherits "shard": it would replace the built-in
                pass

        with pytest.raises(
            ValueError, match="strategy name 'shard' is taken by .*ShardStrategy: give Copy another name"
        ):

            @register_strategy
            class Copy(ShardStrategy):
                name = "shard"

        assert type(get_strategy("shard")) is ShardStrategy
    finally:
        _REGISTRY.pop("test_interleaved", None)


def test_loader_options_are_attributes_that_are_checked_when_set() -> None:
    dm = ShardedDataModule(SyntheticReader(), batch_size=8)
    dm.batch_size = 64  # as Lightning's batch-size finder does
    assert dm.batch_size == dm.options.batch_size == 64
    with pytest.raises(ValueError, match=r"`ShardedDataModule\(batch_size=0\)` must be a positive integer"):
        dm.batch_size = 0
    assert dm.batch_size == 64 and dm.transform is None and dm.padding_key == "is_padding"


def test_a_strategy_that_reads_a_source_in_its_order_turns_shuffle_off(tmp_path: Path) -> None:
    from lightning_sharding.readers.sources import SqliteSource
    from tests.jobs.sources import make_db

    source = SqliteSource(make_db(tmp_path / "rows.sqlite", 8), "SELECT id FROM samples ORDER BY id")
    dm = ShardedDataModule(source=source, strategy="dispatch")
    assert dm.shuffle is False and not get_strategy("dispatch").shuffles
