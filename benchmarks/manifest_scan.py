"""Manifest build for 1,000 local WebDataset tar shards: first start (index every shard) against
the next start (load the cached indexes), and parallel against one indexing thread.

    python -m benchmarks.manifest_scan [--shards 1000] [--samples 32]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from lightning_sharding.readers import TarReader
from lightning_sharding.recipes.synthetic_files import write_regression


def timed_build(pattern: str, cache: Path, threads: int, clear: bool) -> tuple[float, dict[str, int]]:
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
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=32, help="samples per shard (3 tar members each)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_regression(str(root / "shards"), "tar", [args.samples] * args.shards)
        pattern = str(root / "shards" / "*.tar")
        rows = []
        for label, threads, clear in (("first start, 16 threads", 16, True), ("first start, 1 thread", 1, True)):
            times = [timed_build(pattern, root / "cache", threads, clear)[0] for _ in range(args.repeats)]
            rows.append((label, statistics.median(times)))
        timed_build(pattern, root / "cache", 16, True)
        warm = [timed_build(pattern, root / "cache", 16, False) for _ in range(args.repeats)]
        assert all(stats["scanned"] == 0 for _, stats in warm), "the warm start indexed shards again"
        rows.append(("next start (cached)", statistics.median(t for t, _ in warm)))
    first = rows[0][1]
    print(f"manifest of {args.shards} local tar shards x {args.samples} samples (median of {args.repeats})\n")
    print("| build | seconds | per shard (ms) | vs first start |")
    print("|---|---:|---:|---:|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.3f} | {1000 * seconds / args.shards:.2f} | {seconds / first:.2f}x |")


if __name__ == "__main__":
    main()
