"""Elastic resume: a checkpoint written on one (ranks, workers) resumes on any other, exactly-once.

Every case runs real processes: Lightning's ddp_fork ranks or torchrun, DDP over gloo, real workers
from the package's forkserver.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_sharding.loading.audit import audit
from tests.support.harness import (
    FIRST_2X2,
    Checks,
    Job,
    Topology,
    Training,
    assert_exactly_once,
    assert_weights_count_once,
    check_resume,
    weights_of_run,
)

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

TOTAL = sum(Job().data.sizes)


@pytest.mark.parametrize(
    ("before", "after"),
    # At most 2 x 2: the machine has 2 cores. Up in ranks and workers, and down in ranks with workers
    # up; 2x2 -> 1x2 -> 2x0 is the next test, and every other rank change is the in-process contract
    # test's (tests/unit/test_strategy_contract.py).
    [pytest.param((1, 0), (2, 2), marks=pytest.mark.chain), ((2, 1), (1, 2))],  # the inner loop's shard chain
    ids=lambda t: f"{t[0]}x{t[1]}",
)
def test_mid_epoch_resume_on_another_topology(tmp_path: Path, before: tuple[int, int], after: tuple[int, int]) -> None:
    checks = Checks(count_weights=True, progress_bar=True)
    first, then = Job(Topology(*before), checks=checks), Job(Topology(*after), checks=checks)
    seen, segments = check_resume(tmp_path, first, [then], checkpoint_every=3)
    assert_exactly_once(seen, TOTAL, epochs=1)
    assert_weights_count_once(weights_of_run(tmp_path, segments), TOTAL, epochs=1)
    # The progress bar shows k/N, N the batches this rank trains in the epoch: before the resume the
    # plan's count; after it, the batches already trained plus the new topology's plan, so k ends at N.
    # Lightning draws the bar on rank 0 only.
    assert {r["bar"] for r in segments[0].records[0]} == {-(-TOTAL // (before[0] * 8))}
    resumed = segments[-1].records[0]
    assert {r["bar"] for r in resumed} == {resumed[-1]["k"]} and resumed[0]["k"] > 1, resumed
    # The resumed run reports the samples the checkpoint already held as consumed.
    final = segments[-1].report
    assert final is not None and final["epochs"][0]["consumed"] == TOTAL


def test_several_resumes_in_one_epoch_each_on_another_topology(tmp_path: Path, trained_2x2: Path) -> None:
    """2x2 -> 1x2 -> 2x0 inside epoch 0; the ledger stays a handful of ranges. The 2x2 segment is
    the session's shared one (tests/process/conftest.py), resumed from a copy."""
    then = [FIRST_2X2.on(1, 2), FIRST_2X2.on(2, 0)]
    seen, segments = check_resume(tmp_path, FIRST_2X2, then, checkpoint_every=3, trained=trained_2x2)
    assert_exactly_once(seen, TOTAL, epochs=1)
    assert_weights_count_once(weights_of_run(tmp_path, segments), TOTAL, epochs=1)
    (row,) = audit([tmp_path])  # the audit trail of the three segments agrees
    assert (row.consumed, row.duplicates, row.missing, row.complete) == (TOTAL, 0, 0, True)
    resumed_from = segments[1].checkpoints[0]
    state = torch.load(resumed_from, weights_only=True)["lightning_sharding"]
    ranges = state["consumed"].shape[0]
    size = state["consumed"].numel() * state["consumed"].element_size()
    print(f"ledger after two rescales: {ranges} ranges, {size} bytes of ranges")
    assert state["writer"] == {"world_size": 1, "data_parallel_size": 1, "num_workers": 2, "batch_size": 8}
    assert ranges <= 6


def test_a_checkpoint_at_an_epoch_end_resumes_into_a_fresh_epoch(tmp_path: Path) -> None:
    """2 ranks x 8 = 16 samples a step: 200 samples is 13 steps, so step 13 ends epoch 0."""
    first = Job(training=Training(epochs=2), checks=Checks(count_weights=True))
    then = first.on(world_size=1, num_workers=2)
    seen, segments = check_resume(tmp_path, first, [then], checkpoint_every=13)
    assert_exactly_once(seen, TOTAL, epochs=2)
    assert_weights_count_once(weights_of_run(tmp_path, segments), TOTAL, epochs=2)
    assert all(r["epoch"] == 1 for recs in segments[1].records.values() for r in recs)


def test_torchrun_two_nodes_on_one_machine_resumes_a_checkpoint_of_lightnings_launcher(
    tmp_path: Path, trained_2x2: Path
) -> None:
    """Two `torchrun --nnodes=2 --node_rank={0,1}` launches with a rendezvous on 127.0.0.1, resuming
    (a copy of) the session's shared 2x2 segment, trained under Lightning's ddp_fork (tests/process/conftest.py)."""
    then = FIRST_2X2.on(2, 1, launcher="torchrun", num_nodes=2)
    seen, segments = check_resume(tmp_path, FIRST_2X2, [then], checkpoint_every=3, trained=trained_2x2)
    assert_exactly_once(seen, TOTAL, epochs=1)
    assert_weights_count_once(weights_of_run(tmp_path, segments), TOTAL, epochs=1)
    assert "ranks: rank 0 = node 0 local 0 | rank 1 = node 1 local 0" in segments[-1].output
