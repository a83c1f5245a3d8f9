"""First start over many local WebDataset tar shards: the header walk, the first manifest, the cached one.

    python -m benchmarks.manifest_scan [--shards 10000] [--samples 32] [--s3-shards 1000] [--latency-ms 50]
                                       [--repeats 3]

- **Header walk, one core:** tar members per second of ``readers/tar_headers.py`` against Python's
  ``tarfile`` on one shard of 30,000 members, walked header by header (a large shard) and with
  array operations over 1,000 small shards' buffer (what a first start does), against ``tarfile``
  (target: at least 100,000 a second).
- **First start:** the manifest of ``--shards`` shards of ``--samples`` samples (3 members each)
  with nothing cached, with the automatic thread count and with 1 thread (target for 10,000
  shards: at most 5 s on one rank); on 2 ranks of one machine (``torchrun``, gloo), which split
  the shards (``index_once_per="job"``); and from an index written with the data
  (``lightning-sharding index``), with an empty cache.
- **Next start:** the same manifest from the cache.
- **On an object store:** the first start of ``--s3-shards`` shards in a bucket of the loopback S3
  server (moto) behind a proxy adding ``--latency-ms`` to every request, on 1 rank, on 2 ranks, and
  from the data's index (needs the dev extra: moto, boto3, s3fs).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_sharding.readers import TarReader
from lightning_sharding.readers.data_index import write_data_index
from lightning_sharding.readers.storage import FileInfo
from lightning_sharding.readers.tar_headers import local_members, plain_batch
from lightning_sharding.recipes.synthetic_files import write_regression

MEMBERS_TARGET = 100_000  # members a second on one core
FIRST_START_TARGET = 5.0  # seconds for 10,000 local shards of 32 samples on one rank


def walk_rates(directory: Path, members: int, repeats: int) -> tuple[float, float]:
    """Members a second of the header walk and of ``tarfile``, on one shard of ``members`` members."""
    path = directory / "many-members.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(members):
            data = b"x" * (100 + i % 300)
            info = tarfile.TarInfo(f"s{i // 3:06d}.{('cls', 'jpg', 'json')[i % 3]}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ours, theirs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        assert len(local_members(str(path))) == members
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        with tarfile.open(path) as tar:
            assert sum(1 for m in tar if m.isfile()) == members
        theirs.append(time.perf_counter() - start)
    return members / statistics.median(ours), members / statistics.median(theirs)


def batch_walk_rate(directory: Path, shards: int, repeats: int) -> float:
    """Members a second of the array walk (``plain_batch``) over ``shards`` small shards in one buffer."""
    paths = sorted(directory.glob("*.tar"))[:shards]
    data = b"".join(p.read_bytes() for p in paths)
    spans, start = [], 0
    for p in paths:
        spans.append((start, p.stat().st_size))
        start += p.stat().st_size
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        table, ok = plain_batch(data, spans)
        times.append(time.perf_counter() - begin)
        assert ok.all()
    return len(table.size) / statistics.median(times)


def timed_build(
    pattern: str,
    cache: Path,
    threads: int | None,
    clear: bool,
    data_index: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> tuple[float, dict[str, int]]:
    if clear and cache.exists():
        shutil.rmtree(cache)
    reader = TarReader(
        pattern,
        cache_dir=cache,
        scan_threads=threads,
        data_index=None if data_index else False,
        storage_options=storage_options or {},
    )
    start = time.perf_counter()
    items = reader.items()
    elapsed = time.perf_counter() - start
    assert len(items) > 0
    return elapsed, reader.last_scan


def two_ranks(pattern: str, cache: Path, storage_options: dict[str, Any] | None = None) -> float:
    """Seconds of the slower of 2 ranks (torchrun, gloo) building the manifest with nothing cached."""
    shutil.rmtree(cache, ignore_errors=True)
    out = cache.with_suffix(".json")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    cmd += [f"--master_port={port}", "-m", "benchmarks.manifest_scan", "--rank-job", pattern, str(cache), str(out)]
    cmd += ["--storage-options", json.dumps(storage_options or {})]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seconds: list[float] = json.loads(out.read_text())
    return max(seconds)


def rank_job(pattern: str, cache: str, out: str, storage_options: dict[str, Any]) -> None:
    """One rank of :func:`two_ranks`: the manifest inside a collective, timed between barriers."""
    import torch.distributed as dist

    from lightning_sharding.core.world import World
    from lightning_sharding.readers.shared_index import collective

    dist.init_process_group("gloo")
    world = World(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]))
    reader = TarReader(pattern, cache_dir=cache, data_index=False, storage_options=storage_options)
    dist.barrier()
    start = time.perf_counter()
    with collective(world):
        items = reader.items()
    seconds = time.perf_counter() - start
    assert len(items) > 0 and reader.last_scan["scanned"] > 0
    gathered: list[float] = [0.0] * world.world_size
    dist.all_gather_object(gathered, seconds)
    if world.rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def remote_rows(shards: int, samples: int, latency_ms: float, repeats: int) -> None:
    """The first start of ``shards`` shards in a bucket of the loopback S3 server (moto) behind a
    proxy adding ``latency_ms`` to each request: on 1 rank, on 2 ranks, and from the data's index."""
    import logging

    from moto.server import ThreadedMotoServer

    from tests.support.fault_proxy import FaultProxy
    from tests.support.s3 import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"http://{host}:{port}")
    proxy = FaultProxy(s3.endpoint)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            write_regression(f"{s3.bucket('scan')}/wds", "tar", [samples] * shards, storage_options=s3.storage_options)
            pattern, options = "s3://scan/wds/*.tar", proxy.storage_options()
            proxy.delay = latency_ms / 1000
            times = [timed_build(pattern, root / "one", None, True, storage_options=options)[0] for _ in range(repeats)]
            rows.append(("first start, 1 rank (16 threads)", statistics.median(times)))
            two = [two_ranks(pattern, root / "two", options) for _ in range(repeats)]
            rows.append(("first start, 2 ranks (16 threads each)", statistics.median(two)))
            write_data_index(TarReader(pattern, storage_options=options, cache_dir=root / "writer"))
            indexed = [
                timed_build(pattern, root / "indexed", None, True, data_index=True, storage_options=options)
                for _ in range(repeats)
            ]
            assert all(stats["scanned"] == 0 for _, stats in indexed), "a start from the data's index walked shards"
            rows.append(("first start from the data's index", statistics.median(t for t, _ in indexed)))
    finally:
        proxy.close()
        server.stop()
    print(
        f"manifest of {shards} tar shards x {samples} samples on the loopback S3 server, +{latency_ms:.0f} ms a request"
    )
    print(f"(median of {repeats})\n")
    print("| build | seconds | vs 1 rank |")
    print("|---|---:|---:|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.2f} | {seconds / rows[0][1]:.2f}x |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=32, help="samples per shard (3 tar members each)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--s3-shards", type=int, default=1000, help="shards on the loopback S3 server (0: none)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="added to every request to the S3 server")
    parser.add_argument("--rank-job", nargs=3, metavar=("PATTERN", "CACHE", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--storage-options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        rank_job(*args.rank_job, json.loads(args.storage_options))
        return
    if args.s3_shards:
        remote_rows(args.s3_shards, args.samples, args.latency_ms, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ours, theirs = walk_rates(root, 30_000, args.repeats)
        write_regression(str(root / "shards"), "tar", [args.samples] * args.shards)
        batched = batch_walk_rate(root / "shards", 1000, args.repeats)
        pattern = str(root / "shards" / "*.tar")
        auto = TarReader(pattern).indexing_threads([FileInfo(pattern, 0, "")] * args.shards)
        rows = []
        for label, threads in ((f"first start, automatic ({auto} thread(s))", None), ("first start, 1 thread", 1)):
            times = [timed_build(pattern, root / "cache", threads, True)[0] for _ in range(args.repeats)]
            rows.append((label, statistics.median(times)))
        rows.append(
            (
                "first start, 2 ranks (each half)",
                statistics.median(two_ranks(pattern, root / "ranks") for _ in range(args.repeats)),
            )
        )
        write_data_index(TarReader(pattern, cache_dir=root / "cache"))
        indexed = [timed_build(pattern, root / "cache", None, True, data_index=True) for _ in range(args.repeats)]
        assert all(stats["scanned"] == 0 for _, stats in indexed), "a start from the data's index walked shards"
        rows.append(("first start from the data's index", statistics.median(t for t, _ in indexed)))
        timed_build(pattern, root / "cache", None, True)
        warm = [timed_build(pattern, root / "cache", None, False) for _ in range(args.repeats)]
        assert all(stats["scanned"] == 0 for _, stats in warm), "the warm start indexed shards again"
        rows.append(("next start (cached)", statistics.median(t for t, _ in warm)))
    status = "met" if min(ours, batched) >= MEMBERS_TARGET else "NOT MET"
    print(f"tar header walk, one core (median of {args.repeats}), members/s: header by header {ours:,.0f}, ")
    print(f"  array walk over 1,000 shards {batched:,.0f}, tarfile {theirs:,.0f}")
    print(
        f"  ours / tarfile {ours / theirs:.1f}x and {batched / theirs:.1f}x; "
        f"target >= {MEMBERS_TARGET:,} members/s: {status}\n"
    )
    print(f"manifest of {args.shards} local tar shards x {args.samples} samples (median of {args.repeats})\n")
    print("| build | seconds | per shard (ms) | vs first start | target |")
    print("|---|---:|---:|---:|---|")
    first = rows[0][1]
    scaled = FIRST_START_TARGET * args.shards / 10_000
    for label, seconds in rows:
        target = ""
        if label.startswith("first start, automatic"):
            target = f"<= {scaled:.1f} s: {'met' if seconds <= scaled else 'NOT MET'}"
        print(f"| {label} | {seconds:.3f} | {1000 * seconds / args.shards:.2f} | {seconds / first:.2f}x | {target} |")


if __name__ == "__main__":
    main()
