"""The train entry point: ``python -m lightning_sharding.train`` or ``lightning-sharding-train``.

A thin ``@hydra.main`` around :func:`run`, which tests call directly with a composed config.
The default job trains a small regression model on the built-in synthetic data set and prints the
data summary (epochs, samples consumed, padding, throughput) when it ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from lightning_sharding.callbacks import ReleaseProcessGroup, ShardingCallback
from lightning_sharding.config import CONF_DIR, build_reader, register_configs
from lightning_sharding.datamodule import ShardedDataModule


class Regressor(pl.LightningModule):
    """A two-layer MLP for the synthetic data's ``{"x", "y"}`` samples."""

    def __init__(self, dim: int, hidden: int, learning_rate: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean squared error of the prediction of ``y`` from ``x``."""
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD."""
        return torch.optim.SGD(self.parameters(), lr=self.hparams["learning_rate"])


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; returns ``{"epochs": [...reports...], "world_size": ..., ...}``."""
    d = cfg.data
    reader, transform = build_reader(d)
    dm = ShardedDataModule(
        reader,
        transform=transform,
        on_error=d.on_error,
        batch_size=d.batch_size,
        num_workers=d.num_workers,
        seed=d.seed,
        shuffle=d.shuffle,
        even_batches=d.even_batches,
        persistent_workers=d.persistent_workers and d.num_workers > 0,
        multiprocessing_context=d.multiprocessing_context,
        audit_dir=cfg.audit.dir if cfg.audit.enabled else None,
    )
    sharding = ShardingCallback()
    callbacks: list[pl.Callback] = [sharding, ReleaseProcessGroup()]
    if cfg.checkpoint_every_n_steps:
        callbacks.append(
            ModelCheckpoint(
                dirpath=Path(cfg.out_dir) / "checkpoints",
                every_n_train_steps=cfg.checkpoint_every_n_steps,
                save_top_k=-1,
                save_last=True,
            )
        )
    trainer = pl.Trainer(
        **OmegaConf.to_container(cfg.trainer, resolve=True),  # type: ignore[arg-type]
        callbacks=callbacks,
        default_root_dir=cfg.out_dir,
        logger=False,
        enable_checkpointing=bool(cfg.checkpoint_every_n_steps),
    )
    trainer.fit(Regressor(d.dim, cfg.hidden, cfg.learning_rate), datamodule=dm, ckpt_path=cfg.ckpt_path)
    return {
        "epochs": sharding.summary(),
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "seed": dm.seed,
    }


register_configs()


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    run(cfg)


def main() -> None:
    """Console-script entry."""
    _hydra_main()


if __name__ == "__main__":
    main()
