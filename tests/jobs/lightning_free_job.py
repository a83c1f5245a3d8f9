"""A loop of one's own over ``ShardedData`` that must never import Lightning's Trainer package.

Run as ``python tests/jobs/lightning_free_job.py CONFIG.json`` with ``launcher: "fabric"`` (standalone
``lightning_fabric``; Fabric starts the other rank) or under ``torchrun`` (``launcher: "torchrun"``:
``torch.distributed`` and ``torch.distributed.checkpoint``). Each rank trains a few steps on 2
DataLoader workers, saves (``fabric.save`` or ``dcp.save``), loads the state into a new
``ShardedData`` and writes ``rank<R>.json``: the Lightning modules in ``sys.modules`` (there must be
none of ``lightning`` or ``pytorch_lightning``), whether ``lightning_fabric`` ran, and how many
samples the loaded ledger holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STEPS = 3
BATCH = 4


def main(config_path: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_sharding import ShardedData, SyntheticReader

    cfg = json.loads(Path(config_path).read_text())
    out = Path(cfg["out"])
    fabric = None
    if cfg["launcher"] == "fabric":
        from lightning_fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
        rank = fabric.global_rank
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if fabric is not None:
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)

    def data() -> ShardedData:
        reader = SyntheticReader(4, 32)
        return ShardedData(reader, optimizer=optimizer, world=fabric, batch_size=BATCH, num_workers=2, seed=7)

    train = data()
    for step, batch in enumerate(train.train_loader(0), 1):
        loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
        if fabric is not None:
            fabric.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == STEPS:
            break
    path = out / "ckpt"
    if fabric is not None:
        fabric.save(path, {"model": model, "optimizer": optimizer, "data": train})
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict(), "data": train}, checkpoint_id=path)
    train.close()

    resumed = data()
    if fabric is not None:
        fabric.load(path, {"data": resumed})
    else:
        dcp.load({"data": resumed}, checkpoint_id=path)
    consumed = len(resumed.ledger.consumed)
    resumed.close()
    lightning = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
    report = {"lightning": lightning, "fabric": "lightning_fabric" in sys.modules, "consumed": consumed}
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
