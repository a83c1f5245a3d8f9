"""``ShardedDataModule``: the LightningDataModule users subclass or configure.

It takes the topology from the trainer at ``setup()``, owns the manifest and the ledger, builds
the sharded loaders (on a restart, for the epoch Lightning's loops are about to run:
:func:`epoch_lightning_runs_next`), and adds the
:class:`~lightning_sharding.lightning.callbacks.ShardingCallback` that keeps the ledger in step with
training and in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Checkpoint
from torch.utils.data import default_collate
from typing_extensions import override

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.plan import EvenBatches
from lightning_sharding.core.world import DataParallel, World, check_data_parallel
from lightning_sharding.distributed.agreement import agree
from lightning_sharding.distributed.collectives import broadcast_object
from lightning_sharding.lightning.callbacks import ShardingCallback
from lightning_sharding.lightning.controller import controllers_of
from lightning_sharding.lightning.keeper import LedgerKeeper
from lightning_sharding.mixture import Phase, Stream, reader_of
from lightning_sharding.readers.base import Reader
from lightning_sharding.readers.shared_index import collective
from lightning_sharding.readers.sources import Source
from lightning_sharding.strategies import Strategy, TrainLoader, get_strategy, strategy_names
from lightning_sharding.strategies._shared_memory import sweep_dead
from lightning_sharding.strategies._start import worker_context
from lightning_sharding.strategies.base import strategies_where
from lightning_sharding.strategies.options import BatchTransform, LoaderOptions, OnError, OptionAttribute, Transform
from lightning_sharding.tokens import PackedReader, Packing


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
        transport: how workers hand batches to training: ``"pool"`` (reusable shared-memory slots,
            one copy per batch) or ``"torch"`` (PyTorch's own path); see the README's "Performance".
        transform, batch_transform: ``transform(sample, SampleContext) -> sample`` per sample and
            ``batch_transform(batch, BatchContext) -> batch`` per batch (vectorised), run in the worker.
        collate_fn: turns a list of samples into a batch (PyTorch's default collate).
        val_reader, test_reader: evaluation data, sharded without a ledger and never shuffled.
        padding_key: the key of the padding flags added to dict batches; ``None`` adds none.
        allow_data_change: resume when the data changed (the epoch restarts, warned) instead of failing.
        allow_mixture_change: resume a checkpoint of other shares or streams: what it consumed
            stays consumed, the rest of its epoch is drawn at the new shares.
        data_root_map: ``{old prefix: new prefix}`` for a checkpoint of lightning_sharding 0.1, which
            knew items by path, resumed on data that moved (later checkpoints know items by their
            name under the data's root and their content, and resume on moved data without it).
        audit_dir: when set, every rank writes the positions its completed steps consumed there,
            for ``lightning-sharding audit`` to check exactly-once across runs and resumes.
        on_error: ``"raise"`` stops at the first sample that cannot be read or transformed, naming
            it; ``"skip"`` leaves it out, counted (in the summary), and pads its place in the batch
            (flagged). Storage outages are never skipped.
        strategy: ``"shard"`` (each worker reads its own items), ``"broadcast"`` (a rank loads an
            item once into shared memory, its workers crop windows from it; needs a ``WindowedReader``)
            or ``"dispatch"`` (one process per rank reads the non-replicable ``source`` and deals
            batches to the workers; see :mod:`lightning_sharding.strategies.dispatch`).
        prefetch_items: with ``broadcast``, how many items each rank loads ahead of the current one.
        source: the :class:`~lightning_sharding.readers.sources.Source` of ``strategy="dispatch"``; a
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
            ``max_seqlen`` (see :mod:`lightning_sharding.tokens.batch`). Strategy ``shard``.
    """

    def __init__(
        self,
        reader: Reader | None = None,
        *,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int | None = None,
        shuffle: bool = True,
        even_batches: EvenBatches = "pad",
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        multiprocessing_context: str | None = None,
        timeout: float = 0,
        transport: Literal["pool", "torch"] = "pool",
        transform: Transform | None = None,
        batch_transform: BatchTransform | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        val_reader: Reader | None = None,
        test_reader: Reader | None = None,
        padding_key: str | None = "is_padding",
        allow_data_change: bool = False,
        allow_mixture_change: bool = False,
        data_root_map: Mapping[str, str] | None = None,
        audit_dir: str | None = None,
        on_error: OnError = "raise",
        strategy: str | Strategy = "shard",
        prefetch_items: int = 1,
        source: Source | None = None,
        data_parallel: DataParallel | Callable[[pl.Trainer], DataParallel] | None = None,
        streams: Sequence[Stream] | None = None,
        samples_per_epoch: int | None = None,
        batch_composition: str = "mixed",
        packing: Packing | None = None,
        schedule: Sequence[Phase | Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if not isinstance(strategy, Strategy) and strategy not in strategy_names():
            raise ValueError(
                f"`{name}(strategy={strategy!r})` is not a strategy; choose one of {list(strategy_names())}"
            )
        self.strategy: Strategy = get_strategy(strategy)
        if (self.strategy.takes == "source") != (source is not None):
            raise ValueError(
                f"`{name}(strategy={self.strategy.name!r})`: `source=` goes with "
                f"{strategies_where(lambda s: s.takes == 'source')} and only with it"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"`{name}(seed={seed!r})` must be a non-negative integer or None")
        self.options = LoaderOptions(
            batch_size=batch_size,
            num_workers=num_workers,
            shuffle=shuffle,
            even_batches=even_batches,
            transform=transform,
            batch_transform=batch_transform,
            collate_fn=collate_fn or default_collate,
            padding_key=padding_key,
            on_error=on_error,
            prefetch_items=prefetch_items,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            pin_memory=pin_memory,
            multiprocessing_context=multiprocessing_context,
            timeout=timeout,
            transport=transport,
        ).check(name)
        if not self.strategy.shuffles:  # e.g. a source, read in its own order
            self.options = self.options.replace(shuffle=False)
        self.strategy.check(self.options, owner=name)
        if packing is not None and streams is not None:  # every stream packed the same way
            streams = [packed_stream(s, packing, self.strategy, self.options, name) for s in streams]
        self._reader = reader_of(reader, streams, samples_per_epoch, name, batch_composition, batch_size, schedule)
        if packing is not None and streams is None:
            self._reader = packed(self._reader, packing, self.strategy, self.options, name)
        self._val_reader = val_reader
        self._test_reader = test_reader
        self.source = source
        self.seed = seed  # drawn at setup when None
        self._seed_given = seed
        self.allow_data_change = allow_data_change
        self.allow_mixture_change = allow_mixture_change
        self.data_root_map = dict(data_root_map or {})
        self.audit_dir = audit_dir
        if data_parallel is not None and not callable(data_parallel):
            check_data_parallel(data_parallel, None, f"`{name}(data_parallel={data_parallel!r})`")
        self.data_parallel = data_parallel
        self.world = World()
        self.manifest: Manifest | None = None
        self.ledger_keeper: LedgerKeeper | None = None  # the ledger and the manifest it plans by
        self._train_data: Reader | Source | None = None

    @property
    def manifest(self) -> Manifest | None:
        """The training manifest (after ``setup("fit")``), as the ledger plans by it now: a mixture
        changed on resume or a MixtureController's decisions change its epochs' orders."""
        keeper = getattr(self, "ledger_keeper", None)
        return keeper.manifest if keeper is not None else self._manifest

    @manifest.setter
    def manifest(self, value: Manifest | None) -> None:
        self._manifest = value

    @property
    def ledger(self) -> Ledger | None:
        """The training ledger (after ``setup("fit")``)."""
        return self.ledger_keeper.ledger if self.ledger_keeper is not None else None

    @property
    def train_loader(self) -> TrainLoader | None:
        """The train loader built last."""
        return self.ledger_keeper.train_loader if self.ledger_keeper is not None else None

    def make_reader(self) -> Reader:
        """The training reader; override it to build the reader from your own arguments."""
        if self._reader is None:
            raise TypeError(f"{type(self).__name__} has no reader: pass `reader=...` or override `make_reader()`")
        return self._reader

    @override
    def setup(self, stage: str) -> None:
        """Read the topology; to fit, build the reader, manifest (agreed by all ranks), ledger, callback."""
        if self.trainer is not None:
            self.world = World.from_trainer(self.trainer, self.data_parallel)
        if stage != "fit":
            return
        # What a run killed by SIGKILL left in /dev/shm (batch slots, shared arrays) goes at every fit,
        # with or without workers: a pool sweeps only when it is made, and a resume may make none.
        sweep_dead()
        data = self.source if self.source is not None else self.make_reader()
        self.strategy.check(self.options, data, owner=type(self).__name__)
        self._train_data = data
        if self.options.num_workers > 0 and "multiprocessing_context" not in self.strategy.fixed_options:
            # The forkserver (the default start method) imports while the ranks list, plan and restore.
            options = self.options
            used = (self.strategy, data, options.transform, options.batch_transform, options.collate_fn)
            worker_context(options.multiprocessing_context, *used)
        with collective(self.world):  # the leaders list and index, the other ranks receive the items
            self.manifest = self.strategy.manifest(data, self.options.batch_size)
        seed = self._shared_seed()
        self.world = agree(self.world, self.manifest, seed, self.options)
        ledger = Ledger(seed=seed, total=self.manifest.total, manifest=self.manifest.summary())
        keep: dict[str, Any] = dict(seed_given=self._seed_given, audit_dir=self.audit_dir)
        keep.update(allow_data_change=self.allow_data_change, allow_mixture_change=self.allow_mixture_change)
        keep.update(root_map=self.data_root_map)
        self.ledger_keeper = LedgerKeeper(ledger, self.manifest, self.world, self.options, **keep)
        if self.trainer is not None:
            _ensure_callback(self.trainer)
            controllers = controllers_of(self.trainer)
            if len(controllers) > 1:
                raise ValueError(f"the trainer has {len(controllers)} MixtureControllers; give it one")
            if controllers:  # the mixture's epochs under online control, from any decisions to replay
                if not self.strategy.replans:
                    raise ValueError(
                        f"a MixtureController replans the epoch mid-pass, which strategy={self.strategy.name!r} "
                        f"cannot: use {strategies_where(lambda s: s.replans)}"
                    )
                self.ledger_keeper.start_control(controllers[0].replay)

    def _shared_seed(self) -> int:
        if self.seed is not None:
            return self.seed
        seed = int(np.random.SeedSequence().generate_state(1, dtype=np.uint32)[0])
        if self.trainer is not None and self.world.world_size > 1:
            seed = int(self.trainer.strategy.broadcast(seed, src=0))
        elif self.world.world_size > 1:  # a loop of its own (ShardedData): torch.distributed's default group
            seed = int(broadcast_object(seed, self.world.world_size))
        self.seed = seed
        return seed

    @override
    def train_dataloader(self) -> TrainLoader:
        """This rank's training loader; it yields the same number of batches on every rank."""
        keeper = self.ledger_keeper
        if keeper is None or self._train_data is None:
            raise RuntimeError(
                f"{type(self).__name__}.train_dataloader() was called before setup('fit'). "
                "If your subclass overrides setup(), call super().setup(stage) in it."
            )
        if self.trainer is not None:
            keeper.start_epoch(epoch_lightning_runs_next(self.trainer))
        self.seed = keeper.ledger.seed  # a restored checkpoint's seed
        keeper.options = self.options  # the batch-size finder may have changed them
        self.strategy.release(keeper.train_loader)
        keeper.train_loader = self.strategy.build(
            self._train_data, keeper.manifest, keeper.ledger, self.world, self.options, track=True
        )
        return keeper.train_loader

    @override
    def teardown(self, stage: str) -> None:
        """Release what the train loader holds outside Python: shared memory, helper processes."""
        if stage == "fit" and self.train_loader is not None:
            self.train_loader.close()

    # Exposed as properties so that Lightning sees an evaluation loader only when a reader was given
    # (it checks whether the method is overridden); a subclass may still define its own method.
    @property
    def val_dataloader(self) -> Callable[[], Any]:
        """The validation loader: sharded like training, never shuffled, padding flagged."""
        if self._val_reader is None:
            return super().val_dataloader
        return lambda: self._eval_loader(self._val_reader)

    @property
    def test_dataloader(self) -> Callable[[], Any]:
        """The test loader: sharded like training, never shuffled, padding flagged."""
        if self._test_reader is None:
            return super().test_dataloader
        return lambda: self._eval_loader(self._test_reader)

    def _eval_loader(self, reader: Reader | None) -> Iterable[Any]:
        assert reader is not None
        if self.trainer is not None:
            self.world = World.from_trainer(self.trainer, self.data_parallel)
        with collective(self.world):
            manifest = Manifest.from_items(reader.items())
        seed = self.ledger.seed if self.ledger is not None else self.seed or 0
        ledger = Ledger(seed=seed, total=manifest.total, manifest=manifest.summary())
        # Evaluation always pads (flagged): dropping would silently skip samples of every evaluation.
        return self.strategy.build_eval(reader, manifest, ledger, self.world, self.options)


# Every loader option is an attribute too: ``dm.batch_size`` reads ``dm.options``; setting it checks again.
for _name in LoaderOptions.names():
    setattr(ShardedDataModule, _name, OptionAttribute(_name))


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
