"""One word per meaning (issue 52, docs/architecture.md#glossary): the names 0.2 gave a new word still
work for one release, with a DeprecationWarning naming the new spelling (lightning_sharding/_deprecated.py)."""

from __future__ import annotations

import importlib
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
from omegaconf import DictConfig

from lightning_sharding.core.world import BatchContext, SampleContext, WorkerContext

CONTEXT = WorkerContext(data_rank=1, data_size=2, worker_id=0, num_workers=2, epoch=3, seed=7)


@pytest.mark.parametrize("module", ["lightning_sharding.core.world", "lightning_sharding.readers.base",
                                    "lightning_sharding.readers.sources"])  # fmt: skip
def test_shard_context_imports_from_where_it_did_as_the_worker_context_with_a_warning(module: str) -> None:
    said = rf"{module}\.ShardContext is lightning_sharding\.core\.world\.WorkerContext since lightning_sharding 0\.2"
    with pytest.warns(DeprecationWarning, match=said):
        old = importlib.import_module(module).ShardContext
    assert old is WorkerContext


def test_the_roots_shard_context_warns_once_naming_its_home_and_new_name() -> None:
    import lightning_sharding
    from lightning_sharding import _deprecated

    _deprecated._warned.discard("ShardContext")  # warned once per process: as if for the first time
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        old = lightning_sharding.ShardContext  # type: ignore[attr-defined]
    assert old is WorkerContext
    assert [str(w.message) for w in said if w.category is DeprecationWarning] == [
        "lightning_sharding.ShardContext is no longer exported from the package root: import it from "
        "lightning_sharding.core.world as WorkerContext, its name since 0.2 "
        "(the root's name goes away in the next release)"
    ]


def test_an_unknown_name_of_a_module_with_old_names_is_an_attribute_error_without_a_warning() -> None:
    world = importlib.import_module("lightning_sharding.core.world")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
            world.NoSuchName  # noqa: B018


def test_a_contexts_shard_is_its_worker_with_a_warning() -> None:
    sample = SampleContext(CONTEXT, 12, 0, 12)
    batch = BatchContext(CONTEXT, np.arange(4, dtype=np.int64), 0)
    for context, owner in ((sample, "SampleContext"), (batch, "BatchContext")):
        assert context.worker is CONTEXT
        said = rf"{owner}\.shard is {owner}\.worker since lightning_sharding 0\.2"
        with pytest.warns(DeprecationWarning, match=said):
            assert context.shard is CONTEXT
    assert sample.sample_seed == SampleContext(CONTEXT, 12, 5, 1).sample_seed  # the seeds read .worker


def test_a_context_pickled_under_its_old_name_unpickles_as_a_worker_context() -> None:
    old = pickle.dumps(CONTEXT, protocol=0).replace(b"\nWorkerContext\n", b"\nShardContext\n")
    assert b"ShardContext" in old
    with pytest.warns(DeprecationWarning, match="ShardContext"):
        assert pickle.loads(old) == CONTEXT  # noqa: S301 - our own bytes


def test_a_worker_contexts_rank_and_world_size_are_its_data_rank_and_size_with_a_warning() -> None:
    # A rank is a global rank (World.rank); a worker's context carries the data-parallel ones.
    for old, new, value in (("rank", "data_rank", 1), ("world_size", "data_size", 2)):
        said = rf"^WorkerContext\.{old} is WorkerContext\.{new} since lightning_sharding 0\.2 .*World\.{old} is"
        with pytest.warns(DeprecationWarning, match=said) as warned:
            assert getattr(CONTEXT, old) == getattr(CONTEXT, new) == value
        assert warned[0].filename == __file__  # the warning points at the caller


def test_a_worker_context_built_with_the_old_keywords_is_the_same_context_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"^WorkerContext\.(rank|world_size) is WorkerContext\.data_") as warned:
        old = WorkerContext(rank=1, world_size=2, worker_id=0, num_workers=2, epoch=3, seed=7)  # type: ignore[call-arg]
    assert old == CONTEXT and old.worker_seed == CONTEXT.worker_seed
    assert sorted(str(w.message).split()[0] for w in warned) == ["WorkerContext.rank", "WorkerContext.world_size"]
    assert all(w.filename == __file__ for w in warned)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match="got both rank= and data_rank="):
            WorkerContext(data_rank=1, rank=1, data_size=2, worker_id=0, num_workers=2, epoch=3, seed=7)  # type: ignore[call-arg]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # today's names warn nowhere, also in the seed
        assert WorkerContext(1, 2, 0, 2, 3, 7) == CONTEXT and CONTEXT.worker_seed == old.worker_seed


def test_a_context_pickled_with_its_old_field_names_unpickles_with_the_new_ones() -> None:
    pickled = pickle.dumps(CONTEXT, protocol=0)
    old = pickled.replace(b"data_rank", b"rank").replace(b"data_size", b"world_size")
    assert b"data_" not in old
    assert pickle.loads(old) == CONTEXT  # noqa: S301 - our own bytes
    assert pickle.loads(pickle.dumps(CONTEXT)) == CONTEXT  # noqa: S301


def compose_train(tmp_path: Path, *overrides: str) -> DictConfig:
    from hydra import compose, initialize_config_dir

    from lightning_sharding.config import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("train", overrides=[f"out_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", *overrides])


def test_recipe_stream_composes_the_job_of_recipe_sqlite_and_warns_naming_it(tmp_path: Path) -> None:
    from lightning_sharding.train import build_datamodule

    old, new = (compose_train(tmp_path, f"recipe={name}", "data.rows=64") for name in ("stream", "sqlite"))
    assert old != new and new._renamed_recipe is None
    with pytest.warns(DeprecationWarning, match=r"^recipe=stream is now recipe=sqlite since lightning_sharding 0\.2"):
        dm = build_datamodule(old)
    assert old == new, "the alias leaves the new recipe's job, its mark taken out before building"
    assert type(dm.source).__name__ == "SqliteSource" and dm.strategy.name == "dispatch"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        build_datamodule(new)


def test_the_train_command_says_recipe_stream_is_recipe_sqlite_and_runs_that_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_sharding import train
    from lightning_sharding.core import spelling

    ran: list[DictConfig] = []
    monkeypatch.setenv(spelling.ENV, "python")  # main() sets it for the processes it starts
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(train, "run", ran.append)
    monkeypatch.setattr(train, "_log_through_hydra", lambda: None)
    monkeypatch.setattr("sys.argv", [train.PROG, "recipe=stream", f"out_dir={tmp_path}", "hydra/job_logging=disabled"])
    train.main()
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"{train.PROG}: warning:")]
    assert warned == [
        f"{train.PROG}: warning: recipe=stream is now recipe=sqlite since lightning_sharding 0.2; "
        "the old name goes away in the next release"
    ]
    assert len(ran) == 1 and ran[0]._renamed_recipe is None and ran[0].sharding.name == "dispatch"


def test_the_old_module_of_the_sqlite_recipe_imports_as_the_new_one_with_a_warning() -> None:
    import sys

    sys.modules.pop("lightning_sharding.recipes.stream", None)
    with pytest.warns(
        DeprecationWarning, match="lightning_sharding.recipes.stream moved to lightning_sharding.recipes.sqlite"
    ):
        module = importlib.import_module("lightning_sharding.recipes.stream")
    assert module is importlib.import_module("lightning_sharding.recipes.sqlite")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("lightning_sharding.keeper", "lightning_sharding.loading.keeper"),
        ("lightning_sharding.lightning.summary", "lightning_sharding.loading.summary"),
    ],
)
def test_importing_an_old_module_path_leaves_the_new_module_its_own_spec_and_reload(old: str, new: str) -> None:
    import sys

    module = importlib.import_module(new)
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        assert importlib.import_module(old) is module
    assert sys.modules[old] is module and sys.modules[new] is module
    assert module.__spec__ is not None and module.__spec__.name == new and module.__spec__.origin == module.__file__
    first = next(v for v in vars(module).values() if isinstance(v, type) and v.__module__ == new)
    saved = dict(vars(module))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            assert importlib.reload(module) is module
        assert getattr(module, first.__name__) is not first, "the reload ran the new module's own file again"
        assert module.__spec__.name == new
    finally:  # the classes other tests of this process hold
        vars(module).clear()
        vars(module).update(saved)


def test_a_ledgers_done_is_its_trained_positions_with_a_warning() -> None:
    from lightning_sharding.core.ledger import Ledger

    ledger = Ledger(seed=1, total=10, manifest={"fingerprint": "f"})
    ledger.record(np.array([0, 1], dtype=np.int64))
    ledger.commit()
    ledger.record(np.array([5], dtype=np.int64))
    assert ledger.trained.to_array().tolist() == [0, 1, 5]
    with pytest.warns(DeprecationWarning, match=r"Ledger\.done is Ledger\.trained since lightning_sharding 0\.2"):
        assert ledger.done == ledger.trained
    assert "trained" not in ledger.state_dict() and "done" not in ledger.state_dict()  # checkpoints as before


def test_every_module_that_warns_of_an_old_spelling_is_in_the_index_of_deprecated() -> None:
    from lightning_sharding import _deprecated

    package = Path(_deprecated.__file__).parent
    index = _deprecated.__doc__ or ""
    warning = [
        p.relative_to(package).as_posix()
        for p in sorted(package.rglob("*.py"))
        if "DeprecationWarning" in p.read_text()
    ]
    assert "core/world.py" in warning and "loading/engine.py" in warning
    missing = [path for path in warning if path != "_deprecated.py" and f"``{path}``" not in index]
    assert not missing, (
        f"lightning_sharding/_deprecated.py's docstring does not name {missing}: the index of 0.3's removals"
    )
