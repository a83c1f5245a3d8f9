"""Time to first batch after resuming at 0%, 50% and 90% of an epoch of 10^6 samples.

Ours re-plans from the ledger (a range set), so the cost should not grow with the position.
torchdata's StatefulDataLoader, measured in the same run on the same data, fast-forwards its
sampler. Run: ``python -m benchmarks.resume_cost [--workers N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_sharding import SyntheticReader
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import World
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import PlanSampler, ShardedLoader

TOTAL, ITEMS, BATCH, WORLD = 1_000_000, 100, 256, 2


def ours_first_batch(fraction: float, workers: int) -> float:
    """Rank 0 of 2 resumes with ``fraction`` of the epoch consumed (as 2 ranks x ``workers`` left it)."""
    reader = SyntheticReader(ITEMS, TOTAL // ITEMS, dim=16)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=1, total=manifest.total, manifest=manifest.summary())
    world = World(rank=0, world_size=WORLD)
    # Consume the first `fraction` of every worker's run on every rank: the ranges a real run leaves.
    sampler = PlanSampler(ledger, world=world, num_workers=max(1, workers), batch_size=BATCH, even_batches="pad")
    plan = sampler.plan()
    for rank in range(WORLD):
        rank_plan = plan.rank(rank)
        for worker in range(max(1, workers)):
            run = rank_plan.worker_batches(worker)
            for index in list(run)[: int(len(run) * fraction)]:
                ledger.record(rank_plan.batch(index).positions)
    ledger.commit()
    start = time.perf_counter()
    loader = ShardedLoader.build(
        reader, manifest.items, ledger, world=world, options=LoaderOptions(batch_size=BATCH, num_workers=workers)
    )
    next(iter(loader))
    return time.perf_counter() - start


class Vectors(Dataset[dict[str, Any]]):
    """The same samples as SyntheticReader, map-style, for the StatefulDataLoader baseline."""

    def __init__(self) -> None:
        self.reader = SyntheticReader(ITEMS, TOTAL // ITEMS, dim=16)
        self.items = self.reader.items()

    def __len__(self) -> int:
        return TOTAL

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.items[i // (TOTAL // ITEMS)]
        return self.reader.read_batch(item, np.array([i % (TOTAL // ITEMS)]), None)[0]  # type: ignore[arg-type]


def stateful_first_batch(fraction: float, workers: int) -> float:
    """StatefulDataLoader (shuffle on, one rank's half of the data) resumed after ``fraction`` of its batches."""
    dataset = Vectors()
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=WORLD, rank=0, shuffle=True, seed=1)
    make = lambda: StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers)  # noqa: E731
    state = make().state_dict()
    batches = int(len(sampler) // BATCH * fraction)
    # A real state after `batches` steps: only the counters differ from a fresh one, so set them.
    key = "_sampler_iter_yielded" if workers == 0 else None
    if key is not None:
        state[key] = batches
        state["_num_yielded"] = batches
    else:
        state["_snapshot"]["_main_snapshot"]["_sampler_iter_yielded"] = batches
        state["_snapshot"]["_main_snapshot"]["_num_yielded"] = batches
        for w in state["_snapshot"]["_worker_snapshots"].values():
            w["dataset_state"] = None
    start = time.perf_counter()
    loader = make()
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - start


def median_time(fn: Callable[[float, int], float], fraction: float, workers: int, repeats: int) -> float:
    return statistics.median(fn(fraction, workers) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--skip-peer", action="store_true", help="measure lightning_sharding only")
    args = parser.parse_args()
    systems: dict[str, Callable[[float, int], float]] = {"lightning_sharding": ours_first_batch}
    if not args.skip_peer:
        systems["torchdata StatefulDataLoader"] = stateful_first_batch
    print(f"Time to first batch after resume, epoch of {TOTAL:,} samples, batch {BATCH}, rank 0 of {WORLD}, ")
    print(f"{args.workers} worker(s), median of {args.repeats} runs.\n")
    print("| system | 0% (s) | 50% (s) | 90% (s) | 90% / 0% |")
    print("|---|---|---|---|---|")
    for name, fn in systems.items():
        t = {f: median_time(fn, f, args.workers, args.repeats) for f in (0.0, 0.5, 0.9)}
        print(f"| {name} | {t[0.0]:.4f} | {t[0.5]:.4f} | {t[0.9]:.4f} | {t[0.9] / t[0.0]:.2f} |")


if __name__ == "__main__":
    main()
