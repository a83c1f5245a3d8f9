"""The checks that span several config groups, and the run's derived values (world size, checkpoint).

:func:`check_config` refuses combinations of groups that cannot work (broadcast without windows, a
batch size no rank reaches...), naming both keys, before any data is read. The strategies' rules
come from their registry (:mod:`lightning_sharding.strategies`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_sharding.config.schemas import SCHEMAS
from lightning_sharding.strategies import Strategy, get_strategy, strategy_names


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
    check_keys(cfg)
    name = cfg.sharding.name
    if name not in strategy_names():
        raise ConfigError(f"sharding.name={name!r} is not a strategy; choose sharding={'|'.join(strategy_names())}")
    chosen = OmegaConf.get_type(cfg, "sharding")
    option = getattr(chosen, "__dataclass_fields__", {}).get("name")
    if option is not None and option.default != name:  # the option's settings are another strategy's
        raise ConfigError(
            f"sharding.name={name} overrides the name of sharding={option.default}, whose settings are not "
            f"{name}'s: choose the strategy with sharding={name} (its settings come with it)"
        )
    settings = {str(key): value for key, value in cfg.sharding.items() if key != "name"}
    try:
        strategy = get_strategy(name, **settings)
    except (TypeError, ValueError) as err:  # a setting's value, as the strategy's constructor checks it
        given = " ".join(f"sharding.{key}={value}" for key, value in settings.items())
        raise ConfigError(f"sharding={name} {given}: {err}") from None
    data = cfg.data
    feeds = getattr(OmegaConf.get_type(cfg, "data"), "feeds", None)  # None: an untyped data config of your own
    if feeds == "source" and strategy.takes != "source":
        readers = _options(lambda s: s.takes == "source")
        raise ConfigError(
            f"{_choice(cfg, 'data')} builds a non-replicable source, which only {readers} reads, "
            f"but sharding={name}: add {readers}"
        )
    if strategy.takes == "source" and feeds in ("reader", "windows"):
        raise ConfigError(
            f"sharding={name} needs a data option that builds a source (data=sqlite, or a Source of "
            f"your own), but {_choice(cfg, 'data')} builds a reader: use sharding=shard (or broadcast for windows)"
        )
    if strategy.takes == "windows" and feeds in ("reader", "source"):
        raise ConfigError(
            f"sharding={name} needs a reader that can window (data=months, a WindowedReader), "
            f"but {_choice(cfg, 'data')} reads single samples: use sharding=shard, or a windowed data option"
        )
    for key in ("on_error", "even_batches"):  # the loader options a data config sets, as the strategy takes them
        value = data[key]
        reason = strategy.refusal(key, value)
        if reason is not None:
            takers = _options(lambda s: s.refusal(key, value) is None)  # noqa: B023 - called at once
            other = {"on_error": "set data.on_error=raise", "even_batches": "set data.even_batches=pad"}[key]
            raise ConfigError(
                f"data.{key}={data[key]!r}: sharding={name} {reason}; {other}" + (f" or use {takers}" if takers else "")
            )
    if data.batch_size < 1:
        raise ConfigError(f"data.batch_size={data.batch_size} must be a positive number of samples per rank")
    if data.num_workers < 0:
        raise ConfigError(f"data.num_workers={data.num_workers} must be >= 0 (0 loads in the training process)")
    total = OmegaConf.to_object(data).known_total() if feeds is not None else None  # type: ignore[union-attr]
    if total is not None:
        check_batch_size(cfg, total)


def check_keys(cfg: DictConfig) -> None:
    """Refuse a key that no schema knows, naming it and its group.

    Hydra refuses a misspelt ``data.batch_sise=8`` when it composes, but a key appended with ``+``
    (``+data.bogus_key=1``) joins even a typed group, where the builder would then ignore it. Every
    node typed by a schema may hold only its schema's fields. The one exception is the ``trainer``
    group: a key that names a ``lightning.pytorch.Trainer`` argument goes to the Trainer as it is
    (``+trainer.deterministic=true``). Untyped nodes (``data.storage_options``, a group of your own
    without a schema) take any key.
    """
    _check_node_keys(cfg, "", cfg)


def _check_node_keys(cfg: DictConfig, path: str, node: Any) -> None:
    """Check ``node`` (at ``path``, a dotted key of ``cfg``; "" for the root) and everything below it."""
    if node._is_none() or node._is_missing():
        return
    if isinstance(node, ListConfig):
        for index in range(len(node)):
            _check_node_keys(cfg, f"{path}.{index}", node._get_node(index))
        return
    if not isinstance(node, DictConfig):
        return
    kind = node._metadata.object_type
    if kind is not None and dataclasses.is_dataclass(kind):
        known = {f.name for f in dataclasses.fields(kind)}
        for key in map(str, node.keys()):
            if key in known or (path == "trainer" and key in _trainer_arguments()):
                continue
            full_key = f"{path}.{key}".lstrip(".")
            trainer = " and the arguments of lightning.pytorch.Trainer" if path == "trainer" else ""
            raise ConfigError(
                f"Key {key!r} not in {kind.__name__!r} ({_where(cfg, path)}), full_key: {full_key}: "
                "no schema knows it (a key appended with '+' passes Hydra's own check). The keys of "
                f"{path or 'the train config'} are {', '.join(sorted(k for k in known if not k.startswith('_')))}"
                f"{trainer}: fix the spelling (a key the schema knows needs no '+'), or register a schema "
                "that has it for an option of your own"
            )
    for key in map(str, node.keys()):
        _check_node_keys(cfg, f"{path}.{key}".lstrip("."), node._get_node(key))


def _where(cfg: DictConfig, path: str) -> str:
    """The option or group a key at ``path`` belongs to: ``data=synthetic``, ``group 'trainer'``."""
    group = path.split(".")[0]
    if not group:
        return "the train config"
    if len(SCHEMAS.get(group, {})) > 1:
        return _choice(cfg, group)
    return f"group {group!r}"


def _trainer_arguments() -> set[str]:
    """The keyword arguments of ``lightning.pytorch.Trainer``, which the trainer group passes on."""
    import inspect

    from lightning.pytorch import Trainer

    return set(inspect.signature(Trainer.__init__).parameters) - {"self"}


def _names(which: Callable[[Strategy], bool]) -> list[str]:
    """The names of the registered strategies that ``which`` picks."""
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
    if not found:  # as Lightning's ckpt_path="last": one command for a job's first launch and every requeue
        warnings.warn(
            f"ckpt_path=last: no checkpoint in {where} yet (callbacks.dirpath, from out_dir={cfg.out_dir}), "
            "so training starts from scratch. If you meant to resume a run, give its out_dir, or "
            "ckpt_path=PATH/TO/FILE.ckpt",
            stacklevel=2,
        )
        return None
    return str(found[-1])
