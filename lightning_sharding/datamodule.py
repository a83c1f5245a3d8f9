"""``ShardedDataModule``: the LightningDataModule users subclass or configure.

It takes the topology from the trainer at ``setup()``, owns the manifest and the ledger, builds
the sharded loaders, and adds the :class:`~lightning_sharding.callbacks.ShardingCallback` that
keeps the ledger in step with training and in the checkpoint.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint
from torch.utils.data import default_collate
from typing_extensions import override

from lightning_sharding._distributed import gather_objects
from lightning_sharding.dispatch import DISPATCH_EVEN_BATCHES, DispatchLoader
from lightning_sharding.ledger import GLOBAL_STEP_KEY, CheckpointMismatchError, Ledger, ledger_step_mismatch
from lightning_sharding.loader import ON_ERROR_POLICIES, OnError, ShardedLoader, Transform
from lightning_sharding.manifest import Manifest, describe_change
from lightning_sharding.plan import EVEN_BATCH_POLICIES, EvenBatches
from lightning_sharding.rangeset import RangeSet
from lightning_sharding.readers.base import Reader
from lightning_sharding.sources import Source, source_manifest
from lightning_sharding.world import World

STRATEGIES: tuple[str, ...] = ("shard", "broadcast", "dispatch")


class ShardedDataModule(pl.LightningDataModule):
    """Exactly-once, two-level sharded data for Lightning.

    Ranks take contiguous runs of the epoch order (whole items where possible); each rank's
    DataLoader workers take contiguous runs of its batches. Every sample is served once per epoch
    across all ranks and workers, also after a mid-epoch resume on another number of ranks or
    workers, because the checkpoint holds a topology-free ledger of consumed samples.

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
        persistent_workers, prefetch_factor, pin_memory, multiprocessing_context, timeout: passed
            to the DataLoader.
        transform: ``transform(sample, SampleContext) -> sample``, run per sample in the worker.
        collate_fn: turns a list of samples into a batch (PyTorch's default collate).
        val_reader, test_reader: evaluation data, sharded without a ledger and never shuffled.
        padding_key: the key of the padding flags added to dict batches; ``None`` adds none.
        allow_data_change: resume even when the data's fingerprint changed (the epoch restarts
            with a warning) instead of failing.
        audit_dir: when set, every rank writes the positions its completed steps consumed there,
            for ``lightning-sharding audit`` to check exactly-once across runs and resumes.
        on_error: ``"raise"`` (default) stops at the first sample that cannot be read or
            transformed, naming its item and index; ``"skip"`` leaves such samples out, counts
            them as consumed-and-skipped (reported in the summary), and fills their place in the
            batch with flagged padding. Storage outages are never skipped.
        strategy: ``"shard"`` (each worker reads its own items), ``"broadcast"`` (each rank loads
            an item once into shared memory and its workers crop disjoint windows from it; needs a
            :class:`~lightning_sharding.readers.windows.WindowedReader`), or ``"dispatch"`` (one
            process per rank reads the non-replicable ``source`` and deals batches round-robin to
            the workers, which run ``transform``; see :mod:`lightning_sharding.dispatch`).
        prefetch_items: with ``broadcast``, how many items each rank loads ahead of the current one.
        source: the :class:`~lightning_sharding.sources.Source` of ``strategy="dispatch"``; a
            source of unknown length needs ``even_batches="sync"``.
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
        transform: Transform | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        val_reader: Reader | None = None,
        test_reader: Reader | None = None,
        padding_key: str | None = "is_padding",
        allow_data_change: bool = False,
        audit_dir: str | None = None,
        on_error: OnError = "raise",
        strategy: str = "shard",
        prefetch_items: int = 1,
        source: Source | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if strategy not in STRATEGIES:
            raise ValueError(f"`{name}(strategy={strategy!r})` is not a strategy; choose one of {list(STRATEGIES)}")
        if (strategy == "dispatch") != (source is not None):
            raise ValueError(
                f"`{name}(strategy={strategy!r})`: `source=` goes with strategy='dispatch' and only with it"
            )
        policies = DISPATCH_EVEN_BATCHES if strategy == "dispatch" else EVEN_BATCH_POLICIES
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`{name}(batch_size={batch_size!r})` must be a positive integer")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"`{name}(num_workers={num_workers!r})` must be an integer >= 0 (0 loads in-process)")
        if even_batches not in policies:
            raise ValueError(f"`{name}(even_batches={even_batches!r})` must be one of {list(policies)}")
        if persistent_workers and num_workers == 0:
            raise ValueError(f"`{name}(persistent_workers=True)` needs num_workers > 0")
        if prefetch_factor is not None and (num_workers == 0 or prefetch_factor < 1):
            raise ValueError(f"`{name}(prefetch_factor={prefetch_factor})` needs num_workers > 0 and a value >= 1")
        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"`{name}(on_error={on_error!r})` must be one of {list(ON_ERROR_POLICIES)}")
        if on_error == "skip" and strategy != "shard":
            raise ValueError(f"`{name}(on_error='skip')` works with strategy='shard' only, not {strategy!r}")
        if isinstance(prefetch_items, bool) or not isinstance(prefetch_items, int) or prefetch_items < 0:
            raise ValueError(f"`{name}(prefetch_items={prefetch_items!r})` must be an integer >= 0")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"`{name}(seed={seed!r})` must be a non-negative integer or None")
        self._reader = reader
        self.prefetch_items = prefetch_items
        self._val_reader, self._test_reader = val_reader, test_reader
        self.batch_size, self.num_workers = batch_size, num_workers
        self.seed, self.shuffle, self.even_batches = seed, shuffle, even_batches
        self._seed_given = seed
        self.persistent_workers, self.prefetch_factor = persistent_workers, prefetch_factor
        self.pin_memory, self.multiprocessing_context, self.timeout = pin_memory, multiprocessing_context, timeout
        self.transform = transform
        self.collate_fn = collate_fn or default_collate
        self.padding_key = padding_key
        self.allow_data_change = allow_data_change
        self.audit_dir = audit_dir
        self.on_error = on_error
        self.strategy, self.source = strategy, source
        self.world = World()
        self.manifest: Manifest | None = None
        self.ledger: Ledger | None = None
        self.train_loader: ShardedLoader | DispatchLoader | None = None
        self._train_reader: Reader | None = None

    def make_reader(self) -> Reader:
        """The training reader; override it to build the reader from your own arguments."""
        if self._reader is None:
            raise TypeError(f"{type(self).__name__} has no reader: pass `reader=...` or override `make_reader()`")
        return self._reader

    @override
    def setup(self, stage: str) -> None:
        """Read the topology from the trainer; for fitting, build the reader, the manifest (checked
        to be the same on every rank), a fresh ledger, and add the callback."""
        if self.trainer is not None:
            self.world = World.from_trainer(self.trainer)
        if stage != "fit":
            return
        if self.source is not None:
            self.manifest = source_manifest(self.source)
        else:
            self._train_reader = self.make_reader()
            self.manifest = Manifest.from_items(self._train_reader.items())
        self._check_same_data_on_every_rank(self.manifest)
        self.ledger = Ledger(seed=self._shared_seed(), total=self.manifest.total, manifest=self.manifest.summary())
        if self.trainer is not None:
            _ensure_callback(self.trainer)

    def _check_same_data_on_every_rank(self, manifest: Manifest) -> None:
        # A rank whose listing differs (glob order, object-store listing lag) would plan over other
        # positions: shares would overlap or leave gaps. Every rank sees every summary and raises alike.
        summaries = gather_objects(manifest.summary(), self.world.world_size)
        for rank, summary in enumerate(summaries):
            if summary["fingerprint"] != summaries[0]["fingerprint"]:
                raise ValueError(
                    f"rank {rank} lists other data than rank 0: {describe_change(summaries[0], summary)}. "
                    "Every rank must list the same items in the same order: sort globbed or listed paths, "
                    "and do not change the data while the job starts."
                )

    def _shared_seed(self) -> int:
        if self.seed is not None:
            return self.seed
        seed = int(np.random.SeedSequence().generate_state(1, dtype=np.uint32)[0])
        if self.trainer is not None and self.world.world_size > 1:
            seed = int(self.trainer.strategy.broadcast(seed, src=0))
        self.seed = seed
        return seed

    @override
    def train_dataloader(self) -> ShardedLoader | DispatchLoader:
        """This rank's training loader; it yields the same number of batches on every rank."""
        if self.ledger is None or self.manifest is None or (self._train_reader is None and self.source is None):
            raise RuntimeError(
                f"{type(self).__name__}.train_dataloader() was called before setup('fit'). "
                "If your subclass overrides setup(), call super().setup(stage) in it."
            )
        if self.trainer is not None:
            self.ledger.start_epoch(_epoch_lightning_runs_next(self.trainer))
        if self.source is not None:
            self.train_loader = self._dispatch_loader(self.source, self.ledger)
            return self.train_loader
        assert self._train_reader is not None
        self.train_loader = self._loader(self._train_reader, self.manifest, self.ledger, self.shuffle, track=True)
        return self.train_loader

    def _dispatch_loader(self, source: Source, ledger: Ledger) -> DispatchLoader:
        if isinstance(self.train_loader, DispatchLoader):  # reloaded: its dispatch process goes first
            self.train_loader.close()
        return DispatchLoader(source, ledger, even_batches=self.even_batches, track=True, **self._loader_options())

    def _loader_options(self) -> dict[str, Any]:
        """What every strategy's loader takes from this datamodule's arguments."""
        return dict(
            world=self.world,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            transform=self.transform,
            collate_fn=self.collate_fn,
            persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.pin_memory,
            multiprocessing_context=self.multiprocessing_context,
            timeout=self.timeout,
            padding_key=self.padding_key,
        )

    @override
    def teardown(self, stage: str) -> None:
        """Release what the train loader holds outside Python: the broadcast strategy's shared
        memory, the dispatch strategy's dispatch process."""
        close = getattr(self.train_loader, "close", None)
        if stage == "fit" and close is not None:
            close()

    def flush_commit(self) -> None:
        """After a checkpoint was saved, tell a dispatch source its committed position."""
        if isinstance(self.train_loader, DispatchLoader):
            self.train_loader.flush_commit()

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

    def _eval_loader(self, reader: Reader | None) -> ShardedLoader:
        assert reader is not None
        if self.trainer is not None:
            self.world = World.from_trainer(self.trainer)
        manifest = Manifest.from_items(reader.items())
        ledger = Ledger(seed=self.seed or 0, total=manifest.total, manifest=manifest.summary())
        # Evaluation always pads (flagged): dropping would silently skip samples of every evaluation.
        return self._loader(reader, manifest, ledger, shuffle=False, track=False, even_batches="pad")

    def _loader(
        self,
        reader: Reader,
        manifest: Manifest,
        ledger: Ledger,
        shuffle: bool,
        track: bool,
        even_batches: EvenBatches | None = None,
    ) -> ShardedLoader:
        build: Callable[..., ShardedLoader] = ShardedLoader.build
        extra: dict[str, Any] = {}
        if self.strategy == "broadcast":
            from lightning_sharding.broadcast import BroadcastLoader

            build, extra = BroadcastLoader.build, {"prefetch_items": self.prefetch_items}
        return build(
            reader,
            manifest.items,
            ledger,
            shuffle=shuffle,
            even_batches=even_batches or self.even_batches,
            track=track,
            on_error=self.on_error,
            **self._loader_options(),
            **extra,
        )

    # -- ledger bookkeeping, driven by ShardingCallback ------------------------------------------

    def gather_consumed(self) -> None:
        """Union every rank's consumed positions into every rank's ledger (a collective call)."""
        assert self.ledger is not None
        for state in gather_objects(self.ledger.consumed.to_state(), self.world.world_size):
            self.ledger.merge(RangeSet.from_state(state))

    def ledger_state(self, global_step: int | None = None) -> dict[str, Any]:
        """The checkpoint entry: the union of all ranks' ledgers (a collective call), with the optimizer
        step whose weights it matches."""
        assert self.ledger is not None
        self.gather_consumed()
        if isinstance(self.train_loader, DispatchLoader):
            self.train_loader.note_checkpoint()
        state = self.ledger.state_dict()
        # A tensor, not a NumPy array: checkpoints must load with torch.load(weights_only=True).
        state["consumed"] = torch.from_numpy(state["consumed"])
        state["writer"] = {
            "world_size": self.world.world_size,
            "num_workers": self.num_workers,
            "batch_size": self.batch_size,
        }
        if global_step is not None:
            state[GLOBAL_STEP_KEY] = int(global_step)
        return state

    def restore_ledger(self, state: dict[str, Any] | None, global_step: int | None = None) -> None:
        """Restore a checkpoint's ledger; a checkpoint of other data is a clear error, and a ledger
        that does not record ``global_step`` (the checkpoint's optimizer step) is warned about."""
        assert self.ledger is not None and self.manifest is not None
        source = f"the checkpoint {self.trainer.ckpt_path}" if self.trainer is not None else "the checkpoint"
        if state is None:
            warnings.warn(
                f"{source} holds no lightning_sharding data ledger (it was written without "
                "ShardedDataModule): the interrupted epoch restarts from its beginning",
                stacklevel=2,
            )
            return
        mismatch = ledger_step_mismatch(state, global_step)
        if mismatch:
            warnings.warn(f"{source}: {mismatch}", stacklevel=2)
        try:
            restored = Ledger.from_state_dict(state)
        except CheckpointMismatchError as err:
            raise CheckpointMismatchError(f"{source}: {err}") from err
        if self._seed_given is not None and restored.seed != self._seed_given:
            warnings.warn(
                f"seed={self._seed_given} is not used: {source} continues its epoch with its own seed {restored.seed}",
                stacklevel=2,
            )
        self.seed = restored.seed
        if restored.fingerprint == self.manifest.fingerprint:
            self.ledger = restored
            return
        change = describe_change(restored.manifest, self.manifest.summary())
        if not self.allow_data_change:
            raise CheckpointMismatchError(
                f"{source} was written for other data: {change}. Resume with the same data, "
                f"or pass `allow_data_change=True` to start epoch {restored.epoch} afresh on the new data."
            )
        warnings.warn(
            f"the data changed since {source} ({change}); epoch {restored.epoch} restarts "
            "with a fresh order because allow_data_change=True",
            stacklevel=2,
        )
        self.ledger = Ledger(
            seed=restored.seed, total=self.manifest.total, manifest=self.manifest.summary(), epoch=restored.epoch
        )


def _epoch_lightning_runs_next(trainer: pl.Trainer) -> int:
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


def _ensure_callback(trainer: pl.Trainer) -> None:
    """Add ShardingCallback unless present, before any checkpoint callback so that a step is
    accounted before a checkpoint taken at the same step is written."""
    from lightning_sharding.callbacks import ShardingCallback

    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    if any(isinstance(cb, ShardingCallback) for cb in callbacks):
        return
    first_checkpoint = next((i for i, cb in enumerate(callbacks) if isinstance(cb, Checkpoint)), len(callbacks))
    callbacks.insert(first_checkpoint, ShardingCallback())
