"""The whole suite: ``python -m benchmarks [--quick] [--repeats R] [--out DIR]``.

Prints one Markdown table, writes ``DIR/latest.json`` and ``DIR/latest.png`` (default
``benchmarks/results``). Every figure is a median over R runs; every ratio compares systems run
alternately in the same process, round by round, and is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

from benchmarks import loaders, resume_cost, scale, throughput  # noqa: E402
from benchmarks.report import markdown, plot  # noqa: E402

OURS = throughput.OURS
GRID = [(0, 64), (0, 256), (1, 64), (1, 256), (2, 64), (2, 256)]  # (workers, batch); the last is the headline
TRANSPORT_BATCHES = (16, 64, 256, 1024, 4096)


def run_batch_level(root: Path, samples: int, repeats: int) -> dict[str, Any]:
    """0 workers: a batch-level reader (one column read per batch) against per-sample ``__getitem__``."""
    pattern = throughput.write_npy(root / "batch_level", samples)
    runs = [throughput.batch_level_rates(pattern) for _ in range(repeats)]
    ratio = statistics.median(a / b for a, b in runs)
    return {
        "samples": samples,
        "samples_per_s": {
            "lightning_sharding (columns)": statistics.median(a for a, _ in runs),
            "DataLoader (per-sample __getitem__)": statistics.median(b for _, b in runs),
        },
        "ratio": ratio,
        "ratios": [a / b for a, b in runs],
        "target": 5.0,
        "met": ratio >= 5.0,
    }


def run_resume(repeats: int, total: int = resume_cost.TOTAL) -> dict[str, Any]:
    """Time to the first batch after a resume at 0/50/90% of an epoch of ``total`` samples: ours (with
    its 1.2x target), and torchdata's StatefulDataLoader beside it at 10^6 samples (at 10^8 its
    sampler's permutation of the whole epoch takes seconds a run)."""
    fns: dict[str, Callable[..., float]] = {OURS: resume_cost.ours_first_batch}
    if total <= resume_cost.TOTAL:
        fns["torchdata StatefulDataLoader"] = resume_cost.stateful_first_batch
    rows: dict[str, Any] = {}
    for name, fn in fns.items():
        rows[name] = resume_cost.measure(fn, 0, repeats, **({"total": total} if name == OURS else {}))
    target = resume_cost.TARGET
    rows[OURS].update(target=target, met=rows[OURS]["ratio_90_to_0"] <= target)
    return {"samples": total, "items": resume_cost.ITEMS, "batch": resume_cost.BATCH, "workers": 0, "systems": rows}


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 1-2 minutes: a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure (default 3, quick 2)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 3)
    samples = 12_000 if args.quick else 100_000
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    results: dict[str, Any] = {"command": "python -m benchmarks" + (" --quick" if args.quick else "")}
    results.update(machine=machine(), repeats=repeats, quick=args.quick)
    with tempfile.TemporaryDirectory(prefix="lightning-sharding-bench-") as tmp:
        root = Path(tmp)
        grid = loaders.run_grid(root, samples, repeats, [loaders.HEADLINE] if args.quick else GRID, log)
        results["throughput"], results["throughput_grid"] = grid[-1], grid[:-1]
        log("batch transport: slot pool against PyTorch's own path")
        batches = (64, 1024) if args.quick else TRANSPORT_BATCHES
        results["transport"] = loaders.run_transport(root, samples // 2, repeats, batches, log)
        log("batch-level reads")
        results["batch_level"] = run_batch_level(root, samples, repeats)
        log("worker scaling (waits for an idle machine)")
        wait = 0 if args.quick else 180
        results["worker_scaling"] = loaders.run_worker_scaling(root, samples, repeats, 8, wait, log)
    log("resume cost")
    results["resume"] = run_resume(5 if args.quick else 31)  # cheap: more runs tame the noise of 1.5 ms runs
    results["resume_large"] = run_resume(5 if args.quick else 15, resume_cost.LARGE)
    log("planning scale")
    results["planning"] = scale.planning_seconds(max(3, repeats)) | {"target_seconds": 1.0}
    results["planning"]["met"] = results["planning"]["seconds"] < 1.0
    for composition in ("mixed", "stratified", "per_stream"):
        key = "mixture_planning" + ("" if composition == "mixed" else f"_{composition}")
        results[key] = scale.mixture_planning_seconds(max(3, repeats), composition) | {"target_seconds": 1.0}
        results[key]["met"] = results[key]["seconds"] < 1.0
    results["mixture_decision"] = scale.mixture_decision_seconds(max(3, repeats)) | {"target_seconds": 1.0}
    results["mixture_decision"]["met"] = results["mixture_decision"]["seconds"] < 1.0
    results["mixture_change"] = scale.mixture_change_seconds(10**3 if args.quick else 10**4, 100)
    log("checkpoint")
    results["checkpoint"] = scale.checkpoint(repeats)
    log("memory (broadcast)")
    from benchmarks import broadcast_memory

    results["memory"] = broadcast_memory.summary(32 if args.quick else 256)
    results["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "latest.png")
    print(markdown(results))
    log(f"wrote {args.out / 'latest.json'} and {args.out / 'latest.png'}")


if __name__ == "__main__":
    main()
