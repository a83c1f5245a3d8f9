"""The audit trail and ``lightning-sharding audit``: real runs, a real kill and resume, planted faults."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharding import ShardedDataModule, SyntheticReader
from lightning_sharding.loading.audit import audit
from lightning_sharding.train import Regressor
from tests.support.harness import (
    FIRST_2X2,
    assert_exactly_once,
    assert_weights_count_once,
    check_resume,
    checkpoint_step,
    cpu_trainer,
    weights_of_run,
)
from tests.support.replay import assert_replay_matches_audit

pytestmark = pytest.mark.timeout(600)


def tiny_model() -> Regressor:
    return Regressor(dim=8, hidden=4, learning_rate=0.01)


def audited_run(run_dir: Path, **trainer_kwargs: Any) -> Path:
    dm = ShardedDataModule(SyntheticReader(sizes=[9, 12, 7]), batch_size=4, seed=3, audit_dir=str(run_dir / "audit"))
    cpu_trainer(**{"max_epochs": 2, **trainer_kwargs}).fit(tiny_model(), datamodule=dm)
    return run_dir


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "lightning_sharding.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_clean_run_audits_exactly_once(tmp_path: Path) -> None:
    run = audited_run(tmp_path / "run")
    results = audit([run])
    assert [(r.epoch, r.expected, r.consumed, r.duplicates, r.missing, r.complete) for r in results] == [
        (0, 28, 28, 0, 0, True),
        (1, 28, 28, 0, 0, True),
    ]
    proc = cli("audit", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("exactly-once") == 2


def _step_lines(run: Path) -> tuple[Path, list[str]]:
    (path,) = sorted((run / "audit").glob("*.jsonl"))
    return path, path.read_text().splitlines()


def test_audit_catches_a_planted_duplicate(tmp_path: Path) -> None:
    run = audited_run(tmp_path / "run")
    path, lines = _step_lines(run)
    step = next(line for line in lines if json.loads(line)["kind"] == "step")
    path.write_text("\n".join([*lines[:3], step, *lines[3:]]) + "\n")  # one batch served twice
    proc = cli("audit", str(run))
    assert proc.returncode == 1
    row = next(r for r in audit([run]) if r.epoch == 0)
    assert row.duplicates == sum(end - start for start, end in json.loads(step)["pos"])
    assert "VIOLATED" in proc.stdout


def test_audit_catches_a_planted_gap(tmp_path: Path) -> None:
    run = audited_run(tmp_path / "run")
    path, lines = _step_lines(run)
    gap = next(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "step")
    path.write_text("\n".join(lines[:gap] + lines[gap + 1 :]) + "\n")  # one batch never served
    proc = cli("audit", str(run))
    assert proc.returncode == 1
    assert next(r for r in audit([run]) if r.epoch == 0).missing == 4
    assert "VIOLATED" in proc.stdout


def test_an_unfinished_epoch_is_in_progress_not_violated(tmp_path: Path) -> None:
    run = audited_run(tmp_path / "run", max_steps=3)
    (row,) = audit([run])
    assert (row.consumed, row.duplicates, row.complete, row.ok) == (12, 0, False, True)
    proc = cli("audit", str(run))
    assert proc.returncode == 0 and "in progress" in proc.stdout


def test_audit_of_a_missing_directory_names_it(tmp_path: Path) -> None:
    proc = cli("audit", str(tmp_path / "nowhere"))
    assert proc.returncode != 0 and "nowhere" in proc.stdout + proc.stderr


@pytest.mark.processes
def test_audit_of_a_killed_and_resumed_ddp_run_is_exactly_once(tmp_path: Path, trained_2x2: Path) -> None:
    """2 ranks x 2 workers, SIGKILL after a checkpoint, resume on 1 rank x 3 workers, killed the same
    way, resume on 2 ranks x 1 worker. The audit of the three segments agrees with the harness's own
    records: steps after each checkpoint are cut. And the last checkpoint's history replays every step
    the audit trail holds, rank by rank (``inspect --step``). The 2x2 segment is the session's shared
    one (tests/process/conftest.py), resumed from a copy."""
    total = sum(FIRST_2X2.data.sizes)
    then = [FIRST_2X2.on(world_size=1, num_workers=3), FIRST_2X2.on(world_size=2, num_workers=1)]
    seen, segments = check_resume(tmp_path, FIRST_2X2, then, checkpoint_every=3, trained=trained_2x2)
    assert_exactly_once(seen, total, epochs=1)
    assert_weights_count_once(weights_of_run(tmp_path, segments), total, epochs=1)
    killed_steps = max(r["gs"] for r in segments[0].records[0])
    assert killed_steps > 3, "the killed segment trained past its checkpoint"
    proc = cli("audit", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = audit([tmp_path])
    assert (row.consumed, row.duplicates, row.missing) == (total, 0, 0)
    last = max(segments[-1].checkpoints, key=checkpoint_step)
    assert_replay_matches_audit(last, tmp_path, first_steps=range(12), cli_step=4)
    # And each replayed position named by item and index (inspect --step --data) is the sample that the
    # records of the runs say that rank trained at that step, read from the data itself (its id).
    from lightning_sharding.cli.checkpoint import format_step
    from lightning_sharding.core.manifest import Manifest

    sizes = FIRST_2X2.data.sizes
    manifest = Manifest.from_items(SyntheticReader(sizes=list(sizes)).items())
    offsets = [0, *itertools.accumulate(sizes)][:-1]
    first_id = {item.key: offset for item, offset in zip(manifest.items, offsets, strict=True)}
    trained: dict[tuple[int, int], list[int]] = {}  # (step, rank) -> ids, from the runs' own records
    for segment, start, end in zip(segments, (0, 3, 6), (3, 6, None), strict=True):
        for rank, records in segment.records.items():
            for record in records:
                if start <= record["gs"] - 1 and (end is None or record["gs"] - 1 < end):
                    trained.setdefault((record["gs"] - 1, rank), []).extend(record["ids"])
    state = torch.load(last, map_location="cpu", weights_only=True)["lightning_sharding"]
    for step in range(12):
        text = format_step(state, step, 12, manifest)
        rank = -1
        named: dict[tuple[int, int], list[int]] = {}
        for line in text.splitlines():
            if line.startswith("rank "):
                rank = int(line.split()[1].rstrip(":"))
            elif line.startswith("  position "):
                key, index = line.split(": ", 1)[1].rsplit(" [", 1)
                named.setdefault((step, rank), []).append(first_id[key] + int(index.rstrip("]")))
        assert named == {k: v for k, v in trained.items() if k[0] == step}, f"step {step}:\n{text}"


class SlowReader(SyntheticReader):
    def read_batch(self, item: Any, indices: Any, ctx: Any) -> list[Any]:
        time.sleep(0.02)
        return super().read_batch(item, indices, ctx)


class SlowModel(Regressor):
    def __init__(self) -> None:
        super().__init__(dim=8, hidden=4, learning_rate=0.01)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("reader", "model", "data_bound"), [(SlowReader, tiny_model, True), (SyntheticReader, SlowModel, False)]
)
def test_progress_bar_shows_progress_throughput_and_data_wait(reader: Any, model: Any, data_bound: bool) -> None:
    """Data-wait is the share of step time spent waiting for the next batch: high when reading is slow."""
    from lightning_sharding import ShardingCallback

    dm = ShardedDataModule(reader(sizes=[40, 40]), batch_size=4, seed=1)
    trainer = cpu_trainer(callbacks=[ShardingCallback(log_every_n_steps=5)])
    trainer.fit(model(), datamodule=dm)
    metrics = trainer.progress_bar_metrics
    assert metrics["data/progress"] == pytest.approx(1.0)
    assert metrics["data/samples_per_s"] > 0
    assert (metrics["data/wait"] > 0.6) if data_bound else (metrics["data/wait"] < 0.4), metrics
