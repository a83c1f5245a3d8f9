"""Structured-config schemas of the Hydra entry point, and the checks that span several groups.

Every config group (``data``, ``sharding``, ``trainer``, ``model``, ``callbacks``, ``logger``) has
a dataclass schema here, registered in Hydra's ConfigStore: a misspelt key or a wrong type fails
when the config is composed, naming the key. :func:`check_config` then refuses combinations of
groups that cannot work (broadcast without windows, a batch size no rank reaches...), naming both
keys, before any data is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

CONF_DIR = str(Path(__file__).resolve().parent / "conf")  # the packaged Hydra config directory

STRATEGIES = ("shard", "broadcast", "dispatch")  # as datamodule.STRATEGIES (kept import-light here)


# -- data: what is read, and the loader's options ---------------------------------------------------


@dataclass
class LoaderOptions:
    """The options every ``data`` option shares: batching, workers, seed, even batches, errors.

    ``feeds`` says what the option builds: ``"reader"`` (samples), ``"windows"`` (a
    :class:`~lightning_sharding.readers.windows.WindowedReader`) or ``"source"`` (a
    :class:`~lightning_sharding.sources.Source`); :func:`check_config` matches it to the strategy.
    """

    feeds: ClassVar[str] = "reader"

    batch_size: int = 64
    num_workers: int = 2
    seed: int | None = None  # none: drawn on rank 0 and broadcast (and stored in checkpoints)
    shuffle: bool = True
    even_batches: str = "pad"  # pad | drop (| sync with sharding=dispatch)
    persistent_workers: bool = True
    multiprocessing_context: str | None = None  # e.g. spawn
    on_error: str = "raise"  # raise | skip (sharding=shard only)
    cache_dir: str | None = None  # file indexes and generated data; none: ~/.cache/lightning_sharding

    def known_total(self) -> int | None:
        """Samples per epoch when the config alone tells (generated data), else ``None``."""
        return None


@dataclass
class SyntheticData(LoaderOptions):
    """The built-in synthetic regression set (no files): ``num_items`` x ``samples_per_item``."""

    _target_: str = "lightning_sharding.recipes.data.synthetic"
    num_items: int = 16
    samples_per_item: int = 1024
    dim: int = 16

    def known_total(self) -> int | None:
        """Every item holds ``samples_per_item`` samples."""
        return self.num_items * self.samples_per_item


@dataclass
class FilesData(LoaderOptions):
    """Files of one reader format (tar, parquet, npy, jsonl), local or remote.

    With no ``urls``, ``num_items`` files of ``samples_per_item`` regression samples (``dim``
    features) are generated once under ``cache_dir`` and read back.
    """

    _target_: str = "lightning_sharding.recipes.data.files"
    format: str = "tar"  # tar | parquet | npy | jsonl
    urls: list[str] | None = None  # paths, globs or URLs (s3://...); none: generate a data set
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options (credentials...)
    endpoint_url: str | None = None  # an S3-compatible endpoint (MinIO, moto...); none: AWS
    num_items: int = 16
    samples_per_item: int = 1024
    dim: int = 16

    def known_total(self) -> int | None:
        """Known for the generated set only."""
        return None if self.urls else self.num_items * self.samples_per_item


@dataclass
class MonthsData(LoaderOptions):
    """One time-major ``.npy`` array per month, ``(steps, variables)``; samples are windows.

    With no ``paths``, ``months`` months of hourly data are generated (``steps_per_month`` steps).
    """

    feeds: ClassVar[str] = "windows"

    _target_: str = "lightning_sharding.recipes.climate.months"
    paths: list[str] | None = None  # .npy files or globs, in time order; none: generate
    window: int = 48  # steps per window: window - 1 inputs, the last step is the target
    stride: int = 6
    halo: bool = True  # windows may cross a month boundary (the months are one series)
    variables: int = 3  # per-step values; must match the files
    months: int = 12
    steps_per_month: int = 720


@dataclass
class TokensData(LoaderOptions):
    """A token stream in 1-d ``.npy`` files, cut into samples of ``sample_length + 1`` tokens.

    With no ``urls``, ``num_files`` files of ``tokens_per_file`` tokens below ``vocab_size`` are
    generated.
    """

    _target_: str = "lightning_sharding.recipes.tokens.token_files"
    urls: list[str] | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    sample_length: int = 64  # tokens a sample predicts (each sample reads sample_length + 1)
    vocab_size: int = 256
    num_files: int = 8
    tokens_per_file: int = 32768

    def known_total(self) -> int | None:
        """Known for the generated set only."""
        return None if self.urls else self.num_files * (self.tokens_per_file // (self.sample_length + 1))


@dataclass
class SqliteData(LoaderOptions):
    """Rows of a SQLite query, read by one dispatch process per rank (a non-replicable source).

    With no ``path``, a table of ``rows`` regression rows (``dim`` features) is generated.
    """

    feeds: ClassVar[str] = "source"

    _target_: str = "lightning_sharding.recipes.stream.sqlite_rows"
    path: str | None = None
    query: str = "SELECT id, x, y FROM samples ORDER BY (id * 2654435761 + :seed) % 4294967296, id"
    rows: int = 8192
    dim: int = 16

    def known_total(self) -> int | None:
        """Known for the generated table only."""
        return None if self.path else self.rows


# -- sharding: one option per strategy ---------------------------------------------------------------


@dataclass
class ShardSharding:
    """``shard``: ranks take runs of items, each worker reads its own items."""

    strategy: str = "shard"


@dataclass
class BroadcastSharding:
    """``broadcast``: each rank loads an item once into shared memory; workers crop windows from it."""

    strategy: str = "broadcast"
    prefetch_items: int = 1  # items each rank loads ahead of the current one


@dataclass
class DispatchSharding:
    """``dispatch``: one process per rank reads the source and deals batches to the workers."""

    strategy: str = "dispatch"


# -- trainer, model, callbacks, logger ---------------------------------------------------------------


@dataclass
class TrainerConfig:
    """The ``lightning.pytorch.Trainer`` arguments a recipe usually sets."""

    accelerator: str = "cpu"
    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"
    precision: str = "32-true"
    max_epochs: int = 2
    max_steps: int = -1
    accumulate_grad_batches: int = 1
    # Whole steps only: the train loader has no length, so a fraction of an epoch is unknown.
    limit_train_batches: int | None = None
    gradient_clip_val: float | None = None
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    log_every_n_steps: int = 50


@dataclass
class RegressorModel:
    """The two-layer MLP of the regression data (synthetic, files, sqlite)."""

    _target_: str = "lightning_sharding.recipes.models.Regressor"
    dim: int = II("data.dim")
    hidden: int = 32
    learning_rate: float = 0.05


@dataclass
class ForecasterModel:
    """Next-step forecast from the first ``window - 1`` steps of a climate window."""

    _target_: str = "lightning_sharding.recipes.models.Forecaster"
    window: int = II("data.window")
    variables: int = II("data.variables")
    hidden: int = 64
    learning_rate: float = 1e-3


@dataclass
class TokenModel:
    """A tiny next-token model (embedding, MLP, logits) for the token stream."""

    _target_: str = "lightning_sharding.recipes.models.TokenModel"
    vocab_size: int = II("data.vocab_size")
    width: int = 64
    learning_rate: float = 3e-3


@dataclass
class CallbacksConfig:
    """Checkpoints (``ModelCheckpoint``) and the data summary (``ShardingCallback``)."""

    checkpoint: bool = True
    dirpath: str = "${out_dir}/checkpoints"  # where ckpt_path=last looks
    every_n_train_steps: int | None = II("checkpoint_every_n_steps")  # none: at every epoch's end
    save_top_k: int = -1
    save_last: bool = True
    print_summary: bool = True
    log_every_n_steps: int = 10  # data/progress, data/samples_per_s, data/wait


@dataclass
class LoggerConfig:
    """A Lightning logger (``_target_`` and its arguments); ``_target_: null`` logs nothing."""

    _target_: str | None = "lightning.pytorch.loggers.CSVLogger"
    save_dir: str = "${out_dir}"
    name: str = "logs"


@dataclass
class AuditConfig:
    """The audit trail that ``lightning-sharding audit`` checks."""

    enabled: bool = False
    dir: str = "${out_dir}/audit"


@dataclass
class TrainConfig:
    """The whole run. Groups typed ``Any`` take their schema from the option chosen."""

    data: Any = MISSING
    sharding: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: Any = MISSING
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    logger: Any = MISSING
    audit: AuditConfig = field(default_factory=AuditConfig)
    checkpoint_every_n_steps: int | None = None
    ckpt_path: str | None = None  # a file, or "last": the newest checkpoint in callbacks.dirpath
    out_dir: str = "outputs"


SCHEMAS: dict[str, dict[str, type]] = {
    "data": {
        "synthetic_schema": SyntheticData,
        "files_schema": FilesData,
        "months_schema": MonthsData,
        "tokens_schema": TokensData,
        "sqlite_schema": SqliteData,
    },
    "sharding": {
        "shard_schema": ShardSharding,
        "broadcast_schema": BroadcastSharding,
        "dispatch_schema": DispatchSharding,
    },
    "trainer": {"trainer_schema": TrainerConfig},
    "model": {
        "regressor_schema": RegressorModel,
        "forecaster_schema": ForecasterModel,
        "token_model_schema": TokenModel,
    },
    "callbacks": {"callbacks_schema": CallbacksConfig},
    "logger": {"logger_schema": LoggerConfig},
}


def register_configs() -> None:
    """Register the schemas (idempotent): ``train_schema``, and ``<group>/<name>_schema``."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=group, name=name, node=node)


# -- checks across groups ----------------------------------------------------------------------------


class ConfigError(ValueError):
    """A combination of config values that cannot work; the message names every key involved."""


def _choice(cfg: DictConfig, group: str) -> str:
    """``data=files``-style name of the option behind ``cfg[group]`` (its schema, or its target)."""
    kind = OmegaConf.get_type(cfg, group)
    for name, schema in SCHEMAS.get(group, {}).items():
        if kind is schema:
            return f"{group}={name.removesuffix('_schema')}"
    return f"{group}._target_={cfg[group].get('_target_')}"


def check_config(cfg: DictConfig) -> None:
    """Refuse what the groups cannot do together, naming both keys; runs before any data is read."""
    strategy = cfg.sharding.strategy
    if strategy not in STRATEGIES:
        raise ConfigError(f"sharding.strategy={strategy!r} is not a strategy; choose sharding=shard|broadcast|dispatch")
    data = cfg.data
    feeds = getattr(OmegaConf.get_type(cfg, "data"), "feeds", None)  # None: an untyped data config of your own
    if feeds == "source" and strategy != "dispatch":
        raise ConfigError(
            f"{_choice(cfg, 'data')} builds a non-replicable source, which only sharding=dispatch reads, "
            f"but sharding.strategy={strategy!r}: add sharding=dispatch"
        )
    if strategy == "dispatch" and feeds in ("reader", "windows"):
        raise ConfigError(
            f"sharding.strategy='dispatch' needs a data option that builds a source (data=sqlite, or a Source of "
            f"your own), but {_choice(cfg, 'data')} builds a reader: use sharding=shard (or broadcast for windows)"
        )
    if strategy == "broadcast" and feeds in ("reader", "source"):
        raise ConfigError(
            f"sharding.strategy='broadcast' needs a reader that can window (data=months, a WindowedReader), "
            f"but {_choice(cfg, 'data')} reads single samples: use sharding=shard, or a windowed data option"
        )
    if data.on_error == "skip" and strategy != "shard":
        raise ConfigError(
            f"data.on_error='skip' works with sharding.strategy='shard' only, not {strategy!r}: "
            "set data.on_error=raise or use sharding=shard"
        )
    allowed = ("pad", "drop", "sync") if strategy == "dispatch" else ("pad", "drop")
    if data.even_batches not in allowed:
        raise ConfigError(
            f"data.even_batches={data.even_batches!r} is not available with sharding.strategy={strategy!r}; "
            f"choose one of {list(allowed)}" + ("" if strategy == "dispatch" else " (sync needs sharding=dispatch)")
        )
    if data.batch_size < 1 or data.num_workers < 0:
        raise ConfigError(
            f"data.batch_size={data.batch_size} must be >= 1 and data.num_workers={data.num_workers} >= 0"
        )
    total = OmegaConf.to_object(data).known_total() if feeds is not None else None  # type: ignore[union-attr]
    if total is not None:
        check_batch_size(cfg, total)


def world_size_of(cfg: DictConfig) -> int | None:
    """``trainer.devices x trainer.num_nodes`` when both are known numbers (``None`` otherwise)."""
    devices, nodes = cfg.trainer.devices, cfg.trainer.num_nodes
    if isinstance(devices, int) and devices > 0 and isinstance(nodes, int):
        return devices * nodes
    return None


def check_batch_size(cfg: DictConfig, total: int) -> None:
    """A batch size is reachable when every rank's share of the ``total`` samples fills one batch."""
    world = world_size_of(cfg) or 1
    per_rank = total // world
    if cfg.data.batch_size > per_rank:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} cannot be reached: the data holds {total} samples, "
            f"{per_rank} per rank with trainer.devices={cfg.trainer.devices} x trainer.num_nodes="
            f"{cfg.trainer.num_nodes}; lower data.batch_size to {max(per_rank, 1)} or less, or use more data"
        )


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """``ckpt_path``, with ``last`` turned into the newest ``*.ckpt`` under ``callbacks.dirpath``."""
    if cfg.ckpt_path != "last":
        if cfg.ckpt_path is not None and not Path(cfg.ckpt_path).is_file() and "://" not in cfg.ckpt_path:
            raise FileNotFoundError(f"ckpt_path={cfg.ckpt_path}: no such checkpoint file")
        return cfg.ckpt_path  # type: ignore[no-any-return]
    where = Path(cfg.callbacks.dirpath)
    found = sorted(where.glob("*.ckpt"), key=lambda p: (p.stat().st_mtime_ns, p.name.startswith("last")))
    if not found:
        raise FileNotFoundError(
            f"ckpt_path=last: no checkpoint in {where} (callbacks.dirpath, from out_dir={cfg.out_dir}). "
            "Give the out_dir of the run to resume, or ckpt_path=PATH/TO/FILE.ckpt"
        )
    return str(found[-1])
