"""One segment of a hand-written training loop over ``ShardedData``: Lightning Fabric or plain PyTorch under torchrun.

Run as ``python tests/jobs/loop_job.py CONFIG.json`` (``launcher: "fabric"``: Fabric starts the
other ranks) or under ``torchrun`` (``launcher: "torchrun"``). The model counts in its weights: one
float64 weight per sample id, trained by SGD with learning rate 1 on ``-w[ids].sum()`` (scaled by the
world size, which DDP's averaging divides out), so ``w[i]`` is how often sample ``i``'s gradient was
applied. The loop steps every ``accumulate`` batches and once more after an epoch's last batch.

Every ``save_every`` batches (after the step, if the batch ends an accumulation window; else inside
the window) it writes a checkpoint ``ckpt-<segment>-<batches>`` by ``save``:
``"fabric"`` (``fabric.save``), ``"dcp"`` (``torch.distributed.checkpoint.save``, a directory) or
``"torch"`` (``data.state_dict()`` on every rank, ``torch.save`` on rank 0). After ``die_after``
batches of the segment (and the checkpoint of that batch) every rank SIGKILLs itself, like a
preempted job. Rank 0 writes the weights at every epoch's end to ``w-<segment>-epoch<E>.npy``.
``rank0_alone``: rank 0 calls ``data.state_dict()`` alone after the first step (a save that forgot
to gather). ``reenter_after``: the first pass of the segment is left after that many batches, and
the loop asks for the same epoch again (it serves the rest; every rank's ledger alike).

``docs``: save and resume as docs/how-to/own-loop.md's examples do, with that page's
``checkpoints.py`` as written there: every ``save_every`` optimizer steps into a new directory
``<out>/ckpt/step-<steps>``, by ``fabric_save`` (``save: "fabric"``) or ``dcp_save`` (``"dcp"``),
and a start resumes from the newest complete one (``resume_from`` is not used).
``kill_in_save``: ``{"step": S, "rank": r, "moment": m}`` SIGKILLs the job's process group from rank
``r`` inside the save of step ``S``, at moment ``m`` (see :func:`kill_inside_saves`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any


def main(config_path: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from lightning_sharding import ShardedData

    cfg = json.loads(Path(config_path).read_text())
    out, segment = Path(cfg["out"]), cfg["segment"]
    fabric = None
    if cfg["launcher"] == "fabric":
        from lightning_fabric import Fabric  # as docs/how-to/own-loop.md imports it

        ranks = cfg["ranks"]
        fabric = Fabric(accelerator="cpu", devices=ranks, strategy="ddp" if ranks > 1 else "auto")
        fabric.launch()
        rank, world_size = fabric.global_rank, fabric.world_size
    else:
        dist.init_process_group("gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    source = _data(cfg)
    module = counting_model(_num_ids(cfg), world_size)
    optimizer = torch.optim.SGD([{"params": module.layer.parameters(), "lr": 0.01}, {"params": [module.w], "lr": 1.0}])
    if fabric is not None:
        model, optimizer = fabric.setup(module, optimizer)
    else:
        model = torch.nn.parallel.DistributedDataParallel(module) if world_size > 1 else module
    options: dict[str, Any] = dict(batch_size=8, num_workers=cfg["workers"], seed=1234, transport="torch")
    data = ShardedData(**source, **options, optimizer=optimizer, world=fabric, gather_timeout=cfg["gather_timeout"])
    resume = cfg["resume_from"]
    docs = cfg.get("docs", False)
    steps = 0  # optimizer steps over the whole run (under ``docs``)
    if docs:
        checkpoints = docs_checkpoints()
        root = out / "ckpt"
        state = {"model": module, "optimizer": optimizer, "data": data}
        saving: dict[str, int] = {}  # the step being saved, for kill_inside_saves
        if cfg.get("kill_in_save"):
            kill_inside_saves(cfg["kill_in_save"], rank, saving)
        if cfg["save"] == "fabric":
            steps = checkpoints.fabric_resume(fabric, root, state)
        else:
            steps = checkpoints.dcp_resume(root, module, data)
    elif resume:
        _load(resume, module, optimizer, data, fabric)
    batches = 0
    accumulate = cfg["accumulate"]

    def step() -> None:
        nonlocal steps
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if cfg["rank0_alone"] and rank == 0:
            data.state_dict()  # the other ranks never call it
        if docs and steps % cfg["save_every"] == 0:
            saving["step"] = steps
            if cfg["save"] == "fabric":
                checkpoints.fabric_save(fabric, root, state, steps)
            else:
                checkpoints.dcp_save(root, module, data, steps)

    def after_batch() -> None:
        if not docs and batches % cfg["save_every"] == 0:  # with accumulation, also inside a window
            _save(out / f"ckpt-{segment}-{batches:03d}", cfg["save"], module, optimizer, data, fabric, rank)
            _report_modules(out, segment, rank)
        if batches == cfg["die_after"]:
            if world_size > 1:
                dist.barrier()  # every rank's part of the checkpoint is written
            os.kill(os.getpid(), signal.SIGKILL)

    reentered = False
    for epoch in range(data.epoch, cfg["epochs"]):
        pending = 0
        left_early = True
        while left_early:
            left_early = False
            for n, batch in enumerate(data.train_loader(epoch), 1):
                ids = batch["id"][~batch["is_padding"]]
                loss = model(batch["x"], batch["y"], ids)
                if fabric is not None:
                    fabric.backward(loss)
                else:
                    loss.backward()
                pending += 1
                batches += 1
                with open(out / f"seen-{segment}-rank{rank}.jsonl", "a") as f:
                    f.write(json.dumps({"epoch": epoch, "ids": ids.tolist()}) + "\n")
                if pending == accumulate:
                    step()
                    pending = 0
                after_batch()
                if n == cfg["reenter_after"] and not reentered:  # leave the pass, then ask for the epoch again
                    reentered = left_early = True
                    break
        if pending:
            step()  # the epoch's last batches, as Lightning steps them
        if rank == 0:
            np.save(out / f"w-{segment}-epoch{epoch}.npy", module.w.detach().numpy())
    data.close()
    _report_modules(out, segment, rank)


def _report_modules(out: Path, segment: str, rank: int) -> None:
    """``modules-<segment>-rank<R>.json``: the Lightning Trainer's modules this loop imported so far
    (after a resume, steps, saves; there must be none: only ``lightning_fabric`` may load)."""
    lightning = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
    (out / f"modules-{segment}-rank{rank}.json").write_text(json.dumps(lightning))


def counting_model(num_ids: int, world_size: int) -> Any:
    """A small regression layer and one weight per sample id, whose loss pulls each trained id's weight up by 1."""
    import torch

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
            self.w = torch.nn.Parameter(torch.zeros(num_ids, dtype=torch.float64))

        def forward(self, x: Any, y: Any, ids: Any) -> Any:
            fit = torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)
            return fit - self.w[ids].sum() * world_size  # DDP averages over the ranks: 1 per applied sample

    return Counting()


def docs_checkpoints() -> Any:
    """The module ``checkpoints.py`` that docs/how-to/own-loop.md's examples import, as the page writes it."""
    import types

    from tests.support.doc_blocks import ROOT, blocks

    block = next(b for b in blocks(ROOT / "docs" / "how-to" / "own-loop.md") if b.title == "checkpoints.py")
    module = types.ModuleType("checkpoints")
    exec(compile(block.text, block.where, "exec"), module.__dict__)
    return module


def kill_inside_saves(kill: dict[str, Any], rank: int, saving: dict[str, int]) -> None:
    """SIGKILL the job's process group from rank ``kill["rank"]`` inside the save of step ``kill["step"]``
    (``saving["step"]`` is the step being saved), at ``kill["moment"]``:

    - ``"dcp parts"``: DCP's writer has written this rank's part; no ``.metadata`` yet.
    - ``"dcp metadata"``: every part and ``.metadata.tmp`` are written; the coordinator (rank 0) is about
      to rename it to ``.metadata``.
    - ``"fabric write"``: half of ``fabric.save``'s file is at its path, as a move that copies leaves it
      (fsspec moves its temporary file from ``/tmp``: a copy when that is another file system).
    - ``"fabric written"``: rank 0 has written the whole file; ``fabric.save``'s closing barrier not passed.

    Under torchrun a rank has a process group of its own: torchrun stops the other ranks."""
    import io

    import torch
    import torch.distributed.checkpoint.filesystem as dcp_files
    from lightning_fabric.plugins.io import torch_io

    def due() -> bool:
        return rank == kill["rank"] and saving.get("step") == kill["step"]

    def die() -> None:
        os.killpg(os.getpgid(0), signal.SIGKILL)

    moment = kill["moment"]
    if moment == "dcp parts":
        write_data = dcp_files.FileSystemWriter.write_data

        def write_parts(self: Any, *args: Any, **kwargs: Any) -> Any:
            written = write_data(self, *args, **kwargs)
            if due():
                written.wait()
                die()
            return written

        dcp_files.FileSystemWriter.write_data = write_parts
    elif moment == "dcp metadata":
        rename = dcp_files.FileSystem.rename

        def rename_metadata(self: Any, path: Any, new_path: Any) -> None:
            if due() and Path(new_path).name == ".metadata":
                die()
            rename(self, path, new_path)

        dcp_files.FileSystem.rename = rename_metadata
    elif moment in ("fabric write", "fabric written"):
        atomic_save = torch_io._atomic_save

        def save_file(checkpoint: dict[str, Any], filepath: Any) -> None:
            if due() and moment == "fabric write":
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                Path(filepath).write_bytes(buffer.getvalue()[: buffer.tell() // 2])
                die()
            atomic_save(checkpoint, filepath)
            if due():
                die()

        torch_io._atomic_save = save_file
    else:
        raise ValueError(f"kill_in_save: no moment {moment!r}")


def _data(cfg: dict[str, Any]) -> dict[str, Any]:
    from lightning_sharding import SyntheticReader
    from tests.support.data.streams import make_streams

    if cfg["streams"]:
        return dict(streams=make_streams(cfg["streams"]), samples_per_epoch=cfg["samples_per_epoch"])
    return dict(reader=SyntheticReader(sizes=cfg["sizes"]))


def _num_ids(cfg: dict[str, Any]) -> int:
    if cfg["streams"]:
        return sum(sum(s["sizes"]) for s in cfg["streams"])
    return sum(cfg["sizes"])


def _save(path: Path, how: str, module: Any, optimizer: Any, data: Any, fabric: Any, rank: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    if how == "fabric":
        fabric.save(path, {"model": module, "optimizer": optimizer, "data": data})
    elif how == "dcp":
        dcp.save({"model": module.state_dict(), "data": data}, checkpoint_id=str(path))
    else:
        state = data.state_dict()  # on every rank: it gathers
        if rank == 0:
            torch.save({"model": module.state_dict(), "data": state}, path)


def _load(path: str, module: Any, optimizer: Any, data: Any, fabric: Any) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    if Path(path).is_dir():  # a DCP checkpoint, written on any number of ranks
        state = {"model": module.state_dict(), "data": data}
        dcp.load(state, checkpoint_id=path)
        module.load_state_dict(state["model"])
    elif fabric is not None:
        fabric.load(path, {"model": module, "optimizer": optimizer, "data": data})
    else:
        state = torch.load(path, weights_only=True)
        module.load_state_dict(state["model"])
        data.load_state_dict(state["data"])


if __name__ == "__main__":
    main(sys.argv[1])
