"""Long run: many epochs with persistent workers; does anything grow? One process, one rank, 2 workers.

Run: ``python -m benchmarks.long_run [--epochs 20] [--strategies shard,broadcast,dispatch] [--json F]``
(about a minute per strategy on 2 cores). At the end of every epoch it reads, for the training
process and each helper process (DataLoader workers, the dispatch process):

- resident memory (``VmRSS`` of ``/proc/<pid>/status``);
- open file descriptors (``/proc/<pid>/fd``);
- ``/dev/shm`` entries of the run: the ``lsh-*`` files its training process owns, plus every
  ``/dev/shm`` file any of its processes holds open or mapped (other jobs on the machine are not
  counted); and, apart, files unlinked but still open or mapped (PyTorch's shared tensors).

Targets (issue 11): from the end of epoch 2 to the last epoch, each process's RSS grows < 5%, and
neither descriptors nor ``/dev/shm`` entries grow. The helper processes must be the same ones
throughout (persistent workers), or the figures would compare different processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

BASELINE_EPOCH = 1  # 0-based: the figures at the end of the second epoch are the baseline
RSS_GROWTH_LIMIT = 0.05
BATCH, WORKERS = 32, 2


def row_to_sample(row: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Dispatch transform (runs in workers): a row becomes ``{"x": (8,) float32, "id"}``."""
    import torch

    i = int(row["id"])
    return {"x": torch.from_numpy(np.sin(i * 0.618 + np.arange(8)).astype(np.float32)), "id": torch.tensor(i)}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def shm_held(pid: int) -> tuple[set[str], set[str]]:
    """``/dev/shm`` files the process has open or mapped: ``(still listed, already unlinked)``."""
    listed, unlinked = set(), set()
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets.append(os.readlink(fd))
        except OSError:
            continue
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/dev/shm/" in line:
            targets.append(line[line.index("/dev/shm/") :])
    for target in targets:
        if target.startswith("/dev/shm/"):
            (unlinked if target.endswith(" (deleted)") else listed).add(target.removesuffix(" (deleted)"))
    return listed, unlinked


def probe(helpers: dict[str, int]) -> dict[str, Any]:
    """RSS (KiB) and descriptors of the training process and each helper; the run's /dev/shm files:
    ``shm`` entries listed in the directory, ``shm_unlinked`` unlinked but still open or mapped."""
    processes = {"training process": os.getpid(), **helpers}
    token = f"-{os.getpid()}."
    listed = {str(p) for p in Path("/dev/shm").glob("lsh-*") if token in p.name}
    unlinked: set[str] = set()
    for pid in processes.values():
        more, gone = shm_held(pid)
        listed |= more
        unlinked |= gone
    return {
        "pids": processes,
        "rss_kib": {name: rss_kib(pid) for name, pid in processes.items()},
        "fds": {name: len(os.listdir(f"/proc/{pid}/fd")) for name, pid in processes.items()},
        "shm": len(listed),
        "shm_unlinked": len(unlinked),
    }


def make_datamodule(strategy: str, root: Path) -> Any:
    from lightning_sharding import NpyWindows, ShardedDataModule, SyntheticReader
    from lightning_sharding.readers.sources import SqliteSource

    options: dict[str, Any] = dict(
        batch_size=BATCH,
        num_workers=WORKERS,
        persistent_workers=True,
        multiprocessing_context="spawn",
        sharding=strategy,
        seed=7,
    )
    if strategy == "shard":
        return ShardedDataModule(reader=SyntheticReader(num_items=8, samples_per_item=512), **options)
    if strategy == "broadcast":
        paths = []
        for m in range(4):
            path = root / f"month-{m:02d}.npy"
            np.save(path, np.random.default_rng(m).standard_normal((1024, 16)).astype(np.float32))
            paths.append(str(path))
        return ShardedDataModule(reader=NpyWindows(paths, window=8), **options)
    db = root / "rows.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE samples (id INTEGER PRIMARY KEY, payload TEXT)")
    con.executemany("INSERT INTO samples VALUES (?, ?)", [(i, f"row-{i}") for i in range(4096)])
    con.commit()
    con.close()
    source = SqliteSource(db, "SELECT id, payload FROM samples ORDER BY id")
    return ShardedDataModule(source=source, transform=row_to_sample, **options)


def run(strategy: str, epochs: int, root: Path) -> list[dict[str, Any]]:
    """Train ``epochs`` epochs of ``strategy``; one probe per epoch end."""
    import lightning.pytorch as pl
    import torch

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x = batch["x"].float().reshape(len(batch["x"]), -1).mean(dim=1)
            return ((self.w * x) ** 2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    probes: list[dict[str, Any]] = []

    class Probe(pl.Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            helpers = trainer.datamodule.train_loader.helper_processes()  # type: ignore[attr-defined]
            probes.append({"epoch": trainer.current_epoch, **probe({n: p.pid for n, p in helpers.items()})})

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe()],
    )
    trainer.fit(Model(), datamodule=make_datamodule(strategy, root))
    return probes


def verdict(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """Growth from the end of epoch 2 to the last epoch, and whether the targets are met."""
    base, last = probes[BASELINE_EPOCH], probes[-1]
    growth = {name: (last["rss_kib"][name] - kib) / kib for name, kib in base["rss_kib"].items()}
    fd_growth = {name: last["fds"][name] - n for name, n in base["fds"].items()}
    same = all(p["pids"] == base["pids"] for p in probes[BASELINE_EPOCH:])
    met = (
        same
        and max(growth.values()) < RSS_GROWTH_LIMIT
        and max(fd_growth.values()) <= 0
        and last["shm"] <= base["shm"]
        and last["shm_unlinked"] <= base["shm_unlinked"]
    )
    return {
        "rss_growth": growth,
        "fd_growth": fd_growth,
        "shm_growth": last["shm"] - base["shm"],
        "shm_unlinked_growth": last["shm_unlinked"] - base["shm_unlinked"],
        "same_processes": same,
        "met": met,
    }


def table(strategy: str, probes: list[dict[str, Any]], result: dict[str, Any]) -> str:
    names = list(probes[0]["rss_kib"])
    head = f"{strategy}: RSS MiB / open fds per process, the run's /dev/shm files, at each epoch end"
    cols = f"{'epoch':>5}  " + "  ".join(f"{n:>22}" for n in names) + f"  {'shm':>4} {'unlinked':>8}"
    rows = [
        f"{p['epoch']:>5}  "
        + "  ".join(f"{p['rss_kib'][n] / 1024:>12.1f} / {p['fds'][n]:>5}" for n in names)
        + f"  {p['shm']:>4} {p['shm_unlinked']:>8}"
        for p in probes
    ]
    growth = "  ".join(f"{n}: {g * 100:+.2f}%" for n, g in result["rss_growth"].items())
    fds = "  ".join(f"{n}: {d:+d}" for n, d in result["fd_growth"].items())
    summary = [
        f"RSS growth since epoch {BASELINE_EPOCH + 1} (target < {RSS_GROWTH_LIMIT:.0%}): {growth}",
        f"fd growth (target 0): {fds}",
        f"/dev/shm growth (target 0): {result['shm_growth']:+d} listed, "
        f"{result['shm_unlinked_growth']:+d} unlinked but still open or mapped",
        f"same helper processes throughout: {result['same_processes']};  targets met: {result['met']}",
    ]
    return "\n".join([head, cols, *rows, *summary])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--strategies", default="shard,broadcast,dispatch")
    parser.add_argument("--json", type=Path, help="also write the probes and verdicts here")
    args = parser.parse_args(argv)
    if args.epochs <= BASELINE_EPOCH + 1:
        parser.error(f"--epochs must be more than {BASELINE_EPOCH + 1}")
    results: dict[str, Any] = {}
    for strategy in args.strategies.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            probes = run(strategy, args.epochs, Path(tmp))
        result = verdict(probes)
        results[strategy] = {"probes": probes, **result}
        print(table(strategy, probes, result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["met"] for r in results.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
