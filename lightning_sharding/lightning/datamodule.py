"""``ShardedDataModule``: the LightningDataModule users subclass or configure, an adapter over the engine.

The loading itself (the arguments, the listing, the plan, the ledger, the loaders) is the
Lightning-free :class:`~lightning_sharding.loading.engine.LoadingEngine`. This module drives it from
the Trainer's hooks: it takes the topology from the trainer at ``setup()``, builds the train loader
for the epoch Lightning's loops are about to run (on a restart: :func:`epoch_lightning_runs_next`),
and adds the
:class:`~lightning_sharding.lightning.callbacks.ShardingCallback` that keeps the ledger in step with
training and in the checkpoint.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.plan import EvenBatches
from lightning_sharding.core.skip import Skip
from lightning_sharding.core.world import DataParallel, World
from lightning_sharding.lightning.callbacks import ShardingCallback
from lightning_sharding.lightning.controller import controllers_of
from lightning_sharding.loading.engine import LoadingEngine, strategy_of
from lightning_sharding.loading.keeper import LedgerKeeper
from lightning_sharding.mixture import Phase, Stream
from lightning_sharding.readers.base import Reader
from lightning_sharding.readers.sources import Source
from lightning_sharding.strategies import Strategy, TrainLoader
from lightning_sharding.strategies.options import BatchTransform, LoaderOptions, OnError, OptionAttribute, Transform
from lightning_sharding.tokens import Packing

T = TypeVar("T")
# The engine's arguments, the one definition of them (``owner`` is the DataModule's class name).
_ENGINE_ARGUMENTS = frozenset(inspect.signature(LoadingEngine.from_arguments).parameters) - {"owner", "renamed"}


class _EngineAttribute(Generic[T]):
    """``dm.<name>`` is ``dm.engine.<attribute>``: one home for the state, two ways in."""

    def __init__(self, attribute: str, *, writable: bool = True) -> None:
        self.attribute = attribute
        self.writable = writable

    def __get__(self, obj: Any, objtype: type | None = None) -> T:
        if obj is None:
            return self  # type: ignore[return-value]  # the class's attribute: the descriptor itself
        return getattr(obj._engine, self.attribute)  # type: ignore[no-any-return]

    def __set__(self, obj: Any, value: Any) -> None:
        if not self.writable:
            raise AttributeError(f"{type(obj).__name__}.{self.attribute} is read-only")
        setattr(obj._engine, self.attribute, value)


class _StrategyAttribute(_EngineAttribute[Strategy]):
    """``dm.strategy``: set as ``sharding=`` is given (a name, a Strategy or its config), and checked."""

    def __set__(self, obj: Any, value: Any) -> None:
        owner = type(obj).__name__
        strategy = strategy_of(owner, value, {})
        strategy.check(obj._engine.options, owner=owner)
        obj._engine.strategy = strategy


class ShardedDataModule(pl.LightningDataModule):
    """Exactly-once, two-level sharded data for Lightning.

    Ranks take contiguous runs of the epoch order; each rank's workers take runs of its batches.
    Every sample is served once per epoch, also after a mid-epoch resume on another number of ranks
    or workers, because the checkpoint holds a topology-free ledger of consumed samples.

    Give it a :class:`~lightning_sharding.readers.Reader` (or override :meth:`make_reader`), and
    optionally a per-sample ``transform(sample, ctx)`` run inside workers. Validation and test
    readers are sharded the same way without a ledger; batches that are dicts carry a boolean
    ``padding_key`` entry so metrics can leave padding out.

    Args:
        reader: the training data.
        batch_size: samples per batch on each rank.
        num_workers: DataLoader worker processes per rank (0 loads in the training process).
        seed: the shuffle seed shared by all ranks; ``None`` draws one on rank 0 and broadcasts it.
        shuffle: permute items and samples every epoch.
        even_batches: ``"pad"`` repeats at most one flagged sample per rank, ``"drop"`` leaves at
            most one sample per rank unserved (reported); either way every rank yields the same
            number of batches, so DDP never hangs at an epoch's end.
        persistent_workers, prefetch_factor, pin_memory, timeout: passed to the DataLoader.
        multiprocessing_context: how workers start: ``None`` (the default) is, on Linux, a forkserver
            with torch, the package and the reader's modules imported once (``"fork"`` in a notebook,
            ``"spawn"`` on macOS); or ``"forkserver"``, ``"spawn"``, ``"fork"``. docs/performance.md.
        transform, batch_transform: ``transform(sample, SampleContext) -> sample`` per sample and
            ``batch_transform(batch, BatchContext) -> batch`` per batch (vectorised), run in the worker.
        collate_fn: turns a list of samples into a batch (PyTorch's default collate).
        val_reader, test_reader: evaluation data, sharded without a ledger and never shuffled.
        padding_key: the key of the padding flags added to dict batches; ``None`` adds none.
        allow_data_change: resume when the data changed (the epoch restarts, warned) instead of failing.
        allow_mixture_change: resume a checkpoint of other shares or streams: what it consumed
            stays consumed, the rest of its epoch is drawn at the new shares.
        root_map: ``{old prefix: new prefix}`` for a checkpoint of lightning_sharding 0.1, which
            knew items by path, resumed on data that moved (later checkpoints know items by their
            name under the data's root and their content, and resume on moved data without it).
        audit_dir: when set, every rank writes the positions its completed steps consumed there,
            for ``lightning-sharding audit`` to check exactly-once across runs and resumes.
        on_error: ``"raise"`` stops at the first sample that cannot be read or transformed, naming
            it; ``"skip"`` leaves it out, counted (in the summary), and pads its place in the batch
            (flagged). Storage outages are never skipped.
        sharding: how each rank reads its share, a strategy by name (with its default settings) or
            object: ``"shard"`` or ``ShardStrategy(transport=...)`` (each worker reads its own items),
            ``"broadcast"`` or ``BroadcastStrategy(prefetch_items=...)`` (a rank loads an item once into
            shared memory, its workers crop windows from it; needs a ``WindowedReader``), ``"dispatch"``
            (one process per rank reads the non-replicable ``source`` and deals batches to the
            workers), or ``DaliStrategy(graph, ...)``; see :mod:`lightning_sharding.strategies`. A
            Hydra ``sharding`` config (``{"name": "shard", "transport": "torch"}``) is taken whole.
        source: the :class:`~lightning_sharding.readers.sources.Source` of ``sharding="dispatch"``; a
            source of unknown length needs ``even_batches="sync"``.
        streams, samples_per_epoch, batch_composition: a mixture of readers at chosen shares instead
            of ``reader`` (see :class:`~lightning_sharding.mixture.streams.Stream`), the samples of an epoch, and
            ``"mixed"``, ``"stratified"`` or ``"per_stream"`` batches (see the README's "Mixtures").
        schedule: a share schedule for ``streams``: :class:`~lightning_sharding.mixture.schedule.Phase`
            objects (or ``{"start", "shares"}`` mappings), each from a fraction of the epoch on with
            its own shares, so an epoch can end with an annealing phase (see
            :mod:`~lightning_sharding.mixture.schedule`). Batch composition ``"mixed"``.
        data_parallel: ``(rank, size)`` of this rank's model replica among all replicas, or a
            function of the trainer returning it, for meshes Lightning cannot see. By default the
            strategy's ``distributed_sampler_kwargs``: every rank under DDP/FSDP, the data-parallel
            dimension under ``ModelParallelStrategy``. Ranks of one replica read the same batches.
        packing: :class:`~lightning_sharding.tokens.packing.Packing` (``seq_len``, ``mode``): the
            ``reader``'s tokenized documents (a :class:`~lightning_sharding.tokens.documents.DocumentReader`)
            packed into sequences of ``seq_len`` tokens; the ledger counts sequences and a batch holds
            ``input_ids``, ``labels``, ``position_ids``, ``document_ids``, ``cu_seqlens`` and
            ``max_seqlen``, or those of ``Packing(fields=...)`` (see :mod:`lightning_sharding.tokens.batch`).
            Strategy ``shard``.
        skip: what a resume leaves out, for a checkpoint written before a loss spike: global steps
            (``"81200-81400,81500"``, both ends included, or a list of steps), replayed from the
            checkpoint's history as the run that wrote it went on to train them (``{"steps": ...,
            "checkpoint": PATH}``: as a later checkpoint's history says, for steps trained after
            another resume), or samples (``{"samples": "1200-1299", "epoch": E}``: epoch positions, as
            ``lightning-sharding inspect --step`` prints them; the checkpoint's epoch by default), or of
            packed sequences the sequences holding a token of a document (``{"documents": "287"}``). They
            are recorded as skipped in the ledger, never trained nor served again in their epoch, and
            shown in the summary, ``inspect`` and the audit. A checkpoint that applied a skip records it,
            so a requeue with the same ``skip=`` applies it once. See docs/how-to/pretraining.md.
        **renamed: the spellings of 0.1 for one release, with a ``DeprecationWarning`` naming the new
            one: ``strategy=`` (now ``sharding=``), ``data_root_map=`` (``root_map=``), ``transport=``
            and ``prefetch_items=`` (settings of the strategy: ``sharding=ShardStrategy(transport=...)``).
    """

    def __init__(
        self,
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
        data_parallel: DataParallel | Callable[[pl.Trainer], DataParallel] | None = None,
        streams: Sequence[Stream] | None = None,
        samples_per_epoch: int | None = None,
        batch_composition: str = "mixed",
        packing: Packing | None = None,
        schedule: Sequence[Phase | Mapping[str, Any]] | None = None,
        skip: str | Sequence[int] | Mapping[str, Any] | Skip | None = None,
        **renamed: Any,
    ) -> None:
        # Every argument goes to the engine by its name: the signature above repeats the engine's for
        # type checkers, IDEs and LightningCLI (tests/unit/test_datamodule.py holds the two equal).
        arguments = {name: value for name, value in locals().items() if name in _ENGINE_ARGUMENTS}
        super().__init__()
        self._engine = LoadingEngine.from_arguments(type(self).__name__, **arguments, **renamed)

    @property
    def engine(self) -> LoadingEngine:
        """The Lightning-free loading engine this DataModule drives from the Trainer's hooks."""
        return self._engine

    # What users and callbacks read (and the batch-size finder and ShardedData's resume set) lives on the engine.
    options: _EngineAttribute[LoaderOptions] = _EngineAttribute("options")
    strategy: _StrategyAttribute = _StrategyAttribute("strategy")
    seed: _EngineAttribute[int | None] = _EngineAttribute("seed")
    world: _EngineAttribute[World] = _EngineAttribute("world")
    source: _EngineAttribute[Source | None] = _EngineAttribute("source")
    data_parallel: _EngineAttribute[Any] = _EngineAttribute("data_parallel")
    allow_data_change: _EngineAttribute[bool] = _EngineAttribute("allow_data_change")
    allow_mixture_change: _EngineAttribute[bool] = _EngineAttribute("allow_mixture_change")
    root_map: _EngineAttribute[dict[str, str]] = _EngineAttribute("root_map")
    data_root_map: _EngineAttribute[dict[str, str]] = _EngineAttribute("root_map")  # its name in 0.1
    audit_dir: _EngineAttribute[str | None] = _EngineAttribute("audit_dir")
    skip: _EngineAttribute[Skip | None] = _EngineAttribute("skip", writable=False)
    ledger_keeper: _EngineAttribute[LedgerKeeper | None] = _EngineAttribute("keeper")
    manifest: _EngineAttribute[Manifest | None] = _EngineAttribute("manifest", writable=False)
    ledger: _EngineAttribute[Ledger | None] = _EngineAttribute("ledger", writable=False)
    train_loader: _EngineAttribute[TrainLoader | None] = _EngineAttribute("train_loader", writable=False)

    def make_reader(self) -> Reader:
        """The training reader; override it to build the reader from your own arguments."""
        if self._engine.reader is None:
            raise TypeError(f"{type(self).__name__} has no reader: pass `reader=...` or override `make_reader()`")
        return self._engine.reader

    @override
    def setup(self, stage: str) -> None:
        """Read the topology; to fit, build the reader, manifest (agreed by all ranks), ledger, callback."""
        trainer = self.trainer
        world = World.from_trainer(trainer, self.data_parallel) if trainer is not None else self.world
        self.world = world
        if stage != "fit":
            return
        data = self.source if self.source is not None else self.make_reader()
        broadcast = (lambda seed: trainer.strategy.broadcast(seed, src=0)) if trainer is not None else None
        self._engine.setup(data, world, broadcast)
        if trainer is not None:
            _ensure_callback(trainer)
            controllers = controllers_of(trainer)
            if len(controllers) > 1:
                raise ValueError(f"the trainer has {len(controllers)} MixtureControllers; give it one")
            if controllers:  # the mixture's epochs under online control, from any decisions to replay
                self._engine.start_control(controllers[0].replay)

    @override
    def train_dataloader(self) -> TrainLoader:
        """This rank's training loader; it yields the same number of batches on every rank."""
        epoch = epoch_lightning_runs_next(self.trainer) if self.trainer is not None else None
        return self._engine.build_train_loader(epoch)

    @override
    def teardown(self, stage: str) -> None:
        """Release what the train loader holds outside Python: shared memory, helper processes."""
        if stage == "fit":
            self._engine.close()

    # Exposed as properties so that Lightning sees an evaluation loader only when a reader was given
    # (it checks whether the method is overridden); a subclass may still define its own method.
    @property
    def val_dataloader(self) -> Callable[[], Any]:
        """The validation loader: sharded like training, never shuffled, padding flagged."""
        if self._engine.val_reader is None:
            return super().val_dataloader
        return lambda: self._eval_loader(self._engine.val_reader)

    @property
    def test_dataloader(self) -> Callable[[], Any]:
        """The test loader: sharded like training, never shuffled, padding flagged."""
        if self._engine.test_reader is None:
            return super().test_dataloader
        return lambda: self._eval_loader(self._engine.test_reader)

    def _eval_loader(self, reader: Reader | None) -> Iterable[Any]:
        assert reader is not None
        world = World.from_trainer(self.trainer, self.data_parallel) if self.trainer is not None else self.world
        loader: Iterable[Any] = self._engine.eval_loader(reader, world)
        return loader


# Every loader option is an attribute too: ``dm.batch_size`` reads ``dm.options``; setting it checks again.
for _name in LoaderOptions.names():
    setattr(ShardedDataModule, _name, OptionAttribute(_name))


def _ensure_callback(trainer: pl.Trainer) -> None:
    """Add ShardingCallback unless present, before any checkpoint callback so that a step is
    accounted before a checkpoint taken at the same step is written."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    if any(isinstance(cb, ShardingCallback) for cb in callbacks):
        return
    first_checkpoint = next((i for i, cb in enumerate(callbacks) if isinstance(cb, Checkpoint)), len(callbacks))
    callbacks.insert(first_checkpoint, ShardingCallback())


def epoch_lightning_runs_next(trainer: pl.Trainer) -> int:
    """The epoch the iterator created now will serve.

    Lightning creates (and prefetches from) the train iterator in ``setup_data``, before its loops'
    ``reset()`` decides how a restart goes and before it calls ``set_epoch``. A checkpoint written
    in ``on_train_batch_end`` of an epoch's last batch restarts into the next epoch without another
    iterator, so the ledger must already be on that epoch; one written later on the same batch (at
    validation end, say) finishes the saved epoch first, with this iterator. The restart stage is
    computed here from the restored counters exactly as ``FitLoop.reset()`` will compute it.
    """
    fit_loop = trainer.fit_loop
    epoch = int(getattr(fit_loop.epoch_progress.current, "processed", trainer.current_epoch))
    if not fit_loop.restarting:
        return epoch
    fit_loop.update_restart_stage()  # reads the counters only; FitLoop.reset() computes it again
    epoch_loop = fit_loop.epoch_loop
    on_last_batch_end = epoch_loop.restarted_on_train_batch_end and epoch_loop.batch_progress.is_last_batch
    if on_last_batch_end and fit_loop.restarted_mid_epoch:
        epoch += 1  # FitLoop.reset() counts the saved epoch as processed
    return epoch
