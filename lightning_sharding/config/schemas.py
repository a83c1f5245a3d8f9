"""Structured-config schemas of the Hydra entry point, registered in Hydra's ConfigStore.

Every config group (``data``, ``sharding``, ``trainer``, ``model``, ``callbacks``, ``logger``) has
a dataclass schema: a misspelt key or a wrong type fails when the config is composed, naming the
key. The ``data`` schemas are in :mod:`lightning_sharding.config.data`.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

from lightning_sharding.config.data import (
    FilesData,
    ImagesData,
    MixtureData,
    MonthsData,
    PretrainData,
    SqliteData,
    SyntheticData,
    TokensData,
)
from lightning_sharding.config.generated import config_type

if TYPE_CHECKING:
    from lightning_sharding.strategies import Strategy

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")  # the packaged Hydra config directory

# -- sharding: one option per strategy ---------------------------------------------------------------


def sharding_schema(strategy: type[Strategy]) -> type:
    """The schema of ``sharding=<strategy.name>``, generated from the strategy's constructor: ``name``,
    then each of its settings with the constructor's default, typed as a config can hold it (a
    ``Literal`` as ``str``, a function as its dotted path). One definition: the class's signature."""
    hints = typing.get_type_hints(strategy.__init__)
    fields: list[tuple[str, Any, Any]] = [("name", str, field(default=strategy.name))]
    for parameter in inspect.signature(strategy).parameters.values():
        if parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        fields.append((parameter.name, config_type(hints[parameter.name]), field(default=parameter.default)))
    doc = (strategy.__doc__ or "").strip().splitlines()[0]
    schema = make_dataclass(f"{strategy.__name__.removesuffix('Strategy')}Sharding", fields)
    schema.__doc__ = f"``sharding={strategy.name}``: {doc} (generated from {strategy.__name__})"
    schema.__module__ = __name__
    return schema


def _sharding_schemas() -> dict[str, type]:
    """``<name>_schema`` of each built-in strategy."""
    from lightning_sharding.strategies import BroadcastStrategy, DaliStrategy, DispatchStrategy, ShardStrategy

    built_in = (ShardStrategy, BroadcastStrategy, DispatchStrategy, DaliStrategy)
    return {f"{cls.name}_schema": sharding_schema(cls) for cls in built_in}


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
class ImageClassifierModel:
    """A small CNN for the ``images`` data: ``image (B, 3, H, W) uint8`` -> ``classes`` logits."""

    _target_: str = "lightning_sharding.recipes.models.ImageClassifier"
    classes: int = II("data.classes")
    width: int = 16
    learning_rate: float = 1e-2


@dataclass
class CausalLM:
    """A tiny causal transformer over packed sequences, attention kept inside each document."""

    _target_: str = "lightning_sharding.recipes.models.CausalLM"
    vocab_size: int = II("data.vocab_size")
    seq_len: int = II("data.seq_len")
    width: int = 64
    heads: int = 4
    learning_rate: float = 3e-3


@dataclass
class TokenModel:
    """A tiny next-token model (embedding, MLP, logits) for the token files of ``recipe=tokens``."""

    _target_: str = "lightning_sharding.recipes.models.TokenModel"
    vocab_size: int = II("data.vocab_size")
    width: int = 64
    learning_rate: float = 3e-3


@dataclass
class MixtureControllerOptions:
    """A ``MixtureController`` deciding a mixture's shares with ``ExcessLossWeights`` (DoReMi-style)
    every ``every_n_steps`` optimizer steps (``None``: no controller): each stream's loss above its
    ``reference`` loss (0 when not given) raises its share, at rate ``lr``, mixed with the uniform
    shares by ``smoothing``. The recipes' regressor hands its per-stream losses to it."""

    every_n_steps: int | None = None
    reference: dict[str, float] = field(default_factory=dict)
    lr: float = 1.0
    smoothing: float = 1e-3


@dataclass
class CallbacksConfig:
    """Checkpoints (``ModelCheckpoint``), the data summary (``ShardingCallback``), and a mixture's
    online share decisions (``mixture_controller``)."""

    checkpoint: bool = True
    dirpath: str = "${out_dir}/checkpoints"  # where ckpt_path=last looks
    every_n_train_steps: int | None = II("checkpoint_every_n_steps")  # none: at every epoch's end
    save_top_k: int = -1
    save_last: bool = True
    print_summary: bool = True
    log_every_n_steps: int = 10  # data/progress, data/samples_per_s, data/wait
    mixture_controller: MixtureControllerOptions = field(default_factory=MixtureControllerOptions)


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
    # Set by a recipe's old name (conf/recipe/stream.yaml): what to tell the user. The train entry point
    # and plan take it out, warning, before they build anything (lightning_sharding.train.renamed_recipe);
    # what the train entry point's --cfg, --help and --info print leaves it out (train._INTERNAL_KEYS).
    _renamed_recipe: str | None = None


# The schema of each option, by group. The names are the ConfigStore's (top-level, so one name per
# schema across all groups); ``files_schema`` is the schema of ``data=files``.
SCHEMAS: dict[str, dict[str, type]] = {
    "data": {
        "synthetic_schema": SyntheticData,
        "files_schema": FilesData,
        "months_schema": MonthsData,
        "tokens_schema": TokensData,
        "pretrain_schema": PretrainData,
        "images_schema": ImagesData,
        "sqlite_schema": SqliteData,
        "mixture_schema": MixtureData,
    },
    "sharding": _sharding_schemas(),
    "trainer": {"trainer_schema": TrainerConfig},
    "model": {
        "regressor_schema": RegressorModel,
        "forecaster_schema": ForecasterModel,
        "token_model_schema": TokenModel,
        "causal_lm_schema": CausalLM,
        "image_classifier_schema": ImageClassifierModel,
    },
    "callbacks": {"callbacks_schema": CallbacksConfig},
    "logger": {"logger_schema": LoggerConfig},
}


def register_configs() -> None:
    """Register the schemas (idempotent): ``train_schema`` and every ``<name>_schema`` of :data:`SCHEMAS`.

    All at the top level, outside the groups: an option's file extends its schema with
    ``- /<name>_schema@_here_``, and Hydra's ``--help`` (which lists every option of every group)
    shows the options one can choose, not the schemas behind them.
    """
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for schemas in SCHEMAS.values():
        for name, node in schemas.items():
            store.store(name=name, node=node)
