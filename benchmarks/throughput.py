"""Samples/s of every system on the same local data with the same per-sample work, side by side.

The data: ``.npy`` files of rows ``[id, x (64 float32), y]`` written by
:func:`lightning_sharding.recipes.synthetic_files.write_regression`; the streaming peers get the same rows in
their own formats, written by their own writers (see ``peers.py``). The per-sample work is
:func:`lightning_sharding.recipes.synthetic_files.to_regression` for every system; our batch path does the same
work once per batch (``batch_transform``) on rows read a batch at a time. Shuffle on, one rank,
spawned workers. The clock starts at the first batch, so worker start-up is left out.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import SampleContext, World
from lightning_sharding.readers import NpyReader
from lightning_sharding.recipes.synthetic_files import to_regression, write_regression
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import ShardedLoader

DIM, BATCH, FILES = 64, 256, 16
BATCH_ROW_BYTES = 8 + 4 * DIM + 4  # one sample of a batch: id (int64), x and y (float32)


def write_npy(root: Path, samples: int) -> str:
    """Write ``samples`` rows in ``FILES`` files under ``root / "npy"``; returns the glob pattern."""
    per_file = samples // FILES
    write_regression(str(root / "npy"), "npy", [per_file] * FILES, dim=DIM)
    return str(root / "npy" / "*.npy")


def rows_of(pattern: str) -> Iterable[np.ndarray]:
    """Every file's rows, shape ``(n, DIM + 2)`` float32, in file order (the peers' writers read these)."""
    for path in sorted(glob.glob(pattern)):
        yield np.load(path, mmap_mode="r")


def burn(x: np.ndarray, rounds: int) -> np.ndarray:
    """CPU-bound per-sample work for the worker-scaling row: ``rounds`` small matrix products."""
    m = np.outer(x[:16], x[:16])
    for _ in range(rounds):
        m = np.tanh(m @ m)
    return x + np.float32(m.mean())


def _burn_for(samples: int) -> float:
    """Seconds to burn ``samples`` rows in this process (a worker of :func:`bare_scaling`)."""
    x = np.linspace(0, 1, DIM + 2, dtype=np.float32)
    start = time.perf_counter()
    for _ in range(samples):
        burn(x, 8)
    return time.perf_counter() - start


def bare_scaling(samples: int) -> float:
    """The machine's own ceiling for the worker-scaling row: the same burn, with no loader, in two bare
    spawned processes against one (twice the work in the same time would be 2x)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_burn_for, [10, 10])  # both started
        start = time.perf_counter()
        pool.map(_burn_for, [samples])
        one = time.perf_counter() - start
        start = time.perf_counter()
        pool.map(_burn_for, [samples, samples])
        two = time.perf_counter() - start
    return 2 * one / two


class Work:
    """The per-sample work every system does: the row to ``{"id", "x", "y"}``, optionally burning CPU."""

    def __init__(self, burn_rounds: int = 0) -> None:
        self.burn_rounds = burn_rounds

    def __call__(self, sample: Any, ctx: SampleContext | None = None) -> dict[str, Any]:
        out = to_regression(sample if isinstance(sample, dict) else {"x": sample})
        if self.burn_rounds:
            out["x"] = burn(out["x"], self.burn_rounds)
        return out


class NpyRows(Dataset[dict[str, Any]]):
    """Map-style view of the same ``.npy`` files for the plain DataLoader baselines (one row per index)."""

    def __init__(self, pattern: str, work: Work) -> None:
        self.paths = sorted(glob.glob(pattern))
        sizes = [np.load(p, mmap_mode="r").shape[0] for p in self.paths]
        self.starts = np.concatenate(([0], np.cumsum(sizes)))
        self.work = work
        self._maps: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # memory maps are reopened in each worker

    def __len__(self) -> int:
        return int(self.starts[-1])

    def row(self, i: int) -> np.ndarray:
        """Row ``i`` of all files, read from its file's memory map (opened once per process)."""
        f = int(np.searchsorted(self.starts, i, side="right") - 1)
        mm = self._maps.get(f)
        if mm is None:
            mm = self._maps[f] = np.load(self.paths[f], mmap_mode="r")
        return np.asarray(mm[i - self.starts[f]])

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.work(self.row(i))


def epoch_rate(loader: Iterable[Any], workers: int) -> float:
    """Samples/s over one epoch, from the arrival of one batch per worker (all started) to the last."""
    it = iter(loader)
    for _ in range(max(1, workers)):
        next(it)
    n = 0
    start = time.perf_counter()
    for batch in it:
        n += len(batch["id"])
    return n / (time.perf_counter() - start)


def _npy_loader(pattern: str, workers: int, batch: int, transport: str = "pool", **options: Any) -> Iterable[Any]:
    """Our loader over the ``.npy`` rows, one rank, spawned workers, with ``options`` (and the shard
    strategy's ``transport``)."""
    reader = NpyReader(pattern)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    spawn = "spawn" if workers else None
    opts = LoaderOptions(
        batch_size=batch, num_workers=workers, multiprocessing_context=spawn, padding_key=None, **options
    )
    return ShardedLoader.build(reader, manifest.items, ledger, world=World(), options=opts, transport=transport)  # type: ignore[arg-type]


def ours(pattern: str, workers: int, work: Work, batch: int = BATCH) -> Iterable[Any]:
    return _npy_loader(pattern, workers, batch, transform=work)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used (its threads too), from ``/proc`` (None
    where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def epoch_shares(pattern: str, workers: int, work: Work, batch: int = BATCH) -> dict[str, float]:
    """Our per-sample path over one epoch, as :func:`epoch_rate` counts it, and where the CPU of a
    batch goes: ``main_ms`` a batch in the training process (every thread of it: receiving batches,
    dealing tasks, unpacking slots, the provenance), ``workers_ms`` a batch in the workers (kept
    alive to the end, so their CPU can be read; ``nan`` where ``/proc`` is missing)."""
    loader = _npy_loader(pattern, workers, batch, transform=work, persistent_workers=workers > 0)
    it = iter(loader)
    for _ in range(max(1, workers)):
        next(it)
    pids = [p.pid for p in loader.helper_processes().values()]  # type: ignore[attr-defined]
    before = [cpu_seconds(p) for p in pids]
    n = batches = 0
    start, main = time.perf_counter(), time.process_time()
    for b in it:
        n += len(b["id"])
        batches += 1
    wall, main = time.perf_counter() - start, time.process_time() - main
    after = [cpu_seconds(p) for p in pids]
    loader.close()  # type: ignore[attr-defined]
    known = None not in before + after
    spent = sum(a - b for a, b in zip(after, before, strict=True)) if known else float("nan")  # type: ignore[operator]
    return {
        "samples_per_s": n / wall,
        "main_ms": 1000 * main / max(batches, 1),
        "workers_ms": 1000 * spent / max(batches, 1),
    }


def rows_to_regression(batch: dict[str, torch.Tensor], ctx: Any = None) -> dict[str, torch.Tensor]:
    """The work of :class:`Work` on a whole batch of ``[id, x..., y]`` rows: ``{"id", "x", "y"}``, the
    same tensors the per-sample work collates to (a ``batch_transform``; module level, for spawn)."""
    rows = batch["x"]
    return {"id": rows[:, 0].long(), "x": rows[:, 1:-1].contiguous(), "y": rows[:, -1].contiguous()}


def ours_vectorised(
    pattern: str, workers: int, work: Work, batch: int = BATCH, transport: str = "pool"
) -> Iterable[Any]:
    """Ours with batch-level reads and the same work done once per batch (``batch_transform``)."""
    assert work.burn_rounds == 0, "the vectorised form has no CPU burn"
    return _npy_loader(pattern, workers, batch, batch_transform=rows_to_regression, transport=transport)


def _sampled(cls: type[DataLoader[Any]], pattern: str, workers: int, work: Work, batch: int) -> Iterable[Any]:
    dataset = NpyRows(pattern, work)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    context = "spawn" if workers else None
    return cls(dataset, batch_size=batch, sampler=sampler, num_workers=workers, multiprocessing_context=context)


def plain(pattern: str, workers: int, work: Work, batch: int = BATCH) -> Iterable[Any]:
    return _sampled(DataLoader, pattern, workers, work, batch)


def stateful(pattern: str, workers: int, work: Work, batch: int = BATCH) -> Iterable[Any]:
    return _sampled(StatefulDataLoader, pattern, workers, work, batch)


Builder = Callable[[str, int, Work, int], Iterable[Any]]
OURS, OURS_BATCH, PLAIN = "lightning_sharding", "lightning_sharding, batch path", "DataLoader + DistributedSampler"
SYSTEMS: dict[str, Builder] = {
    OURS: ours,
    OURS_BATCH: ours_vectorised,
    PLAIN: plain,
    "torchdata StatefulDataLoader": stateful,
}


def measure(build: Builder, pattern: str, workers: int, work: Work, batch: int = BATCH) -> float:
    torch.manual_seed(0)
    return epoch_rate(build(pattern, workers, work, batch), workers)


class RawRows(NpyRows):
    """The rows as NpyReader gives them, ``{"x": row}`` (no per-sample work), one ``__getitem__`` per
    row: the per-sample baseline."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": np.array(self.row(i))}  # a writable copy, as collate wants


def batch_level_rates(pattern: str) -> tuple[float, float]:
    """Samples/s with 0 workers of our NpyReader reading each batch as one column read (no transform)
    and of a plain DataLoader over :class:`RawRows`; both yield batches ``{"x": (256, DIM + 2) tensor}``."""
    reader = NpyReader(pattern)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    options = LoaderOptions(batch_size=BATCH, padding_key=None)
    ours_loader = ShardedLoader.build(reader, manifest.items, ledger, world=World(), options=options)
    dataset = RawRows(pattern, Work())
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    plain_loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    rates = []
    for loader in (ours_loader, plain_loader):
        n, start = 0, time.perf_counter()
        for batch in loader:
            n += len(batch["x"])
        rates.append(n / (time.perf_counter() - start))
    return rates[0], rates[1]
