"""The suite's results as one Markdown table and one picture (throughput by system, resume time
against position)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _status(row: dict[str, Any]) -> str:
    if "met" not in row:
        return ""
    return "met" if row["met"] else "**missed**"


def _ratio(row: dict[str, Any]) -> str:
    if "ratio" not in row:
        return "1x"
    rounds = row.get("rounds") or [row["ratio"]]
    return f"{row['ratio']:.2f}x (rounds {min(rounds):.2f}-{max(rounds):.2f})"


def _throughput_rows(cell: dict[str, Any]) -> list[str]:
    """One row per system of a (workers, batch) cell; the batch path's ratio is to the plain DataLoader,
    every other ratio is ours (per-sample path) to that system."""
    before, after = cell["load_average"]
    setting = (
        f"throughput ({cell['samples']:,} samples, batch {cell['batch']}, 1 rank x {cell['workers']} workers, "
        f"load average {before:.1f} -> {after:.1f})"
    )
    rows = []
    for name, row in cell["systems"].items():
        target = f">= {row['target']}x" if "target" in row else "-"
        if "unavailable" in row:
            rows.append(f"| {setting} | {name} | not run: {row['unavailable']} | - | {target} | not measured |")
            continue
        figure = f"{row['samples_per_s']:,.0f} samples/s"
        rows.append(f"| {setting} | {name} | {figure} | {_ratio(row)} | {target} | {_status(row)} |")
    return rows


def _transport_rows(tr: dict[str, Any] | None) -> list[str]:
    if tr is None:
        return []
    rows = []
    for batch, row in tr["batches"].items():
        pool, torch = row["samples_per_s"]["pool"], row["samples_per_s"]["torch"]
        rows.append(
            f"| batch transport: slot pool vs PyTorch's own path (batch path, {tr['workers']} workers, batch "
            f"{batch} = {row['batch_bytes'] / 1024:,.1f} KiB, load average {tr['load_average']:.1f}) | "
            f"lightning_sharding | {pool:,.0f} vs {torch:,.0f} samples/s | {_ratio(row)} | - | |"
        )
    return rows


def _scaling_row(ws: dict[str, Any]) -> str:
    setting = f"worker scaling (CPU-bound transform, {ws['samples']:,} samples, load average {ws['load_average']:.1f}"
    of_bare = ws.get("target_of_bare", 0.9)
    if "not_measured" in ws:
        return (
            f"| {setting}) | lightning_sharding 1 -> 2 workers | not measured: {ws['not_measured']} | - | "
            f">= {of_bare:.0%} of 2 bare processes' on an idle machine | not measured |"
        )
    sps = ws["samples_per_s"]
    share = ""
    if "main_share" in ws:
        share = (
            f"; the training process: {ws['main_ms']:.2f} ms CPU a batch, {ws['main_share']:.1%} of a batch's CPU "
            f"(workers {ws['workers_ms']:.2f} ms), which leaves two cores at most {ws['ceiling']:.2f}x"
        )
    bare = ws.get("bare_rounds") or [ws["bare_processes_2_to_1"]]
    ratio = _ratio({"ratio": ws["ratio_2_to_1"], "rounds": ws.get("rounds")})
    return (
        f"| {setting} -> {ws['load_average_after']:.1f}) | lightning_sharding 1 -> 2 workers | "
        f"{sps['1']:,.0f} -> {sps['2']:,.0f} samples/s (the same burn in 2 bare processes: "
        f"{ws['bare_processes_2_to_1']:.2f}x, rounds {min(bare):.2f}-{max(bare):.2f}{share}) | {ratio} | "
        f">= {of_bare:.0%} of bare = {ws['target']:.2f}x | {_status(ws)} |"
    )


def _resume_rows(rs: dict[str, Any] | None) -> list[str]:
    """Time to the first batch after a resume at 0/50/90% of the epoch, one row per system."""
    if rs is None:
        return []
    rows = []
    setting = f"resume: time to first batch ({rs['samples']:,} samples"
    setting += f" in {rs['items']:,} items" if "items" in rs else ""
    for name, row in rs["systems"].items():
        t = row["seconds"]
        figure = " / ".join(f"{t[k] * 1000:.1f}" for k in ("0.0", "0.5", "0.9")) + " ms at 0/50/90%"
        rounds = row.get("rounds") or [row["ratio_90_to_0"]]
        ratio = f"{row['ratio_90_to_0']:.2f} (rounds {min(rounds):.2f}-{max(rounds):.2f})"
        target = f"<= {row['target']} (90%/0%)" if "target" in row else "-"
        status = _status(row)
        rows.append(f"| {setting}, {rs['workers']} workers) | {name} | {figure} | {ratio} | {target} | {status} |")
    return rows


def markdown(results: dict[str, Any]) -> str:
    """One table: measure, system or setting, figure, ratio, target, status."""
    tp, rs, pl, ws = results["throughput"], results["resume"], results["planning"], results["worker_scaling"]
    lines = [
        f"Medians of {results['repeats']} runs; ratios are ours / peer, taken round by round in the same run.",
        "",
        "| measure | system / setting | figure | ratio | target | status |",
        "|---|---|---:|---:|---|---|",
    ]
    for cell in [tp, *results.get("throughput_grid", [])]:
        lines += _throughput_rows(cell)
    for resume in (rs, results.get("resume_large")):
        lines += _resume_rows(resume)
    lines.append(
        f"| planning: one rank + all ranks' counts (4,096 ranks x 8 workers x 10^6 items, 10,000-range ledger) | "
        f"lightning_sharding | {pl['seconds'] * 1000:.1f} ms | - | < 1 s | {_status(pl)} |"
    )
    for key in ("mixture_planning", "mixture_planning_stratified", "mixture_planning_per_stream"):
        mp = results.get(key)
        if mp is None:
            continue
        batches = mp.get("composition", "mixed")
        lines.append(
            f"| planning a mixture ({batches} batches): {mp['streams']} streams x 10^6 items, 4,096 ranks x 8 "
            f"workers, one rank's tasks and streams + all ranks' counts (then, once an epoch, its items: "
            f"{mp['locate_seconds'] * 1000:.0f} ms) | lightning_sharding | {mp['seconds'] * 1000:.1f} ms | - | "
            f"< 1 s | {_status(mp)} |"
        )
    md = results.get("mixture_decision")
    if md is not None:
        lines.append(
            f"| replanning after a `MixtureController` decision (one replan a decision): {md['streams']} streams x "
            f"10^6 items, {md['decisions']} decisions before it, 4,096 ranks x 8 workers, one rank's tasks and "
            f"streams | lightning_sharding | {md['seconds'] * 1000:.1f} ms | - | < 1 s | "
            f"{_status(md)} |"
        )
    mc = results.get("mixture_change")
    if mc is not None:
        lines.append(
            f"| resuming a changed mixture (`allow_mixture_change`), once: 16 streams x {mc['items']:,} items x "
            f"{mc['samples_per_item']} samples, {mc['consumed']:,} consumed | lightning_sharding | "
            f"{mc['seconds']:.2f} s | - | - | |"
        )
    for name, row in results["checkpoint"].items():
        lines.append(
            f"| checkpoint: ledger entry, gather + save at 2 ranks | {name} | {row['bytes']:,} bytes "
            f"({row['ranges']} ranges), {row['gather_save_seconds'] * 1000:.1f} ms | - | - | |"
        )
    bl = results.get("batch_level")
    if bl is not None:
        ours_rate, plain_rate = bl["samples_per_s"].values()
        lines.append(
            f"| batch-level reads, 0 workers ({bl['samples']:,} samples, batch 256, `.npy` rows, no transform) | "
            f"lightning_sharding columns vs DataLoader per-sample `__getitem__` | {ours_rate:,.0f} vs "
            f"{plain_rate:,.0f} samples/s | {bl['ratio']:.1f}x | >= 5x | {_status(bl)} |"
        )
    lines += _transport_rows(results.get("transport"))
    lines.append(_scaling_row(ws))
    mem = results["memory"]
    per_item = mem["data_per_item"]
    baseline = per_item["baseline: a copy per worker"]
    for name, ratio in per_item.items():
        target = mem["targets"].get(name)
        verdict = "" if target is None else ("met" if ratio <= target else "MISSED")
        lines.append(
            f"| memory: PSS above idle / item ({mem['item_mb']} MB item, 1 rank x {mem['workers']} workers) | "
            f"{name} | {ratio:.2f}x the item | {baseline / max(ratio, 1e-9):.2f}x less than a copy per worker | "
            f"{'-' if target is None else f'<= {target}x'} | {verdict} |"
        )
    m = results["machine"]
    lines += [
        "",
        f"Machine: {m['cpus']} CPUs, {m['processor']}, {m['platform']}, Python {m['python']}, torch {m['torch']}; "
        f"load average {m['load_average'][0]:.1f} during the run (shared with other jobs).",
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Throughput by system (bars) and resume time against position (lines) in one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    systems = {n: r for n, r in results["throughput"]["systems"].items() if "samples_per_s" in r}
    names = list(systems)
    left.barh(
        names, [systems[n]["samples_per_s"] for n in names], color=["tab:green"] + ["tab:gray"] * (len(names) - 1)
    )
    left.invert_yaxis()
    left.set_xlabel("samples/s (median)")
    tp = results["throughput"]
    left.set_title(f"throughput, 1 rank x {tp['workers']} workers, batch {tp['batch']}", fontsize=10)
    for resume in (r for r in (results["resume"], results.get("resume_large")) if r is not None):
        for name, row in resume["systems"].items():
            fractions = sorted(row["seconds"], key=float)
            ms = [1000 * row["seconds"][f] for f in fractions]
            right.plot([100 * float(f) for f in fractions], ms, "o-", label=f"{name}, {resume['samples']:,} samples")
    right.set_yscale("log")
    right.set_xlabel("resume position (% of epoch)")
    right.set_ylabel("time to first batch (ms)")
    right.set_title("resume cost", fontsize=10)
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))  # under the axes: lines span them
    fig.savefig(path, dpi=100)
