"""The train entry point: ``lightning-sharding-train`` or ``python -m lightning_sharding.train``.

A thin ``@hydra.main`` around :func:`run`, which tests call directly with a composed config.
``recipe=NAME`` picks a packaged recipe (``lightning_sharding/conf/recipe/NAME.yaml``); the default
job trains a small regression model on the built-in synthetic data set and prints the data
summary (epochs, samples consumed, padding, throughput) when it ends.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import warnings
from typing import TYPE_CHECKING, Any

import hydra
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_sharding.config import (
    CONF_DIR,
    ConfigError,
    check_batch_size,
    check_config,
    register_configs,
    resolve_ckpt_path,
)
from lightning_sharding.core import spelling
from lightning_sharding.strategies.base import DataKindError

# Lightning is imported inside the functions, not here: spawned processes (DataLoader workers, the
# dispatch process, DALI's) re-import the main module, and `import lightning` costs seconds each.
if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_sharding.lightning.callbacks import ShardingCallback
    from lightning_sharding.lightning.datamodule import ShardedDataModule
    from lightning_sharding.recipes.models import Regressor

__all__ = ["CONF_DIR", "Regressor", "build_callbacks", "build_datamodule", "main", "run"]


def __getattr__(name: str) -> Any:
    if name == "Regressor":  # kept importable from here, loaded only when asked for
        from lightning_sharding.recipes.models import Regressor

        return Regressor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_datamodule(cfg: DictConfig) -> ShardedDataModule:
    """Instantiate ``cfg.data`` with the ``sharding`` options and the audit directory (a recipe's old
    name, ``recipe=stream``, warned: :func:`renamed_recipe`)."""
    from lightning_sharding.lightning.datamodule import ShardedDataModule

    said = renamed_recipe(cfg)
    if said is not None:
        warnings.warn(said, DeprecationWarning, stacklevel=2)
    sharding = OmegaConf.to_container(cfg.sharding, resolve=True)
    audit_dir = cfg.audit.dir if cfg.audit.enabled else None
    try:
        dm = instantiate(cfg.data, sharding=sharding, audit_dir=audit_dir, _convert_="all")
    except InstantiationException as err:  # the DataModule refuses data its strategy cannot read when made
        if isinstance(err.__cause__, DataKindError):
            raise ConfigError(_wrong_data(cfg, err.__cause__)) from err.__cause__
        raise
    if not isinstance(dm, ShardedDataModule):
        raise ConfigError(f"data._target_={cfg.data._target_} returned {type(dm).__name__}, not a ShardedDataModule")
    return dm


def _wrong_data(cfg: DictConfig, err: Exception) -> str:
    return (
        f"sharding={cfg.sharding.name} cannot read what data._target_={cfg.data._target_} built "
        f"({err}): choose the sharding option that fits the data, or data that fits the strategy"
    )


def _check_data(cfg: DictConfig, dm: ShardedDataModule) -> None:
    """The checks that need the data itself: what the strategy takes, a reachable batch size."""
    from lightning_sharding.readers.sources import UNKNOWN_LENGTH

    reader = None if dm.source is not None else dm.make_reader()
    try:
        dm.strategy.check_data(dm.source if reader is None else reader, type(dm).__name__)
    except TypeError as err:
        raise ConfigError(_wrong_data(cfg, err)) from err
    if dm.source is not None:
        length = dm.source.length()
        total = UNKNOWN_LENGTH if length is None else length
    else:
        assert reader is not None
        total = sum(item.num_samples for item in reader.items())
    check_batch_size(cfg, total)


def build_callbacks(cfg: DictConfig) -> tuple[ShardingCallback, list[pl.Callback]]:
    """The summary callback, and every callback the trainer gets (checkpoints if enabled)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_sharding.lightning.callbacks import ReleaseProcessGroup, ShardingCallback

    c = cfg.callbacks
    sharding = ShardingCallback(print_summary=c.print_summary, log_every_n_steps=c.log_every_n_steps)
    callbacks: list[pl.Callback] = [sharding, ReleaseProcessGroup()]
    if c.checkpoint:
        callbacks.append(
            ModelCheckpoint(
                dirpath=c.dirpath,
                every_n_train_steps=c.every_n_train_steps,
                save_top_k=c.save_top_k,
                save_last=c.save_last,
            )
        )
    control = c.get("mixture_controller")
    if control is not None and control.every_n_steps:
        from lightning_sharding.lightning.controller import ExcessLossWeights, MixtureController

        policy = ExcessLossWeights(dict(control.reference), lr=control.lr, smoothing=control.smoothing)
        callbacks.append(MixtureController(policy, every_n_steps=control.every_n_steps))
    return sharding, callbacks


def build_logger(cfg: DictConfig) -> Any:
    """The configured Lightning logger, or ``False`` for ``logger=none``."""
    if not cfg.logger.get("_target_"):
        return False
    return instantiate(cfg.logger)


def trainer_options(cfg: DictConfig) -> dict[str, Any]:
    """``cfg.trainer`` as ``pl.Trainer`` keyword arguments (unset optional ones left out)."""
    options = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(options, dict)
    return {str(key): value for key, value in options.items() if value is not None}


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; returns ``{"epochs": [...reports...], "world_size", "global_rank", "seed",
    "ckpt_path"}``. Bad combinations of options fail here, before any data is read."""
    check_config(cfg)  # before Lightning's import: a bad value is said in a second, not after the import
    ckpt_path = resolve_ckpt_path(cfg)
    import lightning.pytorch as pl

    dm = build_datamodule(cfg)
    _check_data(cfg, dm)
    model = instantiate(cfg.model, _convert_="all")
    sharding, callbacks = build_callbacks(cfg)
    trainer = pl.Trainer(
        **trainer_options(cfg),
        callbacks=callbacks,
        default_root_dir=cfg.out_dir,
        logger=build_logger(cfg),
        enable_checkpointing=bool(cfg.callbacks.checkpoint),
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return {
        "epochs": sharding.summary(),
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "seed": dm.seed,
        "ckpt_path": ckpt_path,
    }


register_configs()


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:  # each job of a sweep keeps its checkpoints and logs apart
        cfg.out_dir = hydra_cfg.runtime.output_dir  # <out_dir>/multirun/<date>_<time>/<job number>
    said = renamed_recipe(cfg)
    if said is not None and os.environ.get("LOCAL_RANK", "0") == "0":  # once per node, not once per rank
        print(f"{PROG}: warning: {said}", file=sys.stderr)
    try:
        check_config(cfg)  # a bad value is said before Lightning is imported
        _log_through_hydra()
        run(cfg)
    except Exception as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"{PROG}: error: {user_message(err)}", file=sys.stderr)
        print("(run again with HYDRA_FULL_ERROR=1 to see the traceback)", file=sys.stderr)
        sys.exit(1)


def user_message(err: BaseException) -> str:
    """One line for the user: the error's message; for one raised again in this process from a
    DataLoader worker or a rank (its text carries that process's traceback), the exception at the end
    of that traceback, as the process raised it."""
    text = str(err).strip()
    if "Traceback (most recent call last)" in text:
        lines = text.splitlines()
        starts = [
            i for i, line in enumerate(lines) if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b", line)
        ]
        if starts:
            text = " ".join(lines[starts[-1] :])
    text = " ".join(text.split())
    return text or type(err).__name__


def _log_through_hydra() -> None:
    """One line per log event: Hydra's logging config owns the console and the log file.

    ``import lightning`` gives the ``lightning`` logger a console handler of its own (and its
    subpackages one too when the root logger has none yet), so next to Hydra's handlers every
    Lightning line came out twice. Hand its lines to Hydra's handlers instead; with
    ``hydra/job_logging=disabled`` the root has none and Lightning keeps its own.
    """
    import logging

    import lightning  # noqa: F401 - adds the handlers removed below; run() imports it anyway

    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
        logger.propagate = True


def main() -> None:
    """Console-script entry. Puts the working directory on ``sys.path`` (as ``python -m`` does), so
    a recipe's ``_target_`` may name a module next to it."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    os.environ[spelling.ENV] = "hydra"  # advice in messages, here and in every rank and worker, as overrides
    sys.argv[1:] = [quote_equals(arg) for arg in sys.argv[1:]]
    typo = misspelt_key(sys.argv[1:])
    if typo is not None:
        print(f"{PROG}: error: {typo}", file=sys.stderr)
        sys.exit(2)
    if _prints_config(sys.argv[1:]):
        _print_config()
    else:
        _hydra_main()


PROG = "lightning-sharding-train"
# Hydra's own flags, after which Hydra alone reads the command line (help, a sweep, another config).
_HYDRA_FLAGS: tuple[str, ...] = ("-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info")
_HYDRA_FLAGS += ("-sc", "--shell-completion", "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir")


# Keys that lightning_sharding 0.2 moved: what to write now.
MOVED_KEYS = {
    "data.transport": "sharding.transport (a setting of the shard and broadcast strategies)",
    "sharding.strategy": "sharding=NAME, which picks the strategy with its settings (its key is sharding.name)",
}


# The train config's keys that are the entry point's own, not the job's: what Hydra prints of the config
# (--cfg, --help, --info) leaves them out, and what _renamed_recipe says goes to stderr, as a run says it.
_INTERNAL_KEYS = ("_renamed_recipe",)


def renamed_recipe(cfg: DictConfig) -> str | None:
    """What to tell the user of a recipe's old name, taken out of ``cfg`` (then the job is the new
    recipe's); None for any other config. The old name's file is an alias of the new recipe that sets
    ``_renamed_recipe`` (``conf/recipe/stream.yaml``: ``recipe=stream is now recipe=sqlite``)."""
    said = cfg.get("_renamed_recipe")
    if not said:
        return None
    cfg["_renamed_recipe"] = None
    return _renamed(str(said))


def _renamed(said: str) -> str:
    return f"{said} since lightning_sharding 0.2; the old name goes away in the next release"


def _prints_config(args: list[str]) -> bool:
    """Whether Hydra is asked to print the config (``--cfg``, ``--help``, ``--info``) rather than run the job."""
    flags = ("-c", "--cfg", "-h", "--help", "-i", "--info")
    return any(arg.split("=", 1)[0] in flags for arg in args)


def _print_config() -> None:
    """Hydra's printout of the config, less :data:`_INTERNAL_KEYS`: ``--cfg job`` shows the job, not
    the entry point's marks (``_renamed_recipe: null`` in every job); a recipe's old name is said on
    stderr, as a run says it. Hydra prints the config itself, with no hook to change it first, so its
    output is taken and printed again."""
    import contextlib
    import io

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            _hydra_main()
    finally:
        text, said = without_internal_keys(printed.getvalue())
        if said is not None:
            print(f"{PROG}: warning: {said}", file=sys.stderr)
        sys.stdout.write(text)
        sys.stdout.flush()


def without_internal_keys(printed: str) -> tuple[str, str | None]:
    """A printed config (YAML) less its top-level :data:`_INTERNAL_KEYS`, and what a recipe's old name
    there says (None for any other config)."""
    kept: list[str] = []
    dropped: list[str] = []
    dropping = False
    for line in printed.splitlines(keepends=True):
        if line.split(":", 1)[0] in _INTERNAL_KEYS:
            dropping = True
        elif not (dropping and line.startswith((" ", "\t"))):  # a long value folds onto indented lines
            dropping = False
        (dropped if dropping else kept).append(line)
    values = OmegaConf.create("".join(dropped))
    said = values.get("_renamed_recipe") if isinstance(values, DictConfig) else None
    return "".join(kept), None if not said else _renamed(str(said))


def misspelt_key(args: list[str]) -> str | None:
    """What is wrong with an override that names a key its group does not have (``data.batch_sise=8``),
    with the group's keys and the closest one; None when the command composes, or fails otherwise
    (Hydra then says why). Hydra's own message only suggests appending the typo with ``+``."""
    args = _without_cfg(args)  # `--cfg job` composes the same config: its typos are said the same way
    if any(arg.split("=", 1)[0] in _HYDRA_FLAGS for arg in args):
        return None
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        try:
            compose("train", overrides=args)
            return None
        except OverrideParseException:  # not an override Hydra reads: Hydra says why
            return None
        except ConfigCompositionException as err:
            missing = err.__cause__
            if not isinstance(missing, (ConfigAttributeError, ConfigKeyError)) or not getattr(
                missing, "full_key", None
            ):
                return None
            full_key = str(missing.full_key)
            bad = next((a for a in args if a.lstrip("~+").split("=", 1)[0] == full_key), None)
            try:
                cfg = compose("train", overrides=[a for a in args if a is not bad])
            except Exception:  # noqa: BLE001 - then Hydra's own message is as good as it gets
                return None
    if full_key in MOVED_KEYS:
        return f"{full_key} is {MOVED_KEYS[full_key]} since lightning_sharding 0.2"
    parent, _, key = full_key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return None
    keys = sorted(str(k) for k in node.keys() if not str(k).startswith("_"))
    where = _strategy_setting(parent, key)  # a strategy's setting, exactly: no closest key to guess
    close = [] if where else difflib.get_close_matches(key, keys, n=1)
    hint = f"Did you mean {'.'.join(filter(None, [parent, close[0]]))}? " if close else ""
    more = (
        " (any other argument of lightning.pytorch.Trainer goes in as +trainer.NAME=VALUE)"
        if parent == "trainer"
        else ""
    )
    return (
        f"{full_key}: {parent or 'the train config'} has no key {key!r}{where}. {hint}Its keys are {', '.join(keys)}"
        f"{more}"
    )


def _strategy_setting(parent: str, key: str) -> str:
    """`` (a setting of sharding=broadcast)`` when ``key``, missing from ``parent`` (``sharding`` or
    ``data``), is a setting of other strategies: the options that take it; else ``""``."""
    if parent not in ("sharding", "data"):
        return ""
    from lightning_sharding.strategies.base import strategies_taking

    takers = " or ".join(f"sharding={cls.name}" for cls in strategies_taking(key))
    if not takers:
        return ""
    return f" (a setting of {takers})" if parent == "sharding" else f" (a setting of {takers}, as sharding.{key})"


def _without_cfg(args: list[str]) -> list[str]:
    """``args`` without Hydra's ``--cfg``/``-c`` and its value (``job``, ``hydra``, ``all``), and the
    options of what it prints (``--package``/``-p`` and its value, ``--resolve``)."""
    out: list[str] = []
    skip = ""
    for arg in args:
        if skip:
            skipped, skip = skip, ""
            if skipped == "package" or arg in ("job", "hydra", "all"):
                continue
        if arg in ("--cfg", "-c", "--package", "-p"):
            skip = "package" if arg in ("--package", "-p") else "cfg"
            continue
        if arg == "--resolve" or arg.startswith(("--cfg=", "-c=", "--package=", "-p=")):
            continue
        out.append(arg)
    return out


def quote_equals(arg: str) -> str:
    """An override whose value holds ``=``, as every checkpoint ``ModelCheckpoint`` names by default
    does (``ckpt_path=out/checkpoints/epoch=0-step=20.ckpt``), quoted for Hydra, whose grammar refuses
    an unquoted ``=`` in a value; anything with quotes, brackets, braces or commas is left as written."""
    key, sep, value = arg.partition("=")
    if not sep or arg.startswith("-") or "=" not in value or any(c in value for c in "'\"[]{}(),"):
        return arg
    return f"{key}='{value}'"


if __name__ == "__main__":
    main()
