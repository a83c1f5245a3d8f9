"""Dispatch throughput: 1 worker vs 2 workers fed by one dispatcher, CPU-heavy per-sample transform.

Run: ``python -m benchmarks.dispatch_scaling [--rows N] [--repeats R] [--work K]``. A SQLite table
is read through one cursor by the dispatch process; each worker runs a pure-Python transform of
about ``K`` loop iterations per row. Settings are measured alternately on warm persistent workers
(an epoch is timed after its first batch, so process start-up is excluded), and the best of R
runs of each is printed side by side with their ratio. The issue's target is a ratio of at least
1.7 on an otherwise idle machine with 2 free cores.
"""

from __future__ import annotations

import argparse
import math
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.world import SampleContext, World
from lightning_sharding.readers.sources import SqliteSource, source_manifest
from lightning_sharding.strategies.dispatch import DispatchLoader
from lightning_sharding.strategies.options import LoaderOptions

WORK = int(os.environ.get("DISPATCH_BENCH_WORK", "20000"))


def heavy(row: dict[str, Any], ctx: SampleContext) -> dict[str, Any]:
    """A CPU-bound per-sample transform (pure Python, so it scales with processes, not threads)."""
    import torch

    acc, x = 0.0, float(row["x"])
    for k in range(WORK):
        acc += math.sin(x + k)
    return {"id": torch.tensor(row["id"]), "v": torch.tensor(acc)}


def make_table(path: Path, rows: int) -> None:
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, x REAL)")
        con.executemany("INSERT INTO t VALUES (?, ?)", [(i, i / rows) for i in range(rows)])


def epoch_rate(loader: DispatchLoader, epoch: int) -> float:
    """Samples/s of one epoch, timed from its first batch."""
    loader.sampler.set_epoch(epoch)
    batches = iter(loader)
    first = next(batches)
    start, count = time.perf_counter(), 0
    for batch in batches:
        count += len(batch["id"])
    assert count + len(first["id"]) == loader.ledger.total
    return count / (time.perf_counter() - start)


def transform_only_rate(rows: int) -> float:
    """Samples/s of the transform alone in this process: what one core gives without any loader."""
    from lightning_sharding.core.world import WorkerContext

    ctx = SampleContext(WorkerContext(0, 1, 0, 0, 0, 0), 0, 0, 0)
    start = time.perf_counter()
    for i in range(rows):
        heavy({"id": i, "x": i / rows}, ctx)
    return rows / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.db"
        make_table(db, args.rows)
        source = SqliteSource(db, "SELECT id, x FROM t ORDER BY id")
        summary = source_manifest(source).summary()
        loaders = {
            w: DispatchLoader(
                source,
                Ledger(seed=0, total=args.rows, manifest=summary),
                world=World(),
                options=LoaderOptions(batch_size=16, num_workers=w, transform=heavy, persistent_workers=w > 0),
            )
            for w in (1, 2)
        }
        best = {w: 0.0 for w in loaders}
        reference = 0.0
        try:
            for loader in loaders.values():  # warm-up: start the processes
                epoch_rate(loader, 0)
            for r in range(args.repeats):
                for w, loader in loaders.items():
                    best[w] = max(best[w], epoch_rate(loader, r + 1))
                reference = max(reference, transform_only_rate(args.rows // 4))
        finally:
            for loader in loaders.values():
                loader.close()
    print(f"dispatch scaling: {args.rows} SQLite rows, transform of {WORK} sin() per row, batch 16, best of")
    load = os.getloadavg()[0]
    print(f"{args.repeats} alternating warm epochs; {os.cpu_count()} CPUs, load average {load:.1f} at the end")
    print(f"transform alone, in this process: {reference:.1f} samples/s (one core's ceiling)")
    print(f"{'workers':>8} {'samples/s':>10}")
    for w, rate in best.items():
        print(f"{w:>8} {rate:>10.1f}")
    print(f"ratio 2 workers / 1 worker: {best[2] / best[1]:.2f} (target >= 1.7)")


if __name__ == "__main__":
    main()
