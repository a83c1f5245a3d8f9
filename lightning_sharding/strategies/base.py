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

import importlib
import inspect
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


class Strategy(ABC):
    """How one rank reads: the rules of a strategy and the builder of its loaders.

    Class attributes: ``name`` (the registry key), ``takes`` (``"reader"``, ``"windows"`` for a
    :class:`~lightning_sharding.readers.windows.WindowedReader`, or ``"source"`` for a
    :class:`~lightning_sharding.readers.sources.Source`), ``even_batch_policies``, ``skips_errors`` (whether
    ``on_error="skip"`` works), ``worker_layout`` (how a rank's batches go to its workers),
    ``shuffles`` (whether ``shuffle`` applies), ``mixes`` (whether it reads a mixture of
    ``streams``: it plans by the manifest's order), ``compositions`` (the mixture batch compositions
    it plans), ``packs`` (whether its workers build batches of packed sequences, from a reader
    that :attr:`~lightning_sharding.readers.base.Reader.reads_sequences`), ``replans`` (whether its
    loader plans the rest of a pass again when a mixture decision changes the order), ``fixed_options`` (loader
    options that do not apply) and the reasons said when an option or ``on_error="skip"`` is refused.

    What only this strategy uses is a setting of its own, an argument of its constructor
    (``ShardStrategy(transport="torch")``), returned by :meth:`settings`; a name picks the strategy with
    its defaults (``sharding="shard"``).
    """

    name: ClassVar[str]
    takes: ClassVar[Takes] = "reader"
    even_batch_policies: ClassVar[tuple[str, ...]] = ("pad", "drop")
    skips_errors: ClassVar[bool] = False
    worker_layout: ClassVar[WorkerLayout] = "runs"
    shuffles: ClassVar[bool] = True
    mixes: ClassVar[bool] = False
    packs: ClassVar[bool] = False
    replans: ClassVar[bool] = False  # its loader can plan a pass again mid-way (a MixtureController's decision)
    compositions: ClassVar[tuple[str, ...]] = ("mixed",)
    fixed_options: ClassVar[tuple[str, ...]] = ("batch_transform",)  # a strategy that runs it says so
    no_skip_reason: ClassVar[str] = ""
    fixed_reason: ClassVar[str] = ""

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

    def check(self, options: LoaderOptions, data: object = None, owner: str = "ShardedDataModule") -> None:
        """Raise a ValueError or TypeError naming ``owner``'s argument at fault: a policy or option this
        strategy does not support, or data of the wrong kind (``data`` None is not checked)."""
        if options.even_batches not in self.even_batch_policies:
            raise ValueError(
                f"`{owner}(even_batches={options.even_batches!r})` must be one of {list(self.even_batch_policies)}"
            )
        if options.on_error == "skip" and not self.skips_errors:
            skippers = strategies_where(lambda s: s.skips_errors)
            reason = f": {self.no_skip_reason}" if self.no_skip_reason else ""
            raise ValueError(f"`{owner}(on_error='skip')` works with {skippers} only, not {self.name!r}{reason}")
        default = LoaderOptions()
        for key in self.fixed_options:
            if getattr(options, key) != getattr(default, key):
                reason = self.fixed_reason or f"strategy {self.name!r} does not use it"
                raise ValueError(f"`{owner}({key}={getattr(options, key)!r})` does not apply: {reason}")
        if data is not None:
            self.check_data(data, owner)

    def check_data(self, data: object, owner: str) -> None:
        """Raise a TypeError when ``data`` is not what this strategy ``takes``."""
        from lightning_sharding.readers.base import Reader
        from lightning_sharding.readers.sources import Source
        from lightning_sharding.readers.windows import WindowedReader

        wanted: type = {"reader": Reader, "windows": WindowedReader, "source": Source}[self.takes]
        from lightning_sharding.mixture import MixtureReader

        if isinstance(data, MixtureReader) and not self.mixes:
            raise ValueError(
                f"`{owner}(streams=...)`: strategy {self.name!r} does not read a mixture of streams; "
                f"use {strategies_where(lambda s: s.mixes)}"
            )
        if getattr(data, "reads_sequences", False) and not self.packs:
            raise ValueError(
                f"`{owner}(packing=...)`: strategy {self.name!r} does not read packed sequences; "
                f"use {strategies_where(lambda s: s.packs)}"
            )
        composition = getattr(data, "composition", "mixed")
        if isinstance(data, MixtureReader) and composition not in self.compositions:
            raise ValueError(
                f"`{owner}(batch_composition={composition!r})`: strategy {self.name!r} plans only "
                f"{list(self.compositions)} batches; use {strategies_where(lambda s: composition in s.compositions)}"
            )
        if not isinstance(data, wanted):
            example = {"reader": "", "windows": " (such as NpyWindows)", "source": " (such as SqliteSource)"}
            argument = "source" if self.takes == "source" else "reader"
            raise TypeError(
                f"`{owner}({argument}=...)`: strategy {self.name!r} needs a {wanted.__name__}{example[self.takes]}, "
                f"got {type(data).__name__}"
            )

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
