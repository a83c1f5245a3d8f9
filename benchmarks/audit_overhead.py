"""Training throughput with the audit trail on and off, measured alternately in one run.

Run: ``python -m benchmarks.audit_overhead [--repeats R] [--samples N]``. Prints samples/s for each
setting (median of R alternating runs) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl

from lightning_sharding import ShardedDataModule, SyntheticReader
from lightning_sharding.train import Regressor


def samples_per_second(samples: int, audit_dir: str | None) -> float:
    dm = ShardedDataModule(SyntheticReader(32, samples // 32, dim=16), batch_size=64, seed=1, audit_dir=audit_dir)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    start = time.perf_counter()
    trainer.fit(Regressor(dim=16, hidden=4, learning_rate=0.01), datamodule=dm)
    return samples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=32 * 640)
    args = parser.parse_args()
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            off.append(samples_per_second(args.samples, None))
            on.append(samples_per_second(args.samples, str(Path(tmp) / f"audit{i}")))
        size = sum(p.stat().st_size for p in Path(tmp).rglob("*.jsonl")) / args.repeats
    a, b = statistics.median(off), statistics.median(on)
    print(f"Audit overhead: {args.samples:,} samples, batch 64, 1 rank, 0 workers, median of {args.repeats}\n")
    print("| audit | samples/s | ratio to off | trail per epoch |")
    print("|---|---|---|---|")
    print(f"| off | {a:,.0f} | 1.00 | - |")
    print(f"| on | {b:,.0f} | {b / a:.2f} | {size / 1024:.0f} KiB |")


if __name__ == "__main__":
    main()
