"""Data-parallel groups: the ranks of one model replica (tensor, context or pipeline parallel) read
the same batches, and only the replicas split the data.

Real processes throughout: 4 ranks of DDP over gloo (Lightning's ddp_fork; ``ModelParallelStrategy``'s
own launcher for its test) whose strategy declares
2 replicas x 2 tensor-parallel ranks in ``distributed_sampler_kwargs``, as ``ModelParallelStrategy``
does (tests/jobs/parts.py::ReplicatedDDP), or whose DataModule is told by ``data_parallel=``.
Exactly-once is checked in the records of the first rank of each replica, in the weights (each
sample's weight counts its applied gradients) and by the audit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_sharding.loading.audit import audit
from tests.support.harness import (
    Checks,
    Data,
    Job,
    Topology,
    Training,
    assert_exactly_once,
    assert_weights_count_once,
    check_resume,
    kept_records,
    run_segment,
    served_per_epoch,
    weights_of_run,
)

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

SIZES = (23, 17, 31, 25)  # 96 samples: 2 replicas x batch 8 = 6 steps an epoch
TOTAL = sum(SIZES)


CHECKS = Checks(count_weights=True, audit=True)


def tp(**topology: Any) -> Job:
    """4 ranks: 2 model replicas of 2 tensor-parallel ranks, loading in the rank's process by default."""
    return Job(
        Topology(**{**dict(world_size=4, tensor_parallel=2, num_workers=0), **topology}), Data(SIZES), checks=CHECKS
    )


def ddp() -> Job:
    """Plain DDP on 2 ranks: 2 replicas of 1 rank."""
    return Job(Topology(world_size=2, num_workers=1), Data(SIZES), checks=CHECKS)


def batches(records: list[dict[str, object]]) -> list[tuple[object, ...]]:
    return [(r["epoch"], r["gs"], r["ids"], r["pad"]) for r in records]


def test_the_ranks_of_a_replica_read_identical_batches_and_the_replicas_split_the_epoch(tmp_path: Path) -> None:
    job = tp(num_workers=1).but(training=Training(epochs=2))
    segment = run_segment(tmp_path, "run", job)
    records = segment.records
    assert all(records[r] for r in range(4)), "every rank trained"
    # Same positions, same order, same padding on both ranks of each replica, every step.
    assert batches(records[0]) == batches(records[1])
    assert batches(records[2]) == batches(records[3])
    assert batches(records[0]) != batches(records[2])
    # The two replicas together: every sample once per epoch, in the records and in the weights.
    assert_exactly_once(served_per_epoch(kept_records(segment, None, [0, 2])), TOTAL, epochs=2)
    assert_weights_count_once(weights_of_run(tmp_path, [segment]), TOTAL, epochs=2)
    (first, second) = audit([tmp_path])
    assert (first.consumed, first.duplicates, first.missing, first.complete) == (TOTAL, 0, 0, True)
    assert (second.consumed, second.duplicates, second.missing) == (TOTAL, 0, 0)
    assert len(list((tmp_path / "audit").glob("*.jsonl"))) == 2, "one audit file per replica"
    # The summary counts each sample once and shows the data-parallel rank of every rank.
    assert segment.report is not None and [e["consumed"] for e in segment.report["epochs"]] == [TOTAL, TOTAL]
    assert [e["served_this_run"] for e in segment.report["epochs"]] == [TOTAL, TOTAL]
    assert "world 4 rank(s) in 2 data-parallel replicas of 2" in segment.output
    assert "rank 3 = node 0 local 3 data 1" in segment.output


def test_lightnings_model_parallel_strategy_gives_each_replica_its_share(tmp_path: Path) -> None:
    """Lightning's own ``ModelParallelStrategy`` (a 2 x 2 device mesh over gloo on CPU) names its
    data-parallel dimension in ``distributed_sampler_kwargs``; nothing else is configured. It does
    not synchronise gradients by itself, so exactly-once is read from the records and the audit."""
    # ModelParallelStrategy starts its ranks as Lightning's ddp does: the script runs again for each.
    job = tp(model_parallel=True, launcher="ddp").but(checks=dict(count_weights=False))
    segment = run_segment(tmp_path, "run", job)
    records = segment.records
    assert batches(records[0]) == batches(records[1]) and batches(records[2]) == batches(records[3])
    assert batches(records[0]) != batches(records[2])
    assert_exactly_once(served_per_epoch(kept_records(segment, None, [0, 2])), TOTAL, epochs=1)
    (row,) = audit([tmp_path])
    assert (row.consumed, row.duplicates, row.missing, row.complete) == (TOTAL, 0, 0, True)
    assert "world 4 rank(s) in 2 data-parallel replicas of 2" in segment.output


def test_a_tensor_parallel_checkpoint_resumes_with_another_replica_size_and_as_plain_ddp(tmp_path: Path) -> None:
    """Tensor-parallel 2 (2 replicas of 2 ranks), killed; resumed as tensor-parallel 4 (one replica
    of 4 ranks: another data-parallel size), killed; resumed as plain DDP on 2 ranks."""
    seen, segments = check_resume(tmp_path, tp(), [tp(tensor_parallel=4), ddp()], checkpoint_every=2)
    assert_exactly_once(seen, TOTAL, epochs=1)
    assert_weights_count_once(weights_of_run(tmp_path, segments), TOTAL, epochs=1)
    killed = segments[0].records
    assert batches(killed[0]) == batches(killed[1]) and max(r["gs"] for r in killed[0]) > 2
    one_replica = segments[1].records
    assert batches(one_replica[0]) == batches(one_replica[1]) == batches(one_replica[2]) == batches(one_replica[3])
    assert max(r["gs"] for r in one_replica[0]) > 4
    (row,) = audit([tmp_path])
    assert (row.consumed, row.duplicates, row.missing, row.complete) == (TOTAL, 0, 0, True)
    inspect = subprocess.run(
        [sys.executable, "-m", "lightning_sharding.cli", "inspect", str(segments[0].checkpoints[0])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert inspect.returncode == 0, inspect.stderr
    assert "world_size 4 in 2 data-parallel replicas x num_workers 0" in inspect.stdout, inspect.stdout


def test_a_ddp_checkpoint_resumes_under_tensor_parallelism_given_by_data_parallel(tmp_path: Path) -> None:
    """The reverse, with the replicas named by the user's ``data_parallel=`` function (a mesh Lightning
    cannot see): plain DDP on 4 ranks, ``data_parallel=(global_rank // 2, world_size // 2)``."""
    then = tp(data_parallel_override=True)
    seen, segments = check_resume(tmp_path, ddp(), [then], checkpoint_every=2)
    assert_exactly_once(seen, TOTAL, epochs=1)
    assert_weights_count_once(weights_of_run(tmp_path, segments), TOTAL, epochs=1)
    resumed = segments[-1].records
    assert batches(resumed[0]) == batches(resumed[1]) and batches(resumed[2]) == batches(resumed[3])
    (row,) = audit([tmp_path])
    assert (row.consumed, row.duplicates, row.missing, row.complete) == (TOTAL, 0, 0, True)


def test_ranks_of_one_replica_that_list_other_data_fail_before_reading(tmp_path: Path) -> None:
    """2 ranks told they are one replica (``data_parallel=(0, 1)`` on both); rank 1 lists one more item."""
    topology = Topology(world_size=2, num_workers=0, tensor_parallel=2, data_parallel_override=True)
    job = Job(topology, Data(SIZES, skew_rank1=True))
    segment = run_segment(tmp_path, "run", job, expect_death=True)
    assert "rank 1 lists other data than rank 0" in segment.output, segment.output[-3000:]
    assert not any(segment.records.values()), "no rank trained"
