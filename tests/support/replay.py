"""The replay of a checkpoint's training history (``inspect --step``) against the audit trail of the
chain of runs that wrote it, step by step and rank by rank: for the process tests' chains."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_sharding.core.history import replay_step


def audited_steps(run_dir: Path) -> dict[int, dict[int, list[int]]]:
    """What the audit trail of a chain of runs says each data-parallel rank trained at each global
    step (``trainer.global_step`` while it trained), the steps a resumed run trained again cut as
    ``lightning-sharding audit`` cuts them: a micro-batch line whose ``gs`` moved on finished step ``gs - 1``."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for path in sorted((run_dir / "audit").glob("*.jsonl")):
        header, *lines = [json.loads(line) for line in path.read_text().splitlines()]
        runs.setdefault(header["segment"], {})[int(header["rank"])] = [header, *lines]
    ordered = sorted(runs.values(), key=lambda r: r[min(r)][0]["started"])
    steps: dict[int, dict[int, list[int]]] = {}
    for i, run in enumerate(ordered):
        cut = ordered[i + 1][0][0]["start_step"] if i + 1 < len(ordered) else None
        for rank, (header, *lines) in run.items():
            gs = int(header["start_step"])
            for line in lines:
                if line["kind"] != "step":
                    continue
                step = line["gs"] - 1 if line["gs"] > gs else line["gs"]
                gs = line["gs"]
                if cut is not None and step >= cut:
                    break
                positions = [p for start, end in line["pos"] for p in range(start, end)]
                steps.setdefault(step, {}).setdefault(rank, []).extend(positions)
    return steps


def assert_replay_matches_audit(
    checkpoint: Path, run_dir: Path, first_steps: range, cli_step: int | None = None
) -> None:
    """Every step the checkpoint holds is replayed from its history as the audit trail recorded it,
    on every rank. ``first_steps``: steps that must be there (the chain's); ``cli_step``: a step whose
    ``lightning-sharding inspect --step`` output is checked to print each rank's first position too."""
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state, held = ckpt["lightning_sharding"], int(ckpt["global_step"])
    trail = audited_steps(run_dir)
    assert set(first_steps) <= set(range(held)) <= set(trail), (held, sorted(trail))
    for step in range(held):
        replayed = {r.rank: r.positions.tolist() for r in replay_step(state, step)}
        audited = {rank: trail[step].get(rank, []) for rank in replayed}
        assert replayed == audited, f"step {step}"
    if cli_step is None:
        return
    cmd = [sys.executable, "-m", "lightning_sharding.cli", "inspect", str(checkpoint), "--step", str(cli_step)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shown: dict[int, str] = {}  # each rank's lines (one a micro-batch)
    for line in proc.stdout.splitlines():
        if line.startswith("rank "):
            rank = int(line.split()[1].rstrip(":"))
            shown[rank] = shown.get(rank, "") + line
    for rank, positions in trail[cli_step].items():
        assert f"[{min(positions)}, " in shown[rank], proc.stdout
