"""One training segment for the process tests: a real Trainer, real DDP over gloo, real workers.

Run as ``python tests/jobs/train_job.py CONFIG.json``. Every rank appends one JSON line per
completed training batch to ``<out>/seen-<segment>-rank<r>.jsonl`` (epoch, global step after the
batch, sample ids, padding count). ``die_at_step`` SIGKILLs every rank right after that step ends,
like a preempted job; checkpoints written before it are what a resume starts from.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sharding import ShardedDataModule, ShardingCallback, SyntheticReader


class RecordingModel(pl.LightningModule):
    """A tiny regression model that writes down every sample id its training steps used."""

    def __init__(self, log_path: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.log_path = log_path

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._last = batch
        return torch.nn.functional.mse_loss(self.layer(batch["x"]).squeeze(-1), batch["y"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pad = batch["is_padding"]
        record = {
            "epoch": self.trainer.current_epoch,
            "gs": self.trainer.global_step,
            "ids": batch["id"][~pad].tolist(),
            "pad": int(pad.sum()),
        }
        path = f"{self.log_path}-rank{self.trainer.global_rank}.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class DieAtStep(pl.Callback):
    """SIGKILL this rank when the given global step has completed (after checkpoints of that step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class WriteResult(pl.Callback):
    """Rank 0 writes the ShardingCallback's epoch reports (inside the rank process, also under ddp_spawn)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            sharding = next(cb for cb in trainer.callbacks if isinstance(cb, ShardingCallback))
            self.path.write_text(json.dumps({"epochs": sharding.summary()}))


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    out = Path(cfg["out"])
    dm = ShardedDataModule(
        SyntheticReader(sizes=cfg["sizes"]),
        batch_size=cfg["batch_size"],
        num_workers=cfg["num_workers"],
        seed=cfg["seed"],
        even_batches=cfg["even_batches"],
        persistent_workers=cfg["persistent_workers"] and cfg["num_workers"] > 0,
        multiprocessing_context="spawn" if cfg["num_workers"] > 0 else None,
    )
    model = RecordingModel(str(out / f"seen-{cfg['segment']}"))
    callbacks: list[pl.Callback] = [WriteResult(out / f"result-{cfg['segment']}.json")]
    if cfg["checkpoint_every"]:
        callbacks.append(
            ModelCheckpoint(
                dirpath=out / "checkpoints",
                every_n_train_steps=cfg["checkpoint_every"],
                save_top_k=-1,
                filename=f"{cfg['segment']}-{{epoch}}-{{step}}",
            )
        )
    if cfg["die_at_step"]:
        callbacks.append(DieAtStep(cfg["die_at_step"]))
    world = cfg["world_size"]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp_spawn" if world > 1 else "auto",
        max_epochs=cfg["epochs"],
        accumulate_grad_batches=cfg["accumulate"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(cfg["checkpoint_every"]),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=cfg["resume_from"])


if __name__ == "__main__":
    main(sys.argv[1])
