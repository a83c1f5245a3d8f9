"""Exactly-once without the Trainer: ``ShardedData`` in hand-written loops, counted in the weights.

Each chain trains a loop of tests/jobs/loop_job.py (Lightning Fabric, or plain PyTorch under real
``torchrun``), SIGKILLs it mid-epoch a few steps after a checkpoint, and resumes from that checkpoint
on other topologies (2x2 -> 1x2 -> 2x1). The model holds one weight per sample id that every applied
gradient raises by 1, so the weights themselves say how often each sample was trained; every
checkpoint's ledger must hold exactly the samples its weights hold. Every rank also reports the
modules it imported: neither loop (Fabric's saves, DCP's saves and loads) loads Lightning's Trainer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.harness import ROOT, Topology, job_env, launch

LOOP_JOB = ROOT / "tests" / "jobs" / "loop_job.py"
SIZES = (37, 41, 29, 53, 40)
STREAMS = (
    {"name": "web", "sizes": [30, 25], "weight": 0.6},
    {"name": "code", "sizes": [40, 20], "weight": 0.4},
)
SEED = 1234  # tests/jobs/loop_job.py's


def run_loop(out: Path, segment: str, *, expect_death: bool = False, **config: Any) -> str:
    """Run one segment of the loop job; its output. It must die (SIGKILL) or finish as expected."""
    out.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = dict(
        launcher="fabric",
        ranks=2,
        workers=2,
        save="fabric",
        epochs=2,
        accumulate=1,
        save_every=3,
        die_after=None,
        resume_from=None,
        sizes=list(SIZES),
        streams=None,
        samples_per_epoch=None,
        gather_timeout=600,
        rank0_alone=False,
        reenter_after=None,
        docs=False,
        kill_in_save=None,
    )
    cfg.update(config, out=str(out), segment=segment)
    path = out / f"config-{segment}.json"
    path.write_text(json.dumps(cfg))
    topology = Topology(world_size=cfg["ranks"], launcher="torchrun" if cfg["launcher"] == "torchrun" else "ddp")
    returncode, output = launch(topology, path, job_env(), job=LOOP_JOB)
    if expect_death:
        assert returncode != 0, f"segment {segment} was meant to die but finished:\n{output[-3000:]}"
    else:
        assert returncode == 0, f"segment {segment} failed with {returncode}:\n{output[-5000:]}"
    return output


def checkpoints(out: Path, segment: str) -> list[Path]:
    return sorted(out.glob(f"ckpt-{segment}-*"))


def manifest_of(streams: Any, samples_per_epoch: int | None) -> Any:
    from lightning_sharding import SyntheticReader
    from lightning_sharding.core.manifest import Manifest
    from lightning_sharding.mixture import MixtureReader
    from tests.support.data.streams import make_streams

    if streams:
        return MixtureReader(make_streams(list(streams)), samples_per_epoch).manifest()
    return Manifest.from_items(SyntheticReader(sizes=list(SIZES)).items())


def ids_at(manifest: Any, epoch: int, positions: np.ndarray) -> np.ndarray:
    """The sample id at each of ``positions`` of ``epoch``'s order."""
    items, index = manifest.order(SEED, epoch).locate(positions)
    return np.concatenate(([0], np.cumsum(manifest.counts)))[items] + index


def planned(manifest: Any, epoch: int, num_ids: int) -> np.ndarray:
    """How often each sample id is drawn in ``epoch`` (once each, but for a mixture's repeated draws)."""
    return np.bincount(ids_at(manifest, epoch, np.arange(manifest.total)), minlength=num_ids).astype(float)


def read_checkpoint(path: Path, tmp: Path) -> tuple[np.ndarray, dict[str, Any]]:
    """A checkpoint's per-sample weights and ledger entry, whichever way it was written."""
    if path.is_dir():  # torch.distributed.checkpoint: into one file first
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        tmp.mkdir(exist_ok=True)
        dcp_to_torch_save(path, tmp / f"{path.name}.pt")
        state = torch.load(tmp / f"{path.name}.pt", weights_only=False)
    else:
        state = torch.load(path, weights_only=True)
    return state["model"]["w"].numpy(), state["data"]["ledger"][0]


def assert_ledger_matches_weights(path: Path, manifest: Any, num_ids: int, tmp: Path) -> int:
    """The checkpoint's ledger holds exactly the samples whose gradients its weights hold; its epoch."""
    from lightning_sharding.core.rangeset import RangeSet

    w, entry = read_checkpoint(path, tmp)
    epoch = int(entry["epoch"])
    consumed = RangeSet.from_state(np.asarray(entry["consumed"]))
    positions = np.concatenate([np.arange(a, b) for a, b in consumed.ranges()] or [np.zeros(0, np.int64)])
    expected = sum((planned(manifest, e, num_ids) for e in range(epoch)), np.zeros(num_ids))
    expected += np.bincount(ids_at(manifest, epoch, positions), minlength=num_ids)
    wrong = np.flatnonzero(w != expected)
    assert not wrong.size, (
        f"{path.name}: the ledger (epoch {epoch}, {len(consumed)} consumed, step {entry['global_step']}) "
        f"disagrees with the weights on {wrong.size} samples, e.g. ids {wrong[:5].tolist()}: "
        f"weights {w[wrong[:5]].tolist()}, the ledger says {expected[wrong[:5]].tolist()}"
    )
    return epoch


def assert_chain(out: Path, segments: list[str], manifest: Any, num_ids: int, epochs: int) -> None:
    """Every checkpoint's ledger matches its weights, and each epoch's end weights (from the last
    segment that ended it) hold every planned sample exactly as often as it was drawn. And no rank of
    any segment imported Lightning's Trainer package (``lightning``, ``pytorch_lightning``): the
    loading engine imports none; a Fabric loop loads ``lightning_fabric`` alone."""
    for segment in segments:
        ranks = json.loads((out / f"config-{segment}.json").read_text())["ranks"]
        reports = sorted(out.glob(f"modules-{segment}-rank*.json"))
        assert [r.name for r in reports] == [f"modules-{segment}-rank{k}.json" for k in range(ranks)], reports
        for report in reports:
            imported = json.loads(report.read_text())
            assert imported == [], f"{report.name}: the loop imported {imported[:10]}"
    mid_epoch = []
    for segment in segments:
        for path in checkpoints(out, segment):
            mid_epoch.append(assert_ledger_matches_weights(path, manifest, num_ids, out / "converted"))
    assert mid_epoch, "no checkpoint was written"
    assert_epoch_ends(out, segments, manifest, num_ids, epochs)


def assert_epoch_ends(out: Path, segments: list[str], manifest: Any, num_ids: int, epochs: int) -> None:
    """Each epoch's end weights (from the last segment that ended it) hold every planned sample
    exactly as often as it was drawn."""
    ends: dict[int, np.ndarray] = {}
    for segment in segments:
        ends.update({int(p.stem.rsplit("epoch", 1)[1]): np.load(p) for p in out.glob(f"w-{segment}-epoch*.npy")})
    assert sorted(ends) == list(range(epochs)), f"epochs whose end saved weights: {sorted(ends)}"
    expected = np.zeros(num_ids)
    for epoch in range(epochs):
        expected += planned(manifest, epoch, num_ids)
        wrong = np.flatnonzero(ends[epoch] != expected)
        assert not wrong.size, (
            f"epoch {epoch}'s end: {wrong.size} samples trained other than planned, e.g. ids {wrong[:5].tolist()}: "
            f"weights {ends[epoch][wrong[:5]].tolist()}, planned {expected[wrong[:5]].tolist()}"
        )


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_fabric_loop_killed_and_resumed_on_other_topologies_trains_every_sample_once(tmp_path: Path) -> None:
    # 200 samples, batches of 8: 13 batches a rank on 2 ranks (4 padded), 25 on 1 rank.
    run_loop(tmp_path, "a", ranks=2, workers=2, die_after=7, expect_death=True)
    a = checkpoints(tmp_path, "a")
    assert [p.name for p in a] == ["ckpt-a-003", "ckpt-a-006"]
    run_loop(tmp_path, "b", ranks=1, workers=2, resume_from=str(a[-1]), die_after=8, expect_death=True)
    b = checkpoints(tmp_path, "b")
    # The last segment also leaves its first pass early and asks for the same epoch again.
    run_loop(tmp_path, "c", ranks=2, workers=1, resume_from=str(b[-1]), reenter_after=2)
    manifest = manifest_of(None, None)
    assert_chain(tmp_path, ["a", "b", "c"], manifest, sum(SIZES), epochs=2)


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_torchrun_dcp_loop_of_a_mixture_with_accumulation_resumes_exactly_on_other_topologies(tmp_path: Path) -> None:
    # A two-stream mixture of 240 draws an epoch (streams repeat), a step every 2 batches, checkpoints
    # every 3 batches (every other one inside an accumulation window), DCP written by every rank and
    # read on another number of ranks; the last segment saves with torch.save on rank 0.
    mixture: dict[str, Any] = dict(
        launcher="torchrun", streams=list(STREAMS), samples_per_epoch=240, accumulate=2, save="dcp", save_every=3
    )
    run_loop(tmp_path, "a", **mixture, ranks=2, workers=2, die_after=10, expect_death=True)
    a = checkpoints(tmp_path, "a")
    assert [p.name for p in a] == ["ckpt-a-003", "ckpt-a-006", "ckpt-a-009"] and a[-1].is_dir()
    # 15 batches a rank on 2 ranks: the resume from batch 9, inside a window, has 112 positions left;
    # on 1 rank that is 14 batches, then epoch 1 starts: the last checkpoint is at its first batch.
    run_loop(
        tmp_path, "b", **mixture | dict(ranks=1, workers=2, resume_from=str(a[-1]), die_after=17), expect_death=True
    )
    b = checkpoints(tmp_path, "b")
    assert b[-1].name == "ckpt-b-015"
    run_loop(tmp_path, "c", **mixture | dict(ranks=2, workers=1, resume_from=str(b[-1]), save="torch"))
    assert all(p.is_file() for p in checkpoints(tmp_path, "c"))
    manifest = manifest_of(STREAMS, 240)
    assert_chain(tmp_path, ["a", "b", "c"], manifest, sum(sum(s["sizes"]) for s in STREAMS), epochs=2)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_state_taken_on_rank_0_alone_fails_loudly_naming_the_other_ranks(tmp_path: Path) -> None:
    output = run_loop(
        tmp_path,
        "alone",
        launcher="torchrun",
        ranks=2,
        workers=0,
        rank0_alone=True,
        gather_timeout=5,
        expect_death=True,
    )
    assert "ShardedData.state_dict() on rank 0 gathers every rank's ledger" in output, output[-3000:]
    assert "Call it on every rank" in output
    assert not checkpoints(tmp_path, "alone")
