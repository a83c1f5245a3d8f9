"""The checks that span several config groups, and the run's derived values (world size, checkpoint).

:func:`check_config` refuses combinations of groups that cannot work (broadcast without windows, a
batch size no rank reaches...), naming both keys, before any data is read. The strategies' rules
come from their registry (:mod:`lightning_sharding.strategies`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from lightning_sharding.config.schemas import SCHEMAS

if TYPE_CHECKING:
    from lightning_sharding.strategies import Strategy


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
    from lightning_sharding.strategies import get_strategy, strategy_names  # imports torch: not at import time

    name = cfg.sharding.strategy
    if name not in strategy_names():
        raise ConfigError(f"sharding.strategy={name!r} is not a strategy; choose sharding={'|'.join(strategy_names())}")
    strategy = get_strategy(name)
    data = cfg.data
    feeds = getattr(OmegaConf.get_type(cfg, "data"), "feeds", None)  # None: an untyped data config of your own
    if feeds == "source" and strategy.takes != "source":
        readers = _options(lambda s: s.takes == "source")
        raise ConfigError(
            f"{_choice(cfg, 'data')} builds a non-replicable source, which only {readers} reads, "
            f"but sharding.strategy={name!r}: add {readers}"
        )
    if strategy.takes == "source" and feeds in ("reader", "windows"):
        raise ConfigError(
            f"sharding.strategy={name!r} needs a data option that builds a source (data=sqlite, or a Source of "
            f"your own), but {_choice(cfg, 'data')} builds a reader: use sharding=shard (or broadcast for windows)"
        )
    if strategy.takes == "windows" and feeds in ("reader", "source"):
        raise ConfigError(
            f"sharding.strategy={name!r} needs a reader that can window (data=months, a WindowedReader), "
            f"but {_choice(cfg, 'data')} reads single samples: use sharding=shard, or a windowed data option"
        )
    if data.on_error == "skip" and not strategy.skips_errors:
        skippers = _names(lambda s: s.skips_errors)
        raise ConfigError(
            f"data.on_error='skip' works with {' or '.join(f'sharding.strategy={n!r}' for n in skippers)} only, "
            f"not {name!r}: set data.on_error=raise or use {_options(lambda s: s.skips_errors)}"
        )
    allowed = strategy.even_batch_policies
    if data.even_batches not in allowed:
        elsewhere = _options(lambda s: data.even_batches in s.even_batch_policies)
        raise ConfigError(
            f"data.even_batches={data.even_batches!r} is not available with sharding.strategy={name!r}; "
            f"choose one of {list(allowed)}" + (f" ({data.even_batches} needs {elsewhere})" if elsewhere else "")
        )
    if data.batch_size < 1 or data.num_workers < 0:
        raise ConfigError(
            f"data.batch_size={data.batch_size} must be >= 1 and data.num_workers={data.num_workers} >= 0"
        )
    total = OmegaConf.to_object(data).known_total() if feeds is not None else None  # type: ignore[union-attr]
    if total is not None:
        check_batch_size(cfg, total)


def _names(which: Callable[[Strategy], bool]) -> list[str]:
    """The names of the registered strategies that ``which`` picks."""
    from lightning_sharding.strategies import get_strategy, strategy_names

    return [name for name in strategy_names() if which(get_strategy(name))]


def _options(which: Callable[[Strategy], bool]) -> str:
    """``sharding=NAME`` (several joined by "|") for the registered strategies ``which`` picks; "" for none."""
    names = _names(which)
    return f"sharding={'|'.join(names)}" if names else ""


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
