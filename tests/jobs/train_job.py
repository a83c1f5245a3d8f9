"""One training segment for the process tests: a real Trainer, real DDP over gloo, real workers.

Run as ``python tests/jobs/train_job.py CONFIG.json``. Every rank appends one JSON line per
completed training batch to ``<out>/seen-<segment>-rank<r>.jsonl`` (epoch, global step after the
batch, sample ids, padding count). ``die_at_step`` SIGKILLs every rank right after that step ends,
like a preempted job; checkpoints written before it are what a resume starts from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def main(config_path: str) -> None:
    # Heavy imports stay inside main(): spawned DataLoader workers re-import this file as
    # __mp_main__ and should not pay for importing Lightning.
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_sharding import ShardedDataModule, SyntheticReader
    from lightning_sharding.callbacks import ReleaseProcessGroup
    from lightning_sharding.datasets import to_regression
    from tests.jobs.parts import (
        DieAtStep,
        KillGroupAtStep,
        KillHelperAtStep,
        RaiseAtStep,
        RecordingModel,
        SkewedReader,
        SnapshotAtStep,
        WriteResult,
        file_reader,
    )
    from tests.jobs.windows_data import MonthWindows

    cfg = json.loads(Path(config_path).read_text())
    out = Path(cfg["out"])
    transform = None
    data: dict[str, Any] = {}
    if cfg["strategy"] == "dispatch":
        from tests.jobs.sources import make_source, row_to_sample

        data = dict(source=make_source(cfg["source"]))
        transform = row_to_sample
    elif cfg["strategy"] == "broadcast":
        months = sorted(str(p) for p in Path(cfg["months"]).glob("month-*.npy"))
        data = dict(reader=MonthWindows(months, window=cfg["window"], stride=cfg["stride"], halo=cfg["halo"]))
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
        from lightning_sharding.dali import DaliDataModule

        dm: ShardedDataModule = DaliDataModule(data["reader"], **common)
    else:
        dm = ShardedDataModule(
            **data,
            persistent_workers=cfg["persistent_workers"] and cfg["num_workers"] > 0,
            multiprocessing_context="spawn" if cfg["num_workers"] > 0 else None,
            strategy=cfg["strategy"],
            prefetch_items=cfg["prefetch_items"],
            **common,
        )
    model = RecordingModel(str(out / f"seen-{cfg['segment']}"))
    callbacks: list[pl.Callback] = [WriteResult(out / f"result-{cfg['segment']}.json"), ReleaseProcessGroup()]
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
    if cfg["kill_group"]:
        kill = cfg["kill_group"]
        callbacks.append(KillGroupAtStep(kill["step"], kill["rank"], kill["moment"]))
    if cfg["kill_helper"]:
        kill, mark = cfg["kill_helper"], out / f"fault-{cfg['segment']}.json"
        callbacks.append(KillHelperAtStep(kill["step"], kill["rank"], kill["process"], mark))
    if cfg["snapshot"]:
        callbacks.append(SnapshotAtStep(cfg["snapshot"]["step"], out, Path(cfg["snapshot"]["other"])))
    if cfg["raise_at_step"]:
        callbacks.append(RaiseAtStep(cfg["raise_at_step"]))
    world, nodes = cfg["world_size"], cfg["num_nodes"]
    if cfg["launcher"] == "torchrun":  # one process per rank, started by torchrun on each node
        strategy, devices = "ddp", world // nodes
    else:
        strategy, devices = ("ddp_spawn" if world > 1 else "auto"), world
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        strategy=strategy,
        max_epochs=cfg["epochs"],
        accumulate_grad_batches=cfg["accumulate"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(cfg["checkpoint_every"]),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        limit_train_batches=cfg["limit_train_batches"],
    )
    trainer.fit(model, datamodule=dm, ckpt_path=cfg["resume_from"])


if __name__ == "__main__":
    main(sys.argv[1])
