"""First start over many local WebDataset tar shards: the header walk, the first manifest, the cached one.

    python -m benchmarks.manifest_scan [--shards 10000] [--samples 32] [--repeats 3]

- **Header walk, one core:** tar members per second of ``readers/tar_headers.py`` against Python's
  ``tarfile`` on one shard of 30,000 members (target: at least 100,000 a second).
- **First start:** the manifest of ``--shards`` shards of ``--samples`` samples (3 members each)
  with nothing cached, with the automatic thread count and with 1 thread (target for 10,000
  shards: at most 5 s on one rank).
- **Next start:** the same manifest from the cache.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from lightning_sharding.readers import TarReader
from lightning_sharding.readers.storage import FileInfo
from lightning_sharding.readers.tar_headers import local_members
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


def timed_build(pattern: str, cache: Path, threads: int | None, clear: bool) -> tuple[float, dict[str, int]]:
    if clear and cache.exists():
        shutil.rmtree(cache)
    reader = TarReader(pattern, cache_dir=cache, scan_threads=threads)
    start = time.perf_counter()
    items = reader.items()
    elapsed = time.perf_counter() - start
    assert len(items) > 0
    return elapsed, reader.last_scan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=32, help="samples per shard (3 tar members each)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ours, theirs = walk_rates(root, 30_000, args.repeats)
        write_regression(str(root / "shards"), "tar", [args.samples] * args.shards)
        pattern = str(root / "shards" / "*.tar")
        auto = TarReader(pattern).indexing_threads([FileInfo(pattern, 0, "")] * args.shards)
        rows = []
        for label, threads in ((f"first start, automatic ({auto} thread(s))", None), ("first start, 1 thread", 1)):
            times = [timed_build(pattern, root / "cache", threads, True)[0] for _ in range(args.repeats)]
            rows.append((label, statistics.median(times)))
        timed_build(pattern, root / "cache", None, True)
        warm = [timed_build(pattern, root / "cache", None, False) for _ in range(args.repeats)]
        assert all(stats["scanned"] == 0 for _, stats in warm), "the warm start indexed shards again"
        rows.append(("next start (cached)", statistics.median(t for t, _ in warm)))
    status = "met" if ours >= MEMBERS_TARGET else "NOT MET"
    print(f"tar header walk, one core (median of {args.repeats}): ours {ours:,.0f} members/s, tarfile {theirs:,.0f}")
    print(f"  ours / tarfile {ours / theirs:.1f}x; target >= {MEMBERS_TARGET:,} members/s: {status}\n")
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
