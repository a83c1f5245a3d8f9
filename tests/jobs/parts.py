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
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_sharding import ShardingCallback, SyntheticReader
from lightning_sharding.core.manifest import Item
from lightning_sharding.lightning.progress_bar import train_total


class ReplicatedDDP(DDPStrategy):
    """DDP whose ranks form model replicas of ``replica`` ranks each, as tensor parallelism makes them:
    ranks ``d*T .. d*T+T-1`` are replica ``d`` (the data-parallel dimension outermost, like
    ``ModelParallelStrategy``'s mesh). It says so where Lightning looks, ``distributed_sampler_kwargs``;
    the gradients are still averaged over every rank, which the tests' model accounts for."""

    def __init__(self, replica: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.replica = replica

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size // self.replica, "rank": self.global_rank // self.replica}


def replica_of(replica: int, trainer: pl.Trainer) -> tuple[int, int]:
    """A user's ``data_parallel=`` function for a mesh Lightning cannot see: replicas of ``replica`` ranks."""
    return trainer.global_rank // replica, trainer.world_size // replica


def trained_ids(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The samples a batch trains: its ``id`` of rows not flagged as padding; of packed token
    sequences (tests/support/data/tokens.py), every token of rows not flagged, but padding (id 0)."""
    if "input_ids" not in batch:
        return batch["id"][~batch["is_padding"]]
    tokens = batch["input_ids"][~batch["is_padding"]]
    return tokens[tokens != 0]


class RecordingModel(pl.LightningModule):
    """A tiny regression model that writes down every sample id its training steps used.

    With ``count_weights``, it also holds one float64 weight per sample id, trained by SGD with
    learning rate 1 on ``-w[ids].sum()`` (padding left out, scaled by the data-parallel size and the
    accumulation so that DDP's averaging and Lightning's loss division cancel): after training,
    ``w[i]`` counts how many times sample ``i``'s gradient was applied, in the weights themselves.
    Rank 0 saves ``w`` at every epoch's end to ``<out>/w-<segment>-epoch<E>.npy``.

    ``save_at_batches`` calls ``trainer.save_checkpoint`` from this module's ``on_train_batch_end``
    at those batches of the segment (1-based); ``raise_at_batch`` raises inside ``training_step``.
    """

    def __init__(
        self,
        log_path: str,
        count_weights: bool = False,
        save_at_batches: Sequence[int] = (),
        save_dir: str | None = None,
        raise_at_batch: int | None = None,
        stream_losses: bool = False,
    ) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.stream_losses = stream_losses  # hand per-sample losses to a MixtureController
        self.log_path = log_path
        self.count_weights = count_weights
        self.save_at_batches, self.save_dir = set(save_at_batches), save_dir
        self.raise_at_batch = raise_at_batch
        self._batches = 0

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.count_weights and not hasattr(self, "w"):
            # One weight per sample (of a mixture too, whose epoch may draw more or fewer); of packed
            # tokens, one per token id (tests/support/data/tokens.py: ids 1..T, 0 pads).
            manifest = self.trainer.datamodule.manifest  # type: ignore[attr-defined]
            packed = [manifest.epochs] if hasattr(manifest.epochs, "packing") else []
            mixture = getattr(manifest.epochs, "mixture", None)  # a mixture's, also under control
            packed = packed or [e for e in getattr(mixture, "stream_epochs", ()) if e is not None]
            total = sum(e.tokens for e in packed) + 1 if packed else int(manifest.counts.sum())
            self.w = torch.nn.Parameter(torch.zeros(total, dtype=torch.float64))

    def configure_model(self) -> None:
        """Nothing to shard: ``ModelParallelStrategy`` only asks that the hook exists."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._last = batch
        self._batches += 1
        if self._batches == self.raise_at_batch:
            raise RuntimeError(f"RecordingModel: deliberate failure in training_step of batch {self._batches}")
        if "input_ids" in batch:
            loss = sum(p.sum() for p in self.layer.parameters()) * 0.0  # the layer takes part in every step (DDP)
            if self.stream_losses:  # a loss per sequence: its trained tokens' count, so streams differ
                from lightning_sharding.lightning.controller import log_stream_loss

                log_stream_loss(self, (batch["input_ids"] != 0).sum(dim=1).double(), batch)
        elif self.stream_losses:
            from lightning_sharding.lightning.controller import log_stream_loss

            per_sample = (self.layer(batch["x"]).squeeze(-1) - batch["y"]) ** 2
            log_stream_loss(self, per_sample, batch)
            loss = per_sample.mean()
        else:
            loss = torch.nn.functional.mse_loss(self.layer(batch["x"]).squeeze(-1), batch["y"])
        if self.count_weights:
            ids = trained_ids(batch)
            # DDP averages over every rank; the ranks of a model replica add the same gradient.
            replicas = self.trainer.datamodule.world.data_size  # type: ignore[attr-defined]
            scale = replicas * self.trainer.accumulate_grad_batches
            loss = loss - self.w[ids].sum() * scale
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch["x"]).squeeze(-1), batch["y"]))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pad = batch["is_padding"]
        record = {
            "epoch": self.trainer.current_epoch,
            "gs": self.trainer.global_step,
            # A token's id less 1: the corpus's tokens are samples 0..T-1 to the records' checks.
            "ids": (trained_ids(batch) - 1).tolist() if "input_ids" in batch else batch["id"][~pad].tolist(),
            "pad": int(pad.sum()),
            "k": batch_idx + 1,
            "bar": train_total(self.trainer.progress_bar_callback),
            "pid": os.getpid(),  # the rank's process: the owner named in its /dev/shm files
        }
        path = f"{self.log_path}-rank{self.trainer.global_rank}.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._batches in self.save_at_batches:
            self.trainer.save_checkpoint(Path(str(self.save_dir), f"module-b{self._batches}.ckpt"))

    def on_train_epoch_end(self) -> None:
        if self.count_weights and self.trainer.is_global_zero:
            segment = Path(self.log_path).name.removeprefix("seen-")
            path = Path(self.log_path).parent / f"w-{segment}-epoch{self.trainer.current_epoch}.npy"
            np.save(path, self.w.detach().cpu().numpy())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups: list[dict[str, Any]] = [{"params": self.layer.parameters(), "lr": 0.01}]
        if self.count_weights:
            groups.append({"params": [self.w], "lr": 1.0})
        return torch.optim.SGD(groups, lr=0.01)


class SaveAt(pl.Callback):
    """A user's own callback calling ``trainer.save_checkpoint`` at given batches of the segment
    (1-based): from ``on_train_batch_end``, or by sending itself SIGUSR1 with Lightning's SLURM
    auto-requeue handler installed, from ``on_before_optimizer_step`` (inside a step, after the
    backward pass: ``hook="signal_in_step"``) or ``on_train_batch_start`` (between steps:
    ``hook="signal_between_steps"``); the handler writes ``hpc_ckpt_N.ckpt`` into the trainer's
    root directory, as on a SLURM cluster."""

    def __init__(self, name: str, batches: Sequence[int], save_dir: str, hook: str = "train_batch_end") -> None:
        self.name, self.batches, self.save_dir, self.hook = name, set(batches), save_dir, hook
        self._batches = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._batches += 1
        if self.hook == "signal_between_steps":
            self._save(trainer, "signal_between_steps")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._save(trainer, "signal_in_step")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._save(trainer, "train_batch_end")

    def _save(self, trainer: pl.Trainer, hook: str) -> None:
        if hook != self.hook or self._batches not in self.batches:
            return
        if hook == "train_batch_end":
            trainer.save_checkpoint(Path(self.save_dir, f"{self.name}-b{self._batches}.ckpt"))
            return
        # Lightning's own SLURM handler: it saves hpc_ckpt_N.ckpt, then asks scontrol to requeue
        # (absent here: it logs that the requeue failed, as on a machine without SLURM).
        os.environ.setdefault("SLURM_JOB_ID", "4242")
        handler = trainer._signal_connector._slurm_sigusr_handler_fn
        signal.signal(signal.SIGUSR1, handler)
        os.kill(os.getpid(), signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


class DieAtStep(pl.Callback):
    """SIGKILL this rank when the given global step has completed (after checkpoints of that step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            # What this rank holds in /dev/shm as it dies, so a test sees what the kill left even
            # when a concurrent run's start sweeps it first (every fit sweeps what dead runs left).
            token = f"-{os.getpid()}."
            held = sorted(p.name for p in Path("/dev/shm").glob("lsh-*") if token in p.name)
            note = Path(trainer.default_root_dir, f"killed-holding-rank{trainer.global_rank}.json")
            note.write_text(json.dumps(held))
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
            from tests.support.resources import snapshot

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
    note what this job's whole process group holds (``<out>/resources.json``, see tests/support/resources.py),
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
        from tests.support.resources import snapshot

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
    """The file reader a Job's ``data`` names: ``{"format", "urls", "storage_options", "default_cache",
    "cache_dir", "cache_limit", "index_once_per", "cache_per_node"}``; ``cache_per_node`` gives each
    torchrun node a cache directory of its own, like machines that share no disk."""
    from lightning_sharding.readers import FILE_READERS

    cache = None if spec.get("default_cache") else spec.get("cache_dir", cache_dir)  # None: the default cache
    if spec.get("cache_per_node"):
        cache = Path(cache) / f"node{os.environ.get('GROUP_RANK', '0')}"
    options = dict(storage_options=spec.get("storage_options"), cache_limit=spec.get("cache_limit"))
    options["index_once_per"] = spec.get("index_once_per", "job")
    return FILE_READERS[spec["format"]](spec["urls"], cache_dir=cache, **options)


def rotating_shares(stats: Any) -> dict[str, float]:
    """A policy for the process tests: by the decision's step, one stream 3, the next 1, the third
    nothing (so every decision moves the shares a lot); it also checks what it is handed."""
    names = list(stats.shares)
    assert sum(stats.samples.values()) > 0 and set(stats.loss) == set(names), stats
    k = stats.step % len(names)
    return {names[k]: 3.0, names[(k + 1) % len(names)]: 1.0}


class WriteDecisions(pl.Callback):
    """Writes the data ledger's mixture decisions at the end of fitting (rank 0)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            decisions = trainer.datamodule.ledger.decisions  # type: ignore[attr-defined]
            self.path.write_text(json.dumps(decisions))


class StatsLogged:
    """A policy that first appends what it is handed (step, samples per stream) to ``path``."""

    def __init__(self, policy: Any, path: Path) -> None:
        self.policy, self.path = policy, path

    def __call__(self, stats: Any) -> Any:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": stats.step, "samples": stats.samples}) + "\n")
        return self.policy(stats)


def controller_of(spec: dict[str, Any], path: Path) -> list[pl.Callback]:
    """The MixtureController a job's ``controller`` spec asks for (its policy's statistics logged to
    ``stats-<segment>.jsonl`` beside ``path``), and the callback writing its decisions to ``path``."""
    from lightning_sharding.lightning.controller import MixtureController

    stats = path.with_name(path.name.replace("decisions-", "stats-").replace(".json", ".jsonl"))
    policy = StatsLogged(rotating_shares, stats) if spec.get("policy") == "rotate" else None
    return [MixtureController(policy, spec["every"], decisions=spec.get("decisions") or ()), WriteDecisions(path)]
