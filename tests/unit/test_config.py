"""Config groups: every option composes and instantiates; bad keys, types and combinations fail early."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException
from omegaconf import DictConfig

from lightning_sharding.config import CONF_DIR, ConfigError, check_config, resolve_ckpt_path
from lightning_sharding.train import build_callbacks, build_datamodule, build_logger, run, trainer_options
from tests.support.extras import require

GROUPS = {
    group: sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))
    for group in ("data", "sharding", "trainer", "model", "callbacks", "logger", "recipe")
}
# The data option each sharding and model option goes with.
PARTNER = {
    "broadcast": "months",
    "dispatch": "sqlite",
    "forecaster": "months",
    "token_model": "tokens",
    "causal_lm": "pretrain",
    "image_classifier": "images",
}


def make(tmp_path: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("train", overrides=[f"out_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", *overrides])


def test_every_group_has_its_options() -> None:
    assert GROUPS["sharding"] == ["broadcast", "dali", "dispatch", "shard"]
    assert GROUPS["trainer"] == ["cpu", "ddp_cpu", "gpu", "multi_node"]
    assert {"climate", "webdataset_s3", "tokens", "sqlite", "stream"} <= set(GROUPS["recipe"])
    assert all(GROUPS[g] for g in GROUPS)


def test_help_lists_each_groups_options_and_every_option_composes_typed_by_its_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The schemas are top-level configs, not options: ``--help`` lists the options one chooses and
    no ``*_schema``, while each option still extends its schema (a bad key or type fails when composed)."""
    from omegaconf import OmegaConf

    from lightning_sharding import train
    from lightning_sharding.config import SCHEMAS
    from lightning_sharding.core import spelling

    monkeypatch.setenv(spelling.ENV, "python")  # main() sets it for the processes it starts
    monkeypatch.setattr("sys.argv", [train.PROG, "--help"])
    with pytest.raises(SystemExit) as done:
        train.main()
    assert done.value.code == 0
    listing = capsys.readouterr().out.split("== Config ==")[0]
    choices = dict(line.split(": ", 1) for line in listing.splitlines() if ": " in line)
    assert "_schema" not in listing
    for group, schemas in SCHEMAS.items():
        assert choices[group].split(", ") == GROUPS[group]
        for option in GROUPS[group]:
            partner = [f"data={PARTNER[option]}"] if option in PARTNER else []
            cfg = make(tmp_path, f"{group}={option}", *partner)
            assert OmegaConf.get_type(cfg, group) in schemas.values(), f"{group}={option}"


@pytest.mark.parametrize("option", GROUPS["data"])
def test_every_data_option_builds_its_datamodule(tmp_path: Path, option: str) -> None:
    sharding = {"months": "broadcast", "sqlite": "dispatch"}.get(option, "shard")
    cfg = make(tmp_path, f"data={option}", f"sharding={sharding}")
    check_config(cfg)
    dm = build_datamodule(cfg)
    assert dm.strategy.name == sharding and dm.batch_size == cfg.data.batch_size
    if dm.source is not None:
        assert dm.source.length() == cfg.data.rows
    else:
        assert sum(i.num_samples for i in dm.make_reader().items()) > 0  # generated, then listed


@pytest.mark.needs("PIL", "simplejpeg")
@pytest.mark.parametrize("batch_path", [False, True])
def test_the_images_data_reads_the_image_and_label_fields_it_is_given(tmp_path: Path, batch_path: bool) -> None:
    """Shards of PNG images with their class in a ``label`` field train with ``data.image_fields=[png]
    data.label_field=label``, per sample or on the batch path; a field the reader does not decode is named."""
    import io
    import tarfile

    import numpy as np
    from PIL import Image

    labels = {}
    for s in range(2):
        with tarfile.open(tmp_path / f"part-{s}.tar", "w") as tar:
            for i in range(5):
                key, label = f"s{s}i{i}", (s * 5 + i) % 3
                png = io.BytesIO()
                Image.fromarray(np.full((12, 16, 3), 40 * i, dtype=np.uint8)).save(png, format="PNG")
                for ext, data in (("png", png.getvalue()), ("label", str(label).encode()), ("txt", b"x")):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                labels[key] = label
    images = ["recipe=images", f"data.urls=[{tmp_path}/part-*.tar]", "data.crop=8", "data.classes=3"]
    loading = ["data.num_workers=0", "data.batch_size=4", "data.seed=1", f"data.batch_path={str(batch_path).lower()}"]
    cfg = make(tmp_path, *images, *loading, "data.image_fields=[png]", "data.label_field=label")
    check_config(cfg)
    dm = build_datamodule(cfg)
    dm.setup("fit")
    served = []
    for batch in dm.train_dataloader():
        assert batch["image"].shape[1:] == (3, 8, 8) and batch["label"].dtype == torch.int64
        served += [int(label) for label, pad in zip(batch["label"], batch["is_padding"], strict=True) if not pad]
    dm.teardown("fit")
    assert sorted(served) == sorted(labels.values())
    with pytest.raises(InstantiationException, match=r"'jxl' is no image extension the reader decodes"):
        build_datamodule(make(tmp_path, *images, "data.image_fields=[png,jxl]"))


@pytest.mark.needs("pyarrow")
def test_the_pretrain_data_reads_parquet_token_lists(tmp_path: Path) -> None:
    """A stream's ``.parquet`` prefixes are read by ParquetTokens, from the column the stream names:
    every token of the files is in the epoch's packed sequences once; a stream of two formats is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [list(range(t, t + n)) for t, n in ((1, 5), (6, 9), (15, 2), (17, 7), (24, 3))]
    table = pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int32())), "text": ["a", "b", "c", "d", "e"]})
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=2)
    stream = f"data.streams=[{{name: web, prefixes: ['{tmp_path}/*.parquet'], column: tokens}}]"
    packing = ["data.seq_len=8", "data.batch_size=2", "data.num_workers=0", "data.seed=1"]
    dm = build_datamodule(make(tmp_path, "recipe=pretrain", stream, *packing))
    dm.setup("fit")
    served = [t for batch in dm.train_dataloader() for t in batch["input_ids"][batch["input_ids"] != 0].tolist()]
    dm.teardown("fit")
    assert sorted(served) == list(range(1, 27))
    (tmp_path / "web.idx").write_bytes(b"")
    both = f"data.streams=[{{name: web, prefixes: ['{tmp_path}/train.parquet', '{tmp_path}/web']}}]"
    with pytest.raises(InstantiationException, match=r"data.streams 'web': prefixes \[.*web'\] are not \.parquet"):
        build_datamodule(make(tmp_path, "recipe=pretrain", both))


@pytest.mark.parametrize("option", GROUPS["sharding"])
def test_every_sharding_option_reaches_the_datamodule(tmp_path: Path, option: str) -> None:
    if option == "dali":
        require("nvidia.dali")
    cfg = make(tmp_path, f"sharding={option}", f"data={PARTNER.get(option, 'synthetic')}")
    check_config(cfg)
    assert build_datamodule(cfg).strategy.name == option


@pytest.mark.parametrize("option", GROUPS["model"])
def test_every_model_option_instantiates(tmp_path: Path, option: str) -> None:
    import lightning.pytorch as pl
    from hydra.utils import instantiate

    cfg = make(tmp_path, f"model={option}", f"data={PARTNER.get(option, 'synthetic')}")
    model = instantiate(cfg.model)
    assert isinstance(model, pl.LightningModule) and sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("option", GROUPS["trainer"])
def test_every_trainer_option_instantiates(tmp_path: Path, option: str) -> None:
    import lightning.pytorch as pl
    import torch

    cfg = make(tmp_path, f"trainer={option}")
    options = trainer_options(cfg)
    if option == "gpu" and not torch.cuda.is_available():  # this machine: the options are right, Lightning refuses
        assert options["accelerator"] == "gpu"
        with pytest.raises(Exception, match="(?i)gpu|cuda"):
            pl.Trainer(**options, logger=False)
        return
    trainer = pl.Trainer(**options, logger=False, enable_checkpointing=False)
    assert trainer.num_nodes == cfg.trainer.num_nodes
    assert trainer.num_devices == (cfg.trainer.devices if cfg.trainer.devices > 0 else trainer.num_devices)


@pytest.mark.parametrize("option", GROUPS["callbacks"])
def test_every_callbacks_option_instantiates(tmp_path: Path, option: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    cfg = make(tmp_path, f"callbacks={option}")
    _, callbacks = build_callbacks(cfg)
    checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    assert len(checkpoints) == (1 if option == "default" else 0)
    if checkpoints:
        assert checkpoints[0].dirpath == str(tmp_path / "checkpoints")


@pytest.mark.parametrize("option", GROUPS["logger"])
def test_every_logger_option_instantiates(tmp_path: Path, option: str) -> None:
    logger = build_logger(make(tmp_path, f"logger={option}"))
    assert (logger is False) == (option == "none")
    if logger:
        assert Path(logger.save_dir) == tmp_path


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.batch_sise=8", "batch_sise"),
        ("data.num_workers=two", "num_workers"),
        ("sharding.prefetch_itmes=2", "prefetch_itmes"),
        ("trainer.devices=many", "devices"),
        ("model.hiden=3", "hiden"),
        ("callbacks.checkpont=false", "checkpont"),
        ("recipe=climate data.windo=4", "windo"),
        ("recipe=climate sharding.prefetch_items=x", "prefetch_items"),
        ("recipe=nope", "nope"),
    ],
)
def test_a_misspelt_key_or_wrong_type_fails_at_compose_time(tmp_path: Path, override: str, key: str) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        make(tmp_path, *override.split())
    assert key in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+data.bogus_key=1", "Key 'bogus_key' not in 'SyntheticData' (data=synthetic), full_key: data.bogus_key"),
        ("+data.streams.0.wieght=2 data=mixture", "Key 'wieght' not in 'StreamOptions' (data=mixture)"),
        ("+sharding.prefetch_itmes=2 recipe=climate",
         "Key 'prefetch_itmes' not in 'BroadcastSharding' (sharding=broadcast), full_key: sharding.prefetch_itmes"),
        ("+trainer.max_epoch=3",
         "Key 'max_epoch' not in 'TrainerConfig' (group 'trainer'), full_key: trainer.max_epoch"),
        ("+model.hiden=3", "Key 'hiden' not in 'RegressorModel' (model=regressor), full_key: model.hiden"),
        ("+callbacks.checkpont=false", "Key 'checkpont' not in 'CallbacksConfig' (group 'callbacks')"),
        ("+audit.enable=true", "Key 'enable' not in 'AuditConfig' (group 'audit'), full_key: audit.enable"),
        ("+out_dri=x", "Key 'out_dri' not in 'TrainConfig' (the train config), full_key: out_dri"),
    ],
)  # fmt: skip
def test_a_key_appended_with_plus_that_no_schema_knows_is_refused_by_name(
    tmp_path: Path, override: str, message: str
) -> None:
    """Hydra lets ``+group.key=value`` into a typed group; the builder would then ignore the key."""
    cfg = make(tmp_path, *override.split())  # composes: Hydra's own check lets the key in
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert message in str(err.value)
    assert "no schema knows it" in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["+data.storage_options={key: KEY, secret: SECRET}", "recipe=webdataset_s3"],  # an untyped dict: any key
        ["data.streams.1.weight=null", "+data.streams.1.choose=500", "recipe=mixture"],  # a known key, with '+'
        ["+trainer.deterministic=true"],  # a Trainer argument the schema leaves out goes to the Trainer
    ],
)
def test_a_key_appended_with_plus_that_a_schema_or_the_trainer_knows_passes(
    tmp_path: Path, overrides: list[str]
) -> None:
    from lightning_sharding.train import trainer_options

    cfg = make(tmp_path, *overrides)
    check_config(cfg)
    if overrides[0].startswith("+trainer"):
        assert trainer_options(cfg)["deterministic"] is True


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["sharding=broadcast"], ["sharding=broadcast", "data=synthetic", "window"]),
        (["data=files", "sharding=broadcast"], ["sharding=broadcast", "data=files"]),
        (["data=sqlite"], ["data=sqlite", "sharding=shard"]),
        (["sharding=dispatch"], ["sharding=dispatch", "data=synthetic"]),
        (["recipe=climate", "data.on_error=skip"], ["data.on_error='skip'", "broadcast cannot skip", "sharding=shard"]),
        (["data.even_batches=sync"], ["data.even_batches='sync'", "sharding=shard"]),
        (["data.num_items=2", "data.samples_per_item=50", "data.batch_size=128"],
         ["data.batch_size=128", "100 samples"]),
        (["trainer=ddp_cpu", "data.num_items=1", "data.samples_per_item=100", "data.batch_size=64"],
         ["data.batch_size=64", "trainer.devices=2", "50 per rank"]),
    ],
)  # fmt: skip
def test_a_combination_that_cannot_work_names_both_keys(tmp_path: Path, overrides: list[str], named: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        check_config(make(tmp_path, *overrides))
    for text in named:
        assert text in str(err.value)


def test_a_reader_of_your_own_that_cannot_window_is_refused_for_broadcast(tmp_path: Path) -> None:
    """An untyped data config (no schema) is checked once built: its reader is not a WindowedReader."""
    overrides = ["sharding=broadcast", "data=files", "data.num_items=2", "data.samples_per_item=10"]
    cfg = make(tmp_path, *overrides)
    from omegaconf import OmegaConf

    cfg.data = OmegaConf.create(OmegaConf.to_container(cfg.data))  # as a YAML without a schema
    with pytest.raises(ConfigError, match=r"sharding=broadcast cannot read.*TarReader"):
        run(cfg)


def test_ckpt_path_last_without_a_checkpoint_starts_fresh_saying_where_it_looked(tmp_path: Path) -> None:
    """As Lightning's ckpt_path="last": one command for a job's first launch and every requeue."""
    said = f"ckpt_path=last: no checkpoint in {tmp_path / 'checkpoints'} yet .* starts from scratch"
    with pytest.warns(UserWarning, match=said):
        assert resolve_ckpt_path(make(tmp_path, "ckpt_path=last")) is None
    with pytest.raises(FileNotFoundError, match="ckpt_path=nothing.ckpt: no such checkpoint file"):
        resolve_ckpt_path(make(tmp_path, "ckpt_path=nothing.ckpt"))


def test_ckpt_path_last_takes_the_newest_checkpoint(tmp_path: Path) -> None:
    import os

    where = tmp_path / "checkpoints"
    where.mkdir()
    for age, name in enumerate(["epoch=0-step=4.ckpt", "last.ckpt", "epoch=0-step=2.ckpt"]):
        (where / name).write_bytes(b"")
        os.utime(where / name, ns=(10**18 - age * 10**9, 10**18 - age * 10**9))
    assert resolve_ckpt_path(make(tmp_path, "ckpt_path=last")) == str(where / "epoch=0-step=4.ckpt")


def test_a_schedule_reaches_the_datamodule_and_a_bad_one_is_named(tmp_path: Path) -> None:
    cfg = make(tmp_path, "recipe=anneal", "data.num_workers=0")
    schedule = build_datamodule(cfg).make_reader().manifest().summary()["schedule"]
    assert [(p["start"], p["shares"]) for p in schedule] == [
        (0.0, {"web": 3.0, "code": 1.0}),
        (0.7, {"code": 1.0, "books": 1.0}),
    ]
    cfg = make(tmp_path, "recipe=anneal", "data.num_workers=0", "data.schedule.1.start=0")
    with pytest.raises(
        InstantiationException, match=r"schedule phase 1 starts at 0, not after phase 0 \(0\) of the epoch"
    ):
        build_datamodule(cfg)


def test_a_schedule_over_training_with_a_ramp_reaches_the_datamodule(tmp_path: Path) -> None:
    schedule = "data.schedule=[{samples: 0, shares: {web: 3, code: 1}}, {samples: 3000, shares: {books: 1}, ramp: 160}]"
    cfg = make(tmp_path, "recipe=anneal", "data.num_workers=0", schedule)
    training = build_datamodule(cfg).make_reader().manifest().summary()["training_schedule"]
    assert training[0] == {"samples": 0, "shares": {"web": 3.0, "code": 1.0}} and len(training) == 1 + 16 + 1
    assert training[1]["samples"] == 3000 and training[-1] == {"samples": 3160, "shares": {"books": 1.0}}


def test_allow_mixture_change_reaches_the_datamodule(tmp_path: Path) -> None:
    cfg = make(tmp_path, "data=mixture", "data.num_workers=0")
    assert build_datamodule(cfg).allow_mixture_change is False
    cfg = make(tmp_path, "data=mixture", "data.num_workers=0", "data.allow_mixture_change=true")
    assert build_datamodule(cfg).allow_mixture_change is True


def test_a_value_with_equals_signs_is_quoted_for_hydra_and_nothing_else_is() -> None:
    from lightning_sharding.train import quote_equals

    assert quote_equals("ckpt_path=runs/x/epoch=0-step=20.ckpt") == "ckpt_path='runs/x/epoch=0-step=20.ckpt'"
    assert quote_equals("+data.root=/d/year=2024") == "+data.root='/d/year=2024'"
    for kept in (
        "ckpt_path=last",
        "data.urls=[s3://b/year=2024/*.tar]",
        "ckpt_path='a=b'",
        "a=x=1,y=2",
        "-m",
        "--cfg=job",
    ):
        assert quote_equals(kept) == kept


def test_a_misspelt_key_names_its_group_keys_and_the_closest_one() -> None:
    from lightning_sharding.train import misspelt_key

    said = misspelt_key(["recipe=tokens", "data.tokens_per_fil=3"])
    assert said is not None and said.startswith("data.tokens_per_fil: data has no key 'tokens_per_fil'. ")
    assert "Did you mean data.tokens_per_file?" in said and "Its keys are allow_data_change, batch_size," in said
    assert "+trainer.NAME=VALUE" in (misspelt_key(["trainer.max_epoch=1"]) or "")
    for fine in (["data.batch_size=3"], ["ckpt_path=last"], ["-m", "data.batch_sise=1,2"], ["data=nonexistent"]):
        assert misspelt_key(fine) is None  # composes, or Hydra alone reads it, or fails for another reason
    # What Hydra alone can tell: an override it cannot parse, and its --cfg printing options around a typo.
    assert misspelt_key(["data.batch_size=["]) is None
    said = misspelt_key(["--cfg", "job", "--package", "data", "--resolve", "data.batch_sise=3"])
    assert said is not None and "Did you mean data.batch_size?" in said


@pytest.mark.parametrize("recipe", ["stream", "sqlite"])
def test_cfg_job_prints_the_job_without_the_entry_points_marks_and_an_old_recipe_name_warns(
    recipe: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_sharding import train
    from lightning_sharding.core import spelling

    monkeypatch.setenv(spelling.ENV, "python")  # main() sets it for the processes it starts
    monkeypatch.setattr("sys.argv", [train.PROG, "--cfg", "job", f"recipe={recipe}", f"out_dir={tmp_path}"])
    train.main()
    out, err = capsys.readouterr()
    assert "_renamed_recipe" not in out and "name: dispatch" in out and f"out_dir: {tmp_path}" in out
    warned = [line for line in err.splitlines() if line.startswith(f"{train.PROG}: warning:")]
    said = "recipe=stream is now recipe=sqlite since lightning_sharding 0.2; the old name goes away in the next release"
    assert warned == ([f"{train.PROG}: warning: {said}"] if recipe == "stream" else [])


def test_a_printed_config_loses_the_internal_keys_also_folded_and_says_an_old_recipe_name() -> None:
    from lightning_sharding.train import without_internal_keys

    text, said = without_internal_keys("a: 1\n_renamed_recipe: recipe=x is now\n  recipe=y\nb:\n  c: 2\n")
    assert text == "a: 1\nb:\n  c: 2\n"
    assert said == "recipe=x is now recipe=y since lightning_sharding 0.2; the old name goes away in the next release"
    assert without_internal_keys("a: 1\n_renamed_recipe: null\n") == ("a: 1\n", None)
