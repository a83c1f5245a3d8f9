"""The strategy interface: what a strategy takes, what it allows, and the loaders it builds.

A :class:`Strategy` is a spec read by everything that must know a strategy's rules (the
DataModule, the Hydra config checks, ``lightning-sharding plan``) and the builder of its loaders.
A :class:`TrainLoader` is what the training side relies on: an iterable of batches whose
provenance it keeps in a :class:`~lightning_sharding.strategies.DeliveredLog`, with an
:class:`EpochSampler` that Lightning moves from epoch to epoch and whose plan
(:class:`EpochOutline`) the callback reports; its checkpoint hooks default to nothing.
Strategies are looked up by name in a registry that users may add to with
:func:`register_strategy`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, Generic, Literal, Protocol, runtime_checkable

from typing_extensions import TypeVar

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.plan import WorkerLayout
from lightning_sharding.core.world import World
from lightning_sharding.strategies._delivery import DeliveredLog, Provenance
from lightning_sharding.strategies.options import LoaderOptions

Takes = Literal["reader", "windows", "source"]


class EpochOutline(Protocol):
    """What the training side reads off an epoch's plan (an ``EpochPlan``, or how a synced epoch ended)."""

    @property
    def num_batches(self) -> int:
        """Batches every rank serves in this pass."""
        ...

    @property
    def padding_per_rank(self) -> Any:
        """Padding samples per rank, shape ``(world_size,)``."""
        ...

    @property
    def dropped_per_rank(self) -> Any:
        """Samples per rank left unserved this epoch, shape ``(world_size,)``."""
        ...


@runtime_checkable
class EpochSampler(Protocol):
    """What a :class:`TrainLoader`'s ``sampler`` must offer. Lightning calls ``set_epoch`` on a
    loader's ``sampler`` at every epoch start (the only way it tells a loader the epoch); the
    :class:`~lightning_sharding.lightning.callbacks.ShardingCallback` reads ``epoch_plan`` for the
    progress bar's total and the epoch's report, and a loader checks each batch against ``epoch``.
    A strategy's own sampler usually keeps the ledger and plans the pass when iterated."""

    @property
    def epoch(self) -> int:
        """The epoch being served: the ledger's."""
        ...

    @property
    def epoch_plan(self) -> EpochOutline | None:
        """The plan of the current pass over the epoch (``None`` before the first)."""
        ...

    def set_epoch(self, epoch: int) -> None:
        """A new epoch starts, with nothing of it consumed (the ledger's ``start_epoch``)."""
        ...


# A loader class names its sampler type, TrainLoader[PlanSampler]; one that does not gets Any.
SamplerT = TypeVar("SamplerT", bound=EpochSampler, default=Any)


class TrainLoader(ABC, Generic[SamplerT]):
    """The iterable Lightning gets for one rank: batches with provenance stripped.

    Subclasses set ``sampler`` (an :class:`EpochSampler`; ``TrainLoader[MySampler]`` types it as
    the subclass's own) and ``delivered`` (a :class:`~lightning_sharding.strategies.DeliveredLog`,
    whose ``accept`` turns each worker's :class:`~lightning_sharding.strategies.Delivery` into the
    batch for training), and define ``__iter__``. It is not a ``DataLoader`` on purpose: Lightning
    then leaves it alone (no sampler injection).
    """

    sampler: SamplerT
    delivered: DeliveredLog
    batch_sampler = None  # Lightning's evaluation loop reads it off any loader that has a `sampler`
    batches_before_plan = 0  # batches of this pass yielded under earlier plans (a mixture decision replanned it)

    @abstractmethod
    def __iter__(self) -> Iterator[Any]:
        """This pass's batches, provenance kept in ``delivered``."""

    @property
    def epoch(self) -> int:
        """The epoch being served."""
        return self.sampler.epoch

    @property
    def epoch_plan(self) -> EpochOutline | None:
        """The plan of the current pass (``None`` before the first)."""
        return self.sampler.epoch_plan

    def set_epoch(self, epoch: int) -> None:
        """A new epoch starts with nothing consumed."""
        self.sampler.set_epoch(epoch)

    def pop_delivered(self) -> Provenance:
        """Provenance of the oldest delivered batch whose step has not been accounted yet."""
        return self.delivered.pop()

    def helper_processes(self) -> dict[str, Any]:
        """This rank's helper processes (``.pid``, ``.exitcode``) by name."""
        return {}

    def decision_point(self) -> tuple[int, int]:
        """``(position, batches)``: where a mixture decision made now takes effect (see the ``shard``
        strategy's loader, the one that replans mid-pass)."""
        raise ValueError(f"{type(self).__name__} cannot change a mixture's shares mid-epoch; use sharding='shard'")

    def switch_order(self, manifest: Any, *, now: bool) -> None:
        """Serve by ``manifest``'s order: ``now``, the rest of this epoch from the next batch on; else
        from the next epoch."""
        raise ValueError(f"{type(self).__name__} cannot change a mixture's shares mid-epoch; use sharding='shard'")

    def close(self) -> None:  # noqa: B027 - a no-op unless a strategy needs it
        """Release processes and memory now (teardown, a dead worker)."""

    def note_checkpoint(self, ledger: Ledger) -> None:  # noqa: B027 - a no-op unless a strategy needs it
        """A checkpoint is being written with ``ledger`` as it is now."""

    def flush_commit(self) -> None:  # noqa: B027 - a no-op unless a strategy needs it
        """The checkpoint noted last is saved."""


class DataKindError(TypeError):
    """The data is not the kind a strategy reads (a plain reader for ``broadcast``, a reader for ``dispatch``)."""


class Strategy(ABC):
    """How one rank reads: the rules of a strategy and the builder of its loaders.

    Class attributes, what the engine and the planner must know: ``name`` (the registry key),
    ``takes`` (``"reader"``, ``"windows"`` for a
    :class:`~lightning_sharding.readers.windows.WindowedReader`, or ``"source"`` for a
    :class:`~lightning_sharding.readers.sources.Source`), ``worker_layout`` (how a rank's batches go
    to its workers) and ``shuffles`` (whether ``shuffle`` applies: a source is read in its own order).

    What a strategy takes beyond the defaults it says in one place, :meth:`refusal`, asked for each
    loader option that differs from its default and for what the data asks (a mixture, packed
    sequences, a mixture controller). A refusal names the owner, the argument, the reason and the
    strategies that would take it.

    What only this strategy uses is a setting of its own, an argument of its constructor
    (``ShardStrategy(transport="torch")``), returned by :meth:`settings`; a name picks the strategy with
    its defaults (``sharding="shard"``).
    """

    name: ClassVar[str]
    takes: ClassVar[Takes] = "reader"
    worker_layout: ClassVar[WorkerLayout] = "runs"
    shuffles: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _adopt_flags(cls)

    def __eq__(self, other: object) -> bool:
        # `dm.strategy == "shard"` keeps working now that `dm.strategy` is a Strategy.
        if isinstance(other, str):
            return other == self.name
        return NotImplemented

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.settings().items())})"

    def settings(self) -> dict[str, Any]:
        """This strategy's own settings, by the names its constructor takes them under."""
        return {}

    @classmethod
    def refusal(cls, setting: str, value: Any) -> str | None:
        """Why this strategy cannot take ``setting=value``, as words that follow "strategy NAME"
        (``"does not read a mixture of streams"``); ``None`` when it can.

        Asked for every loader option whose value differs from its default (``even_batches``,
        ``on_error``, ``batch_transform``, ``persistent_workers``, ...), and for what the data asks:
        ``streams`` (a mixture; the value is its batch composition), ``packing`` (packed sequences),
        ``mixture_control`` (a ``MixtureController`` that replans a pass mid-way) and ``skip_steps``
        (``skip=`` naming global steps, replayed from the training history; the value is ``num_workers``).

        The base strategy refuses ``on_error="skip"``, an ``even_batches`` other than ``"pad"`` or
        ``"drop"``, a ``batch_transform``, a mixture, packed sequences and mixture control; it takes
        every other option, which configure the DataLoader a strategy builds (``num_workers``,
        ``transform``, ``collate_fn``, ``persistent_workers``, ``prefetch_factor``, ``pin_memory``,
        ``timeout``, ``multiprocessing_context``, ``padding_key``). A strategy that builds no DataLoader
        refuses those itself. Override it to refuse or take more, and return ``super().refusal(...)``
        for the rest.
        """
        if setting == "even_batches":
            return None if value in _PLAIN_EVEN_BATCHES else f"plans only {list(_PLAIN_EVEN_BATCHES)} batches"
        if setting == "on_error":
            return None if value == "raise" else "cannot fill the place of a skipped sample"
        return _REFUSED.get(setting)

    def check(self, options: LoaderOptions, data: object = None, owner: str = "ShardedDataModule") -> None:
        """Raise a ValueError or TypeError naming ``owner``'s argument at fault: an option this strategy
        does not take (:meth:`refusal`), or data of the wrong kind (``data`` None is not checked)."""
        default = LoaderOptions()
        for key in (f.name for f in dataclasses.fields(options)):
            value = getattr(options, key)
            if value != getattr(default, key):
                self._refuse(owner, key, value, f"{key}={value!r}")
        if data is not None:
            self.check_data(data, owner)

    def check_data(self, data: object, owner: str) -> None:
        """Raise when ``data`` asks what this strategy does not take, or is not what it ``takes``."""
        from lightning_sharding.mixture import MixtureReader
        from lightning_sharding.readers.base import Reader
        from lightning_sharding.readers.sources import Source
        from lightning_sharding.readers.windows import WindowedReader

        if isinstance(data, MixtureReader):  # asked once, with its batch composition
            composition = getattr(data, "composition", "mixed")
            given = "streams=..." if composition == "mixed" else f"streams=..., batch_composition={composition!r}"
            self._refuse(owner, "streams", composition, given)
        if getattr(data, "reads_sequences", False):
            self._refuse(owner, "packing", True, "packing=...")
        wanted: type = {"reader": Reader, "windows": WindowedReader, "source": Source}[self.takes]
        if not isinstance(data, wanted):
            example = {"reader": "", "windows": " (such as NpyWindows)", "source": " (such as SqliteSource)"}
            argument = "source" if self.takes == "source" else "reader"
            raise DataKindError(
                f"`{owner}({argument}=...)`: strategy {self.name!r} needs a {wanted.__name__}{example[self.takes]}, "
                f"got {type(data).__name__}"
            )

    def _refuse(self, owner: str, setting: str, value: Any, given: str) -> None:
        """Raise when this strategy refuses ``setting=value``, naming ``owner(given)`` and the takers."""
        reason = self.refusal(setting, value)
        if reason is not None:
            raise ValueError(f"`{owner}({given})`: {refusal_message(self, setting, value, reason)}")

    def manifest(self, data: Any, batch_size: int | None = None) -> Manifest:
        """The manifest of the training data (a reader's items and mixture, whose blocks take
        ``batch_size``; or a source's length)."""
        from lightning_sharding.mixture import MixtureReader
        from lightning_sharding.readers.base import Reader

        if isinstance(data, MixtureReader):
            return data.manifest(batch_size)
        return data.manifest() if isinstance(data, Reader) else Manifest.from_items(data.items())

    @abstractmethod
    def build(
        self, data: Any, manifest: Manifest, ledger: Ledger, world: World, options: LoaderOptions, *, track: bool
    ) -> TrainLoader:
        """The loader of ``world.rank`` for ``ledger``'s epoch; ``track`` keeps provenance for the ledger."""

    def build_eval(
        self, reader: Any, manifest: Manifest, ledger: Ledger, world: World, options: LoaderOptions
    ) -> Iterable[Any]:
        """An evaluation loader: never shuffled, always padded (flagged), no provenance kept."""
        evaluation = options.replace(shuffle=False, even_batches="pad")
        return self.build(reader, manifest, ledger, world, evaluation, track=False)

    def release(self, loader: TrainLoader | None) -> None:  # noqa: B027 - a no-op unless a strategy needs it
        """Before a new train loader is built: release what the previous one holds, if it must go first."""


_REGISTRY: dict[str, type[Strategy]] = {}
_BUILT_IN = ("shard", "broadcast", "dispatch", "dali")  # modules of lightning_sharding.strategies


def _registry() -> dict[str, type[Strategy]]:
    """The registry, built-in strategies first in a fixed order (their modules register them when
    imported, in whatever order something imports them), then the users' in registration order."""
    for module in _BUILT_IN:
        importlib.import_module(f"lightning_sharding.strategies.{module}")
    ordered = {name: _REGISTRY[name] for name in _BUILT_IN}
    ordered.update((name, cls) for name, cls in _REGISTRY.items() if name not in ordered)
    return ordered


S = TypeVar("S", bound=type[Strategy])


def register_strategy(cls: S) -> S:
    """Class decorator: make ``cls`` available as ``sharding=cls.name``; a name is registered once."""
    name = cls.__dict__.get("name")  # its own: a subclass that inherits a name would replace its parent
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name` of its own (a non-empty string)")
    registry = _REGISTRY if cls.__module__.startswith(__package__ + ".") else _registry()
    known = registry.get(name)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(
            f"strategy name {name!r} is taken by {known.__module__}.{known.__qualname__}: "
            f"give {cls.__name__} another name"
        )
    _REGISTRY[name] = cls
    return cls


_PLAIN_EVEN_BATCHES = ("pad", "drop")
_REFUSED = {  # what the base strategy does not take, whatever the value (see Strategy.refusal)
    "batch_transform": "does not run a batch transform",
    "streams": "does not read a mixture of streams",
    "packing": "does not read packed sequences",
    "mixture_control": "cannot replan a pass mid-way (a MixtureController's decision)",
}


def refusal_message(strategy: Strategy | type[Strategy], setting: str, value: Any, reason: str) -> str:
    """``strategy NAME REASON; use sharding='shard'``: the strategies that take ``setting=value`` and
    read the data ``strategy`` reads (a source goes to none of the readers' strategies)."""
    kind = strategy.takes

    def taker(other: type[Strategy]) -> bool:
        reads = other.takes == kind or (other.takes == "reader" and kind == "windows")  # a window reader is a reader
        return reads and other.refusal(setting, value) is None

    takers = strategies_where(taker)
    return f"strategy {strategy.name!r} {reason}" + (f"; use {takers}" if takers != "no strategy" else "")


# The class attributes a strategy declared its rules with before 0.2 (now `Strategy.refusal`).
_FLAGS = ("even_batch_policies", "skips_errors", "mixes", "packs", "replans", "compositions", "fixed_options")
_FLAG_REASONS = ("no_skip_reason", "fixed_reason")


def _adopt_flags(cls: type[Strategy]) -> None:
    """Give a strategy that declares the flags of 0.1 (``fixed_options = (...)``) a :meth:`refusal` that
    reads them, with a DeprecationWarning naming the new spelling; 0.3 removes this."""
    declared = {key: cls.__dict__[key] for key in _FLAGS + _FLAG_REASONS if key in cls.__dict__}
    if not declared or "refusal" in cls.__dict__:
        return
    warnings.warn(
        f"strategy {cls.__name__} declares {sorted(declared)}: since 0.2 a strategy says what it takes in "
        "`refusal(setting, value)` (see docs/how-to/own-strategy.md); the flags work until 0.3",
        DeprecationWarning,
        stacklevel=3,
    )
    flags = {key: getattr(cls, key) for key in _FLAGS + _FLAG_REASONS if hasattr(cls, key)}
    parent = cls.__mro__[1].refusal  # type: ignore[attr-defined]

    def refusal(owner: type[Strategy], setting: str, value: Any) -> str | None:
        if setting == "even_batches" and "even_batch_policies" in flags:
            allowed = tuple(flags["even_batch_policies"])
            return None if value in allowed else f"plans only {list(allowed)} batches"
        if setting == "on_error" and "skips_errors" in flags:
            skip = value == "raise" or flags["skips_errors"]
            return None if skip else flags.get("no_skip_reason") or "cannot fill the place of a skipped sample"
        if setting == "streams" and ("mixes" in flags or "compositions" in flags):
            if not flags.get("mixes", True):
                return _REFUSED[setting]
            compositions = tuple(flags.get("compositions", ("mixed",)))
            return None if value in compositions else f"plans only {list(compositions)} batches"
        flag = {"packing": "packs", "mixture_control": "replans"}.get(setting, "")
        if flag in flags:
            return None if flags[flag] else _REFUSED[setting]
        if "fixed_options" in flags and setting in LoaderOptions.__dataclass_fields__:
            return (flags.get("fixed_reason") or "does not use it") if setting in flags["fixed_options"] else None
        return parent.__func__(owner, setting, value)  # type: ignore[no-any-return]

    cls.refusal = classmethod(refusal)  # type: ignore[method-assign, assignment]


def strategies_where(which: Callable[[type[Strategy]], bool]) -> str:
    """``sharding='shard'`` (or several, joined by "or") for the registered strategies ``which`` picks."""
    return " or ".join(f"sharding={name!r}" for name, cls in _registry().items() if which(cls)) or "no strategy"


def strategies_taking(setting: str) -> list[type[Strategy]]:
    """The registered strategies whose constructor takes ``setting``."""
    return [cls for cls in _registry().values() if setting in inspect.signature(cls).parameters]


def strategy_names() -> tuple[str, ...]:
    """The registered strategies' names."""
    return tuple(_registry())


def get_strategy(strategy: str | Strategy, **settings: Any) -> Strategy:
    """The strategy of that name, built with its ``settings`` (an instance is returned as it is)."""
    if isinstance(strategy, Strategy):
        return strategy
    cls = _registry().get(strategy)
    if cls is None:
        raise ValueError(f"sharding={strategy!r} is not a strategy; choose one of {list(_registry())}")
    return cls(**settings)
