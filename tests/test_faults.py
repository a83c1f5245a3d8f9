"""Faults: the whole job SIGKILLed at random points, dead helper processes, two runs side by side.

Every kill is a real SIGKILL of real processes (Lightning's ddp_spawn ranks, spawned DataLoader
workers, dispatch processes); every exactly-once claim is checked by the audit trail over all
segments of a run (``lightning_sharding.audit``) and, independently, by the sample ids the training
steps recorded. Kill points are drawn from a seed that is printed and put in every assertion
message; set ``LSH_FAULT_SEED`` to replay one.
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharding.audit import audit, format_audit
from tests.harness import (
    Job,
    Segment,
    assert_exactly_once,
    checkpoint_step,
    kept_records,
    run_segment,
    served_per_epoch,
)
from tests.jobs.sources import make_db
from tests.jobs.windows_data import write_months

TOPOLOGIES = [(ranks, workers) for ranks in (1, 2) for workers in (0, 1, 2)]
KILLS = 5
EVERY = 2  # checkpoint every 2 steps: a kill lands 0 or 1 step after the newest checkpoint
BATCH = 4
MONTHS = (37, 41, 29, 53, 40)  # broadcast: 185 windows of 4 steps
ROWS = 200  # dispatch: rows of the SQLite source


def fault_seed() -> int:
    seed = int(os.environ.get("LSH_FAULT_SEED") or random.SystemRandom().randrange(2**31))
    print(f"LSH_FAULT_SEED={seed}")
    return seed


def strategy_job(strategy: str, data: Path) -> tuple[Job, int]:
    """A 1-epoch job of ``strategy`` with its own small data under ``data``, and its sample count."""
    if strategy == "broadcast":
        write_months(data, MONTHS)
        return Job(strategy="broadcast", months=str(data), batch_size=BATCH), sum(n - 3 for n in MONTHS)
    if strategy == "dispatch":
        data.mkdir(parents=True, exist_ok=True)
        source = {"kind": "sqlite", "path": str(make_db(data / "rows.db", ROWS))}
        return Job(strategy="dispatch", source=source, batch_size=BATCH), ROWS
    return Job(batch_size=BATCH), sum(Job().sizes)


def consumed_in(checkpoint: Path) -> int:
    """Samples the checkpoint's ledger holds as consumed in its epoch."""
    ranges = torch.load(checkpoint, weights_only=True)["lightning_sharding"]["consumed"]
    return int((ranges[:, 1] - ranges[:, 0]).sum()) if ranges.numel() else 0


@dataclass(frozen=True)
class Kill:
    """Segment topology and where its kill lands (None for the last segment, which finishes)."""

    ranks: int
    workers: int
    resumed_at: int
    step: int | None
    rank: int | None
    moment: str | None


def run_with_kills(out: Path, job: Job, total: int, rng: random.Random, seed: int) -> tuple[list[Segment], list[Kill]]:
    """The first segment on 2 ranks x 2 workers, then one resume per kill on a random topology; each
    but the last is SIGKILLed (its whole process group) at a random step after its first checkpoint."""
    segments: list[Segment] = []
    kills: list[Kill] = []
    resume: Path | None = None
    for i in range(KILLS + 1):
        ranks, workers = (2, 2) if i == 0 else rng.choice(TOPOLOGIES)
        start = checkpoint_step(resume) if resume is not None else 0
        kill = Kill(ranks, workers, start, None, None, None)
        if i < KILLS:
            left = total - (consumed_in(resume) if resume is not None else 0)
            fewest_steps = -(-left // (ranks * job.batch_size))  # no step serves more than ranks x batch
            first_checkpoint = (start // EVERY + 1) * EVERY
            step = min(first_checkpoint + rng.randrange(EVERY), start + fewest_steps - 1)
            assert step >= first_checkpoint, f"seed {seed}: data too small for {KILLS} kills: {kills}"
            kill = replace(kill, step=step, rank=rng.randrange(ranks), moment=rng.choice(["before", "after"]))
        kills.append(kill)
        segment_job = replace(
            job,
            world_size=ranks,
            num_workers=workers,
            audit=True,
            checkpoint_every=EVERY,
            resume_from=str(resume) if resume is not None else None,
            kill_group=None if kill.step is None else {"step": kill.step, "rank": kill.rank, "moment": kill.moment},
        )
        segment = run_segment(out, f"seg{i}", segment_job, expect_death=kill.step is not None)
        segments.append(segment)
        if kill.step is not None:
            assert segment.returncode == -signal.SIGKILL, f"seed {seed}: segment {i} {kill} ended {segment.returncode}"
            # Resume from the newest checkpoint there is, as an operator would.
            resume = max((out / "checkpoints").glob("*.ckpt"), key=checkpoint_step)
    return segments, kills


@pytest.mark.processes
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["shard", "broadcast", "dispatch"])
def test_sigkill_of_the_whole_job_at_random_points_then_resume_on_random_topologies(
    tmp_path: Path, strategy: str
) -> None:
    seed = fault_seed()
    rng = random.Random(f"{seed}-{strategy}")
    job, total = strategy_job(strategy, tmp_path / "data")
    out = tmp_path / "run"
    segments, kills = run_with_kills(out, job, total, rng, seed)
    where = f"seed {seed} ({strategy}), segments: {kills}"
    print(where)
    results = audit([out])
    table = format_audit(results)
    print(table)
    assert [r.epoch for r in results] == [0], f"{where}\n{table}"
    (epoch,) = results
    assert epoch.complete and epoch.ok and epoch.consumed == total, f"{where}\n{table}"
    # The same claim from the sample ids themselves: what every segment trained on up to the step
    # the next one resumed from.
    kept: list[dict[str, Any]] = []
    for segment, following in zip(segments, [*kills[1:], None], strict=True):
        kept += kept_records(segment, following.resumed_at if following is not None else None)
    try:
        assert_exactly_once(served_per_epoch(kept), total, epochs=1)
    except AssertionError as err:
        raise AssertionError(f"{where}: {err}") from None
    assert all(k.resumed_at < n.resumed_at for k, n in zip(kills, kills[1:], strict=False)), where
    final = segments[-1].report
    assert final is not None and final["epochs"][0]["consumed"] == total, where
