"""The Hydra entry point's config: dataclass schemas per group, and the checks across groups."""

from lightning_sharding.config.checks import (
    ConfigError,
    check_batch_size,
    check_config,
    resolve_ckpt_path,
    world_size_of,
)
from lightning_sharding.config.data import DataOptions
from lightning_sharding.config.schemas import CONF_DIR, SCHEMAS, TrainConfig, register_configs

__all__ = [
    "CONF_DIR",
    "SCHEMAS",
    "ConfigError",
    "DataOptions",
    "TrainConfig",
    "check_batch_size",
    "check_config",
    "register_configs",
    "resolve_ckpt_path",
    "world_size_of",
]
