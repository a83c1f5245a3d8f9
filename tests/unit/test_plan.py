"""plan_epoch: exactly-once coverage of the remaining positions, even batches, workers, re-planning."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.plan import BatchTask, EpochPlan, RankPlan, plan_epoch
from lightning_sharding.core.rangeset import RangeSet

MAX_TOTAL = 5000


@st.composite
def consumed_sets(draw: st.DrawFn, total: int) -> RangeSet:
    """A random subset of ``[0, total)``: nothing, everything, a few ranges, or scattered positions."""
    kind = draw(st.sampled_from(["empty", "all", "ranges", "ranges", "positions"]))
    if kind == "empty":
        return RangeSet()
    if kind == "all":
        return RangeSet.interval(0, total)
    if kind == "positions":
        return RangeSet.from_positions(draw(st.lists(st.integers(0, total - 1), max_size=60)))
    starts = draw(st.lists(st.integers(0, total - 1), max_size=10))
    lengths = draw(st.lists(st.integers(1, max(1, total // 3)), min_size=len(starts), max_size=len(starts)))
    return RangeSet.from_ranges((s, min(s + n, total)) for s, n in zip(starts, lengths, strict=True))


@dataclass(frozen=True)
class Case:
    total: int
    consumed: RangeSet
    world_size: int
    num_workers: int
    batch_size: int
    even_batches: str
    epoch: int

    def plan(self) -> EpochPlan:
        return plan_epoch(
            self.total,
            self.consumed,
            epoch=self.epoch,
            world_size=self.world_size,
            num_workers=self.num_workers,
            batch_size=self.batch_size,
            even_batches=self.even_batches,  # type: ignore[arg-type]
        )


# Building a BatchTask costs tens of microseconds, so cases are kept to at most ~MAX_BATCHES batches in all:
# a huge epoch cut into batches of one behaves like a small epoch cut into batches of one, only slower.
MAX_BATCHES = 400


def batch_sizes(total: int = 1) -> st.SearchStrategy[int]:
    return st.integers(max(1, -(-total // MAX_BATCHES)), 64)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    batch_size = draw(batch_sizes())
    limit = min(MAX_TOTAL, MAX_BATCHES * batch_size)
    # Half the cases are small epochs, where most edge cases live (ranks with nothing, one batch...).
    total = draw(st.one_of(st.integers(1, min(300, limit)), st.integers(1, limit)))
    return Case(
        total=total,
        consumed=draw(consumed_sets(total)),
        world_size=draw(st.integers(1, 16)),
        num_workers=draw(st.integers(0, 4)),
        batch_size=batch_size,
        even_batches=draw(st.sampled_from(["pad", "drop"])),
        epoch=draw(st.integers(0, 100)),
    )


def real_part(task: BatchTask) -> np.ndarray:
    return task.positions[: len(task.positions) - task.num_padding]


def pad_part(task: BatchTask) -> np.ndarray:
    return task.positions[len(task.positions) - task.num_padding :]


def check_rank(rp: RankPlan, plan: EpochPlan) -> tuple[list[int], list[int], list[int]]:
    """Check one rank's tasks; return its (real positions in yield order, padding, dropped positions)."""
    tasks = list(rp.tasks())
    assert len(tasks) == rp.num_batches == plan.num_batches
    assert sorted(t.index for t in tasks) == list(range(rp.num_batches))

    real: list[int] = []
    padding: list[int] = []
    for task in tasks:
        assert task.epoch == plan.epoch
        assert task.positions.dtype == np.int64
        assert 0 <= task.num_padding <= len(task.positions) <= plan.batch_size
        if task.index < rp.num_batches - 2:
            assert len(task.positions) == plan.batch_size  # only the last two batches may be short
        if task.index != rp.num_batches - 1:
            assert task.num_padding == 0
        if rp.num_served >= rp.num_batches:
            assert len(real_part(task)) >= 1  # no batch of padding alone while real samples remain
        assert task.index in rp.worker_batches(task.worker)
        real.extend(real_part(task).tolist())
        padding.extend(pad_part(task).tolist())

    # Padding and dropping follow the policy: at most one sample per rank, never both.
    assert len(padding) == rp.num_padding
    if plan.even_batches == "pad":
        assert rp.num_padding in (0, 1) and rp.num_dropped == 0
        # Padding only where real samples cannot fill every batch (batch size 1, or nothing left).
        assert (rp.num_padding == 1) == (rp.num_served < rp.num_batches)
    else:
        assert rp.num_dropped in (0, 1) and rp.num_padding == 0
    # Padding repeats a real remaining position (any rank's), so the reader can produce it.
    assert all(p in plan.remaining for p in padding)

    # The rank serves its own positions, batch by batch in increasing order, minus what it drops.
    own = rp.positions.to_array().tolist()
    by_index = sorted(tasks, key=lambda t: t.index)
    assert [p for t in by_index for p in real_part(t).tolist()] == own[: rp.num_served]
    return real, padding, own[rp.num_served :]


@settings(max_examples=1000, deadline=None)
@given(cases())
def test_plan_serves_remaining_positions_exactly_once(case: Case) -> None:
    plan = case.plan()
    consumed_model = set(case.consumed.to_array().tolist())
    remaining_model = set(range(case.total)) - consumed_model
    assert plan.remaining.to_array().tolist() == sorted(remaining_model)

    served: list[int] = []
    dropped: list[int] = []
    previous_end = -1
    for r in range(case.world_size):
        rp = plan.rank(r)
        assert rp.rank == r and rp.epoch == case.epoch
        assert len(rp.positions) == int(plan.rank_counts[r])
        # Ranks own contiguous, ordered runs of the remaining positions.
        if rp.positions:
            assert int(rp.positions.to_array()[0]) > previous_end
            previous_end = int(rp.positions.to_array()[-1])
        real, _, rank_dropped = check_rank(rp, plan)
        assert len(rank_dropped) == rp.num_dropped
        served.extend(real)
        dropped.extend(rank_dropped)

    # Coverage and disjointness: every remaining position once, either served or dropped.
    assert len(served) == len(set(served))
    assert set(served).isdisjoint(dropped)
    assert sorted(served + dropped) == sorted(remaining_model)
    assert consumed_model.isdisjoint(served)

    counts = plan.rank_counts
    assert counts.shape == (case.world_size,) and int(counts.sum()) == len(remaining_model)
    assert int(counts.max()) - int(counts.min()) <= 1


@settings(max_examples=200, deadline=None)
@given(cases())
def test_per_rank_padding_and_dropping_agree_with_rank_plans(case: Case) -> None:
    plan = case.plan()
    ranks = [plan.rank(r) for r in range(case.world_size)]
    assert plan.padding_per_rank.tolist() == [rp.num_padding for rp in ranks]
    assert plan.dropped_per_rank.tolist() == [rp.num_dropped for rp in ranks]
    assert plan.padding_per_rank.shape == plan.dropped_per_rank.shape == (case.world_size,)
    served = sum(rp.num_served for rp in ranks)
    assert served == len(plan.remaining) - int(plan.dropped_per_rank.sum())


@settings(max_examples=200, deadline=None)
@given(cases())
def test_worker_runs_partition_the_batches_and_tasks_are_round_robin(case: Case) -> None:
    plan = case.plan()
    workers = max(1, case.num_workers)
    for r in sorted({0, case.world_size - 1}):
        rp = plan.rank(r)
        runs = [rp.worker_batches(w) for w in range(workers)]
        # Contiguous, in worker order, disjoint, covering range(num_batches), near-equal.
        assert all(run.step == 1 for run in runs)
        assert [i for run in runs for i in run] == list(range(rp.num_batches))
        assert max(len(run) for run in runs) - min(len(run) for run in runs) <= 1

        # The DataLoader deals round-robin from each worker's queue, skipping exhausted workers.
        queues = [list(run) for run in runs]
        expected: list[tuple[int, int]] = []
        while any(queues):
            for w, queue in enumerate(queues):
                if queue:
                    expected.append((w, queue.pop(0)))
        assert [(t.worker, t.index) for t in rp.tasks()] == expected


@settings(max_examples=100, deadline=None)
@given(cases())
def test_plan_is_deterministic(case: Case) -> None:
    def snapshot(plan: EpochPlan) -> tuple[object, ...]:
        tasks = [
            (t.index, t.worker, t.num_padding, t.positions.tolist())
            for r in range(plan.world_size)
            for t in plan.rank(r).tasks()
        ]
        fields = (plan.epoch, plan.total, plan.world_size, plan.num_workers, plan.batch_size, plan.even_batches)
        return (*fields, plan.remaining, plan.rank_counts.tolist(), plan.num_batches, tasks)

    assert snapshot(case.plan()) == snapshot(case.plan())


@settings(max_examples=200, deadline=None)
@given(
    cases(), st.integers(1, 16), st.integers(0, 4), st.lists(st.integers(0, 10**6), min_size=16, max_size=16), st.data()
)
def test_replanning_on_another_topology_covers_exactly_the_rest(
    case: Case, world_size: int, num_workers: int, progress: list[int], data: st.DataObject
) -> None:
    batch_size = data.draw(batch_sizes(case.total), label="new batch_size")
    plan = case.plan()
    ledger = Ledger(seed=0, total=case.total, manifest={"fingerprint": "x"}, epoch=case.epoch)
    ledger.merge(case.consumed)
    # Every rank gets through a random prefix of its tasks (in dealing order); only real positions count.
    for r in range(case.world_size):
        tasks = list(plan.rank(r).tasks())
        for task in tasks[: progress[r] % (len(tasks) + 1)]:
            ledger.record(real_part(task))
            ledger.commit()
    assert case.consumed.difference(ledger.consumed) == RangeSet()  # consumed only grows

    again = Case(case.total, ledger.consumed, world_size, num_workers, batch_size, case.even_batches, case.epoch)
    replan = again.plan()
    rest = set(range(case.total)) - set(ledger.consumed.to_array().tolist())
    assert replan.remaining == ledger.consumed.complement(case.total)
    assert len(replan.remaining) == (ledger.total - len(ledger.consumed)) == len(rest)

    served: list[int] = []
    dropped: list[int] = []
    for r in range(world_size):
        real, _, rank_dropped = check_rank(replan.rank(r), replan)
        served.extend(real)
        dropped.extend(rank_dropped)
    assert len(served) == len(set(served))
    assert sorted(served + dropped) == sorted(rest)


def test_pad_policy_splits_the_short_ranks_last_batch_instead_of_padding() -> None:
    # 9 positions over 2 ranks with batch 4: 5 and 4 -> rank 0 needs 2 batches; rank 1 splits
    # its one full batch into two halves, so no batch is padding alone.
    plan = plan_epoch(9, RangeSet(), epoch=0, world_size=2, num_workers=0, batch_size=4, even_batches="pad")
    assert plan.num_batches == 2
    assert plan.padding_per_rank.tolist() == [0, 0]
    assert [t.positions.tolist() for t in plan.rank(1).tasks()] == [[5, 6], [7, 8]]


def test_pad_policy_pads_only_when_batches_outnumber_samples() -> None:
    # Batch size 1: 3 positions over 2 ranks are 2 and 1 samples for 2 batches each.
    plan = plan_epoch(3, RangeSet(), epoch=0, world_size=2, num_workers=0, batch_size=1, even_batches="pad")
    assert plan.padding_per_rank.tolist() == [0, 1]
    last = list(plan.rank(1).tasks())[-1]
    assert last.num_padding == 1 and last.positions.tolist() == [2]


def test_drop_policy_leaves_one_position_for_later() -> None:
    plan = plan_epoch(9, RangeSet(), epoch=0, world_size=2, num_workers=0, batch_size=4, even_batches="drop")
    assert plan.num_batches == 1
    assert plan.dropped_per_rank.tolist() == [1, 0]
    assert [t.positions.tolist() for t in plan.rank(0).tasks()] == [[0, 1, 2, 3]]
    assert [t.positions.tolist() for t in plan.rank(1).tasks()] == [[5, 6, 7, 8]]


def test_rank_with_nothing_left_pads_with_a_remaining_position() -> None:
    consumed = RangeSet.from_ranges([(0, 10), (11, 20)])  # only position 10 is left
    plan = plan_epoch(20, consumed, epoch=3, world_size=4, num_workers=2, batch_size=8, even_batches="pad")
    assert plan.num_batches == 1
    assert plan.padding_per_rank.tolist() == [0, 1, 1, 1]
    for r in range(1, 4):
        (task,) = plan.rank(r).tasks()
        assert task.positions.tolist() == [10] and task.num_padding == 1


def test_fully_consumed_epoch_has_no_batches() -> None:
    plan = plan_epoch(5, RangeSet.interval(0, 5), epoch=0, world_size=3, num_workers=2, batch_size=2)
    assert plan.num_batches == 0
    assert all(list(plan.rank(r).tasks()) == [] for r in range(3))


def test_rank_outside_world_is_rejected() -> None:
    plan = plan_epoch(5, RangeSet(), epoch=0, world_size=2, num_workers=0, batch_size=2)
    with pytest.raises(ValueError, match="rank 2"):
        plan.rank(2)
    with pytest.raises(IndexError):
        plan.rank(0).batch(plan.num_batches)


GOOD = {"epoch": 0, "world_size": 2, "num_workers": 1, "batch_size": 4, "even_batches": "pad"}


@pytest.mark.parametrize(
    ("total", "consumed", "override", "message"),
    [
        (0, RangeSet(), {}, "total=0"),
        (-5, RangeSet(), {}, "total=-5"),
        (10, RangeSet(), {"world_size": 0}, "world_size=0"),
        (10, RangeSet(), {"num_workers": -1}, "num_workers=-1"),
        (10, RangeSet(), {"batch_size": 0}, "batch_size=0"),
        (10, RangeSet(), {"even_batches": "truncate"}, "even_batches='truncate'"),
        (10, RangeSet.interval(8, 11), {}, "position 10"),
        (10, RangeSet.from_positions([3, 40]), {}, "position 40"),
    ],
)
def test_bad_arguments_are_named(total: int, consumed: RangeSet, override: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_epoch(total, consumed, **{**GOOD, **override})  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(cases())
def test_a_batchs_positions_are_the_ranks_cut_from_the_set(case: Case) -> None:
    """The positions of a batch that lies in one range are an ``arange`` (O(1) in Python); every
    batch holds what ``select`` cuts from the rank's positions."""
    plan = case.plan()
    for rank in range(case.world_size):
        rank_plan = plan.rank(rank)
        for index in range(rank_plan.num_batches):
            lo, hi = rank_plan.bounds(index)
            np.testing.assert_array_equal(rank_plan._elements(lo, hi), rank_plan.positions.select(lo, hi).to_array())
