"""``LoadingEngine``: the training data of one fit, driven by plain calls, with no Lightning in sight.

It turns the arguments a user gives (a reader, a mixture, packed documents or a source; the loader
options; the strategy; the resume policy) into checked values, and at :meth:`LoadingEngine.setup`
lists the data, agrees with every rank on the plan, and makes the :class:`LedgerKeeper` that builds
the train loader of each epoch and keeps its ledger. Two adapters drive it, as the Trainer drives
Fabric: :class:`~lightning_sharding.ShardedDataModule` from the Trainer's hooks, and
:class:`~lightning_sharding.ShardedData` from a loop of your own (Fabric, or ``torchrun``).
"""

from __future__ import annotations

import contextlib
import gc
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
from torch.utils.data import default_collate

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.plan import EvenBatches
from lightning_sharding.core.skip import Skip, SkipError
from lightning_sharding.core.spelling import option
from lightning_sharding.core.world import DataParallel, World, check_data_parallel
from lightning_sharding.distributed.collectives import broadcast_object
from lightning_sharding.loading.agreement import agree
from lightning_sharding.loading.keeper import LedgerKeeper
from lightning_sharding.mixture import Decision, Phase, Stream, reader_of
from lightning_sharding.readers.base import Reader
from lightning_sharding.readers.files import indexing_yields
from lightning_sharding.readers.shared_index import collective
from lightning_sharding.readers.sources import Source
from lightning_sharding.strategies import Strategy, TrainLoader, get_strategy, strategy_names
from lightning_sharding.strategies._shared_memory import sweep_dead
from lightning_sharding.strategies._start import forkserver_importing, worker_context
from lightning_sharding.strategies.base import refusal_message, strategies_taking, strategies_where
from lightning_sharding.strategies.options import BatchTransform, LoaderOptions, OnError, Transform
from lightning_sharding.tokens import PackedReader, Packing

# Seeds ``broadcast(seed) -> seed`` share a drawn seed with: the Trainer's strategy, or torch.distributed.
Broadcast = Callable[[int], int]


class LoadingEngine:
    """The training (and evaluation) data of one fit, for an adapter to drive.

    Build it with :meth:`from_arguments` (the arguments of :class:`~lightning_sharding.ShardedDataModule`,
    which documents them), then :meth:`setup` on every rank at once, then :meth:`train_loader` for each
    epoch. ``owner`` is the name messages give the arguments' owner (``ShardedData(batch_size=0)``).
    """

    def __init__(
        self,
        *,
        owner: str,
        reader: Reader | None,
        source: Source | None,
        options: LoaderOptions,
        strategy: Strategy,
        seed: int | None,
        data_parallel: Any,
        allow_data_change: bool,
        allow_mixture_change: bool,
        root_map: Mapping[str, str],
        audit_dir: str | None,
        val_reader: Reader | None,
        test_reader: Reader | None,
        skip: Skip | None = None,
    ) -> None:
        self.owner = owner
        self.reader = reader
        self.source = source
        self.options = options
        self.strategy = strategy
        self.seed = seed  # drawn at setup when None
        self.seed_given = seed
        self.data_parallel = data_parallel
        self.allow_data_change = allow_data_change
        self.allow_mixture_change = allow_mixture_change
        self.root_map = dict(root_map)
        self.audit_dir = audit_dir
        self.skip = skip
        self.val_reader = val_reader
        self.test_reader = test_reader
        self.world = World()
        self.keeper: LedgerKeeper | None = None  # the ledger and the manifest it plans by, after setup
        self.data: Reader | Source | None = None  # what the train loaders read, after setup

    @classmethod
    def from_arguments(
        cls,
        owner: str,
        reader: Reader | None = None,
        *,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int | None = None,
        shuffle: bool = True,
        even_batches: EvenBatches | Literal["sync"] = "pad",
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        multiprocessing_context: str | None = None,
        timeout: float = 0,
        transform: Transform | None = None,
        batch_transform: BatchTransform | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        val_reader: Reader | None = None,
        test_reader: Reader | None = None,
        padding_key: str | None = "is_padding",
        allow_data_change: bool = False,
        allow_mixture_change: bool = False,
        root_map: Mapping[str, str] | None = None,
        audit_dir: str | None = None,
        on_error: OnError = "raise",
        sharding: str | Strategy | Mapping[str, Any] = "shard",
        source: Source | None = None,
        data_parallel: DataParallel | Callable[[Any], DataParallel] | None = None,
        streams: Sequence[Stream] | None = None,
        samples_per_epoch: int | None = None,
        batch_composition: str = "mixed",
        packing: Packing | None = None,
        schedule: Sequence[Phase | Mapping[str, Any]] | None = None,
        skip: str | Sequence[int] | Mapping[str, Any] | Skip | None = None,
        **renamed: Any,
    ) -> LoadingEngine:
        """The engine of these arguments, checked; each refusal names ``owner`` and the argument.

        These are the one definition of the arguments and their defaults; ``ShardedDataModule``'s
        signature repeats them for type checkers and documents them, and a test holds the two equal.
        ``renamed`` takes the spellings of 0.1 for one release, warned (:func:`renamed_arguments`).
        """
        keyword = "strategy" if "strategy" in renamed else "sharding"  # as the user spelled it, in messages
        sharding, root_map = renamed_arguments(owner, renamed, sharding, root_map)
        chosen = strategy_of(owner, sharding, renamed, keyword)
        if (chosen.takes == "source") != (source is not None):
            raise ValueError(
                f"`{owner}(sharding={chosen.name!r})`: `source=` goes with "
                f"{strategies_where(lambda s: s.takes == 'source')} and only with it"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"`{owner}(seed={seed!r})` must be a non-negative integer or None")
        options = LoaderOptions(
            batch_size=batch_size,
            num_workers=num_workers,
            shuffle=shuffle,
            even_batches=even_batches,
            transform=transform,
            batch_transform=batch_transform,
            collate_fn=collate_fn or default_collate,
            padding_key=padding_key,
            on_error=on_error,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            pin_memory=pin_memory,
            multiprocessing_context=multiprocessing_context,
            timeout=timeout,
        ).check(owner)
        if not chosen.shuffles:  # e.g. a source, read in its own order
            options = options.replace(shuffle=False)
        chosen.check(options, owner=owner)
        if packing is not None and streams is not None:  # every stream packed the same way
            streams = [packed_stream(s, packing, chosen, options, owner) for s in streams]
        data = reader_of(reader, streams, samples_per_epoch, owner, batch_composition, batch_size, schedule)
        if packing is not None and streams is None:
            data = packed(data, packing, chosen, options, owner)
        if data is not None:  # wrong data for the strategy is refused now, not at setup
            chosen.check_data(data, owner)
        if data_parallel is not None and not callable(data_parallel):
            check_data_parallel(data_parallel, None, f"`{owner}(data_parallel={data_parallel!r})`")
        try:
            skipped = Skip.of(skip)
        except SkipError as err:
            raise ValueError(f"`{owner}(skip={skip!r})`: {str(err).removeprefix('skip= ')}") from None
        reason = chosen.refusal("skip_steps", num_workers) if skipped is not None and skipped.steps else None
        if reason is not None:
            message = refusal_message(chosen, "skip_steps", num_workers, reason)
            samples = option("skip", {"samples": "FIRST-LAST"})
            raise ValueError(f"`{owner}(skip={skip!r})`: {message}, or name samples ({samples})")
        if skipped is not None and chosen.takes == "source":
            raise ValueError(
                f"`{owner}(skip={skip!r})`: sharding={chosen.name!r} deals a source's samples as they come, "
                "which no plan names: skip= goes with the strategies that read a reader"
            )
        return cls(
            owner=owner,
            reader=data,
            source=source,
            options=options,
            strategy=chosen,
            seed=seed,
            data_parallel=data_parallel,
            allow_data_change=allow_data_change,
            allow_mixture_change=allow_mixture_change,
            root_map=root_map or {},
            audit_dir=audit_dir,
            val_reader=val_reader,
            test_reader=test_reader,
            skip=skipped,
        )

    @property
    def manifest(self) -> Manifest | None:
        """The training manifest as the ledger plans by it now (after :meth:`setup`): a mixture changed on
        resume or a controller's decisions change its epochs' orders."""
        return self.keeper.manifest if self.keeper is not None else None

    @property
    def ledger(self) -> Ledger | None:
        """The training ledger (after :meth:`setup`)."""
        return self.keeper.ledger if self.keeper is not None else None

    @property
    def train_loader(self) -> TrainLoader | None:
        """The train loader built last."""
        return self.keeper.train_loader if self.keeper is not None else None

    def setup(self, data: Reader | Source, world: World, broadcast: Broadcast | None = None) -> LedgerKeeper:
        """List ``data``, agree with every rank of ``world`` on the plan and make the ledger (a collective
        call: every rank at once). A drawn seed is shared by ``broadcast`` (default: ``torch.distributed``)."""
        self.world = world
        # What a run killed by SIGKILL left in /dev/shm (batch slots, shared arrays) goes at every fit,
        # with or without workers: a pool sweeps only when it is made, and a resume may make none.
        sweep_dead()
        self.strategy.check(self.options, data, owner=self.owner)
        self.data = data
        if self.options.num_workers > 0 and self.strategy.refusal("multiprocessing_context", "forkserver") is None:
            # The forkserver (the default start method) imports while the ranks list, plan and restore.
            options = self.options
            used = (self.strategy, data, options.transform, options.batch_transform, options.collate_fn)
            worker_context(options.multiprocessing_context, *used)
        # Local files are indexed leaving a core to the forkserver's imports, which the workers wait on.
        with older_objects_frozen(), indexing_yields(forkserver_importing()):
            with collective(self.world):  # the leaders list and index, the other ranks receive the items
                manifest = self.strategy.manifest(data, self.options.batch_size)
            seed = self._shared_seed(broadcast)
            self.world = agree(self.world, manifest, seed, self.options)
            ledger = Ledger(seed=seed, total=manifest.total, manifest=manifest.summary())
        keep: dict[str, Any] = dict(seed_given=self.seed_given, audit_dir=self.audit_dir)
        keep.update(allow_data_change=self.allow_data_change, allow_mixture_change=self.allow_mixture_change)
        keep.update(root_map=self.root_map, skip=self.skip)
        self.keeper = LedgerKeeper(ledger, manifest, self.world, self.options, **keep)
        return self.keeper

    def start_control(self, decisions: list[Decision] | None) -> None:
        """Put the mixture's epochs under online control, from ``decisions`` to replay (after :meth:`setup`)."""
        reason = self.strategy.refusal("mixture_control", True)
        if reason is not None:
            raise ValueError(f"a MixtureController: {refusal_message(self.strategy, 'mixture_control', True, reason)}")
        self._keeper().start_control(decisions)

    def _shared_seed(self, broadcast: Broadcast | None) -> int:
        if self.seed is not None:
            return self.seed
        seed = int(np.random.SeedSequence().generate_state(1, dtype=np.uint32)[0])
        if self.world.world_size > 1:
            seed = int(broadcast(seed) if broadcast is not None else broadcast_object(seed, self.world.world_size))
        self.seed = seed
        return seed

    def _keeper(self) -> LedgerKeeper:
        if self.keeper is None or self.data is None:
            raise RuntimeError(
                f"{self.owner}.train_dataloader() was called before setup('fit'). "
                "If your subclass overrides setup(), call super().setup(stage) in it."
            )
        return self.keeper

    def build_train_loader(self, epoch: int | None = None) -> TrainLoader:
        """This rank's loader of ``epoch`` (default: the ledger's), replacing the one built before; it
        yields the same number of batches on every rank."""
        keeper = self._keeper()
        if epoch is not None:
            keeper.start_epoch(epoch)
        self.seed = keeper.ledger.seed  # a restored checkpoint's seed
        keeper.options = self.options  # the batch-size finder may have changed them
        self.strategy.release(keeper.train_loader)
        keeper.train_loader = self.strategy.build(
            self.data, keeper.manifest, keeper.ledger, self.world, self.options, track=True
        )
        return keeper.train_loader

    def forget_train_loader(self) -> None:
        """Release the train loader built on a ledger that was just replaced (a loaded state)."""
        keeper = self._keeper()
        self.seed = keeper.ledger.seed
        self.strategy.release(keeper.train_loader)
        keeper.train_loader = None

    def eval_loader(self, reader: Reader, world: World) -> Any:
        """A loader of ``reader`` on this rank of ``world``: sharded like training, never shuffled, padding
        flagged (dropping would silently skip samples of every evaluation)."""
        self.world = world
        with collective(world):
            manifest = Manifest.from_items(reader.items())
        seed = self.ledger.seed if self.ledger is not None else self.seed or 0
        ledger = Ledger(seed=seed, total=manifest.total, manifest=manifest.summary())
        return self.strategy.build_eval(reader, manifest, ledger, world, self.options)

    def close(self) -> None:
        """Release what the train loader holds outside Python: shared memory, helper processes."""
        if self.train_loader is not None:
            self.train_loader.close()


# Arguments of 0.1 that 0.2 renamed (still taken for one release, warned): old name -> new name.
RENAMED = {"strategy": "sharding", "data_root_map": "root_map"}
# Arguments of 0.1 that became settings of the strategies that use them (ShardStrategy(transport=...)).
STRATEGY_SETTINGS = ("transport", "prefetch_items")


def renamed_arguments(
    owner: str, renamed: dict[str, Any], sharding: Any, root_map: Mapping[str, str] | None
) -> tuple[Any, Mapping[str, str] | None]:
    """``sharding`` and ``root_map`` as given under their names of 0.1 (warned once each); refuses an
    argument no release had, and the same argument under both names."""
    unknown = [key for key in renamed if key not in RENAMED and key not in STRATEGY_SETTINGS]
    if "name" in unknown:
        raise TypeError(
            f"{owner}() got an unexpected keyword argument 'name': a Hydra `sharding` config (its `name` and "
            "settings) goes in whole, as sharding=sharding, not as **sharding"
        )
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    given: dict[str, Any] = {"sharding": sharding, "root_map": root_map}
    defaults = {"sharding": "shard", "root_map": None}
    for old, new in RENAMED.items():
        if old not in renamed:
            continue
        if given[new] != defaults[new]:
            raise TypeError(f"`{owner}({old}=..., {new}=...)`: {old}= is the old name of {new}=; give {new}= alone")
        warnings.warn(
            f"`{owner}({old}=...)` is `{owner}({new}=...)` since lightning_sharding 0.2; the old name goes away "
            "in the next release",
            DeprecationWarning,
            stacklevel=4,
        )
        given[new] = renamed.pop(old)
    return given["sharding"], given["root_map"]


def strategy_of(
    owner: str, sharding: str | Strategy | Mapping[str, Any], settings: dict[str, Any], keyword: str = "sharding"
) -> Strategy:
    """The strategy ``sharding`` names (or is, or configures: Hydra's ``{"name": ..., **settings}``),
    with the strategy ``settings`` 0.1 took as arguments of ``owner`` (warned); a setting the strategy
    does not take is refused, naming those that do."""
    if isinstance(sharding, Mapping):  # the `sharding` group of a Hydra config: its name and settings
        config = dict(sharding)
        if not isinstance(config.get("name"), str):
            raise ValueError(f"`{owner}(sharding={config!r})`: a strategy's config needs its `name` (shard, ...)")
        sharding = config.pop("name")
        if sharding in strategy_names():
            given = f"`{owner}(sharding={dict(name=sharding, **config)!r})`"
            for key in config:
                takers = strategies_taking(key)
                if all(cls.name != sharding for cls in takers):
                    where = " or ".join(f"sharding.name={cls.name}" for cls in takers) or "no strategy"
                    raise ValueError(f"{given}: {key!r} is a setting of {where}, not of strategy {sharding!r}")
            try:
                return get_strategy(sharding, **config)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{given}: {err}") from None
    if not isinstance(sharding, Strategy) and sharding not in strategy_names():
        raise ValueError(f"`{owner}({keyword}={sharding!r})` is not a strategy; choose one of {list(strategy_names())}")
    if not settings:
        return get_strategy(sharding)
    spelled = ", ".join(f"{key}={value!r}" for key, value in settings.items())
    for key in settings:
        takers = strategies_taking(key)
        name = sharding.name if isinstance(sharding, Strategy) else sharding
        if all(cls.name != name for cls in takers):
            where = " or ".join(f"{cls.__name__}({key}=...)" for cls in takers)
            raise ValueError(f"`{owner}({key}=...)` is a setting of {where}, not of strategy {name!r}")
    if isinstance(sharding, Strategy):
        raise ValueError(
            f"`{owner}({spelled})` with sharding={sharding!r}: give the setting to the strategy, "
            f"{type(sharding).__name__}({spelled})"
        )
    chosen = get_strategy(sharding, **settings)
    warnings.warn(
        f"`{owner}({spelled})` is a setting of the strategy since lightning_sharding 0.2: pass "
        f"`sharding={chosen!r}` (the old spelling goes away in the next release)",
        DeprecationWarning,
        stacklevel=4,
    )
    return chosen


def packed_stream(stream: Stream, packing: Packing, strategy: Strategy, options: LoaderOptions, owner: str) -> Stream:
    """``stream`` with its reader packed by ``packing``."""
    return replace(stream, reader=packed(stream.reader, packing, strategy, options, owner))


def packed(
    reader: Reader | None,
    packing: Packing,
    strategy: Strategy,
    options: LoaderOptions,
    owner: str,
) -> PackedReader:
    """``reader``'s documents packed by ``packing``; what cannot go with packing is refused, named."""
    if options.transform is not None or options.collate_fn is not default_collate:
        raise ValueError(
            f"`{owner}(packing=...)` builds whole batches of sequences: transform= and collate_fn= do not "
            "apply; use batch_transform= to change a batch"
        )
    if options.on_error != "raise":
        raise ValueError(f"`{owner}(packing=..., on_error={options.on_error!r})`: packed batches are never skipped")
    if reader is None:
        raise TypeError(f"`{owner}(packing=...)` packs the documents of reader=...: give one")
    packed_reader = PackedReader(reader, packing)  # type: ignore[arg-type]  # refused there unless a DocumentReader
    strategy.check_data(packed_reader, owner)  # a strategy that does not read packed sequences refuses it
    return packed_reader


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """The garbage collector's full collections in the block skip the objects made before it
    (:func:`gc.freeze`, undone after). In a process that imported Lightning they are about a million,
    and listing and indexing 10,000 files sets off a full collection or two that walk them all: 0.2 s
    of a 1.3 s setup (docs/performance.md). Nothing is frozen when the collector is off, or when some
    objects are frozen already (the user's, kept so), nor without the interpreter's lock, where each
    of these calls stops every thread to walk the whole heap."""
    if not gc.isenabled() or sysconfig.get_config_var("Py_GIL_DISABLED") or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
