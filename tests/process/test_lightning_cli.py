"""``LightningCLI`` (jsonargparse) on a ``ShardedDataModule`` subclass, as docs/how-to/lightning-cli.md shows.

The subclass takes two arguments of its own and passes the rest on with ``**kwargs``: the CLI must
offer ShardedDataModule's arguments as ``--data.*`` options, train with spawned workers, checkpoint
mid-epoch, and resume from that checkpoint on another number of workers with every sample's
gradient applied once. The CLI runs in the test process (one rank; the docs page's own test runs
it on 2 DDP ranks), so what each step trained is read straight from the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_sharding import ShardedDataModule, SyntheticReader

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240), pytest.mark.needs("jsonargparse")]

SAMPLES = 4 * 64
BATCH = 16


class Recorder(pl.LightningModule):
    """Records, per training step, the optimizer step it leads to and the ids of its real samples."""

    def __init__(self, learning_rate: float = 0.05) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.net = torch.nn.Linear(8, 1)
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.trainer.global_step, batch["id"][~batch["is_padding"]].tolist()))
        return torch.nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)


class SyntheticData(ShardedDataModule):
    """The built-in synthetic data; every other argument is ShardedDataModule's."""

    def __init__(self, num_items: int = 4, samples_per_item: int = 64, **kwargs: Any) -> None:
        super().__init__(SyntheticReader(num_items, samples_per_item), **kwargs)


def cli(tmp_path: Path, *args: str) -> Any:
    """``python cli.py fit ARGS``, in this process."""
    from lightning.pytorch.cli import LightningCLI

    common = [f"--data.batch_size={BATCH}", "--trainer.accelerator=cpu"]
    common += ["--trainer.devices=1", "--trainer.logger=false", "--trainer.enable_progress_bar=false"]
    common += [f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_model_summary=false"]
    return LightningCLI(Recorder, SyntheticData, args=["fit", *common, *args], save_config_kwargs={"overwrite": True})


@pytest.fixture(autouse=True)
def command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when pytest's own arguments are on sys.argv beside its ``args=``."""
    monkeypatch.setattr("sys.argv", ["cli.py"])


def test_lightning_cli_trains_a_sharded_datamodule_and_resumes_exactly_once(tmp_path: Path) -> None:
    save = ["--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path / 'ckpts'}"]
    save += ["--trainer.callbacks.filename=mid", "--trainer.callbacks.every_n_train_steps=4"]
    # 2 spawned workers, stopped after 6 steps; the checkpoint holds steps 1-4.
    first = cli(tmp_path, "--data.num_workers=2", "--trainer.max_steps=6", *save)
    assert isinstance(first.datamodule, SyntheticData) and first.datamodule.num_workers == 2
    assert [step for step, _ in first.model.seen] == [0, 1, 2, 3, 4, 5]
    kept = [i for step, ids in first.model.seen if step < 4 for i in ids]
    after = [i for step, ids in first.model.seen if step >= 4 for i in ids]

    # The same epoch on 1 worker, from the checkpoint of step 4.
    ckpt = str(tmp_path / "ckpts" / "mid.ckpt")
    second = cli(tmp_path, "--data.num_workers=1", "--trainer.max_epochs=1", f"--ckpt_path={ckpt}", *save)
    assert second.datamodule.num_workers == 1
    resumed = [i for _, ids in second.model.seen for i in ids]
    assert sorted(kept + resumed) == list(range(SAMPLES)), "every sample's gradient applied once in the epoch"
    assert set(after) <= set(resumed), "the steps after the checkpoint are trained again, as its weights lack them"
    assert len(kept) == 4 * BATCH


def test_lightning_cli_offers_the_datamodules_arguments_and_checks_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning.pytorch.cli import LightningCLI

    with pytest.raises(SystemExit) as printed:
        LightningCLI(Recorder, SyntheticData, args=["fit", "--data.batch_size=64", "--print_config"])
    assert printed.value.code == 0
    out = capsys.readouterr().out
    assert "batch_size: 64" in out and "even_batches: pad" in out and "samples_per_item: 64" in out
    with pytest.raises(SystemExit) as refused:
        LightningCLI(Recorder, SyntheticData, args=["fit", "--data.batch_size=many"])
    assert refused.value.code != 0
    assert "batch_size" in capsys.readouterr().err
