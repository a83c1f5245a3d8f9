"""``ShardingCallback``: keeps the ledger in step with training and inside Lightning checkpoints.

- A batch's samples join the ledger once its training step has run, and become checkpointable once
  an optimizer step has applied their gradients (gradient accumulation). Both are read from the
  trainer's progress whenever the ledger is read (:mod:`lightning_sharding.loading.accounting`), so a
  checkpoint saved from any hook or callback position holds exactly what its weights hold.
- Lightning writes only global rank 0's checkpoint, but every rank runs the save hooks: the ledgers
  of all ranks are gathered there, and every rank restores the union on load.
- At every epoch's end the consumed, padded and dropped counts are reported; the summary is
  printed on rank 0 when fitting ends.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loops.progress import _ProcessedTracker
from typing_extensions import override

from lightning_sharding.core.history import segment_entry
from lightning_sharding.core.ledger import CHECKPOINT_KEY
from lightning_sharding.core.skip import SkipError
from lightning_sharding.core.spelling import from_the_command_line
from lightning_sharding.core.world import World
from lightning_sharding.distributed.collectives import gather_objects
from lightning_sharding.lightning.progress_bar import show_train_total
from lightning_sharding.lightning.release import ReleaseProcessGroup
from lightning_sharding.loading.accounting import StepAccounting, TrainerProgress
from lightning_sharding.loading.audit import AuditWriter, run_header
from lightning_sharding.loading.keeper import LedgerKeeper
from lightning_sharding.loading.summary import EpochReport, format_summary
from lightning_sharding.mixture import ControlledMixture, change_of, mixture_of
from lightning_sharding.strategies import Provenance

__all__ = ["EpochReport", "ReleaseProcessGroup", "ShardingCallback"]


class ShardingCallback(pl.Callback):
    """Drives the ledger of a :class:`~lightning_sharding.ShardedDataModule`, which adds it by itself.

    It reaches the ledger through the datamodule's ``ledger_keeper`` (a :class:`LedgerKeeper`) only.
    """

    def __init__(self, print_summary: bool = True, log_every_n_steps: int = 10) -> None:
        self.print_summary = print_summary
        self.log_every_n_steps = log_every_n_steps
        self.reports: list[EpochReport] = []
        self._accounting = StepAccounting()
        self._optimizer_steps = 0
        self._step_hooks: list[Any] = []
        self._unreported: list[Provenance] = []
        self._epoch_start = 0.0
        self._served = 0
        self._skipped = 0
        self._interleave: Any = None  # (manifest, the epoch's order of its mixture): streams(positions)
        self._stream_served = np.zeros(0, dtype=np.int64)
        self._consumed_at_start = 0
        self._batch_start = 0.0
        self._batch_end = 0.0
        self._wait = self._busy = 0.0
        self._audit: AuditWriter | None = None
        self.worlds: list[World] = []
        self._history_noted = False

    @staticmethod
    def _keeper(trainer: pl.Trainer) -> LedgerKeeper:
        dm = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
        keeper = getattr(dm, "ledger_keeper", None)
        if not isinstance(keeper, LedgerKeeper):
            raise TypeError(
                "ShardingCallback needs the trainer's datamodule to be a ShardedDataModule set up for fitting, "
                f"got {type(dm).__name__}; pass `datamodule=` to `trainer.fit`"
            )
        return keeper

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        keeper = self._keeper(trainer)
        if not keeper.skip_settled:
            assert keeper.skip is not None
            resume = "ckpt_path=PATH" if from_the_command_line() else "trainer.fit(..., ckpt_path=PATH)"
            raise SkipError(
                f"skip={keeper.skip.describe()!r} leaves out samples at a resume, and this fit starts from no "
                f"checkpoint: pass the checkpoint written before those steps, {resume}"
            )
        if keeper.audit_dir is not None:
            self._audit = self._open_audit(trainer, keeper, keeper.audit_dir)
        # Counted when optimizer.step() returns, so that a save between the update and Lightning's own
        # step counter (inside a user's `optimizer_step`) still sees the update.
        self._step_hooks = [opt.register_step_post_hook(self._count_step) for opt in trainer.optimizers]
        self._accounting.start_run(self._optimizer_steps)
        self._history_noted = False  # the run's history entry is written at its first batch
        # Lightning skips on_train_epoch_start when it resumes mid-epoch; start the clock here too.
        self.on_train_epoch_start(trainer, pl_module)

    @staticmethod
    def _open_audit(trainer: pl.Trainer, keeper: LedgerKeeper, directory: str) -> AuditWriter | None:
        # One id and start time per run, from rank 0, so all ranks' files belong together.
        started = trainer.strategy.broadcast(time.time(), src=0)
        run = trainer.strategy.broadcast(f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}", src=0)
        if keeper.world.replica_rank != 0:  # the first rank of each model replica writes for all of its ranks
            return None
        resumed_from = str(trainer.ckpt_path) if trainer.ckpt_path else None
        header = run_header(keeper, started=started, start_step=trainer.global_step, resumed_from=resumed_from)
        return AuditWriter(directory, run, keeper.world.data_rank, header)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        keeper = self._keeper(trainer)
        self._epoch_start = time.perf_counter()
        self._served = 0
        self._skipped = 0
        mixture = mixture_of(keeper.manifest)
        self._interleave = self._stream_order(keeper) if mixture else None
        self._stream_served = np.zeros(len(mixture.draws) if mixture is not None else 0, dtype=np.int64)
        self._consumed_at_start = len(keeper.ledger.consumed)
        self._accounting.start_epoch()
        self._batch_end = 0.0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = time.perf_counter()
        keeper = self._keeper(trainer)
        keeper.committed()  # the checkpoint of the previous step is saved by now
        self._accounting.batch_starts(self._progress(trainer))
        if not self._history_noted:
            self._history_noted = True
            self._note_history(trainer, keeper, self._accounting.batches_before or 0)
        self._show_total(trainer)
        if self._batch_end:  # the time since the last step ended went to waiting for this batch
            self._wait += self._batch_start - self._batch_end

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        keeper = self._keeper(trainer)
        self._report(trainer, self._sync(trainer, keeper))
        self._show_total(trainer)  # a Rich bar resumed mid-epoch is drawn only now
        self._batch_end = time.perf_counter()
        self._busy += self._batch_end - self._batch_start
        if self.log_every_n_steps and trainer.global_step % self.log_every_n_steps == 0:
            self._log_progress(pl_module, keeper)

    @staticmethod
    def _note_history(trainer: pl.Trainer, keeper: LedgerKeeper, batches_before: int) -> None:
        """Add this run's entry to the ledger's history: where it starts (step, epoch, what its epoch
        had consumed: the plan's input; the epoch's batches before it, which set where Lightning's
        accumulation windows end) and on which topology. Bookkeeping only; the plan never reads it."""
        ledger = keeper.ledger
        ledger.history.append(
            segment_entry(
                step=trainer.global_step,
                epoch=ledger.epoch,
                consumed=ledger.consumed | ledger.skipped,  # what the plan leaves out
                ahead=ledger.skip_ahead,
                world_size=keeper.world.data_size,
                num_workers=keeper.options.num_workers,
                batch_size=keeper.options.batch_size,
                accumulate=trainer.accumulate_grad_batches,
                even_batches=keeper.options.even_batches,
                batches_before=batches_before,
                fingerprint=ledger.fingerprint,
                limited=_limited(trainer.limit_train_batches),
                worker_layout=_replay_layout(keeper.train_loader),
            )
        )

    def _progress(self, trainer: pl.Trainer) -> TrainerProgress:
        """The trainer's batch counters for the current epoch, and the optimizer steps that returned."""
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        assert isinstance(current, _ProcessedTracker)  # typed as its base class, which has no `processed`
        return TrainerProgress(current.started, current.processed, self._optimizer_steps, bool(trainer.optimizers))

    def _show_total(self, trainer: pl.Trainer) -> None:
        """The progress bar's total: batches of this epoch before a resume plus those planned since."""
        loader = self._keeper(trainer).train_loader
        before = self._accounting.batches_before
        plan = loader.epoch_plan if loader is not None else None
        if plan is not None and before is not None:  # None: a source of unknown length (even_batches="sync")
            earlier = loader.batches_before_plan if loader is not None else 0
            show_train_total(trainer.progress_bar_callback, before + earlier + plan.num_batches)

    def _count_step(self, *args: Any) -> None:
        self._optimizer_steps += 1

    def _remove_step_hooks(self) -> None:
        for hook in self._step_hooks:
            hook.remove()
        self._step_hooks = []

    def _report(self, trainer: pl.Trainer, provenances: list[Provenance]) -> None:
        """Count and audit accounted batches, with those a checkpoint saved earlier in the hook accounted."""
        for provenance in self._unreported + provenances:
            self._served += len(provenance.positions) - provenance.num_padding
            self._count_streams(provenance.consumed_positions, self._keeper(trainer))
            self._skipped += len(provenance.skipped)
            if self._audit is not None:
                self._audit.step(
                    provenance.epoch,
                    trainer.global_step,
                    provenance.consumed_positions,
                    provenance.num_padding,
                    skipped=len(provenance.skipped),
                )
        self._unreported = []

    @staticmethod
    def _stream_order(keeper: LedgerKeeper) -> Any:
        """A mixture's order of the current epoch, which tells each position's stream (also after a
        change, and after a controller's decision: the order of the manifest as it is now)."""
        return keeper.manifest, keeper.manifest.order(keeper.ledger.seed, keeper.ledger.epoch)

    def _count_streams(self, positions: Any, keeper: LedgerKeeper) -> None:
        """A mixture's samples trained this epoch, per stream (logged as ``data/stream/<name>``)."""
        if self._interleave is not None and len(positions):
            if self._interleave[0] is not keeper.manifest:  # a decision changed the order since
                self._interleave = self._stream_order(keeper)
            which, _ = self._interleave[1].streams(positions)
            self._stream_served += np.bincount(which, minlength=len(self._stream_served))

    def _sync(self, trainer: pl.Trainer, keeper: LedgerKeeper) -> list[Provenance]:
        """Bring the ledger to what the weights hold now; the newly accounted batches, oldest first."""
        if keeper.train_loader is None:
            return []
        return self._accounting.sync(self._progress(trainer), keeper.train_loader.pop_delivered, keeper.ledger)

    def _log_progress(self, pl_module: pl.LightningModule, keeper: LedgerKeeper) -> None:
        """Epoch progress (exact to within one sample per rank: other ranks are assumed in step), samples/s
        of all ranks, the share of step time spent waiting for data, and rank 0's shard-cache figures."""
        world = keeper.world.data_size  # the ranks of a model replica serve the same samples
        elapsed = time.perf_counter() - self._epoch_start
        position = self._consumed_at_start + self._served * world
        metrics = {
            "data/progress": min(1.0, position / keeper.ledger.total),
            "data/samples_per_s": self._served * world / elapsed if elapsed > 0 else 0.0,
            "data/wait": self._wait / (self._wait + self._busy) if self._wait + self._busy > 0 else 0.0,
        }
        pl_module.log_dict(metrics, prog_bar=True, on_step=True, on_epoch=False, rank_zero_only=True)
        shares = self._scheduled_shares(keeper, position)
        if shares:
            pl_module.log_dict(shares, on_step=True, on_epoch=False, rank_zero_only=True)
        if keeper.train_loader is not None:  # data/cache_hit, data/prefetch_wait: when the reader counts them
            pl_module.log_dict(keeper.train_loader.delivered.take_metrics(), on_step=True, rank_zero_only=True)
        self._wait = self._busy = 0.0

    @staticmethod
    def _scheduled_shares(keeper: LedgerKeeper, position: int) -> dict[str, float]:
        """A share schedule's shares at epoch ``position`` (``data/share/<stream>``): each stream's
        part of the phase being trained (none without a schedule, or in an epoch changed on resume)."""
        mixture = mixture_of(keeper.manifest)
        epochs = keeper.manifest.epochs
        if isinstance(epochs, ControlledMixture):  # under online control: the last decision's shares
            shares = epochs.shares_at(keeper.ledger.epoch, position)
            return {f"data/share/{name}": share for name, share in shares.items()}
        if mixture is None or not mixture.schedule or change_of(keeper.manifest) is not None:
            return {}
        rows = mixture.phases
        bounds = np.cumsum([0] + [sum(row) for row in rows])
        phase = min(len(rows) - 1, max(0, int(np.searchsorted(bounds, position, side="right")) - 1))
        total = sum(rows[phase]) or 1
        return {f"data/share/{name}": d / total for name, d in zip(mixture.names, rows[phase], strict=True)}

    def note_decision(self, decision: dict[str, Any]) -> None:
        """A mixture decision was made (a MixtureController's): into the audit trail."""
        if self._audit is not None:
            self._audit.decision(decision)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        keeper = self._keeper(trainer)
        self._report(trainer, self._sync(trainer, keeper))
        keeper.gather()
        if self.log_every_n_steps:  # the bar's last figure is the epoch's end, not the last logged step's
            done = len(keeper.ledger.consumed) / keeper.ledger.total if keeper.ledger.total else 1.0
            pl_module.log("data/progress", done, prog_bar=True, on_step=False, on_epoch=True, rank_zero_only=True)
        loader = keeper.train_loader
        plan = loader.epoch_plan if loader is not None else None
        # On the strategy's device (NCCL reduces only CUDA tensors) and int64 (counts beyond 2**24).
        # Summed over the first rank of each model replica: its other ranks served the same samples.
        first = keeper.world.replica_rank == 0
        counts = torch.tensor(
            [self._served * first, self._skipped * first], dtype=torch.int64, device=trainer.strategy.root_device
        )
        served, skipped = (int(x) for x in trainer.strategy.reduce(counts, reduce_op="sum").tolist())
        report = EpochReport(
            epoch=keeper.ledger.epoch,
            samples=keeper.ledger.total,
            consumed=len(keeper.ledger.consumed),
            served_this_run=served,
            padding=int(plan.padding_per_rank.sum()) if plan is not None else 0,
            dropped=int(plan.dropped_per_rank.sum()) if plan is not None else 0,
            batches_per_rank=plan.num_batches + loader.batches_before_plan if plan is not None and loader else 0,
            skipped=skipped,
            seconds=time.perf_counter() - self._epoch_start,
            skipped_on_resume=len(keeper.ledger.skipped),
        )
        self.reports.append(report)
        # An epoch stopped early (max_steps, limit_train_batches) is not finished: the audit
        # then reports it in progress rather than missing samples.
        finished = report.consumed + report.dropped + report.skipped_on_resume == report.samples
        if self._audit is not None and finished:
            self._audit.epoch_end(report.epoch, trainer.global_step, report.dropped)
        # The figures are global already (equal on every rank): "max" keeps them as they are.
        pl_module.log_dict(
            {
                "data/consumed": float(report.consumed),
                "data/padding": float(report.padding),
                "data/skipped": float(report.skipped),
            },
            sync_dist=True,
            reduce_fx="max",
        )
        mixture = mixture_of(keeper.manifest)
        if mixture is not None:  # each replica's first rank counts; summed over ranks
            share = float(keeper.world.replica_rank == 0)
            names = [f"data/stream/{n}" for n in mixture.names]
            per_stream = {name: share * n for name, n in zip(names, self._stream_served.tolist(), strict=True)}
            pl_module.log_dict(per_stream, sync_dist=True, reduce_fx="sum")

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Whatever hook or signal handler saves, and wherever this callback sits in the list, the
        # ledger is first brought to the batches whose gradients the weights being saved hold.
        keeper = self._keeper(trainer)
        self._unreported += self._sync(trainer, keeper)
        checkpoint[CHECKPOINT_KEY] = keeper.state(global_step=trainer.global_step)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        source = f"the checkpoint {trainer.ckpt_path}" if trainer.ckpt_path else "the checkpoint"
        self._keeper(trainer).restore(checkpoint.get(CHECKPOINT_KEY), checkpoint.get("global_step"), source)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._audit is not None:
            self._audit.close()
        self._remove_step_hooks()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_step_hooks()
        if self._audit is not None:
            self._audit.close()
        keeper = self._keeper(trainer)
        keeper.committed()
        self.worlds = gather_objects(keeper.world, keeper.world.world_size)
        if self.print_summary and trainer.is_global_zero:
            summary = keeper.manifest.summary()
            packing = summary.get("packing")
            streams = [s for s in summary.get("streams") or [] if "packing" in s]
            seed, skips = keeper.ledger.seed, keeper.ledger.skips
            print(format_summary(self.reports, keeper.options, seed, self.worlds, packing, streams, skips))

    def summary(self) -> list[dict[str, Any]]:
        """The epoch reports as plain dicts."""
        return [{**asdict(r), "samples_per_second": r.samples_per_second} for r in self.reports]


def _replay_layout(loader: Any) -> str | None:
    """How the loader deals a rank's batches, as the history replays them: its sampler's layout of a
    strategy that deals batches by the plan's workers; ``None`` for one that does not (dispatch), and
    ``"merged"`` for dali with several sources (each batch merges a run of every source's)."""
    layout = getattr(getattr(loader, "sampler", None), "worker_layout", None)
    return "merged" if layout is not None and getattr(loader, "num_sources", 1) > 1 else layout


def _limited(limit: int | float | None) -> bool:
    """Whether ``limit_train_batches`` cuts epochs short (an int counts batches, a float a fraction)."""
    return limit is not None and not (isinstance(limit, float) and limit >= 1.0)
