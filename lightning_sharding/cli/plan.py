"""``lightning-sharding plan``: one epoch of the train config's data planned for a topology."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from lightning_sharding.cli._common import (
    FORMATS,
    PROG,
    CliError,
    _check_plot_path,
    _draw,
    _first_line,
    _int_at_least,
    _require_matplotlib,
    data_files,
)
from lightning_sharding.cli.plan_format import format_plan
from lightning_sharding.config import CONF_DIR, ConfigError
from lightning_sharding.config.checks import check_keys
from lightning_sharding.core.plan import EVEN_BATCH_POLICIES
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import check_data_parallel
from lightning_sharding.mixture import mixture_of

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from lightning_sharding.core.manifest import Manifest
    from lightning_sharding.core.order import EpochOrder
    from lightning_sharding.core.plan import EvenBatches
    from lightning_sharding.mixture import MixtureOrder


def register(sub: Any) -> None:
    """Add the ``plan`` subcommand to the subparsers ``sub``."""
    plan = sub.add_parser(
        "plan",
        help="show which samples, batches and items each rank and worker gets",
        description="Plan one epoch of data files, or of the train config's data (any data option or recipe), for "
        "a topology and print, per rank and per (rank, worker), the samples, batches, padding, dropped samples and "
        "items touched.",
        epilog=f"example: {PROG} plan '/data/train/*.tar' --world-size 4 --workers 2\n"
        f"         {PROG} plan data.num_items=16 data.samples_per_item=1000 --world-size 4 --workers 2\n"
        f"         {PROG} plan --world-size 8 --data-parallel 4   (4 replicas of 2 tensor-parallel ranks)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "overrides",
        nargs="*",
        metavar="DATA|KEY=VALUE",
        help="data files (paths, globs, URLs, or a directory of files of one format: read as data=files of their "
        "format, or as data.urls of the data option or recipe chosen) and Hydra overrides of the train config, "
        "e.g. data.num_items=16",
    )
    plan.add_argument(
        "--world-size", type=_int_at_least(1), metavar="N", help="ranks (default: trainer.devices x trainer.num_nodes)"
    )
    plan.add_argument(
        "--data-parallel",
        type=_int_at_least(1),
        metavar="N",
        help="model replicas among the ranks (tensor/context/pipeline parallel: each replica's ranks read the "
        "same batches; default: every rank)",
    )
    plan.add_argument(
        "--workers", type=_int_at_least(0), metavar="N", help="DataLoader workers per rank (default: data.num_workers)"
    )
    plan.add_argument(
        "--batch-size", type=_int_at_least(1), metavar="N", help="samples per batch (default: data.batch_size)"
    )
    plan.add_argument("--seed", type=_int_at_least(0), metavar="N", help="shuffle seed (default: data.seed, or 0)")
    plan.add_argument("--epoch", type=_int_at_least(0), default=0, metavar="N", help="epoch to plan (default 0)")
    plan.add_argument(
        "--even-batches", choices=EVEN_BATCH_POLICIES, help="uneven ranks: pad or drop (default: data.even_batches)"
    )
    plan.add_argument(
        "--format", choices=sorted(set(FORMATS.values())), help="the data files' format (default: their extension)"
    )
    plan.add_argument("--config-dir", metavar="DIR", help="a folder of recipes, as for lightning-sharding-train")
    plan.add_argument(
        "--config-name", default="train", metavar="NAME", help="the recipe in --config-dir (default: train)"
    )
    plan.add_argument(
        "--sharding",
        "--strategy",  # its name in 0.1
        dest="strategy",
        metavar="NAME",
        help="a registered sharding strategy, e.g. shard (default: the config's sharding=)",
    )
    plan.add_argument("--plot", metavar="FILE.png", help="also draw the assignment into this image")
    plan.set_defaults(func=_plan)


# A Hydra override: KEY=VALUE (KEY a config key or group, maybe with + or ++), or ~KEY.
_OVERRIDE = re.compile(r"~|\+{0,2}[A-Za-z_][\w.@/-]*=")


def _data_overrides(arguments: Sequence[str], fmt: str | None) -> list[str]:
    """``plan``'s arguments as Hydra overrides: the overrides as given, after what reads the data files
    among them: ``data=files`` of their format, or the ``data.urls`` of the data option or recipe that
    the overrides choose."""
    overrides = [a for a in arguments if _OVERRIDE.match(a)]
    data = [a for a in arguments if not _OVERRIDE.match(a)]
    if not data:
        if fmt is not None:
            raise CliError(f"--format {fmt} is the format of data files: name them (plan PATH... --format {fmt})")
        return overrides
    from lightning_sharding.core.spelling import hydra_value

    given = dict(o.lstrip("+").partition("=")[::2] for o in overrides)
    urls, fmt = data_files(data, fmt or given.get("data.format"))
    reading = [f"data.urls={hydra_value(urls)}"]
    if given.get("data", "files") == "files" and "recipe" not in given:  # data=files, of their format
        reading = [*(["data=files"] if "data" not in given else []), f"data.format={fmt}", *reading]
    return [*reading, *overrides]


def _compose(overrides: Sequence[str], config_dir: str | None = None, config_name: str = "train") -> DictConfig:
    """The train config, or a recipe in ``config_dir``, with ``overrides`` applied; a bad override
    is a :class:`CliError`."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from lightning_sharding.config import register_configs

    for override in overrides:
        if "=" not in override and not override.startswith("~"):
            raise CliError(f"{override!r} is not a KEY=VALUE override (e.g. data.num_items=16)")
    register_configs()
    search = [] if config_dir is None else [f"hydra.searchpath=[file://{CONF_DIR}]"]
    directory = CONF_DIR if config_dir is None else str(Path(config_dir).resolve())
    if config_dir is not None and not (Path(directory) / f"{config_name}.yaml").is_file():
        raise CliError(f"no recipe {config_name}.yaml in --config-dir {config_dir}")
    try:
        with initialize_config_dir(config_dir=directory, version_base=None, job_name=PROG):
            cfg = compose(config_name, overrides=[*search, *overrides])
    except (HydraException, OmegaConfBaseException) as err:
        reason = _first_line(err)
        if err.__cause__ is not None:
            reason = f"{reason.rstrip('.')}: {_first_line(err.__cause__)}"
        if not any(o in reason for o in overrides):
            reason = f"{reason} (in {' '.join(overrides)})"
        raise CliError(f"bad override: {reason}") from None
    from lightning_sharding.train import renamed_recipe

    said = renamed_recipe(cfg)  # a recipe's old name (recipe=stream): said here, where the user reads it
    if said is not None:
        print(f"{PROG}: warning: {said}", file=sys.stderr)
    return cfg


@dataclass(frozen=True)
class _DataSettings:
    """What ``plan`` takes from the train config (its ``data`` group and the world size)."""

    batch_size: int
    seed: int
    shuffle: bool
    even_batches: str
    num_workers: int
    world_size: int


def _data_settings(cfg: DictConfig) -> _DataSettings:
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = cfg.data
        return _DataSettings(
            batch_size=int(data.batch_size),
            seed=int(data.seed or 0),
            shuffle=bool(data.shuffle),
            even_batches=str(data.even_batches),
            num_workers=int(data.num_workers),
            world_size=int(cfg.trainer.devices) * int(cfg.trainer.num_nodes),
        )
    except (OmegaConfBaseException, TypeError, ValueError) as err:
        raise CliError(f"the train config's data group is unusable: {_first_line(err)}") from None


def _manifest(cfg: DictConfig, batch_size: int | None = None) -> Manifest:
    """The items the config's data holds (any data option or recipe: built as training builds it;
    a stratified or per_stream mixture in blocks of ``batch_size``)."""
    from lightning_sharding.core.manifest import Manifest
    from lightning_sharding.readers.synthetic import SyntheticReader

    data = cfg.data
    if str(data.get("_target_", "")).endswith(".synthetic"):  # no Lightning import for the common case
        try:
            return Manifest.from_items(SyntheticReader(data.num_items, data.samples_per_item, data.dim).items())
        except ValueError as err:
            raise CliError(str(err)) from None
    from lightning_sharding.readers.sources import source_manifest
    from lightning_sharding.train import build_datamodule

    try:
        dm = build_datamodule(cfg)
        if dm.source is not None:
            return source_manifest(dm.source)
        manifest = dm.strategy.manifest(dm.make_reader(), batch_size)
    except Exception as err:  # noqa: BLE001 - a bad data option: say which and why
        cause = err.__cause__ or err
        raise CliError(f"cannot build data={cfg.data.get('_target_')}: {_first_line(cause)}") from None
    return manifest


def _plan(args: argparse.Namespace) -> int:
    from lightning_sharding.core.plan import plan_epoch

    plot = _check_plot_path(args.plot)
    cfg = _compose(_data_overrides(args.overrides, args.format), args.config_dir, args.config_name)
    try:
        check_keys(cfg)  # a `+data.bogus_key=1` is refused here as training refuses it
    except ConfigError as err:
        raise CliError(str(err)) from None
    data = _data_settings(cfg)
    strategy = _strategy(args.strategy or str(cfg.sharding.name))
    batch_size = args.batch_size if args.batch_size is not None else data.batch_size
    seed = args.seed if args.seed is not None else data.seed
    even_batches = args.even_batches or data.even_batches
    if batch_size < 1:
        raise CliError(f"data.batch_size={batch_size} must be 1 or more")
    if seed < 0:
        raise CliError(f"data.seed={seed} must be 0 or more")
    if even_batches not in EVEN_BATCH_POLICIES:
        raise CliError(f"data.even_batches={even_batches!r} must be one of {', '.join(map(repr, EVEN_BATCH_POLICIES))}")
    world_size = args.world_size if args.world_size is not None else data.world_size
    data_size = world_size if args.data_parallel is None else args.data_parallel
    source = "--world-size" if args.world_size is not None else "trainer.devices x trainer.num_nodes; set --world-size"
    try:
        check_data_parallel(
            (0, data_size), world_size, f"--data-parallel {data_size} (world size {world_size} from {source})"
        )
    except ValueError as err:
        raise CliError(str(err)) from None
    if plot is not None and data_size != world_size:
        raise CliError("--plot draws ranks, not replicas: leave out --data-parallel to draw the plan of plain ranks")
    manifest = _manifest(cfg, batch_size)
    if plot is not None and "packing" in manifest.summary():
        raise CliError("--plot draws the items of an epoch; a packed epoch's plan is printed only (leave out --plot)")
    if plot is not None:
        _require_matplotlib(plot)  # said now, not after the whole plan was made and printed
    # A source (strategy dispatch) is read in its own order: such a strategy never shuffles.
    # A fresh manifest: never a changed epoch's order, which only a resumed checkpoint has.
    order = cast(
        "EpochOrder | MixtureOrder", manifest.order(seed, args.epoch, shuffle=data.shuffle and strategy.shuffles)
    )
    spec = mixture_of(manifest)
    mixture = cast("MixtureOrder", order) if spec is not None else None
    plan = plan_epoch(
        order,
        RangeSet(),
        world_size=data_size,  # the data-parallel ranks split the data; a replica's ranks share it
        num_workers=args.workers if args.workers is not None else data.num_workers,
        batch_size=batch_size,
        even_batches=cast("EvenBatches", even_batches),
        worker_layout=strategy.worker_layout,  # as the strategy's sampler plans
    )
    text = format_plan(
        plan,
        order,
        fingerprint=manifest.fingerprint,
        strategy=strategy.name,
        replica_size=world_size // data_size,
        shares=spec.shares if spec is not None else (),
        mixture=mixture,
        tokens=getattr(order, "tokens", None),  # packed sequences count their tokens
        packing=manifest.summary().get("packing"),
    )
    print(text)
    if plot is not None:
        import lightning_sharding.cli.plots as plots

        _draw(plots.plot_plan, plot, plan, order, mixture)
        print(f"plot written to {plot}")
    return 0


def _strategy(name: str) -> Any:
    """The registered strategy ``name``; an unknown name is a :class:`CliError` listing the known ones."""
    from lightning_sharding.strategies import get_strategy, strategy_names

    if name not in strategy_names():
        raise CliError(
            f"strategy {name!r} (from --sharding or the config's sharding=) is not a strategy; "
            f"choose one of {', '.join(strategy_names())}"
        )
    return get_strategy(name)
