"""The loader rows of the suite: throughput of every system over a grid of workers x batch sizes,
our two batch transports side by side, and worker scaling measured only on an idle machine.

Every cell runs its systems alternately, round by round, rotating who goes first (the first run of
a process pays for cold caches), and records the 1-minute load average before and after it, so a
figure taken while the machine was busy shows as such.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import peers, throughput
from benchmarks.throughput import OURS, OURS_BATCH, PLAIN

# The targets hold at 2 workers, batch 256: our per-sample path at least level with the
# plain DataLoader and its stateful twin, ahead of the streaming peers, the batch path 1.3x ahead.
TARGETS = {PLAIN: 1.0, "torchdata StatefulDataLoader": 1.0} | dict.fromkeys(peers.PEERS, 1.2)
# Worker scaling: 1 -> 2 workers within 10 % of what two bare processes gain on the same machine.
BATCH_PATH_TARGET, SCALING_OF_BARE, IDLE_LOAD = 1.3, 0.9, 1.5
HEADLINE = (2, throughput.BATCH)
Log = Callable[[str], None]


def load_average() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def wait_for_idle(limit_s: float, log: Log) -> float:
    """Wait up to ``limit_s`` for the 1-minute load average to fall to ``IDLE_LOAD``; returns the last reading."""
    deadline = time.monotonic() + limit_s
    load = load_average()
    while load > IDLE_LOAD and time.monotonic() < deadline:
        log(f"  waiting for an idle machine: load average {load:.2f} > {IDLE_LOAD}")
        time.sleep(10)
        load = load_average()
    return load


def builders_with_peers(root: Path, pattern: str) -> tuple[dict[str, throughput.Builder], dict[str, str]]:
    """Every system's builder over the rows of ``pattern`` (the peers write their own formats under
    ``root``), and for each peer that cannot run here the reason."""
    builders = dict(throughput.SYSTEMS)
    unavailable: dict[str, str] = {}
    for name in peers.PEERS:
        module, reason = peers.load(name)
        if module is None:
            unavailable[name] = reason or "unknown"
            continue
        out = root / name.replace(" ", "_")
        module.prepare(pattern, out)
        builders[name] = peers.builder(module, out)
    return builders, unavailable


def run_cell(
    builders: dict[str, throughput.Builder],
    unavailable: dict[str, str],
    pattern: str,
    repeats: int,
    cell: tuple[int, int],
    log: Log,
) -> dict[str, Any]:
    """One (workers, batch) cell: every system's samples/s, and its ratio to ours round by round (the
    batch path's ratio is to the plain DataLoader). Targets only in the headline cell."""
    workers, batch = cell
    work = throughput.Work()
    names = list(builders)
    runs: dict[str, list[float]] = {name: [] for name in names}
    load_before = load_average()
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(throughput.measure(builders[name], pattern, workers, work, batch))
            log(f"  {workers} workers, batch {batch}, round {r + 1}/{repeats}: {name} {runs[name][-1]:,.0f} samples/s")
    headline = cell == HEADLINE
    systems: dict[str, Any] = {}
    for name in names:
        row: dict[str, Any] = {"samples_per_s": statistics.median(runs[name]), "runs": runs[name]}
        if name != OURS:
            ours, other = (runs[OURS_BATCH], runs[PLAIN]) if name == OURS_BATCH else (runs[OURS], runs[name])
            rounds = [a / b for a, b in zip(ours, other, strict=True)]
            row.update(ratio=statistics.median(rounds), rounds=rounds)
            target = BATCH_PATH_TARGET if name == OURS_BATCH else TARGETS.get(name)
            if headline and target is not None:
                row.update(target=target, met=row["ratio"] >= target)
        systems[name] = row
    for name, reason in unavailable.items():
        systems[name] = {"unavailable": reason} | ({"target": TARGETS[name]} if headline else {})
    return {"workers": workers, "batch": batch, "load_average": [load_before, load_average()], "systems": systems}


def run_grid(root: Path, samples: int, repeats: int, cells: list[tuple[int, int]], log: Log) -> list[dict[str, Any]]:
    """Every system in every (workers, batch) cell, on the same ``samples`` rows."""
    pattern = throughput.write_npy(root, samples)
    builders, unavailable = builders_with_peers(root, pattern)
    grid = []
    for cell in cells:
        log(f"throughput: {cell[0]} workers, batch {cell[1]}")
        grid.append(run_cell(builders, unavailable, pattern, repeats, cell, log) | {"samples": samples})
    return grid


def run_transport(root: Path, samples: int, repeats: int, batches: tuple[int, ...], log: Log) -> dict[str, Any]:
    """Our batch path with 2 workers, batches through the slot pool against PyTorch's own path, at
    several batch sizes: where the pool stops paying (the crossover) shows as a ratio below 1."""
    pattern = throughput.write_npy(root / "transport", samples)
    work, rows = throughput.Work(), {}
    for batch in batches:
        runs: dict[str, list[float]] = {"pool": [], "torch": []}
        for r in range(repeats):
            for transport in ("pool", "torch") if r % 2 == 0 else ("torch", "pool"):
                build = partial(throughput.ours_vectorised, transport=transport)
                runs[transport].append(throughput.measure(build, pattern, 2, work, batch))
        rounds = [a / b for a, b in zip(runs["pool"], runs["torch"], strict=True)]
        rows[str(batch)] = {
            "batch_bytes": batch * throughput.BATCH_ROW_BYTES,
            "samples_per_s": {name: statistics.median(r) for name, r in runs.items()},
            "ratio": statistics.median(rounds),
            "rounds": rounds,
        }
        log(f"  transport, batch {batch}: pool / torch {rows[str(batch)]['ratio']:.2f}x")
    return {"samples": samples, "workers": 2, "batches": rows, "load_average": load_average()}


def run_worker_scaling(
    root: Path, samples: int, repeats: int, burn_rounds: int, wait_s: float, log: Log
) -> dict[str, Any]:
    """Ours with a CPU-bound per-sample transform on 1 and then 2 workers, measured only when the load
    average has fallen to ``IDLE_LOAD`` (waiting up to ``wait_s``); above it, the reason instead of a
    figure, since two workers on a busy 2-core machine measure the other jobs, not the loader. Beside it,
    the same burn in two bare processes against one: the most this machine gives that work; the target
    is 90 % of it. And where the rest goes: the CPU of a batch in the training process (``main_ms``) and
    in the workers (``workers_ms``), and the most two cores give when the training process's share comes
    out of the workers' (``ceiling``: 2 x one worker's CPU a batch / (two workers' + the training process's))."""
    row: dict[str, Any] = {"samples": samples, "burn_rounds": burn_rounds, "target_of_bare": SCALING_OF_BARE}
    load = wait_for_idle(wait_s, log)
    row["load_average"] = load
    if load > IDLE_LOAD:
        row["not_measured"] = f"load average {load:.2f} > {IDLE_LOAD} after waiting {wait_s:.0f} s"
        return row
    pattern = throughput.write_npy(root / "scaling", samples)
    work = throughput.Work(burn_rounds)
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    bare: list[float] = []
    for r in range(repeats):
        for workers in runs:
            runs[workers].append(throughput.epoch_shares(pattern, workers, work))
        bare.append(throughput.bare_scaling(samples // 10))
        two = runs[2][-1]
        log(
            f"  scaling round {r + 1}/{repeats}: {runs[1][-1]['samples_per_s']:,.0f} -> {two['samples_per_s']:,.0f} "
            f"samples/s, bare {bare[-1]:.2f}x; training process {two['main_ms']:.2f} ms CPU a batch"
        )
    rounds = [b["samples_per_s"] / a["samples_per_s"] for a, b in zip(runs[1], runs[2], strict=True)]
    ratio, ceiling = statistics.median(rounds), statistics.median(bare)

    def median(workers: int, key: str) -> float:
        return statistics.median(run[key] for run in runs[workers])

    main, spent, one = median(2, "main_ms"), median(2, "workers_ms"), median(1, "workers_ms")
    row.update(
        samples_per_s={str(w): median(w, "samples_per_s") for w in runs},
        ratio_2_to_1=ratio,
        rounds=rounds,
        bare_processes_2_to_1=ceiling,
        bare_rounds=bare,
        target=SCALING_OF_BARE * ceiling,
        met=ratio >= SCALING_OF_BARE * ceiling,
        main_ms=main,
        main_ms_1_worker=median(1, "main_ms"),
        workers_ms=spent,
        workers_ms_1_worker=one,
        main_share=main / (main + spent),
        ceiling=2 * one / (spent + main),
        load_average_after=load_average(),
    )
    return row
