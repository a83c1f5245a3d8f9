"""The model and callbacks of the process-test training job (imported by the rank processes only)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_sharding import Item, ShardingCallback, SyntheticReader


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


class KillGroupAtStep(pl.Callback):
    """SIGKILL the job's whole process group (every rank, worker and dispatch process) from ``rank``
    once global step ``step`` has completed: ``"after"`` the step, before Lightning's checkpoint
    callbacks (they run last: a checkpoint of that step is lost, as when killed while saving), or
    ``"before"`` the next step, holding a batch delivered but not trained on."""

    def __init__(self, step: int, rank: int, moment: str) -> None:
        self.step, self.rank, self.moment = step, rank, moment

    def _kill(self, trainer: pl.Trainer, moment: str) -> None:
        if moment == self.moment and trainer.global_rank == self.rank and trainer.global_step >= self.step:
            from tests.jobs.resources import snapshot

            # Python's named semaphores (multiprocessing queues) outlive a killed process group,
            # whose resource tracker dies with it: note them so the test can remove them afterwards.
            held = [n for n in snapshot(os.getpgid(0))["shm"] if Path(str(n)).name.startswith("sem.")]
            Path(trainer.default_root_dir, "semaphores.json").write_text(json.dumps(held))
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._kill(trainer, "before")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._kill(trainer, "after")


class KillHelperAtStep(pl.Callback):
    """SIGKILL one helper process of ``rank`` (``"DataLoader worker 1"``, ``"dispatch process"``) once
    step ``step`` has completed, like the out-of-memory killer; notes when and whom in ``mark``."""

    def __init__(self, step: int, rank: int, process: str, mark: Path) -> None:
        self.step, self.rank, self.process, self.mark = step, rank, process, mark

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        victim = trainer.datamodule.train_loader.helper_processes()[self.process]  # type: ignore[attr-defined]
        self.mark.write_text(json.dumps({"time": time.time(), "pid": victim.pid}))
        os.kill(victim.pid, signal.SIGKILL)


class SnapshotAtStep(pl.Callback):
    """Rank 0, once step ``step`` has completed: meet the other run (``<out>/ready`` and the other's),
    note what this job's whole process group holds (``<out>/resources.json``, see resources.py),
    and meet again, so that both notes are taken while both runs are alive."""

    def __init__(self, step: int, out: Path, other: Path) -> None:
        self.step, self.out, self.other = step, out, other

    def _meet(self, name: str) -> None:
        (self.out / name).write_text("")
        deadline = time.time() + 120
        while not (self.other / name).exists():
            if time.time() > deadline:
                raise TimeoutError(f"the other run never reached {self.other / name}")
            time.sleep(0.05)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank != 0 or trainer.global_step != self.step:
            return
        from tests.jobs.resources import snapshot

        self._meet("ready")
        held = {**snapshot(os.getpgid(0)), "master_port": int(os.environ["MASTER_PORT"])}
        (self.out / "resources.json").write_text(json.dumps(held))
        self._meet("noted")


class RaiseAtStep(pl.Callback):
    """Raise an exception in this rank when the given global step has completed, like a bug in training code."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            # What this process holds in /dev/shm right now, so the test can check it is gone afterwards.
            token = f"-{os.getpid()}."
            held = sorted(p.name for p in Path("/dev/shm").glob("lsh-*") if token in p.name)
            Path(trainer.default_root_dir, f"held-rank{trainer.global_rank}.json").write_text(json.dumps(held))
            raise RuntimeError(f"RaiseAtStep: deliberate failure after step {self.step}")


class WriteResult(pl.Callback):
    """Rank 0 writes the ShardingCallback's epoch reports (inside the rank process, also under ddp_spawn)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            sharding = next(cb for cb in trainer.callbacks if isinstance(cb, ShardingCallback))
            datamodule = type(trainer.datamodule).__name__  # type: ignore[attr-defined]
            self.path.write_text(json.dumps({"epochs": sharding.summary(), "datamodule": datamodule}))


class SkewedReader(SyntheticReader):
    """Synthetic data whose rank-1 listing has one more item, like an object-store listing that lags."""

    def items(self) -> Sequence[Item]:
        items = list(super().items())
        if os.environ.get("LOCAL_RANK") == "1":
            items.append(Item("late-arrival", 5))
        return items


def file_reader(spec: dict[str, Any], cache_dir: Path) -> Any:
    """The file reader a Job's ``data`` names: ``{"format", "urls", "storage_options", "default_cache"}``."""
    from lightning_sharding.readers import FILE_READERS

    cache = None if spec.get("default_cache") else cache_dir  # None: $LIGHTNING_SHARDING_CACHE or ~/.cache
    return FILE_READERS[spec["format"]](spec["urls"], storage_options=spec.get("storage_options"), cache_dir=cache)
