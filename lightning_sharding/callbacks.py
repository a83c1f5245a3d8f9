"""``ShardingCallback``: keeps the ledger in step with training and inside Lightning checkpoints.

- A step's samples count once its ``on_train_batch_end`` runs, and become checkpointable once an
  optimizer step has applied their gradients (gradient accumulation).
- Lightning writes only global rank 0's checkpoint, but every rank runs the save hooks: the ledgers
  of all ranks are gathered there, and every rank restores the union on load.
- At every epoch's end the consumed, padded and dropped counts are reported; the summary is
  printed on rank 0 when fitting ends.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_sharding._distributed import gather_objects
from lightning_sharding.datamodule import CHECKPOINT_KEY, ShardedDataModule
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
    seconds: float

    @property
    def samples_per_second(self) -> float:
        """Real samples trained per second of this run's part of the epoch, all ranks together."""
        return self.served_this_run / self.seconds if self.seconds > 0 else 0.0


class ShardingCallback(pl.Callback):
    """Drives the :class:`ShardedDataModule` ledger. ``ShardedDataModule`` adds it by itself."""

    def __init__(self, print_summary: bool = True) -> None:
        self.print_summary = print_summary
        self.reports: list[EpochReport] = []
        self._last_step = -1
        self._epoch_start = 0.0
        self._served = 0
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
        # Lightning skips on_train_epoch_start when it resumes mid-epoch; start the clock here too.
        self.on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = time.perf_counter()
        self._served = 0
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        dm = self._datamodule(trainer)
        stepped = trainer.global_step != self._last_step or not trainer.optimizers
        self._last_step = trainer.global_step
        self._served += dm.account_step(optimizer_stepped=stepped)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = self._datamodule(trainer)
        assert dm.ledger is not None and dm.train_loader is not None
        dm.ledger.commit()  # Lightning steps on an epoch's last batch whatever the accumulation
        dm.gather_consumed()
        plan = dm.train_loader.sampler.epoch_plan
        # On the strategy's device (NCCL reduces only CUDA tensors) and int64 (counts beyond 2**24).
        count = torch.tensor(self._served, dtype=torch.int64, device=trainer.strategy.root_device)
        served = int(trainer.strategy.reduce(count, reduce_op="sum").item())
        report = EpochReport(
            epoch=dm.ledger.epoch,
            samples=dm.ledger.total,
            consumed=len(dm.ledger.consumed),
            served_this_run=served,
            padding=int(plan.padding_per_rank.sum()) if plan is not None else 0,
            dropped=int(plan.dropped_per_rank.sum()) if plan is not None else 0,
            batches_per_rank=plan.num_batches if plan is not None else 0,
            seconds=time.perf_counter() - self._epoch_start,
        )
        self.reports.append(report)
        # The figures are global already (equal on every rank): "max" keeps them as they are.
        pl_module.log_dict(
            {"data/consumed": float(report.consumed), "data/padding": float(report.padding)},
            sync_dist=True,
            reduce_fx="max",
        )

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CHECKPOINT_KEY] = self._datamodule(trainer).ledger_state()

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._datamodule(trainer).restore_ledger(checkpoint.get(CHECKPOINT_KEY))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = self._datamodule(trainer)
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
    cols = f"{'epoch':>5} {'samples':>9} {'consumed':>9} {'padding':>7} {'dropped':>7} {'batches/rank':>12} "
    cols += f"{'seconds':>8} {'samples/s':>10}"
    rows = [
        f"{r.epoch:>5} {r.samples:>9} {r.consumed:>9} {r.padding:>7} {r.dropped:>7} {r.batches_per_rank:>12} "
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
