"""Time spent waiting for data when the shards are remote and every request takes 50 ms more.

A real S3-protocol server (moto) on loopback behind a proxy that delays each request, WebDataset tar
shards in its bucket, and a training loop of 1 rank x 2 workers that computes for ``--step-ms`` per
batch. Three ways to read, run alternately round by round in one process:

- ``ranged``: no local cache; every batch reads its samples by ranged requests;
- ``cache``: ``cache_limit`` set; a worker fetches a whole shard when it first reads from it;
- ``cache + prefetch``: also ``prefetch_files``; workers fetch their next shards while they read.

Each round starts with an empty shard cache (the file indexes are built once, before). Printed:
seconds waiting for batches per epoch once every worker has delivered its first batch (the time
``next()`` on the loader took, summed; the first batches also wait for the workers to start), the
share of the epoch that was waiting, and how much less the prefetch waits than each other way.
Run: ``python -m benchmarks.remote [--latency-ms 50] [--step-ms 20] [--repeats 3]``.
Needs the dev extra (moto, boto3, s3fs).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from lightning_sharding.core.ledger import Ledger  # noqa: E402
from lightning_sharding.core.manifest import Manifest  # noqa: E402
from lightning_sharding.core.world import World  # noqa: E402
from lightning_sharding.readers import TarReader  # noqa: E402
from lightning_sharding.recipes.synthetic_files import to_regression, write_regression  # noqa: E402
from lightning_sharding.strategies.options import LoaderOptions  # noqa: E402
from lightning_sharding.strategies.shard import ShardedLoader  # noqa: E402
from tests.support.fault_proxy import FaultProxy  # noqa: E402
from tests.support.s3 import S3Server  # noqa: E402

WAYS = {
    "ranged": {},
    "cache": {"cache_limit": 10**10},
    "cache + prefetch": {"cache_limit": 10**10, "prefetch_files": 2},
}


def epoch_wait(reader: TarReader, step: float, workers: int, batch: int) -> tuple[float, float]:
    """(seconds waiting for batches, seconds of the epoch) for one epoch of ``reader``, both counted
    from the first batch of the last worker to start: before it, workers start up, alike for all."""
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=5, total=manifest.total, manifest=manifest.summary())
    options = LoaderOptions(
        batch_size=batch, num_workers=workers, transform=to_regression, multiprocessing_context="spawn"
    )
    loader = ShardedLoader.build(reader, manifest.items, ledger, world=World(), options=options)
    batches = iter(loader)
    served = sum(len(next(batches)["id"]) for _ in range(max(1, workers)))
    start, waited = time.perf_counter(), 0.0
    time.sleep(step)
    while True:
        asked = time.perf_counter()
        try:
            got = next(batches)
        except StopIteration:
            break
        waited += time.perf_counter() - asked
        served += len(got["id"])
        time.sleep(step)  # the training step
    loader.close()
    assert served >= manifest.total, f"served {served} of {manifest.total} samples"
    return waited, time.perf_counter() - start


def ratio(a: float, b: float) -> float:
    """``a / b``; infinite when only ``b`` is 0 (the prefetch waited not at all), 1 when both are."""
    return a / b if b > 0 else (math.inf if a > 0 else 1.0)


def run(latency: float, step: float, repeats: int, shards: int, per_shard: int, dim: int) -> dict[str, Any]:
    """The figures of every way, medians over ``repeats`` rounds."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"http://{host}:{port}")
    proxy = FaultProxy(s3.endpoint)
    root = Path(tempfile.mkdtemp(prefix="remote-bench-"))
    try:
        write_regression(
            f"{s3.bucket('bench')}/wds", "tar", [per_shard] * shards, dim=dim, storage_options=s3.storage_options
        )
        urls, options = "s3://bench/wds/part-*.tar", proxy.storage_options()
        TarReader(urls, storage_options=options, cache_dir=root).items()  # index once, outside the timing
        proxy.delay = latency
        waits: dict[str, list[float]] = {way: [] for way in WAYS}
        shares: dict[str, list[float]] = {way: [] for way in WAYS}
        for r in range(repeats):
            for way, knobs in WAYS.items():
                shutil.rmtree(root / "shards", ignore_errors=True)
                reader = TarReader(urls, storage_options=options, cache_dir=root, **knobs)
                waited, total = epoch_wait(reader, step, workers=2, batch=64)
                waits[way].append(waited)
                shares[way].append(waited / total)
                print(f"  round {r + 1}: {way:<17} waited {waited:6.2f} s of {total:6.2f} s", flush=True)
        return {
            "latency_ms": latency * 1000,
            "step_ms": step * 1000,
            "samples": shards * per_shard,
            "wait_s": {w: statistics.median(v) for w, v in waits.items()},
            "wait_share": {w: statistics.median(v) for w, v in shares.items()},
            "prefetch_less_than": {
                w: statistics.median(ratio(a, b) for a, b in zip(waits[w], waits["cache + prefetch"], strict=True))
                for w in ("ranged", "cache")
            },
        }
    finally:
        proxy.close()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--prefetch-files", type=int, default=2)
    args = parser.parse_args()
    WAYS["cache + prefetch"]["prefetch_files"] = args.prefetch_files
    result = run(args.latency_ms / 1000, args.step_ms / 1000, args.repeats, args.shards, args.per_shard, args.dim)
    print(
        f"\n{result['samples']} samples in {args.shards} tar shards, +{result['latency_ms']:.0f} ms per request, "
        f"{result['step_ms']:.0f} ms per step, 1 rank x 2 workers, batch 64, prefetch_files={args.prefetch_files} "
        f"(medians of {args.repeats}):\n"
    )
    print("| reading | waiting for data per epoch | share of the epoch | prefetch waits less by |")
    print("|---|---|---|---|")
    for way in WAYS:
        less = result["prefetch_less_than"].get(way)
        shown = "—" if less is None else ("no wait left" if math.isinf(less) else f"{less:.1f}x")
        print(f"| {way} | {result['wait_s'][way]:.2f} s | {result['wait_share'][way]:.0%} | {shown} |")
    print("\ntarget: prefetch waits at least 5x less than without it")
    for way in ("ranged", "cache"):
        less, wait, share = result["prefetch_less_than"][way], result["wait_s"][way], result["wait_share"][way]
        verdict = "met" if less >= 5 else "missed"
        print(f"- against {way}: {verdict} ({'no wait left' if math.isinf(less) else f'{less:.1f}x'})", end="")
        if less < 5:  # say why: there was little left to hide
            print(
                f": {way} alone waits {wait:.2f} s ({share:.0%} of the epoch), what the DataLoader's own queue "
                "does not hide at these step times; shorter steps leave more to hide "
                "(--step-ms 5 --shards 32 --per-shard 128 --prefetch-files 4)"
            )
        else:
            print()


if __name__ == "__main__":
    main()
