"""The strategy registry and the DataModule's view of it: names, order, clear refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sharding import ShardedDataModule, SyntheticReader
from lightning_sharding.strategies import get_strategy, register_strategy, strategy_names
from lightning_sharding.strategies.base import _REGISTRY
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import ShardStrategy
from tests.support.harness import ROOT


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
        dm = ShardedDataModule(SyntheticReader(), sharding="test_interleaved")
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
    from tests.support.data.sources import make_db

    source = SqliteSource(make_db(tmp_path / "rows.sqlite", 8), "SELECT id FROM samples ORDER BY id")
    dm = ShardedDataModule(source=source, sharding="dispatch")
    assert dm.shuffle is False and not get_strategy("dispatch").shuffles


def test_the_default_start_method_is_a_forkserver_on_linux_and_what_python_can_serve_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import multiprocessing
    import types

    from lightning_sharding.strategies import _start

    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: None)
    monkeypatch.setattr(sys, "platform", "linux")
    assert _start.start_method(None) == "forkserver"
    assert _start.start_method("spawn") == "spawn"
    assert _start.start_method(multiprocessing.get_context("fork")) == "fork"
    notebook = types.ModuleType("__main__")
    notebook.get_ipython = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    assert _start.start_method(None) == "fork"  # a notebook's classes cannot be imported by a new process
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _start.start_method(None) == "spawn"
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "spawn")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    assert _start.start_method(None) == "forkserver"  # as a ddp_spawn rank finds it: set by spawning, not by you


def test_the_multiprocessing_internals_the_forkserver_start_relies_on_are_there() -> None:
    """``leave_forkserver`` and the after-fork reset use these; were they renamed, a killed training
    process would leave its server and workers running again."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    for name in ("_forkserver_pid", "_forkserver_alive_fd", "_forkserver_address", "_preload_modules"):
        assert hasattr(server, name), name


def test_a_forkserver_preloads_the_storage_package_a_reader_of_remote_files_reads_with() -> None:
    """A worker's first read of s3:// imports s3fs (a second); the server imports it instead, while
    the training process lists (Reader.worker_modules)."""
    from lightning_sharding.readers import TarReader
    from lightning_sharding.strategies._start import preload_modules

    remote = TarReader(["s3://bucket/a/*.tar", "gs://bucket/b.tar", "/data/c.tar"])
    assert remote.worker_modules() == ["fsspec", "s3fs", "gcsfs"]
    assert {"s3fs", "gcsfs", "lightning_sharding.readers.tar"} <= set(preload_modules(remote))
    assert TarReader("/data/*.tar").worker_modules() == ["fsspec"], "local files need no storage package"


def test_a_class_of_a_fileless_main_is_refused_for_new_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from lightning_sharding.strategies._worker import check_picklable

    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    Cell = type("Cell", (), {"__module__": "__main__"})
    main.Cell = Cell  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"defined in a notebook.*multiprocessing_context='fork'"):
        check_picklable("DataLoader workers started with forkserver", "", reader=Cell())
    with pytest.raises(ValueError, match=r"multiprocessing_context='Fork'.*must be one of"):
        LoaderOptions(multiprocessing_context="Fork").check("ShardedDataModule")


def test_a_strategy_says_what_it_takes_in_refusal_and_each_refusal_names_the_strategies_that_take_it() -> None:
    # The built-in rules, asked the one way: None is taken, a string is the reason.
    assert get_strategy("shard").refusal("on_error", "skip") is None
    assert get_strategy("dispatch").refusal("even_batches", "sync") is None
    assert get_strategy("shard").refusal("even_batches", "sync") == "plans only ['pad', 'drop'] batches"
    assert get_strategy("broadcast").refusal("streams", "mixed") == "does not read a mixture of streams"
    assert get_strategy("dali").refusal("streams", "mixed") is None
    assert get_strategy("dali").refusal("streams", "stratified") == "plans only ['mixed'] batches"
    assert get_strategy("dali").refusal("pin_memory", True) is not None
    for name in ("broadcast", "dali"):
        refused = rf"on_error='skip'\)`: strategy '{name}' cannot .*; use sharding='shard'$"
        with pytest.raises(ValueError, match=refused):
            get_strategy(name).check(LoaderOptions(on_error="skip"))
    refused = (
        r"even_batches='sync'\)`: strategy 'shard' plans only \['pad', 'drop'\] batches$"  # dispatch reads a source
    )
    with pytest.raises(ValueError, match=refused):
        get_strategy("shard").check(LoaderOptions(even_batches="sync"))


def test_a_strategy_of_0_1_that_declares_flags_still_works_and_is_told_the_new_spelling() -> None:
    flags = r"declares \['fixed_options', 'fixed_reason', 'skips_errors'\].*refusal"
    with pytest.warns(DeprecationWarning, match=flags):

        class OldStyle(ShardStrategy):  # as docs/how-to/own-strategy.md wrote it in 0.1
            name = "test_old_style"
            fixed_options = ("num_workers", "transform", "batch_transform")
            fixed_reason = "reads in the training process"
            skips_errors = False

    assert OldStyle.refusal("num_workers", 2) == "reads in the training process"
    assert OldStyle.refusal("on_error", "skip") == "cannot fill the place of a skipped sample"
    assert OldStyle.refusal("pin_memory", True) is None  # not among its fixed options
    assert OldStyle.refusal("streams", "mixed") is None  # inherited from the shard strategy
    with pytest.raises(ValueError, match=r"num_workers=2\)`: strategy 'test_old_style' reads in the training process"):
        OldStyle().check(LoaderOptions(num_workers=2))


def test_a_refusal_names_only_strategies_that_read_the_data_given_and_wrong_data_is_refused_at_once(
    tmp_path: Path,
) -> None:
    import sqlite3

    from lightning_sharding import NpyWindows, SqliteSource, Stream

    with sqlite3.connect(tmp_path / "rows.db") as db:
        db.execute("CREATE TABLE t (id INTEGER)")

    # A source's refusal suggests no reader's strategy; a window reader's suggests the readers' shard.
    refused = r"on_error='skip'\)`: strategy 'dispatch' cannot skip a sample: [^;]*$"
    with pytest.raises(ValueError, match=refused):
        ShardedDataModule(
            source=SqliteSource(str(tmp_path / "rows.db"), "SELECT id FROM t ORDER BY id"),
            sharding="dispatch",
            on_error="skip",
        )
    with pytest.raises(ValueError, match=r"strategy 'broadcast' cannot skip a sample: .*; use sharding='shard'$"):
        get_strategy("broadcast").check(LoaderOptions(on_error="skip"))
    assert NpyWindows  # imported for the kinds above: a WindowedReader is a Reader
    # The wrong kind of data for the strategy is refused when the DataModule is made, not in fit.
    with pytest.raises(TypeError, match=r"strategy 'broadcast' needs a WindowedReader \(such as NpyWindows\)"):
        ShardedDataModule(SyntheticReader(), sharding="broadcast")
    # A strategy that takes only stratified batches takes a stratified mixture (asked once, with it).

    class StratifiedOnly(ShardStrategy):
        name = "test_stratified_only"

        @classmethod
        def refusal(cls, setting: str, value: object) -> str | None:
            return "plans only ['stratified'] batches" if setting == "streams" and value != "stratified" else None

    streams = [Stream("a", SyntheticReader(2, 8)), Stream("b", SyntheticReader(2, 8))]
    stratified = ShardedDataModule(streams=streams, batch_composition="stratified", batch_size=4).make_reader()
    StratifiedOnly().check_data(stratified, "ShardedDataModule")
    mixed = ShardedDataModule(streams=streams, batch_size=4).make_reader()
    with pytest.raises(ValueError, match=r"\(streams=...\)`: strategy 'test_stratified_only' plans only"):
        StratifiedOnly().check_data(mixed, "ShardedDataModule")


def test_the_strategy_attribute_is_set_as_sharding_is_given_and_checked() -> None:
    dm = ShardedDataModule(SyntheticReader(), on_error="skip")
    dm.strategy = {"name": "shard", "transport": "torch"}
    assert isinstance(dm.strategy, ShardStrategy) and dm.strategy.transport == "torch"
    with pytest.raises(ValueError, match=r"sharding='bogus'\)` is not a strategy"):
        dm.strategy = "bogus"
    with pytest.raises(ValueError, match=r"on_error='skip'\)`: strategy 'broadcast' cannot skip"):
        dm.strategy = "broadcast"
    assert dm.strategy == "shard"
    with pytest.raises(ValueError, match=r"'prefetch_items' is a setting of sharding.name=broadcast, not of strategy"):
        ShardedDataModule(SyntheticReader(), sharding={"name": "shard", "prefetch_items": 3})
