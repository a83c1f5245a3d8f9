"""Memory of the broadcast strategy: 1 rank, 4 workers, items of 512 MB, side by side with a baseline.

Run: ``python -m benchmarks.broadcast_memory`` (a few minutes on 2 cores; writes 1.5 GB of .npy
files to a temporary directory and needs about 4 GB of free memory for the baseline). It prints two
tables: one item (the targets: <= 1.5x the item without prefetch, <= 2.5x with depth 1) and two
items, where prefetching actually loads the next item while the first is in use.

Each configuration trains nothing: it iterates one epoch of windows, and a sampling thread adds up
the proportional set size (PSS, ``/proc/<pid>/smaps_rollup``) of the main process and its
DataLoader workers every few milliseconds, keeping the peak. What PSS does and does not count:

- a page mapped by k processes counts 1/k in each, so the sum over processes counts it once;
- a ``/dev/shm`` page that nobody maps (a prefetched shared array no worker has opened yet: the main
  process writes them with ``write()`` and never maps them) is in no PSS at all. So the
  ``/dev/shm`` bytes are reported too, and ``footprint`` = sum of PSS without its tmpfs part
  (``Pss_Anon + Pss_File``) + all ``/dev/shm`` bytes of the run, which counts every page once;
- the interpreter, torch and NumPy of 5 processes cost memory whatever the data; it is measured
  on a tiny item and reported as ``idle``, and ``data`` = peak minus idle.

The baseline is a plain DataLoader whose workers each ``np.load`` the whole item they read (what
the ``shard`` strategy amounts to when every worker needs the same big item).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import World
from lightning_sharding.readers.windows import NpyWindows
from lightning_sharding.strategies._shared_memory import SHM_DIR
from lightning_sharding.strategies.broadcast import BroadcastLoader
from lightning_sharding.strategies.options import LoaderOptions

MB = 1 << 20
FEATURES = 1024  # float32: 4 KiB per time step
# Stride = window: the windows tile every item, so the workers touch (and PSS counts) every page.
WINDOW, STRIDE, BATCH, WORKERS = 32, 32, 64, 4


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return kids


def rollup(pid: int) -> dict[str, int]:
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            name, value, *_ = line.split()
            fields[name.rstrip(":")] = int(value) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return fields


def shm_bytes(pid: int) -> int:
    total = 0
    for path in SHM_DIR.glob(f"lsh-*-{pid}.*"):
        try:
            total += path.stat().st_blocks * 512
        except FileNotFoundError:
            pass
    return total


class PeakMemory:
    """Samples main process + workers every ``every`` seconds in a thread; keeps the peaks."""

    def __init__(self, every: float = 0.005) -> None:
        self.every = every
        self.pss = self.footprint = self.shm = self.workers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            pids = [me, *children(me)]
            stats = [rollup(p) for p in pids]
            pss = sum(s.get("Pss", 0) for s in stats)
            private = sum(s.get("Pss_Anon", 0) + s.get("Pss_File", 0) for s in stats)
            shm = shm_bytes(me)
            self.pss, self.shm = max(self.pss, pss), max(self.shm, shm)
            self.footprint = max(self.footprint, private + shm)
            self.workers = max(self.workers, len(pids) - 1)
            time.sleep(self.every)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def write_items(directory: Path, count: int, item_mb: int) -> list[str]:
    steps = item_mb * MB // (FEATURES * 4)
    paths = []
    for i in range(count):
        path = directory / f"month-{i:02d}.npy"
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(steps, FEATURES))
        for lo in range(0, steps, 8192):  # real data, not a sparse file: every page is read later
            array[lo : lo + 8192] = np.float32(i + lo)
        array.flush()
        del array
        paths.append(str(path))
    return paths


def run_broadcast(paths: list[str], depth: int) -> tuple[PeakMemory, int, float]:
    reader = NpyWindows(paths, window=WINDOW, stride=STRIDE)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    loader = BroadcastLoader.build(
        reader,
        manifest.items,
        ledger,
        world=World(),
        options=LoaderOptions(batch_size=BATCH, num_workers=WORKERS, multiprocessing_context="spawn"),
        prefetch_items=depth,
    )
    return iterate(loader)


class OwnCopy(Dataset[Any]):
    """Baseline: each worker loads the whole item it needs (one cached copy per worker)."""

    def __init__(self, paths: list[str], windows_per_item: int) -> None:
        self.paths, self.per_item = paths, windows_per_item
        self._item, self._data = -1, np.empty(0)

    def __len__(self) -> int:
        return len(self.paths) * self.per_item

    def __getitem__(self, indices: list[int]) -> Any:
        item = indices[0] // self.per_item
        if item != self._item:
            self._data = np.empty(0)  # drop the old copy before loading the next one
            self._data = np.load(self.paths[item])
            self._item = item
        starts = (np.asarray(indices) % self.per_item) * STRIDE
        assert get_worker_info() is not None
        return torch.from_numpy(self._data[starts[:, None] + np.arange(WINDOW)])


def run_baseline(paths: list[str], windows_per_item: int) -> tuple[PeakMemory, int, float]:
    dataset = OwnCopy(paths, windows_per_item)
    # Batches in item order, interleaved over workers as in broadcast: every worker needs every item.
    batches = [list(range(i, min(i + BATCH, len(dataset)))) for i in range(0, len(dataset), BATCH)]
    batches = [b for b in batches if b[0] // windows_per_item == b[-1] // windows_per_item]
    loader = DataLoader(dataset, sampler=batches, batch_size=None, num_workers=WORKERS, multiprocessing_context="spawn")
    return iterate(loader)


def iterate(loader: Any) -> tuple[PeakMemory, int, float]:
    start = time.perf_counter()
    windows = 0
    with PeakMemory() as peak:
        for batch in loader:
            x = batch["x"] if isinstance(batch, dict) else batch
            windows += len(x)
    return peak, windows, time.perf_counter() - start


def measure(tmp: Path, count: int, item_mb: int) -> list[tuple[str, PeakMemory, int, float, float | None]]:
    """Rows ``(configuration, peak, windows, seconds, target)`` for ``count`` items of ``item_mb``."""
    directory = tmp / f"items-{count}"
    directory.mkdir()
    paths = write_items(directory, count, item_mb)
    windows_per_item = NpyWindows(paths, window=WINDOW, stride=STRIDE).items()[0].num_samples
    rows = [
        ("broadcast, no prefetch", *run_broadcast(paths, 0), 1.5),
        ("broadcast, prefetch depth 1", *run_broadcast(paths, 1), 2.5),
        ("baseline: a copy per worker", *run_baseline(paths, windows_per_item), None),
    ]
    for path in paths:
        os.unlink(path)
    return rows


def idle_memory(tmp: Path) -> PeakMemory:
    """What the main process and its workers hold with a 1 MB item: subtracted from every figure."""
    (tmp / "tiny").mkdir()
    return run_broadcast(write_items(tmp / "tiny", 1, 1), 0)[0]


def summary(item_mb: int) -> dict[str, Any]:
    """One item of ``item_mb``: each configuration's data / item (PSS above idle), for the suite's table."""
    with tempfile.TemporaryDirectory(prefix="lsh-bench-") as name:
        tmp = Path(name)
        idle = idle_memory(tmp)
        rows = measure(tmp, 1, item_mb)
    return {
        "item_mb": item_mb,
        "workers": WORKERS,
        "data_per_item": {row[0]: (row[1].pss - idle.pss) / (item_mb * MB) for row in rows},
        "targets": {row[0]: row[4] for row in rows if row[4] is not None},
    }


def table(tmp: Path, count: int, item_mb: int, idle: PeakMemory) -> None:
    item = item_mb * MB
    rows = measure(tmp, count, item_mb)
    print(f"\n{count} item(s) of {item_mb} MB, 1 rank x {WORKERS} workers")
    head = f"{'configuration':<29} {'windows':>7} {'s':>6} {'peak PSS':>9} {'data':>8} {'data/item':>9}"
    head += f" {'/dev/shm':>9} {'footprint':>9} {'target (data/item)':>18}"
    print(head)
    for name, peak, windows, seconds, target in rows:
        data = peak.pss - idle.pss
        verdict = "-" if target is None else (f"<= {target}x " + ("met" if data <= target * item else "MISSED"))
        print(
            f"{name:<29} {windows:>7} {seconds:>6.1f} {peak.pss / MB:>7.0f}MB {data / MB:>6.0f}MB "
            f"{data / item:>8.2f}x {peak.shm / MB:>7.0f}MB {peak.footprint / MB:>7.0f}MB {verdict:>18}"
        )
    base = rows[2][1].pss - idle.pss
    for name, peak, *_ in rows[:2]:
        print(f"  baseline data / {name} data: {base / max(1, peak.pss - idle.pss):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--item-mb", type=int, default=512)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 workers on 2 cores: on purpose
    with tempfile.TemporaryDirectory(prefix="lsh-bench-") as name:
        tmp = Path(name)
        idle = idle_memory(tmp)
        print(
            f"float32 items of {FEATURES} features per step, windows T={WINDOW} S={STRIDE}, batch {BATCH}; "
            f"idle (main + {idle.workers} child processes on a 1 MB item): sum of PSS {idle.pss / MB:.0f} MB"
        )
        table(tmp, 1, args.item_mb, idle)
        table(tmp, 2, args.item_mb, idle)
    print(
        "\npeak PSS: peak of the sum over main + workers; data: peak PSS - idle; footprint: peak of "
        "(PSS without its tmpfs part + every /dev/shm byte of the run), which also counts shared arrays no "
        "process maps yet (PSS cannot see those)"
    )


if __name__ == "__main__":
    main()
