"""ShardedDataModule in one process with a real Trainer: bad input, checkpoint checks, accumulation."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_sharding import CheckpointMismatchError, Reader, ShardedDataModule, SyntheticReader
from tests.support.harness import cpu_trainer as trainer

pytestmark = pytest.mark.timeout(180)


class Recorder(pl.LightningModule):
    """Records the ids of every completed training step; can save a checkpoint after a given batch."""

    def __init__(self, save_after: int | None = None, save_to: Path | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.steps: list[list[int]] = []
        self.save_after, self.save_to = save_after, save_to

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch["x"]).squeeze(-1), batch["y"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append(batch["id"][~batch["is_padding"]].tolist())
        if self.save_after is not None and len(self.steps) == self.save_after:
            assert self.save_to is not None
            self.trainer.save_checkpoint(self.save_to)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"even_batches": "spread"}, "even_batches='spread'"),
        ({"persistent_workers": True}, "persistent_workers=True"),
        ({"seed": -5}, "seed=-5"),
    ],
)
def test_bad_arguments_fail_at_construction_naming_the_value(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match="ShardedDataModule") as err:
        ShardedDataModule(SyntheticReader(), **kwargs)
    assert needle in str(err.value)


def test_a_reader_is_required() -> None:
    with pytest.raises(TypeError, match="has no reader"):
        trainer().fit(Recorder(), datamodule=ShardedDataModule())


def test_an_unpicklable_transform_is_refused_before_workers_start() -> None:
    dm = ShardedDataModule(
        SyntheticReader(), num_workers=1, multiprocessing_context="spawn", transform=lambda s, ctx: s
    )
    with pytest.raises(TypeError, match="cannot be pickled into DataLoader workers started with spawn"):
        trainer().fit(Recorder(), datamodule=dm)


def _checkpoint(tmp_path: Path, reader: Reader, **kwargs: Any) -> tuple[Path, Recorder]:
    path = tmp_path / "mid.ckpt"
    model = Recorder(save_after=3, save_to=path)
    trainer(max_steps=5).fit(model, datamodule=ShardedDataModule(reader, batch_size=4, seed=11, **kwargs))
    return path, model


def test_allow_data_change_restarts_the_epoch_with_a_warning(tmp_path: Path) -> None:
    path, _ = _checkpoint(tmp_path, SyntheticReader(sizes=[10, 10, 10]))
    model = Recorder()
    dm = ShardedDataModule(SyntheticReader(sizes=[10, 10, 12]), batch_size=4, allow_data_change=True)
    with pytest.warns(UserWarning, match="data changed"):
        trainer().fit(model, datamodule=dm, ckpt_path=path)
    assert sorted(i for step in model.steps for i in step) == list(range(32))


def test_a_newer_ledger_version_is_refused(tmp_path: Path) -> None:
    path, _ = _checkpoint(tmp_path, SyntheticReader(sizes=[10, 10]))
    ckpt = torch.load(path, weights_only=True)
    ckpt["lightning_sharding"]["version"] = 99
    torch.save(ckpt, path)
    with pytest.raises(CheckpointMismatchError, match="version 99"):
        trainer().fit(
            Recorder(), datamodule=ShardedDataModule(SyntheticReader(sizes=[10, 10]), batch_size=4), ckpt_path=path
        )


def test_a_checkpoint_without_a_ledger_restarts_its_epoch_with_a_warning(tmp_path: Path) -> None:
    path, _ = _checkpoint(tmp_path, SyntheticReader(sizes=[10, 10]))
    ckpt = torch.load(path, weights_only=True)
    del ckpt["lightning_sharding"]
    torch.save(ckpt, path)
    model = Recorder()
    with pytest.warns(UserWarning, match="no lightning_sharding data ledger"):
        trainer().fit(
            model, datamodule=ShardedDataModule(SyntheticReader(sizes=[10, 10]), batch_size=4), ckpt_path=path
        )
    assert sorted(i for step in model.steps for i in step) == list(range(20))


def test_a_ledger_that_does_not_record_its_step_is_resumed_with_a_warning(tmp_path: Path) -> None:
    """A checkpoint of an earlier lightning_sharding has no step in its ledger: it still resumes,
    with a warning that it may not match its weights."""
    path, first = _checkpoint(tmp_path, SyntheticReader(sizes=[10, 10]))
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["lightning_sharding"]["global_step"] == ckpt["global_step"] == 3
    del ckpt["lightning_sharding"]["global_step"]
    torch.save(ckpt, path)
    model = Recorder()
    with pytest.warns(UserWarning, match="does not record the optimizer step it matches"):
        trainer().fit(
            model, datamodule=ShardedDataModule(SyntheticReader(sizes=[10, 10]), batch_size=4), ckpt_path=path
        )
    ids = [i for step in first.steps[:3] + model.steps for i in step]
    assert sorted(ids) == list(range(20))


def test_accumulated_but_unstepped_samples_are_not_checkpointed(tmp_path: Path) -> None:
    """accumulate_grad_batches=2 and a save after batch 3: batch 3's gradient was never applied, so
    its samples are served again after the resume; batches 1-2 are not."""
    reader = SyntheticReader(sizes=[9, 14, 7])
    path = tmp_path / "acc.ckpt"
    first = Recorder(save_after=3, save_to=path)
    dm = ShardedDataModule(reader, batch_size=4, seed=5)
    trainer(accumulate_grad_batches=2, max_steps=3).fit(first, datamodule=dm)
    state = torch.load(path, weights_only=True)["lightning_sharding"]
    consumed = {i for a, b in state["consumed"].tolist() for i in range(a, b)}
    assert len(consumed) == 8  # two stepped batches of 4, not the third
    resumed = Recorder()
    trainer(accumulate_grad_batches=2).fit(resumed, datamodule=ShardedDataModule(reader, batch_size=4), ckpt_path=path)
    kept = first.steps[:2] + resumed.steps
    ids = [i for step in kept for i in step]
    assert sorted(ids) == list(range(30)), "every sample exactly once over the stepped batches"
    assert set(first.steps[2]) <= {i for step in resumed.steps for i in step}


def test_validation_is_sharded_and_its_padding_is_flagged() -> None:
    class WithVal(Recorder):
        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            self.val_ids = getattr(self, "val_ids", []) + batch["id"][~batch["is_padding"]].tolist()

    model = WithVal()
    dm = ShardedDataModule(SyntheticReader(sizes=[10]), val_reader=SyntheticReader(sizes=[5, 6]), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(num_sanity_val_steps=0).fit(model, datamodule=dm)
    assert sorted(model.val_ids) == list(range(11))


@pytest.mark.parametrize("save_on", ["last_batch", "epoch_end"])
def test_a_checkpoint_at_an_epoch_boundary_resumes_into_the_next_epoch(tmp_path: Path, save_on: str) -> None:
    """Lightning reuses the iterator it made before set_epoch when the restored epoch is complete;
    the loader must already serve the next epoch, and in the same order as an unbroken run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    reader = SyntheticReader(sizes=[12])
    unbroken = Recorder()
    trainer(max_epochs=2).fit(unbroken, datamodule=ShardedDataModule(reader, batch_size=4, seed=1))
    every = {"every_n_train_steps": 3} if save_on == "last_batch" else {"every_n_epochs": 1}
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}-{step}", **every)
    first = Recorder()
    trainer(max_steps=4, callbacks=[ckpt], enable_checkpointing=True).fit(
        first, datamodule=ShardedDataModule(reader, batch_size=4, seed=1)
    )
    resumed = Recorder()
    trainer(max_epochs=2).fit(
        resumed, datamodule=ShardedDataModule(reader, batch_size=4), ckpt_path=tmp_path / "epoch=0-step=3.ckpt"
    )
    assert resumed.steps == unbroken.steps[3:]


def test_a_datamodule_reused_by_a_second_trainer_starts_a_fresh_ledger() -> None:
    dm = ShardedDataModule(SyntheticReader(sizes=[7, 9]), batch_size=4, seed=2)
    first, second = Recorder(), Recorder()
    trainer().fit(first, datamodule=dm)
    trainer().fit(second, datamodule=dm)
    for model in (first, second):
        assert sorted(i for step in model.steps for i in step) == list(range(16))


def test_gathering_ledgers_without_a_process_group_is_an_error() -> None:
    from lightning_sharding.distributed.collectives import gather_objects

    assert gather_objects("x", 1) == ["x"]
    with pytest.raises(RuntimeError, match="gather the data ledgers of 2 ranks"):
        gather_objects("x", 2)


def test_the_datamodule_takes_the_engines_arguments_with_the_same_defaults() -> None:
    # LoadingEngine.from_arguments is the one definition; the DataModule repeats its signature for type
    # checkers, IDEs and LightningCLI, and must not drift from it (names, order, defaults, types).
    import inspect

    from lightning_sharding.loading.engine import LoadingEngine

    engine = dict(inspect.signature(LoadingEngine.from_arguments).parameters)
    engine.pop("owner")
    module = dict(inspect.signature(ShardedDataModule.__init__).parameters)
    module.pop("self")
    assert list(module) == list(engine)
    for name, parameter in engine.items():
        theirs = module[name]
        assert (theirs.default, theirs.kind) == (parameter.default, parameter.kind), name
        same_type = theirs.annotation == parameter.annotation
        lightning_callable = (
            name == "data_parallel" and theirs.annotation.replace("pl.Trainer", "Any") == parameter.annotation
        )
        assert same_type or lightning_callable, (name, theirs.annotation, parameter.annotation)
