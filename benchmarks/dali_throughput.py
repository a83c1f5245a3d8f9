"""DALI loader vs the DataLoader-based ShardedLoader, one rank, side by side in one run.

Prints samples/s of a full epoch (pipeline or worker start excluded: the first batch is waited
for before the clock starts) for the same synthetic data, batch size and worker count.
Run: ``python -m benchmarks.dali_throughput [--samples N] [--workers W] [--batch B]``.
"""

from __future__ import annotations

import argparse
import time

from lightning_sharding import SyntheticReader
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import World
from lightning_sharding.lightning.dali import DaliStrategy
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import ShardedLoader


def epoch_rate(loader: object) -> tuple[float, int]:
    it = iter(loader)  # type: ignore[call-overload]
    first = next(it)
    n = len(first["id"])
    start = time.perf_counter()
    for batch in it:
        n += len(batch["id"])
    return (n - len(first["id"])) / (time.perf_counter() - start), n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    reader = SyntheticReader(num_items=16, samples_per_item=args.samples // 16, dim=64)
    manifest = Manifest.from_items(reader.items())
    rates = {}
    for name in ("dataloader", "dali"):
        ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
        options = LoaderOptions(batch_size=args.batch, num_workers=args.workers)
        if name == "dali":
            loader: object = DaliStrategy().build(reader, manifest, ledger, World(), options, track=False)
        else:
            spawn = options.replace(multiprocessing_context="spawn")
            loader = ShardedLoader.build(reader, manifest.items, ledger, world=World(), options=spawn)
        rates[name], n = epoch_rate(loader)
        print(f"{name:>10}: {rates[name]:>10.0f} samples/s over {n} samples, {args.workers} workers")
    print(f"dali / dataloader: {rates['dali'] / rates['dataloader']:.2f}x")


if __name__ == "__main__":
    main()
