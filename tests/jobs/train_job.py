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

    cfg = json.loads(Path(config_path).read_text())  # tests/support/harness.py::Job, part by part
    out = Path(cfg["out"])
    training = cfg["training"]
    if training["resume_each"]:  # one fresh DataModule and Trainer per checkpoint, in this one process
        for ckpt in training["resume_each"]:
            trainer, model = _trainer(pl, cfg, out, f"{cfg['segment']}-{Path(ckpt).stem}")
            trainer.fit(model, datamodule=_datamodule(cfg, out), ckpt_path=ckpt)
        return
    trainer, model = _trainer(pl, cfg, out, cfg["segment"])
    trainer.fit(model, datamodule=_datamodule(cfg, out), ckpt_path=training["resume_from"])


def _datamodule(cfg: dict[str, Any], out: Path) -> Any:
    """The segment's DataModule, as the config says."""
    from lightning_sharding import ShardedDataModule, SyntheticReader
    from lightning_sharding.recipes.synthetic_files import to_regression
    from tests.jobs.parts import SkewedReader, file_reader, replica_of
    from tests.support.data.windows import MonthWindows

    spec, loading, topology = cfg["data"], cfg["loading"], cfg["topology"]
    transform = None
    data: dict[str, Any] = {}
    if loading["sharding"] == "dispatch":
        from tests.support.data.sources import make_source, row_to_sample

        data = dict(source=make_source(spec["source"]))
        transform = row_to_sample
    elif loading["sharding"] == "broadcast":
        months = sorted(str(p) for p in Path(spec["months"]).glob("month-*.npy"))
        data = dict(reader=MonthWindows(months, window=spec["window"], stride=spec["stride"], halo=spec["halo"]))
    elif spec["tokens"]:
        from tests.support.data.tokens import packed_reader, packed_spec, packed_streams

        tokens = spec["tokens"]
        if tokens.get("streams"):  # a mixture of token streams, each packed the same way
            data = dict(
                streams=packed_streams(tokens["streams"], tokens.get("shares")),
                packing=packed_spec(tokens),
                schedule=spec["schedule"],
                allow_mixture_change=spec["allow_mixture_change"],
            )
        else:
            data = dict(reader=packed_reader(tokens["dir"], **tokens.get("options", {})), packing=packed_spec(tokens))
    elif spec["streams"]:
        from tests.support.data.streams import make_streams

        data = dict(
            streams=make_streams(spec["streams"]),
            samples_per_epoch=spec["samples_per_epoch"],
            batch_composition=spec["batch_composition"],
            schedule=spec["schedule"],
            allow_mixture_change=spec["allow_mixture_change"],
        )
    elif spec["files"]:
        data, transform = dict(reader=file_reader(spec["files"], cache_dir=out / "cache")), to_regression
    else:
        data = dict(reader=(SkewedReader if spec["skew_rank1"] else SyntheticReader)(sizes=spec["sizes"]))
    workers = topology["num_workers"]
    common = dict(
        transform=transform,
        on_error=loading["on_error"],
        batch_size=loading["batch_size"],
        num_workers=workers,
        seed=loading["seed"],
        even_batches=loading["even_batches"],
        audit_dir=str(out / "audit") if cfg["checks"]["audit"] else None,
        **({"skip": cfg["training"]["skip"]} if cfg["training"].get("skip") is not None else {}),
    )
    if loading["loader"] == "dali":
        from lightning_sharding.lightning.dali import DaliDataModule

        dm: ShardedDataModule = DaliDataModule(data["reader"], **common)
    else:
        replicas = topology["tensor_parallel"]
        dm = ShardedDataModule(
            **data,
            persistent_workers=loading["persistent_workers"] and workers > 0,
            multiprocessing_context=loading["start_method"] if workers > 0 else None,
            sharding=_strategy(loading),
            data_parallel=partial(replica_of, replicas) if topology["data_parallel_override"] else None,
            val_reader=SyntheticReader(sizes=[16, 16]) if cfg["saves"]["val_check_interval"] else None,
            **common,
        )
    return dm


def _strategy(loading: dict[str, Any]) -> Any:
    """The strategy ``loading["sharding"]`` names, with the settings of the harness it takes."""
    import inspect

    from lightning_sharding.strategies import get_strategy

    taken = inspect.signature(type(get_strategy(loading["sharding"]))).parameters
    settings = {key: loading[key] for key in ("transport", "prefetch_items") if key in taken}
    return get_strategy(loading["sharding"], **settings)


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

    topology, training, checks = cfg["topology"], cfg["training"], cfg["checks"]
    save, faults = cfg["saves"], cfg["faults"]
    saves = out / "saves"
    saves.mkdir(parents=True, exist_ok=True)
    model = RecordingModel(
        str(out / f"seen-{segment}"),
        count_weights=checks["count_weights"],
        save_at_batches=save["module_saves"],
        save_dir=str(saves),
        raise_at_batch=faults["raise_in_step_at_batch"],
        stream_losses=bool(cfg["data"]["controller"]),
    )
    callbacks: list[pl.Callback] = [WriteResult(out / f"result-{segment}.json"), ReleaseProcessGroup()]
    user_saves = [
        (SaveAt(s["name"], s["batches"], str(saves), s.get("hook", "train_batch_end")), bool(s.get("after")))
        for s in save["callbacks"]
    ]
    callbacks += [cb for cb, after in user_saves if not after]
    if any(after for _, after in user_saves):  # placed explicitly, ahead of the callbacks that come after it
        callbacks.append(ShardingCallback())
        callbacks += [cb for cb, after in user_saves if after]
    if save["checkpoint_every"]:
        callbacks.append(
            ModelCheckpoint(
                dirpath=out / "checkpoints",
                every_n_train_steps=save["checkpoint_every"],
                save_top_k=-1,
                filename=f"{segment}-{{epoch}}-{{step}}",
            )
        )
    if save["every_n_epochs"]:
        callbacks.append(
            ModelCheckpoint(
                dirpath=saves,
                every_n_epochs=save["every_n_epochs"],
                save_on_train_epoch_end=True,
                save_top_k=-1,
                filename=f"{segment}-epoch-end-{{epoch}}-{{step}}",
            )
        )
    if save["val_check_interval"]:
        callbacks.append(
            ModelCheckpoint(
                dirpath=saves,
                monitor="val_loss",  # also makes its state key differ from the every_n_epochs one
                save_on_train_epoch_end=False,
                save_top_k=-1,
                filename=f"{segment}-val-end-{{step}}",
            )
        )
    if faults["raise_in_step_at_batch"]:
        callbacks.append(OnExceptionCheckpoint(dirpath=saves, filename=f"{segment}-on-exception"))
    if cfg["data"]["controller"]:  # before the kill: a decision of the step is made before it dies
        from tests.jobs.parts import controller_of

        callbacks += controller_of(cfg["data"]["controller"], out / f"decisions-{segment}.json")
    if faults["die_at_step"]:
        callbacks.append(DieAtStep(faults["die_at_step"]))
    if faults["kill_group"]:
        kill = faults["kill_group"]
        callbacks.append(KillGroupAtStep(kill["step"], kill["rank"], kill["moment"]))
    if faults["kill_helper"]:
        kill, mark = faults["kill_helper"], out / f"fault-{segment}.json"
        callbacks.append(KillHelperAtStep(kill["step"], kill["rank"], kill["process"], mark))
    if checks["snapshot"]:
        callbacks.append(SnapshotAtStep(checks["snapshot"]["step"], out, Path(checks["snapshot"]["other"])))
    if faults["raise_at_step"]:
        callbacks.append(RaiseAtStep(faults["raise_at_step"]))
    world, nodes = topology["world_size"], topology["num_nodes"]
    if training["resume_each"]:
        strategy, devices = "auto", 1
    elif topology["launcher"] == "torchrun":  # one process per rank, started by torchrun on each node
        strategy, devices = "ddp", world // nodes
    elif topology["launcher"] == "ddp":  # Lightning's own launcher: this script runs again for each further rank
        strategy, devices = ("ddp" if world > 1 else "auto"), world
    elif topology["launcher"] == "fork":  # Lightning's ddp_fork: this process forks every rank
        strategy, devices = ("ddp_fork" if world > 1 else "auto"), world
    else:
        strategy, devices = ("ddp_spawn" if world > 1 else "auto"), world
    if topology["model_parallel"]:  # started like ddp: the script runs again for each further rank
        from lightning.pytorch.strategies import ModelParallelStrategy

        replica = topology["tensor_parallel"]
        strategy = ModelParallelStrategy(data_parallel_size=world // replica, tensor_parallel_size=replica)
    elif topology["tensor_parallel"] > 1 and not topology["data_parallel_override"]:
        from tests.jobs.parts import ReplicatedDDP

        start = {"spawn": "spawn", "fork": "fork"}.get(topology["launcher"], "popen")
        strategy = ReplicatedDDP(topology["tensor_parallel"], start_method=start)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        strategy=strategy,
        max_epochs=training["epochs"],
        accumulate_grad_batches=training["accumulate"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(save["checkpoint_every"] or save["every_n_epochs"] or save["val_check_interval"]),
        enable_progress_bar=checks["progress_bar"],
        enable_model_summary=False,
        default_root_dir=str(out),
        limit_train_batches=training["limit_train_batches"],
        val_check_interval=save["val_check_interval"],
        num_sanity_val_steps=0,
    )
    return trainer, model


if __name__ == "__main__":
    main(sys.argv[1])
