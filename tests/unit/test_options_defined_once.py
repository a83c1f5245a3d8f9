"""Each option is defined once, with one default, for the Python API and Hydra alike.

The loader options of Hydra's ``data`` schemas take their defaults from the Python API's signature,
and a data option's YAML states its own choices visibly. A strategy owns its settings
(``sharding=ShardStrategy(transport="torch")``): the Hydra ``sharding`` schemas are generated from the
strategies' constructors and compared here field by field, for every built-in strategy including dali.
The spellings of 0.1 (``strategy=``, ``transport=``, ``prefetch_items=``, ``data_root_map=``) still
work for one release, warned."""

from __future__ import annotations

import dataclasses
import inspect
import typing
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from omegaconf import MISSING, OmegaConf

from lightning_sharding import NpyWindows, ShardedData, ShardedDataModule, SqliteSource, SyntheticReader
from lightning_sharding.config.data import DataOptions, PhaseOptions, PretrainData, StreamOptions, TokenStreamOptions
from lightning_sharding.config.schemas import CONF_DIR, SCHEMAS
from lightning_sharding.loading.engine import LoadingEngine
from lightning_sharding.mixture import Phase, Stream
from lightning_sharding.recipes.mixture import SHARES
from lightning_sharding.strategies import (
    BroadcastStrategy,
    DaliStrategy,
    DispatchStrategy,
    ShardStrategy,
    get_strategy,
    strategy_names,
)
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.tokens import Packing
from lightning_sharding.train import build_datamodule
from tests.support.data.windows import write_months
from tests.support.extras import require

BUILT_IN = (ShardStrategy, BroadcastStrategy, DispatchStrategy, DaliStrategy)
ARGUMENTS = inspect.signature(LoadingEngine.from_arguments).parameters


def test_the_data_schemas_loader_options_are_the_python_apis_field_by_field() -> None:
    shared = [f for f in dataclasses.fields(DataOptions) if f.name in ARGUMENTS]
    assert {f.name for f in dataclasses.fields(DataOptions)} - {f.name for f in shared} == {"cache_dir"}
    for f in shared:
        assert typing.get_type_hints(DataOptions)[f.name] in (str, *_plain(ARGUMENTS[f.name].annotation)), f.name
    # Every data schema's fields that are engine arguments (data=mixture's samples_per_epoch,
    # batch_composition, allow_mixture_change, schedule...) have the engine's default.
    for name, schema in SCHEMAS["data"].items():
        for f in dataclasses.fields(schema):
            if f.name in ARGUMENTS:
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
                python = ARGUMENTS[f.name].default
                # root_map {} and streams []: none given
                assert default == python or (default in ({}, []) and python is None), (name, f.name)
    # The Python API's own simple call and the defaults it documents.
    assert (ARGUMENTS["batch_size"].default, ARGUMENTS["num_workers"].default) == (32, 0)


def test_the_loader_options_of_a_data_schema_go_to_the_datamodule_with_no_list_to_keep() -> None:
    from lightning_sharding.recipes.data import _BUILT_HERE, _PASSED

    loader_options = {f.name for f in dataclasses.fields(DataOptions) if f.name in ARGUMENTS}
    assert set(_PASSED) == loader_options - set(_BUILT_HERE) and set(_BUILT_HERE) <= loader_options


def test_hydra_sets_the_dataloader_options_of_the_python_api(tmp_path: Path) -> None:
    from lightning_sharding.train import misspelt_key

    assert misspelt_key(["trainer=gpu", "data.pin_memory=true"]) is None  # was: data has no key 'pin_memory'
    overrides = [f"out_dir={tmp_path}", f"data.cache_dir={tmp_path}", "data.pin_memory=true", "data.prefetch_factor=4"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("train", overrides=[*overrides, "data.timeout=5", "data.padding_key=pad"])
    options = build_datamodule(cfg).options
    assert (options.pin_memory, options.prefetch_factor, options.timeout, options.padding_key) == (True, 4, 5.0, "pad")
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("train", overrides=[f"out_dir={tmp_path}", "data.padding_key=null"])
    assert build_datamodule(cfg).options.padding_key is None
    defaults = build_datamodule(compose_default(tmp_path)).options
    assert (defaults.pin_memory, defaults.prefetch_factor, defaults.timeout, defaults.padding_key) == (
        ARGUMENTS["pin_memory"].default,
        ARGUMENTS["prefetch_factor"].default,
        ARGUMENTS["timeout"].default,
        ARGUMENTS["padding_key"].default,
    )


def compose_default(tmp_path: Path) -> typing.Any:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("train", overrides=[f"out_dir={tmp_path}"])


def _plain(annotation: str) -> tuple[type, ...]:
    """The OmegaConf types an annotation of the signature (a string) can be held as."""
    names = {"int": int, "bool": bool, "float": float, "str": str, "int | None": int | None}
    names |= {"str | None": str | None, "Mapping[str, str] | None": dict[str, str]}
    names |= {"str | Sequence[int] | Mapping[str, Any] | Skip | None": typing.Any}  # skip=: a string, list or mapping
    return (names[annotation],) if annotation in names else ()


@pytest.mark.parametrize("option", sorted(p.stem for p in (Path(CONF_DIR) / "data").glob("*.yaml")))
def test_a_data_option_states_the_loader_options_it_chooses_and_keeps_the_others_defaults(
    option: str, tmp_path: Path
) -> None:
    stated = {line.split(":")[0] for line in (Path(CONF_DIR) / "data" / f"{option}.yaml").read_text().splitlines()}
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        data = compose("train", overrides=[f"data={option}", f"out_dir={tmp_path}"]).data
    for key in data:  # every field of the option's schema that is an engine argument
        if key in ARGUMENTS and key not in stated:
            python = ARGUMENTS[key].default
            assert data[key] == python or (python is None and data[key] in ({}, [])), (option, key)
    assert {"batch_size", "num_workers", "persistent_workers"} <= stated  # the recipes' choices, visible


@pytest.mark.parametrize("strategy", BUILT_IN, ids=lambda cls: cls.name)
def test_the_hydra_schema_of_each_strategy_is_its_constructor_field_by_field(strategy: type) -> None:
    schema = SCHEMAS["sharding"][f"{strategy.name}_schema"]
    fields = {f.name: f for f in dataclasses.fields(schema)}
    assert fields.pop("name").default == strategy.name
    parameters = inspect.signature(strategy).parameters
    assert list(fields) == list(parameters)
    hints = typing.get_type_hints(strategy.__init__)
    for name, parameter in parameters.items():
        assert fields[name].default == parameter.default, name
        assert fields[name].type in (hints[name], str, int | None, str | None, typing.Optional[str]), name  # noqa: UP045
    # The settings a strategy reports are the ones its constructor takes, so repr() rebuilds it.
    built = strategy()
    assert set(built.settings()) - {"graph"} == set(parameters) - {"graph"}
    assert repr(built).startswith(f"{strategy.__name__}(")


def test_a_strategy_is_given_with_its_settings_and_a_name_picks_its_defaults() -> None:
    dm = ShardedDataModule(SyntheticReader(), sharding=ShardStrategy(transport="torch"))
    assert isinstance(dm.strategy, ShardStrategy) and dm.strategy.transport == "torch"
    assert ShardedDataModule(SyntheticReader(), sharding="shard").strategy.settings() == {"transport": "pool"}
    assert BroadcastStrategy().settings() == {"prefetch_items": 1, "transport": "pool"}
    with pytest.raises(ValueError, match=r"`ShardStrategy\(transport='tcp'\)` must be one of \['pool', 'torch'\]"):
        ShardStrategy(transport="tcp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`BroadcastStrategy\(prefetch_items=-1\)` must be an integer >= 0"):
        BroadcastStrategy(prefetch_items=-1)
    with pytest.raises(ValueError, match=r"`ShardedDataModule\(sharding='shards'\)` is not a strategy"):
        ShardedDataModule(SyntheticReader(), sharding="shards")
    assert "dali" in strategy_names()


def test_the_spellings_of_0_1_still_work_warned_with_the_new_one(tmp_path: Path) -> None:
    with pytest.warns(
        DeprecationWarning, match=r"`ShardedDataModule\(strategy=\.\.\.\)` is `ShardedDataModule\(sharding"
    ):
        assert ShardedDataModule(SyntheticReader(), strategy="shard").strategy.name == "shard"
    with pytest.warns(DeprecationWarning, match=r"pass `sharding=ShardStrategy\(transport='torch'\)`"):
        dm = ShardedDataModule(SyntheticReader(), transport="torch")
    assert dm.strategy.transport == "torch"  # type: ignore[attr-defined]
    windows = NpyWindows(write_months(tmp_path / "months", [8, 8]), window=4)
    with pytest.warns(DeprecationWarning, match=r"sharding=BroadcastStrategy\(prefetch_items=2, transport='pool'\)"):
        dm = ShardedDataModule(windows, strategy="broadcast", prefetch_items=2)
    assert dm.strategy.prefetch_items == 2  # type: ignore[attr-defined]
    with pytest.warns(
        DeprecationWarning, match=r"`ShardedDataModule\(data_root_map=\.\.\.\)` is `ShardedDataModule\(root_map"
    ):
        dm = ShardedDataModule(SyntheticReader(), data_root_map={"/old/": "/new/"})
    assert dm.root_map == {"/old/": "/new/"}
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.warns(DeprecationWarning, match=r"`ShardedData\(transport='torch'\)` is a setting of the strategy"):
        data = ShardedData(SyntheticReader(), optimizer=optimizer, transport="torch", batch_size=4)
    data.close()


def test_a_setting_given_where_it_does_not_belong_names_the_strategies_that_take_it(tmp_path: Path) -> None:
    import sqlite3

    with sqlite3.connect(tmp_path / "rows.db") as db:
        db.execute("CREATE TABLE t (id INTEGER)")
    source = SqliteSource(str(tmp_path / "rows.db"), "SELECT id FROM t ORDER BY id")
    with pytest.raises(ValueError, match=r"transport=\.\.\.\)` is a setting of ShardStrategy\(transport=\.\.\.\) or "):
        ShardedDataModule(source=source, sharding="dispatch", transport="torch")
    with pytest.raises(
        ValueError, match=r"is a setting of BroadcastStrategy\(prefetch_items=\.\.\.\), not of strategy 'shard'"
    ):
        ShardedDataModule(SyntheticReader(), prefetch_items=2)
    with pytest.raises(ValueError, match=r"give the setting to the strategy, ShardStrategy\(transport='torch'\)"):
        ShardedDataModule(SyntheticReader(), sharding=ShardStrategy(), transport="torch")
    with pytest.raises(TypeError, match=r"`ShardedDataModule\(strategy=\.\.\., sharding=\.\.\.\)`"):
        ShardedDataModule(SyntheticReader(), strategy="shard", sharding="broadcast")
    with pytest.raises(TypeError, match=r"ShardedDataModule\(\) got an unexpected keyword argument 'batch_sise'"):
        ShardedDataModule(SyntheticReader(), batch_sise=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spellings warn of nothing
        ShardedDataModule(SyntheticReader(), sharding=ShardStrategy(transport="torch"), root_map={"/a/": "/b/"})


def test_hydra_sets_a_strategys_settings_under_sharding(tmp_path: Path) -> None:
    def datamodule(*overrides: str) -> ShardedDataModule:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("train", overrides=[f"out_dir={tmp_path}", f"data.cache_dir={tmp_path}", *overrides])
        return build_datamodule(cfg)

    dm = datamodule("sharding.transport=torch")
    assert isinstance(dm.strategy, ShardStrategy) and dm.strategy.transport == "torch"
    dm = datamodule("recipe=climate", "sharding.prefetch_items=3")
    assert isinstance(dm.strategy, BroadcastStrategy) and dm.strategy.prefetch_items == 3
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("train", overrides=["sharding=dali", "sharding.num_threads=2", "sharding.device_id=null"])
    assert OmegaConf.to_container(cfg.sharding) == {
        "name": "dali",
        "graph": None,
        "num_threads": 2,
        "device_id": None,
        "prefetch_queue_depth": 2,
        "py_start_method": "spawn",
    }
    require("nvidia.dali")
    dm = datamodule("sharding=dali", "sharding.num_threads=2", "data.num_workers=0")
    assert isinstance(dm.strategy, DaliStrategy) and dm.strategy.pipeline.num_threads == 2


def test_a_dali_graph_is_a_function_or_its_dotted_path() -> None:
    strategy = DaliStrategy("tests.unit.test_options_defined_once.identity_graph")
    assert strategy.pipeline.graph is identity_graph
    with pytest.raises(ValueError, match=r"DaliStrategy\(graph='no_such_module.graph'\): cannot import it"):
        DaliStrategy("no_such_module.graph")
    with pytest.raises(ValueError, match=r"graph='tests\.unit\.test_options_defined_once\.BUILT_IN'\) is not a"):
        DaliStrategy("tests.unit.test_options_defined_once.BUILT_IN")
    assert get_strategy("dali").settings()["num_threads"] == 1


def identity_graph(fields: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """A DALI graph that changes nothing (found by its dotted path above)."""
    return fields


def test_a_hydra_sharding_config_goes_in_whole_and_its_settings_are_checked_where_set(tmp_path: Path) -> None:
    from lightning_sharding.config import ConfigError, check_config
    from lightning_sharding.train import misspelt_key

    dm = ShardedDataModule(SyntheticReader(), sharding={"name": "shard", "transport": "torch"})
    assert isinstance(dm.strategy, ShardStrategy) and dm.strategy.transport == "torch"
    with pytest.raises(TypeError, match=r"a Hydra `sharding` config .* goes in whole, as sharding=sharding"):
        ShardedDataModule(SyntheticReader(), **{"name": "shard", "transport": "torch"})
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"`ShardedDataModule\(strategy='bogus'\)`"):
        ShardedDataModule(SyntheticReader(), strategy="bogus")

    def config(*overrides: str) -> typing.Any:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return compose("train", overrides=[f"out_dir={tmp_path}", *overrides])

    with pytest.raises(ConfigError, match=r"sharding=shard sharding\.transport=bogus: `ShardStrategy\(transport="):
        check_config(config("sharding.transport=bogus"))
    with pytest.raises(ConfigError, match=r"choose the strategy with sharding=dispatch \(its settings come with it\)"):
        check_config(config("sharding.name=dispatch", "data=sqlite"))
    assert "sharding.transport" in str(misspelt_key(["data.transport=torch"]))
    assert "sharding=NAME" in str(misspelt_key(["sharding.strategy=broadcast"]))
    assert "Did you mean sharding.transport?" in str(misspelt_key(["--cfg", "job", "sharding.transprot=torch"]))


def test_hydras_message_for_a_strategy_setting_of_another_option_names_the_option_that_takes_it() -> None:
    from lightning_sharding.train import misspelt_key

    said = misspelt_key(["sharding.prefetch_items=2"])  # sharding=shard takes none
    assert said == (
        "sharding.prefetch_items: sharding has no key 'prefetch_items' (a setting of sharding=broadcast). "
        "Its keys are name, transport"
    )
    said = str(misspelt_key(["sharding=dispatch", "sharding.transport=torch"]))
    assert "has no key 'transport' (a setting of sharding=shard or sharding=broadcast)." in said
    assert "(a setting of sharding=dali)" in str(misspelt_key(["sharding.num_threads=2"]))
    said = str(misspelt_key(["data.prefetch_items=2"]))  # under data: its place is sharding's
    assert "has no key 'prefetch_items' (a setting of sharding=broadcast, as sharding.prefetch_items). Its" in said
    assert "(a setting" not in str(misspelt_key(["sharding.transprot=torch"]))  # a typo keeps its closest key


@pytest.mark.parametrize(
    ("schema", "api", "skipped"),
    [(StreamOptions, Stream, {"name", "reader"}), (TokenStreamOptions, Stream, {"name", "reader"})]
    + [(PhaseOptions, Phase, {"note"}), (PretrainData, Packing, set())],
    ids=["data=mixture streams", "data=pretrain streams", "schedule phases", "data=pretrain packing"],
)
def test_a_streams_and_a_phases_schema_hold_the_python_classes_fields_with_their_defaults(
    schema: type, api: type, skipped: set[str]
) -> None:
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for f in dataclasses.fields(api):
        if f.name in skipped:
            continue
        assert f.name in fields, f"{schema.__name__} lacks {api.__name__}.{f.name}"
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = MISSING if required else f.default  # a required field: ???, which the option's YAML gives
        assert fields[f.name].default == default and fields[f.name].default_factory == f.default_factory, f.name
    assert set(SHARES) == {f.name for f in dataclasses.fields(Stream)} - {"name", "reader"}


def test_data_pretrain_builds_the_packing_of_its_yaml_and_packings_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_sharding.recipes import pretrain

    built: list[typing.Any] = []
    real = pretrain.datamodule
    monkeypatch.setattr(pretrain, "datamodule", lambda *a, **kw: built.append(kw["packing"]) or real(*a, **kw))
    stated = (Path(CONF_DIR) / "data" / "pretrain.yaml").read_text().splitlines()
    assert {"seq_len: 128", "vocab_size: 256"} <= set(stated)  # the recipe's choices, visible
    overrides = [f"out_dir={tmp_path}", f"data.cache_dir={tmp_path}", "data=pretrain"]
    overrides.append("data.streams=[{name: web, documents: 20, longest: 30}]")
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        build_datamodule(compose("train", overrides=overrides))
        build_datamodule(compose("train", overrides=[*overrides, "data.mode=best_fit", "data.fields=[input_ids]"]))
    assert built[0] == Packing(seq_len=128, vocab_size=256)
    assert built[1] == Packing(seq_len=128, mode="best_fit", vocab_size=256, fields=("input_ids",))
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("train", overrides=[*overrides, "data.vocab_size=null"])
    with pytest.raises(InstantiationException, match=r"data\.vocab_size=null: stream 'web' has no prefixes"):
        build_datamodule(cfg)


def test_hydra_takes_a_streams_share_in_tokens_and_a_schedule_of_tokens_for_packed_streams(tmp_path: Path) -> None:
    streams = "[{name: a, documents: 60, tokens: 1500}, {name: b, documents: 60, weight: 1.0}]"
    schedule = "[{shares: {a: 1.0, b: 1.0}}, {tokens: 4000, shares: {a: 1.0}}]"
    overrides = [f"out_dir={tmp_path}", f"data.cache_dir={tmp_path}", "recipe=pretrain"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("train", overrides=[*overrides, f"data.streams={streams}", f"data.schedule={schedule}"])
    mixture = build_datamodule(cfg).make_reader()
    assert [(s.name, s.tokens, s.weight) for s in mixture.streams] == [("a", 1500, None), ("b", None, 1.0)]
    phases = [(p.tokens, dict(p.shares)) for p in mixture.phases if not p.note]
    assert phases == [(0, {"a": 1.0, "b": 1.0}), (4000, {"a": 1.0})]  # the first phase starts at token 0
    # A share in tokens on files that are not packed is the Python API's refusal, word for word.
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        more = ["recipe=mixture", "data.streams.0.weight=null", "data.streams.0.tokens=100"]
        cfg = compose("train", overrides=[*overrides[:2], *more])
    with pytest.raises(
        InstantiationException, match=r"stream 'web': a share in tokens \(tokens=100\) needs packed token sequences"
    ):
        build_datamodule(cfg)


def test_the_loader_options_defaults_are_the_python_apis() -> None:
    # LoaderOptions() is what Strategy.check takes for "not set": it must be the arguments' defaults.
    from torch.utils.data import default_collate

    for f in dataclasses.fields(LoaderOptions):
        default = getattr(LoaderOptions(), f.name)
        python = ARGUMENTS[f.name].default
        assert default == python or (f.name == "collate_fn" and python is None and default is default_collate), f.name
    assert "sync" in ARGUMENTS["even_batches"].annotation  # dispatch's policy is in the signature's type
