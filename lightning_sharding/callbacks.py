"""``ShardingCallback``: keeps the ledger in step with training and inside Lightning checkpoints.

- A batch's samples join the ledger once its training step has run, and become checkpointable once
  an optimizer step has applied their gradients (gradient accumulation). Both are read from the
  trainer's progress whenever the ledger is read (:mod:`lightning_sharding.accounting`), so a
  checkpoint saved from any hook or callback position holds exactly what its weights hold.
- Lightning writes only global rank 0's checkpoint, but every rank runs the save hooks: the ledgers
  of all ranks are gathered there, and every rank restores the union on load.
- At every epoch's end the consumed, padded and dropped counts are reported; the summary is
  printed on rank 0 when fitting ends.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.progress import _ProcessedTracker
from typing_extensions import override

from lightning_sharding._distributed import gather_objects
from lightning_sharding.accounting import StepAccounting, TrainerProgress
from lightning_sharding.audit import AuditWriter
from lightning_sharding.datamodule import ShardedDataModule
from lightning_sharding.ledger import CHECKPOINT_KEY
from lightning_sharding.loader import Provenance
from lightning_sharding.progress_bar import show_train_total
from lightning_sharding.world import World


@dataclass
class EpochReport:
    """What one epoch (or the part of it this run trained) served, summed over all ranks."""

    epoch: int
    samples: int
    consumed: int
    served_this_run: int
    padding: int
    dropped: int
    batches_per_rank: int
    skipped: int
    seconds: float

    @property
    def samples_per_second(self) -> float:
        """Real samples trained per second of this run's part of the epoch, all ranks together."""
        return self.served_this_run / self.seconds if self.seconds > 0 else 0.0


class ShardingCallback(pl.Callback):
    """Drives the :class:`ShardedDataModule` ledger. ``ShardedDataModule`` adds it by itself."""

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
        self._consumed_at_start = 0
        self._batch_start = self._batch_end = 0.0
        self._wait = self._busy = 0.0
        self._audit: AuditWriter | None = None
        self.worlds: list[World] = []

    @staticmethod
    def _datamodule(trainer: pl.Trainer) -> ShardedDataModule:
        dm = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
        if not isinstance(dm, ShardedDataModule):
            raise TypeError(
                "ShardingCallback needs the trainer's datamodule to be a ShardedDataModule, "
                f"got {type(dm).__name__}; pass `datamodule=` to `trainer.fit`"
            )
        return dm

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = self._datamodule(trainer)
        if dm.audit_dir is not None:
            self._audit = self._open_audit(trainer, dm, dm.audit_dir)
        # Counted when optimizer.step() returns, so that a save between the update and Lightning's own
        # step counter (inside a user's `optimizer_step`) still sees the update.
        self._step_hooks = [opt.register_step_post_hook(self._count_step) for opt in trainer.optimizers]
        self._accounting.start_run(self._optimizer_steps)
        # Lightning skips on_train_epoch_start when it resumes mid-epoch; start the clock here too.
        self.on_train_epoch_start(trainer, pl_module)

    @staticmethod
    def _open_audit(trainer: pl.Trainer, dm: ShardedDataModule, directory: str) -> AuditWriter:
        assert dm.ledger is not None and dm.manifest is not None
        # One id and start time per run segment, from rank 0, so all ranks' files belong together.
        started = trainer.strategy.broadcast(time.time(), src=0)
        segment = trainer.strategy.broadcast(f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}", src=0)
        header = {
            "started": started,
            "world_size": dm.world.world_size,
            "num_workers": dm.num_workers,
            "seed": dm.ledger.seed,
            "total": dm.ledger.total,
            "fingerprint": dm.manifest.fingerprint,
            "start_step": trainer.global_step,
            "resumed_from": str(trainer.ckpt_path) if trainer.ckpt_path else None,
        }
        return AuditWriter(directory, segment, dm.world.rank, header)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = self._datamodule(trainer)
        self._epoch_start = time.perf_counter()
        self._served = 0
        self._skipped = 0
        self._consumed_at_start = len(dm.ledger.consumed) if dm.ledger is not None else 0
        self._accounting.start_epoch()
        self._batch_end = 0.0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = time.perf_counter()
        self._datamodule(trainer).flush_commit()  # the checkpoint of the previous step is saved by now
        self._accounting.batch_starts(self._progress(trainer))
        self._show_total(trainer)
        if self._batch_end:  # the time since the last step ended went to waiting for this batch
            self._wait += self._batch_start - self._batch_end

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        dm = self._datamodule(trainer)
        self._report(trainer, self._sync(trainer, dm))
        self._show_total(trainer)  # a Rich bar resumed mid-epoch is drawn only now
        self._batch_end = time.perf_counter()
        self._busy += self._batch_end - self._batch_start
        if self.log_every_n_steps and trainer.global_step % self.log_every_n_steps == 0:
            self._log_progress(trainer, pl_module, dm)

    def _progress(self, trainer: pl.Trainer) -> TrainerProgress:
        """The trainer's batch counters for the current epoch, and the optimizer steps that returned."""
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        assert isinstance(current, _ProcessedTracker)  # typed as its base class, which has no `processed`
        return TrainerProgress(current.started, current.processed, self._optimizer_steps, bool(trainer.optimizers))

    def _show_total(self, trainer: pl.Trainer) -> None:
        """The progress bar's total: batches of this epoch before a resume plus those planned since."""
        loader, before = self._datamodule(trainer).train_loader, self._accounting.batches_before
        planned = getattr(getattr(getattr(loader, "sampler", None), "epoch_plan", None), "num_batches", None)
        if planned is not None and before is not None:  # None: a source of unknown length (even_batches="sync")
            show_train_total(trainer.progress_bar_callback, before + planned)

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

    def _sync(self, trainer: pl.Trainer, dm: ShardedDataModule) -> list[Provenance]:
        """Bring the ledger to what the weights hold now; the newly accounted batches, oldest first."""
        if dm.train_loader is None or dm.ledger is None:
            return []
        return self._accounting.sync(self._progress(trainer), dm.train_loader.pop_delivered, dm.ledger)

    def _log_progress(self, trainer: pl.Trainer, pl_module: pl.LightningModule, dm: ShardedDataModule) -> None:
        """Epoch progress (exact to within one sample per rank: other ranks are assumed in step),
        samples/s of all ranks, and the share of step time spent waiting for data."""
        assert dm.ledger is not None
        world = dm.world.world_size
        elapsed = time.perf_counter() - self._epoch_start
        metrics = {
            "data/progress": min(1.0, (self._consumed_at_start + self._served * world) / dm.ledger.total),
            "data/samples_per_s": self._served * world / elapsed if elapsed > 0 else 0.0,
            "data/wait": self._wait / (self._wait + self._busy) if self._wait + self._busy > 0 else 0.0,
        }
        pl_module.log_dict(metrics, prog_bar=True, on_step=True, on_epoch=False, rank_zero_only=True)
        self._wait = self._busy = 0.0

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = self._datamodule(trainer)
        assert dm.ledger is not None and dm.train_loader is not None
        self._report(trainer, self._sync(trainer, dm))
        dm.gather_consumed()
        plan = dm.train_loader.sampler.epoch_plan
        # On the strategy's device (NCCL reduces only CUDA tensors) and int64 (counts beyond 2**24).
        counts = torch.tensor([self._served, self._skipped], dtype=torch.int64, device=trainer.strategy.root_device)
        served, skipped = (int(x) for x in trainer.strategy.reduce(counts, reduce_op="sum").tolist())
        report = EpochReport(
            epoch=dm.ledger.epoch,
            samples=dm.ledger.total,
            consumed=len(dm.ledger.consumed),
            served_this_run=served,
            padding=int(plan.padding_per_rank.sum()) if plan is not None else 0,
            dropped=int(plan.dropped_per_rank.sum()) if plan is not None else 0,
            batches_per_rank=plan.num_batches if plan is not None else 0,
            skipped=skipped,
            seconds=time.perf_counter() - self._epoch_start,
        )
        self.reports.append(report)
        # An epoch stopped early (max_steps, limit_train_batches) is not finished: the audit
        # then reports it in progress rather than missing samples.
        finished = report.consumed + report.dropped == report.samples
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

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Whatever hook or signal handler saves, and wherever this callback sits in the list, the
        # ledger is first brought to the batches whose gradients the weights being saved hold.
        dm = self._datamodule(trainer)
        self._unreported += self._sync(trainer, dm)
        checkpoint[CHECKPOINT_KEY] = dm.ledger_state(global_step=trainer.global_step)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._datamodule(trainer).restore_ledger(checkpoint.get(CHECKPOINT_KEY), checkpoint.get("global_step"))

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
        dm = self._datamodule(trainer)
        dm.flush_commit()
        self.worlds = gather_objects(dm.world, dm.world.world_size)
        if self.print_summary and trainer.is_global_zero:
            print(format_summary(self.reports, dm, self.worlds))

    def summary(self) -> list[dict[str, Any]]:
        """The epoch reports as plain dicts."""
        return [{**asdict(r), "samples_per_second": r.samples_per_second} for r in self.reports]


def format_summary(reports: list[EpochReport], dm: ShardedDataModule, worlds: list[World]) -> str:
    """A one-screen table of what every epoch served, and where every rank ran."""
    w = dm.world
    head = (
        f"lightning_sharding summary: world {w.world_size} rank(s) x {dm.num_workers} worker(s), "
        f"batch {dm.batch_size}, seed {dm.seed}, even batches '{dm.even_batches}'"
    )
    ranks = "ranks: " + " | ".join(
        f"rank {x.rank} = node {x.node_rank} local {x.local_rank}" for x in sorted(worlds, key=lambda x: x.rank)
    )
    cols = f"{'epoch':>5} {'samples':>9} {'consumed':>9} {'padding':>7} {'dropped':>7} {'skipped':>7} "
    cols += f"{'batches/rank':>12} "
    cols += f"{'seconds':>8} {'samples/s':>10}"
    rows = [
        f"{r.epoch:>5} {r.samples:>9} {r.consumed:>9} {r.padding:>7} {r.dropped:>7} {r.skipped:>7} "
        f"{r.batches_per_rank:>12} "
        f"{r.seconds:>8.2f} {r.samples_per_second:>10.0f}"
        for r in reports
    ]
    if not rows:
        rows = ["  (no training epoch ended in this run)"]
    return "\n".join([head, ranks, cols, *rows])


class ReleaseProcessGroup(pl.Callback):
    """Destroy the ``torch.distributed`` process group when fitting ends (opt-in, for scripts).

    A gloo rank that exits with its process group alive can abort in interpreter shutdown
    ("terminate called without an active exception", see pytorch/pytorch#179291). Add this to a
    script whose processes exit after ``fit``; leave it out if the same process runs
    ``trainer.test()`` afterwards.
    """

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
