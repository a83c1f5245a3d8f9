"""Structured-config schemas for the Hydra entry point.

Registered in Hydra's ConfigStore, so a misspelt key or a wrong type fails when the config is
composed, with the key's name, not halfway through training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore

CONF_DIR = str(Path(__file__).resolve().parent / "conf")  # the packaged Hydra config directory


@dataclass
class DataConfig:
    """The built-in synthetic data set and the sharded loader's options."""

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
