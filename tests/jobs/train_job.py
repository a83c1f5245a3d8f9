"""One training segment for the process tests: a real Trainer, real DDP over gloo, real workers.

Run as ``python tests/jobs/train_job.py CONFIG.json``. Every rank appends one JSON line per
completed training batch to ``<out>/seen-<segment>-rank<r>.jsonl`` (epoch, global step after the
batch, sample ids, padding count). ``die_at_step`` SIGKILLs every rank right after that step ends,
like a preempted job; checkpoints written before it are what a resume starts from.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any


def main(config_path: str) -> None:
    # Heavy imports stay inside main(): spawned DataLoader workers re-import this file as
    # __mp_main__ and should not pay for importing Lightning.
    import lightning.pytorch as pl

    cfg = json.loads(Path(config_path).read_text())
    out = Path(cfg["out"])
    if cfg["resume_each"]:  # one fresh DataModule and Trainer per checkpoint, in this one process
        for ckpt in cfg["resume_each"]:
            trainer, model = _trainer(pl, cfg, out, f"{cfg['segment']}-{Path(ckpt).stem}")
            trainer.fit(model, datamodule=_datamodule(cfg, out), ckpt_path=ckpt)
        return
    trainer, model = _trainer(pl, cfg, out, cfg["segment"])
    trainer.fit(model, datamodule=_datamodule(cfg, out), ckpt_path=cfg["resume_from"])


def _datamodule(cfg: dict[str, Any], out: Path) -> Any:
    """The segment's DataModule, as the config says."""
    from lightning_sharding import ShardedDataModule, SyntheticReader
    from lightning_sharding.recipes.synthetic_files import to_regression
    from tests.jobs.parts import SkewedReader, file_reader, replica_of
    from tests.jobs.windows_data import MonthWindows

    transform = None
    data: dict[str, Any] = {}
    if cfg["strategy"] == "dispatch":
        from tests.jobs.sources import make_source, row_to_sample

        data = dict(source=make_source(cfg["source"]))
        transform = row_to_sample
    elif cfg["strategy"] == "broadcast":
        months = sorted(str(p) for p in Path(cfg["months"]).glob("month-*.npy"))
        data = dict(reader=MonthWindows(months, window=cfg["window"], stride=cfg["stride"], halo=cfg["halo"]))
    elif cfg["streams"]:
        from tests.jobs.streams_data import make_streams

        data = dict(
            streams=make_streams(cfg["streams"]),
            samples_per_epoch=cfg["samples_per_epoch"],
            batch_composition=cfg["batch_composition"],
            allow_mixture_change=cfg["allow_mixture_change"],
        )
    elif cfg["data"]:
        data, transform = dict(reader=file_reader(cfg["data"], cache_dir=out / "cache")), to_regression
    else:
        data = dict(reader=(SkewedReader if cfg["skew_rank1"] else SyntheticReader)(sizes=cfg["sizes"]))
    common = dict(
        transform=transform,
        on_error=cfg["on_error"],
        batch_size=cfg["batch_size"],
        num_workers=cfg["num_workers"],
        seed=cfg["seed"],
        even_batches=cfg["even_batches"],
        audit_dir=str(out / "audit") if cfg["audit"] else None,
    )
    if cfg.get("loader", "dataloader") == "dali":
        from lightning_sharding.lightning.dali import DaliDataModule

        dm: ShardedDataModule = DaliDataModule(data["reader"], **common)
    else:
        dm = ShardedDataModule(
            **data,
            persistent_workers=cfg["persistent_workers"] and cfg["num_workers"] > 0,
            multiprocessing_context="spawn" if cfg["num_workers"] > 0 else None,
            strategy=cfg["strategy"],
            data_parallel=partial(replica_of, cfg["tensor_parallel"]) if cfg["data_parallel_override"] else None,
            prefetch_items=cfg["prefetch_items"],
            val_reader=SyntheticReader(sizes=[16, 16]) if cfg["val_check_interval"] else None,
            **common,
        )
        dm.transport = cfg["transport"]  # a loader option: set as an attribute, checked again
    return dm


def _trainer(pl: Any, cfg: dict[str, Any], out: Path, segment: str) -> tuple[Any, Any]:
    """The Trainer and the model of one segment, with every callback the config asks for."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    from lightning_sharding.lightning.callbacks import ReleaseProcessGroup, ShardingCallback
    from tests.jobs.parts import (
        DieAtStep,
        KillGroupAtStep,
        KillHelperAtStep,
        RaiseAtStep,
        RecordingModel,
        SaveAt,
        SnapshotAtStep,
        WriteResult,
    )

    saves = out / "saves"
    saves.mkdir(parents=True, exist_ok=True)
    model = RecordingModel(
        str(out / f"seen-{segment}"),
        count_weights=cfg["count_weights"],
        save_at_batches=cfg["module_saves"],
        save_dir=str(saves),
        raise_at_batch=cfg["raise_in_step_at_batch"],
    )
    callbacks: list[pl.Callback] = [WriteResult(out / f"result-{segment}.json"), ReleaseProcessGroup()]
    user_saves = [
        (SaveAt(s["name"], s["batches"], str(saves), s.get("hook", "train_batch_end")), bool(s.get("after")))
        for s in cfg["saves"]
    ]
    callbacks += [cb for cb, after in user_saves if not after]
    if any(after for _, after in user_saves):  # placed explicitly, ahead of the callbacks that come after it
        callbacks.append(ShardingCallback())
        callbacks += [cb for cb, after in user_saves if after]
    if cfg["checkpoint_every"]:
        callbacks.append(
            ModelCheckpoint(
                dirpath=out / "checkpoints",
                every_n_train_steps=cfg["checkpoint_every"],
                save_top_k=-1,
                filename=f"{segment}-{{epoch}}-{{step}}",
            )
        )
    if cfg["every_n_epochs"]:
        callbacks.append(
            ModelCheckpoint(
                dirpath=saves,
                every_n_epochs=cfg["every_n_epochs"],
                save_on_train_epoch_end=True,
                save_top_k=-1,
                filename=f"{segment}-epoch-end-{{epoch}}-{{step}}",
            )
        )
    if cfg["val_check_interval"]:
        callbacks.append(
            ModelCheckpoint(
                dirpath=saves,
                monitor="val_loss",  # also makes its state key differ from the every_n_epochs one
                save_on_train_epoch_end=False,
                save_top_k=-1,
                filename=f"{segment}-val-end-{{step}}",
            )
        )
    if cfg["raise_in_step_at_batch"]:
        callbacks.append(OnExceptionCheckpoint(dirpath=saves, filename=f"{segment}-on-exception"))
    if cfg["die_at_step"]:
        callbacks.append(DieAtStep(cfg["die_at_step"]))
    if cfg["kill_group"]:
        kill = cfg["kill_group"]
        callbacks.append(KillGroupAtStep(kill["step"], kill["rank"], kill["moment"]))
    if cfg["kill_helper"]:
        kill, mark = cfg["kill_helper"], out / f"fault-{segment}.json"
        callbacks.append(KillHelperAtStep(kill["step"], kill["rank"], kill["process"], mark))
    if cfg["snapshot"]:
        callbacks.append(SnapshotAtStep(cfg["snapshot"]["step"], out, Path(cfg["snapshot"]["other"])))
    if cfg["raise_at_step"]:
        callbacks.append(RaiseAtStep(cfg["raise_at_step"]))
    world, nodes = cfg["world_size"], cfg["num_nodes"]
    if cfg["resume_each"]:
        strategy, devices = "auto", 1
    elif cfg["launcher"] == "torchrun":  # one process per rank, started by torchrun on each node
        strategy, devices = "ddp", world // nodes
    else:
        strategy, devices = ("ddp_spawn" if world > 1 else "auto"), world
    if cfg["model_parallel"]:  # started like ddp: the script runs again for each further rank
        from lightning.pytorch.strategies import ModelParallelStrategy

        replica = cfg["tensor_parallel"]
        strategy = ModelParallelStrategy(data_parallel_size=world // replica, tensor_parallel_size=replica)
    elif cfg["tensor_parallel"] > 1 and not cfg["data_parallel_override"]:
        from tests.jobs.parts import ReplicatedDDP

        start = "spawn" if cfg["launcher"] == "spawn" else "popen"
        strategy = ReplicatedDDP(cfg["tensor_parallel"], start_method=start)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        strategy=strategy,
        max_epochs=cfg["epochs"],
        accumulate_grad_batches=cfg["accumulate"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(cfg["checkpoint_every"] or cfg["every_n_epochs"] or cfg["val_check_interval"]),
        enable_progress_bar=cfg["progress_bar"],
        enable_model_summary=False,
        default_root_dir=str(out),
        limit_train_batches=cfg["limit_train_batches"],
        val_check_interval=cfg["val_check_interval"],
        num_sanity_val_steps=0,
    )
    return trainer, model


if __name__ == "__main__":
    main(sys.argv[1])
