"""Structured-config schemas for the Hydra entry point.

Registered in Hydra's ConfigStore, so a misspelt key or a wrong type fails when the config is
composed, with the key's name, not halfway through training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from lightning_sharding.loader import Transform
from lightning_sharding.readers.base import Reader

CONF_DIR = str(Path(__file__).resolve().parent / "conf")  # the packaged Hydra config directory


@dataclass
class DataConfig:
    """The data (built-in synthetic set, or files in one of the reader formats) and the loader's options.

    With ``format`` other than ``synthetic`` and no ``urls``, a small regression data set of
    ``num_items`` files x ``samples_per_item`` samples is written once under ``cache_dir`` and read
    back, so every recipe runs on a fresh machine.
    """

    format: str = "synthetic"  # synthetic | tar | parquet | npy | jsonl
    urls: list[str] | None = None  # paths, globs or s3:// URLs; none: generate a data set
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options, e.g. S3 endpoint
    cache_dir: str | None = None  # file indexes and generated data; none: ~/.cache/lightning_sharding
    on_error: str = "raise"  # raise | skip
    num_items: int = 16
    samples_per_item: int = 1024
    dim: int = 16
    batch_size: int = 64
    num_workers: int = 2
    seed: int | None = None
    shuffle: bool = True
    even_batches: str = "pad"
    persistent_workers: bool = True
    multiprocessing_context: str | None = None


@dataclass
class TrainerConfig:
    """The subset of ``lightning.pytorch.Trainer`` arguments a recipe usually sets."""

    accelerator: str = "cpu"
    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"
    max_epochs: int = 2
    max_steps: int = -1
    accumulate_grad_batches: int = 1
    limit_train_batches: float = 1.0
    enable_progress_bar: bool = True
    log_every_n_steps: int = 50


@dataclass
class AuditConfig:
    """The audit trail that ``lightning-sharding audit`` checks."""

    enabled: bool = False
    dir: str = "${out_dir}/audit"


@dataclass
class TrainConfig:
    """The whole run: data, trainer, model size, checkpoints and resume."""

    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    hidden: int = 32
    learning_rate: float = 0.05
    checkpoint_every_n_steps: int | None = None
    ckpt_path: str | None = None
    out_dir: str = "outputs"


def register_configs() -> None:
    """Register the schemas (idempotent)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def build_reader(data: Any) -> tuple[Reader, Transform | None]:
    """The reader (and the transform to ``{"id", "x", "y"}`` samples) that a ``data`` config names."""
    from lightning_sharding.datasets import FORMATS, to_regression, write_regression
    from lightning_sharding.readers import FILE_READERS, SyntheticReader
    from lightning_sharding.readers.files import default_cache_dir

    if data.format == "synthetic":
        return SyntheticReader(data.num_items, data.samples_per_item, data.dim), None
    if data.format not in FILE_READERS:
        raise ValueError(f"data.format={data.format!r} is unknown; choose synthetic or one of {list(FORMATS)}")
    cache = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    urls = list(data.urls) if data.urls else None
    options = dict(data.storage_options or {})
    if urls is None:
        where = cache / "datasets" / f"{data.format}-{data.num_items}x{data.samples_per_item}x{data.dim}"
        if not (where / "COMPLETE").exists():  # written last: a half-written set is rewritten
            write_regression(str(where), data.format, [data.samples_per_item] * data.num_items, dim=data.dim)
            (where / "COMPLETE").touch()
        urls = [str(where / f"part-*.{data.format}")]
    reader = FILE_READERS[data.format](urls, storage_options=options, cache_dir=cache)
    return reader, to_regression
