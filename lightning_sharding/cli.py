"""The ``lightning-sharding`` command line: ``plan``, ``inspect`` and ``audit``.

``plan`` shows which samples, batches and items every (rank, worker) gets for a topology;
``inspect`` reads the data ledger inside a Lightning checkpoint. Heavy imports (Hydra, torch,
matplotlib) happen inside the commands, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np

from lightning_sharding.config import CONF_DIR, STRATEGIES
from lightning_sharding.ledger import CHECKPOINT_KEY, GLOBAL_STEP_KEY, ledger_step_mismatch
from lightning_sharding.plan import EVEN_BATCH_POLICIES
from lightning_sharding.rangeset import RangeSet

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from lightning_sharding.manifest import Manifest
    from lightning_sharding.order import EpochOrder
    from lightning_sharding.plan import EpochPlan, EvenBatches, RankPlan

PROG = "lightning-sharding"
# World sizes above this print the first and last RANKS_SHOWN // 2 ranks only; likewise workers.
MAX_RANKS = 16
RANKS_SHOWN = 16
MAX_WORKERS = 8
WORKERS_SHOWN = 8


class CliError(Exception):
    """A user error: printed as one line on stderr, exit status 2, no traceback."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, so ``main`` prints one line and returns."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see `{self.prog} --help`)", prog=self.prog)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small: it must be {low} or more")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-sharding`` argument parser with its ``plan``, ``inspect`` and ``audit`` subcommands."""
    from lightning_sharding import _version, audit

    parser = _Parser(prog=PROG, description="Plan, inspect and audit exactly-once sharded data loading.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    plan = sub.add_parser(
        "plan",
        help="show which samples, batches and items each rank and worker gets",
        description="Plan one epoch of the train config's data (any data option or recipe) for a topology and "
        "print, per rank and per (rank, worker), the samples, batches, padding, dropped samples and items touched.",
        epilog=f"example: {PROG} plan data.num_items=16 data.samples_per_item=1000 --world-size 4 --workers 2",
    )
    plan.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides of the train config, e.g. data.num_items=16"
    )
    plan.add_argument(
        "--world-size", type=_int_at_least(1), metavar="N", help="ranks (default: trainer.devices x trainer.num_nodes)"
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
    plan.add_argument("--config-dir", metavar="DIR", help="a folder of recipes, as for lightning-sharding-train")
    plan.add_argument(
        "--config-name", default="train", metavar="NAME", help="the recipe in --config-dir (default: train)"
    )
    plan.add_argument("--strategy", choices=STRATEGIES, help="sharding strategy (default: sharding.strategy)")
    plan.add_argument("--plot", metavar="FILE.png", help="also draw the assignment into this image")
    plan.set_defaults(func=_plan)

    inspect = sub.add_parser(
        "inspect",
        help="show the data ledger of a Lightning checkpoint",
        description="Print what a checkpoint's lightning_sharding ledger holds: seed, epoch, data fingerprint, "
        "consumed and remaining samples, the topology that wrote it, and Lightning's step and epoch.",
    )
    inspect.add_argument("checkpoint", metavar="CKPT", help="a checkpoint written by Lightning")
    inspect.add_argument("--plot", metavar="FILE.png", help="also draw the epoch's progress into this image")
    inspect.set_defaults(func=_inspect)

    audit.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    prog = PROG
    try:
        args, extra = parser.parse_known_args(argv)
        prog = f"{PROG} {args.command}"
        if extra:
            # Hydra overrides may come after options (`plan --world-size 2 data.num_items=4`).
            if args.command != "plan" or any(e.startswith("-") for e in extra):
                raise CliError(f"unrecognized arguments: {' '.join(extra)} (see `{prog} --help`)")
            args.overrides = [*args.overrides, *extra]
        status: int = args.func(args)
        return status
    except SystemExit as done:  # --help and --version
        return done.code if isinstance(done.code, int) else 0
    except CliError as err:
        message = str(err)
        prog = err.prog or prog
    except (OSError, ValueError) as err:  # what the audit raises for a bad directory or file
        message = str(err)
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


# -- plan ----------------------------------------------------------------------------------------


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
            return compose(config_name, overrides=[*search, *overrides])
    except (HydraException, OmegaConfBaseException) as err:
        reason = _first_line(err)
        if err.__cause__ is not None:
            reason = f"{reason.rstrip('.')}: {_first_line(err.__cause__)}"
        if not any(o in reason for o in overrides):
            reason = f"{reason} (in {' '.join(overrides)})"
        raise CliError(f"bad override: {reason}") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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


@dataclass(frozen=True)
class _Row:
    """One printed row: a rank (``worker`` None) or one of its workers."""

    rank: int
    worker: int | None
    samples: int
    batches: int
    padding: int
    dropped: int | None
    items: int


def _nonempty_slots(order: EpochOrder) -> RangeSet:
    """The slots of the epoch order (item ``order.item_order[slot]``) that hold samples."""
    return RangeSet.from_positions(np.flatnonzero(order.counts[order.item_order] > 0))


def _slots(order: EpochOrder, positions: RangeSet, nonempty: RangeSet) -> RangeSet:
    """The slots of the epoch order that ``positions`` fall in.

    Works on ranges, never on single positions: the same result as the distinct items of
    ``order.locate(positions.to_array())``, at the cost of the number of ranges.
    """
    if not positions:
        return RangeSet()
    first = np.searchsorted(order.starts, positions.starts, side="right") - 1
    last = np.searchsorted(order.starts, positions.ends - 1, side="right") - 1
    # A range spanning an empty item would list its slot: keep only slots that hold samples.
    return RangeSet(first, last + 1).intersection(nonempty)


def _worker_positions(rank: RankPlan, worker: int) -> tuple[RangeSet, int]:
    """The real positions of ``worker``'s batches and its padding samples."""
    run = rank.worker_batches(worker)
    if not run:
        return RangeSet(), 0
    lo, hi = rank.bounds(run[0])[0], rank.bounds(run[-1])[1]
    padding = rank.num_padding if run[-1] == rank.num_batches - 1 else 0
    return rank.positions.select(lo, hi), padding


def _shown(count: int, limit: int, shown: int) -> list[int | None]:
    """Indices to print, with ``None`` where a ``...`` line stands for the ones left out."""
    if count <= limit:
        return list(range(count))
    half = shown // 2
    return [*range(half), None, *range(count - half, count)]


def _plan_rows(plan: EpochPlan, order: EpochOrder) -> tuple[list[_Row | None], list[RangeSet]]:
    """Printed rows (``None`` for ``...``) and every rank's slots, for the totals."""
    rank_slots: list[RangeSet] = []
    rows: list[_Row | None] = []
    nonempty = _nonempty_slots(order)
    shown = set(_shown(plan.world_size, MAX_RANKS, RANKS_SHOWN))
    for r in range(plan.world_size):
        rank = plan.rank(r)
        served = rank.positions.select(0, rank.num_served)
        rank_slots.append(_slots(order, served, nonempty))
        if r not in shown:
            if r - 1 in shown:
                rows.append(None)
            continue
        rows.append(
            _Row(r, None, rank.num_served, rank.num_batches, rank.num_padding, rank.num_dropped, len(rank_slots[-1]))
        )
        if plan.num_workers == 0:
            continue
        for w in _shown(plan.num_workers, MAX_WORKERS, WORKERS_SHOWN):
            if w is None:
                rows.append(None)
                continue
            positions, padding = _worker_positions(rank, w)
            items = len(_slots(order, positions, nonempty))
            rows.append(_Row(r, w, len(positions), len(rank.worker_batches(w)), padding, None, items))
    return rows, rank_slots


def format_plan(plan: EpochPlan, order: EpochOrder, *, fingerprint: str = "", strategy: str = "shard") -> str:
    """The ``plan`` table: a header, one row per rank and per (rank, worker), and a totals line."""
    rows, rank_slots = _plan_rows(plan, order)
    items = int(np.count_nonzero(order.counts))
    workers = _plural(plan.num_workers, "worker") if plan.num_workers else "0 workers (loading in the rank's process)"
    shuffle = "shuffled" if order.shuffle else "not shuffled"
    lines = [
        f"epoch {plan.epoch}, seed {order.seed}, {shuffle}: "
        f"{_plural(plan.total, 'sample')} in {_plural(order.counts.size, 'item')}"
        + (f" (data fingerprint {fingerprint[:16]})" if fingerprint else ""),
        f"world {_plural(plan.world_size, 'rank')} x {workers}, batch size {plan.batch_size}, "
        f"even_batches={plan.even_batches}, strategy {strategy}",
        "",
        f"{'rank':>6} {'worker':>6} {'samples':>9} {'batches':>8} {'padding':>8} {'dropped':>8} {'items':>6}",
    ]
    for row in rows:
        if row is None:
            lines.append(f"{'...':>6}")
            continue
        worker = "all" if row.worker is None else str(row.worker)
        dropped = "-" if row.dropped is None else str(row.dropped)
        lines.append(
            f"{row.rank:>6} {worker:>6} {row.samples:>9} {row.batches:>8} {row.padding:>8} {dropped:>8} {row.items:>6}"
        )
    # Items read by two ranks or more: count, per slot, the ranks whose slots cover it.
    cover = np.zeros(order.counts.size + 1, dtype=np.int64)
    for slots in rank_slots:
        np.add.at(cover, slots.starts, 1)
        np.add.at(cover, slots.ends, -1)
    shared = int(np.count_nonzero(np.cumsum(cover)[:-1] >= 2))
    served = int(plan.rank_counts.sum() - plan.dropped_per_rank.sum())
    touched = _union_len(rank_slots)
    dropped_total = int(plan.dropped_per_rank.sum())
    lines.append(
        f"{'total':>6} {'':>6} {served:>9} {plan.num_batches * plan.world_size:>8} "
        f"{int(plan.padding_per_rank.sum()):>8} {dropped_total:>8} {touched:>6}"
    )
    per_rank = f"{plan.num_batches} {'batch' if plan.num_batches == 1 else 'batches'} per rank"
    lines.append(
        f"{per_rank}; {served} served + {dropped_total} dropped = {plan.total} samples; "
        f"{shared} of {_plural(items, 'item')} read by more than one rank"
    )
    return "\n".join(lines)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _union_len(sets: Sequence[RangeSet]) -> int:
    if not sets:
        return 0
    starts = np.concatenate([s.starts for s in sets])
    ends = np.concatenate([s.ends for s in sets])
    return len(RangeSet(starts, ends))


def _check_plot_path(text: str | None) -> Path | None:
    """``--plot``'s path, checked before any work: its directory must exist."""
    if text is None:
        return None
    path = Path(text)
    if path.is_dir():
        raise CliError(f"--plot {text}: is a directory; give an image file name such as plan.png")
    if not path.parent.is_dir():
        raise CliError(f"--plot {text}: the directory {path.parent} does not exist")
    return path


def _manifest(cfg: DictConfig) -> Manifest:
    """The items the config's data holds (any data option or recipe: built as training builds it)."""
    from lightning_sharding.manifest import Manifest
    from lightning_sharding.readers.synthetic import SyntheticReader

    data = cfg.data
    if str(data.get("_target_", "")).endswith(".synthetic"):  # no Lightning import for the common case
        try:
            return Manifest.from_items(SyntheticReader(data.num_items, data.samples_per_item, data.dim).items())
        except ValueError as err:
            raise CliError(str(err)) from None
    from lightning_sharding.sources import source_manifest
    from lightning_sharding.train import build_datamodule

    try:
        dm = build_datamodule(cfg)
        if dm.source is not None:
            return source_manifest(dm.source)
        return Manifest.from_items(dm.make_reader().items())
    except Exception as err:  # noqa: BLE001 - a bad data option: say which and why
        cause = err.__cause__ or err
        raise CliError(f"cannot build data={cfg.data.get('_target_')}: {_first_line(cause)}") from None


def _plan(args: argparse.Namespace) -> int:
    from lightning_sharding.order import EpochOrder
    from lightning_sharding.plan import plan_epoch

    plot = _check_plot_path(args.plot)
    cfg = _compose(args.overrides, args.config_dir, args.config_name)
    data = _data_settings(cfg)
    strategy = args.strategy or str(cfg.sharding.strategy)
    batch_size = args.batch_size if args.batch_size is not None else data.batch_size
    seed = args.seed if args.seed is not None else data.seed
    even_batches = args.even_batches or data.even_batches
    if batch_size < 1:
        raise CliError(f"data.batch_size={batch_size} must be 1 or more")
    if seed < 0:
        raise CliError(f"data.seed={seed} must be 0 or more")
    if even_batches not in EVEN_BATCH_POLICIES:
        raise CliError(f"data.even_batches={even_batches!r} must be one of {', '.join(map(repr, EVEN_BATCH_POLICIES))}")
    manifest = _manifest(cfg)
    # A dispatch source is read in its own order: the dispatch loader never shuffles.
    order = EpochOrder(manifest.counts, seed, args.epoch, shuffle=data.shuffle and strategy != "dispatch")
    plan = plan_epoch(
        manifest.total,
        RangeSet(),
        epoch=args.epoch,
        world_size=args.world_size if args.world_size is not None else data.world_size,
        num_workers=args.workers if args.workers is not None else data.num_workers,
        batch_size=batch_size,
        even_batches=cast("EvenBatches", even_batches),
        worker_layout="interleaved" if strategy == "broadcast" else "runs",  # as the strategy's sampler plans
    )
    print(format_plan(plan, order, fingerprint=manifest.fingerprint, strategy=strategy))
    if plot is not None:
        from lightning_sharding import plots

        _draw(plots.plot_plan, plot, plan, order)
        print(f"plot written to {plot}")
    return 0


def _draw(function: Callable[..., None], path: Path, *args: Any) -> None:
    from lightning_sharding.plots import MatplotlibMissingError

    try:
        function(path, *args)
    except MatplotlibMissingError as err:
        raise CliError(str(err)) from None
    except (OSError, ValueError) as err:
        raise CliError(f"--plot {path}: {err}") from None


# -- inspect -------------------------------------------------------------------------------------


def _load_checkpoint(path: Path) -> Mapping[str, Any]:
    """``torch.load`` a checkpoint safely; every failure is a :class:`CliError` naming the path."""
    if not path.exists():
        raise CliError(f"no such checkpoint file: {path}")
    if path.is_dir():
        raise CliError(f"{path} is a directory, not a checkpoint file")
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to unpickle is the file's fault
        raise CliError(f"{path} is not a readable PyTorch checkpoint: {_first_line(err)}") from None
    if not isinstance(ckpt, Mapping):
        raise CliError(f"{path} holds a {type(ckpt).__name__}, not a Lightning checkpoint")
    return ckpt


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def format_inspect(path: Path, ckpt: Mapping[str, Any]) -> str:
    """The ``inspect`` report of a checkpoint holding a valid data ledger."""
    from lightning_sharding.ledger import Ledger

    state = ckpt[CHECKPOINT_KEY]
    ledger = Ledger.from_state_dict(state)
    manifest = ledger.manifest
    consumed = len(ledger.consumed)
    remaining = ledger.total - consumed
    ranges = np.asarray(state["consumed"])
    writer = state.get("writer")
    if isinstance(writer, Mapping):
        topology = (
            f"world_size {writer.get('world_size', '?')} x num_workers {writer.get('num_workers', '?')}, "
            f"batch_size {writer.get('batch_size', '?')}"
        )
    else:
        topology = "not recorded"
    return "\n".join(
        [
            f"checkpoint   {path}",
            f"ledger       version {state['version']}, seed {ledger.seed}, epoch {ledger.epoch}",
            f"data         fingerprint {ledger.fingerprint[:16]}, {manifest.get('num_items', '?')} items, "
            f"{manifest.get('total', ledger.total)} samples, "
            f"first {manifest.get('first_key', '?')}, last {manifest.get('last_key', '?')}",
            f"consumed     {consumed} of {ledger.total} samples ({_percent(consumed, ledger.total)})",
            f"remaining    {remaining} samples ({_percent(remaining, ledger.total)})",
            f"writer       {topology}",
            f"ledger size  {_plural(ledger.consumed.num_ranges, 'range')}, {ranges.nbytes} bytes",
            f"lightning    global_step {ckpt.get('global_step', 'n/a')}, epoch {ckpt.get('epoch', 'n/a')}",
            _step_line(state, ckpt.get("global_step")),
        ]
    )


def _step_line(state: Mapping[str, Any], global_step: Any) -> str:
    """Which optimizer step the ledger matches, or a warning that it may not match the weights."""
    mismatch = ledger_step_mismatch(state, global_step)
    if mismatch:
        return f"WARNING      {mismatch}"
    return f"matches      optimizer step {state[GLOBAL_STEP_KEY]}: the samples whose gradients these weights hold"


def _inspect(args: argparse.Namespace) -> int:
    from lightning_sharding.ledger import CheckpointMismatchError, Ledger

    path = Path(args.checkpoint)
    plot = _check_plot_path(args.plot)
    ckpt = _load_checkpoint(path)
    if CHECKPOINT_KEY not in ckpt:
        raise CliError(f"{path} holds no lightning_sharding data ledger (it was written without ShardedDataModule)")
    try:
        report = format_inspect(path, ckpt)
    except (CheckpointMismatchError, ValueError) as err:
        raise CliError(f"{path}: {err}") from None
    print(report)
    if plot is not None:
        from lightning_sharding import plots

        ledger = Ledger.from_state_dict(ckpt[CHECKPOINT_KEY])
        _draw(plots.plot_progress, plot, ledger.consumed, ledger.total, ledger.epoch)
        print(f"plot written to {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
