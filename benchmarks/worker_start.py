"""What it costs to start DataLoader workers, by start method: ``python -m benchmarks.worker_start
[--workers 2 4 8] [--repeats 3] [--quick]``.

Each measurement is a fresh training process, as a job's start or a resume is: a script whose top
level imports Lightning (as the README's example does) builds one rank's loader over synthetic data
with ``persistent_workers=False`` and N workers, started with ``spawn``, ``fork`` or ``forkserver``
(ours, the default: torch, the package and the script's imports preloaded once). For each it notes:

- start: wall seconds from the loader's ``iter()`` until every worker has delivered a batch, and the
  CPU seconds of every helper process by then (the workers and, for the forkserver, its server);
- epoch start: the same at the next epoch's ``iter()`` (workers are not persistent: they start
  again; the forkserver is running already);
- resume: wall seconds from a new process's loader built from a ledger half consumed to its first
  batch (the server's start included: nothing of the old process is left).

Figures are the medians of R rounds, each method in turn within a round; the ratio is spawn's figure
over the method's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

METHODS = ("spawn", "fork", "forkserver")
ROOT = Path(__file__).resolve().parent.parent

# The training process: imports Lightning at its top like a user's script, then times its loader.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import lightning.pytorch  # noqa: F401 - a training script's top level, as users write it
    from lightning_sharding import SyntheticReader
    from lightning_sharding.core.ledger import Ledger
    from lightning_sharding.core.manifest import Manifest
    from lightning_sharding.core.world import World
    from lightning_sharding.strategies.options import LoaderOptions
    from lightning_sharding.strategies.shard import ShardedLoader


    def cpu_of(pid):
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


    def start(loader, workers):
        begin = time.perf_counter()
        iterator = iter(loader)
        for _ in range(workers):  # one batch from each worker (they take runs of batches in turn)
            next(iterator)
        wall = time.perf_counter() - begin
        helpers = [p.pid for p in loader.helper_processes().values()]
        from multiprocessing import forkserver
        server = getattr(forkserver._forkserver, "_forkserver_pid", None)
        cpu = sum(cpu_of(pid) for pid in helpers + ([server] if server else []))
        return wall, cpu, iterator


    if __name__ == "__main__":
        method, workers, consumed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
        reader = SyntheticReader(num_items=64, samples_per_item=64, dim=16)
        manifest = Manifest.from_items(reader.items())
        ledger = Ledger(seed=1, total=manifest.total, manifest=manifest.summary())
        ledger.record(list(range(int(manifest.total * consumed))))
        ledger.commit()
        options = LoaderOptions(batch_size=16, num_workers=workers, multiprocessing_context=method)
        begin = time.perf_counter()
        loader = ShardedLoader.build(reader, manifest, ledger, world=World(0, 1), options=options)
        wall, cpu, iterator = start(loader, workers)
        result = {"start_wall": time.perf_counter() - begin, "start_cpu": cpu}
        if consumed == 0:
            for _ in iterator:  # the rest of the epoch, then the next epoch's start
                pass
            loader.sampler.set_epoch(1)
            wall, cpu, iterator = start(loader, workers)
            result.update(epoch_wall=wall)
        print(json.dumps(result))
    """
)


def measure(method: str, workers: int, consumed: float, script: Path) -> dict[str, float]:
    """One fresh training process: its start (and, from 0 consumed, its next epoch's start)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), method, str(workers), str(consumed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{method} with {workers} workers failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def run(workers: list[int], repeats: int, script: Path, *, resume: bool = True) -> dict[str, Any]:
    """``{workers: {method: {figure: median}}}``, each method in turn within a round."""
    results: dict[str, Any] = {}
    for n in workers:
        rounds: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        for _ in range(repeats):
            for method in METHODS:
                fresh = measure(method, n, 0.0, script)
                fresh["resume_wall"] = measure(method, n, 0.5, script)["start_wall"] if resume else float("nan")
                rounds[method].append(fresh)
        results[str(n)] = {
            m: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for m, runs in rounds.items()
        }
    return results


def table(results: dict[str, Any]) -> str:
    """The Markdown table: a row per (workers, method); ratios are spawn's figure over the row's."""
    lines = [
        "| workers | start method | start: wall s | start: helper CPU s | epoch start: wall s | resume: first batch s |"
        " spawn / this (start CPU, epoch start, resume) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, by_method in results.items():
        spawn = by_method["spawn"]
        for method, row in by_method.items():
            ratios = ", ".join(
                f"{spawn[k] / row[k]:.1f}x" if row[k] > 0 else "-" for k in ("start_cpu", "epoch_wall", "resume_wall")
            )
            name = f"{method} (default, preloaded)" if method == "forkserver" else method
            lines.append(
                f"| {n} | {name} | {row['start_wall']:.2f} | {row['start_cpu']:.2f} | {row['epoch_wall']:.2f} "
                f"| {row['resume_wall']:.2f} | {ratios} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 workers, 1 round, no resume (a smoke run)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    workers, repeats = ([2], 1) if args.quick else (args.workers, args.repeats)
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"lsh_worker_start_{os.getpid()}.py"
    script.write_text(SCRIPT)
    try:
        results = run(workers, repeats, script, resume=not args.quick)
    finally:
        script.unlink(missing_ok=True)
    print(f"## Worker start by start method ({os.cpu_count()} cores, {repeats} rounds, medians)")
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
