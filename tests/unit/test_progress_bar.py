"""The progress bar shows ``k/N`` with N this rank's planned batches of the epoch, TQDM and Rich,
also after a resume that re-plans the epoch (here: another batch size; tests/process/test_elastic.py checks
another number of ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lightning_sharding import ShardedDataModule, ShardingCallback, SyntheticReader
from lightning_sharding.lightning.progress_bar import train_total
from tests.support.harness import cpu_trainer

pytestmark = pytest.mark.timeout(180)


class BarReader(pl.LightningModule):
    """Notes ``(epoch, k, total shown)`` after every training batch; saves after batch ``save_after``."""

    def __init__(self, save_after: int | None = None, save_to: Path | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.seen: list[tuple[int, int, Any]] = []
        self.save_after, self.save_to = save_after, save_to

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch["x"]).squeeze(-1), batch["y"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append((self.current_epoch, batch_idx + 1, train_total(self.trainer.progress_bar_callback)))
        if len(self.seen) == self.save_after:
            self.trainer.save_checkpoint(str(self.save_to))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _bar(kind: str) -> pl.Callback:
    if kind == "rich":
        from tests.support.extras import require

        require("rich")
        return RichProgressBar()
    return TQDMProgressBar()


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_the_bar_total_is_the_planned_batch_count_also_after_a_replanning_resume(tmp_path: Path, kind: str) -> None:
    reader = SyntheticReader(sizes=[13, 17, 10])  # 40 samples: 10 batches of 4, then 5 of 8
    first = BarReader(save_after=3, save_to=tmp_path / "mid.ckpt")
    trainer = cpu_trainer(max_epochs=2, enable_progress_bar=True, callbacks=[_bar(kind)])
    trainer.fit(first, datamodule=ShardedDataModule(reader, batch_size=4, seed=3))
    assert [total for _, _, total in first.seen] == [10] * 20
    assert [k for _, k, _ in first.seen] == list(range(1, 11)) * 2

    resumed = BarReader()
    trainer = cpu_trainer(max_epochs=2, enable_progress_bar=True, callbacks=[_bar(kind)])
    trainer.fit(resumed, datamodule=ShardedDataModule(reader, batch_size=8), ckpt_path=tmp_path / "mid.ckpt")
    # Epoch 0 resumed after 3 batches of 4: 28 samples left are 4 batches of 8, so k runs 4..7 of 7.
    epoch0 = [(k, total) for epoch, k, total in resumed.seen if epoch == 0]
    epoch1 = [(k, total) for epoch, k, total in resumed.seen if epoch == 1]
    assert [k for k, _ in epoch0] == [4, 5, 6, 7]
    # Rich draws a bar of a resumed epoch only at its first batch end; from then on it shows the total.
    assert [total for _, total in epoch0][1:] == [7, 7, 7] and epoch0[0][1] in (7, None, float("inf"))
    assert epoch1 == [(k, 5) for k in range(1, 6)]


def test_the_bar_ends_an_epoch_at_its_progress_not_at_the_last_logged_steps(tmp_path: Path) -> None:
    # 10 batches, logged every 4 steps: the last step log says 0.8; the epoch's end says what the ledger holds.
    seen: list[float] = []

    class AtEpochEnd(pl.Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen.append(float(trainer.progress_bar_metrics["data/progress"]))

    callbacks = [ShardingCallback(print_summary=False, log_every_n_steps=4), AtEpochEnd(), TQDMProgressBar()]
    trainer = cpu_trainer(max_epochs=2, enable_progress_bar=True, callbacks=callbacks)
    trainer.fit(BarReader(), datamodule=ShardedDataModule(SyntheticReader(sizes=[13, 17, 10]), batch_size=4, seed=3))
    assert seen == [1.0, 1.0]
