"""Mixtures under real DDP: three streams of different shares, killed mid-epoch and resumed on other
topologies; every planned draw is trained once, per stream, by the records, the weights and the audit.

2 ranks x 2 workers first, then 1 x 2, then 2 x 1 (the machine's budget is 2 x 2; the in-process
contract and mixture tests carry the other topologies).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding.loading.audit import audit, format_audit
from tests.support.data.streams import planned_blocks, planned_ids
from tests.support.harness import (
    FIRST_MIXTURE_2X2,
    MIXTURE,
    Checks,
    Data,
    Job,
    Loading,
    Training,
    check_resume,
    kept_records,
    weights_of_run,
)

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

STREAMS = (
    {"name": "web", "sizes": [37, 41, 29], "weight": 3},  # 107 samples, down-sampled
    {"name": "code", "sizes": [23, 17], "weight": 1},  # 40 samples
    {"name": "books", "sizes": [11], "repeat": 2.0},  # 11 samples, each twice an epoch
)
PER_EPOCH = 150  # books 22, web 96, code 32
SEED = 1234


def mixture_job(streams: tuple[dict[str, Any], ...], epochs: int, **data: Any) -> Job:
    """2 ranks x 2 workers over a mixture of ``streams``, PER_EPOCH draws an epoch, audited, weights counted."""
    return Job(
        data=Data(streams=streams, samples_per_epoch=PER_EPOCH, **data),
        loading=Loading(seed=SEED),
        training=Training(epochs=epochs),
        checks=Checks(audit=True, count_weights=True),
    )


def test_a_mixture_resumes_on_other_topologies_serving_each_planned_draw_once(tmp_path: Path) -> None:
    job = mixture_job(STREAMS, epochs=2)
    then = [job.on(world_size=1), job.on(num_workers=1)]
    seen, segments = check_resume(tmp_path, job, then, checkpoint_every=3)
    for epoch in (0, 1):
        planned = planned_ids(list(STREAMS), PER_EPOCH, SEED, epoch)
        assert sum(planned.values()) == PER_EPOCH
        assert seen[epoch] == planned, f"epoch {epoch}: served {sum(seen[epoch].values())} of {PER_EPOCH} draws"
    # In the weights: each epoch added to every sample exactly the number of times it was planned.
    weights = weights_of_run(tmp_path, segments)
    previous = np.zeros(sum(sum(s["sizes"]) for s in STREAMS))
    for epoch in (0, 1):
        planned = planned_ids(list(STREAMS), PER_EPOCH, SEED, epoch)
        expected = np.zeros_like(previous)
        expected[list(planned)] = list(planned.values())
        assert np.array_equal(weights[epoch] - previous, expected), f"epoch {epoch}"
        previous = weights[epoch]
    # The audit counts each stream's draws separately.
    results = audit([tmp_path])
    table = format_audit(results)
    assert [r.epoch for r in results] == [0, 1] and all(r.ok and r.complete for r in results), table
    for r in results:
        assert [(s.name, s.expected, s.consumed, s.duplicates) for s in r.streams] == [
            ("web", 96, 96, 0),
            ("code", 32, 32, 0),
            ("books", 22, 22, 0),
        ], table
    assert "stream 'books'" in table
    # web draws 96 of its 107 samples an epoch: the two epochs cover all of it.
    assert {i for e in (0, 1) for i in seen[e] if i < 107} == set(range(107))


SCHEDULE = (  # three phases: web and code, then all three, then an annealing tail without web
    {"start": 0.0, "shares": {"web": 1, "code": 1}},
    {"start": 0.5, "shares": {"web": 3, "code": 1, "books": 1}},
    {"start": 0.8, "shares": {"books": 1, "code": 1}},
)


def test_a_share_schedule_resumes_on_other_topologies_training_each_planned_draw_once(tmp_path: Path) -> None:
    """A schedule of three phases, killed mid-epoch on 2 x 2 and resumed on 1 x 2 then 2 x 1: every
    epoch trains exactly its planned draws, phase by phase, in the weights."""
    job = mixture_job(STREAMS, epochs=2, schedule=SCHEDULE)
    then = [job.on(world_size=1), job.on(num_workers=1)]
    seen, segments = check_resume(tmp_path, job, then, checkpoint_every=3)
    weights = weights_of_run(tmp_path, segments)
    previous = np.zeros(sum(sum(s["sizes"]) for s in STREAMS))
    for epoch in (0, 1):
        planned = planned_ids(list(STREAMS), PER_EPOCH, SEED, epoch, schedule=list(SCHEDULE))
        assert sum(planned.values()) == PER_EPOCH and seen[epoch] == planned, f"epoch {epoch}"
        expected = np.zeros_like(previous)
        expected[list(planned)] = list(planned.values())
        assert np.array_equal(weights[epoch] - previous, expected), f"epoch {epoch}"
        previous = weights[epoch]
        # The phases' shares, by the planned ids: web is down-sampled, code and books repeat.
        web, code, books = (
            sum(n for i, n in planned.items() if lo <= i < hi) for lo, hi in ((0, 107), (107, 147), (147, 158))
        )
        assert (web, code, books) == (65, 61, 24), f"epoch {epoch}"
    # In training time: the last segment trains epoch 1 whole on 2 ranks x 1 worker, 16 samples a
    # step. Phase 1 (books' first draws) starts at position 75, step 4; phase 2 (no web) at 120,
    # step 7: every rank crosses each boundary at the same step, never serving a later phase early.
    records = [r for rank in segments[-1].records.values() for r in rank if r["epoch"] == 1]
    first = min(r["gs"] for r in records)
    books = [r["gs"] - first for r in records if any(147 <= i < 158 for i in r["ids"])]
    web = [r["gs"] - first for r in records if any(i < 107 for i in r["ids"])]
    assert min(books) == 4 and max(web) == 7, (books, web)
    results = audit([tmp_path])
    table = format_audit(results)
    assert all(r.ok and r.complete for r in results), table
    for r in results:
        assert [(s.name, s.expected, s.consumed, s.duplicates) for s in r.streams] == [
            ("web", 65, 65, 0),
            ("code", 61, 61, 0),
            ("books", 24, 24, 0),
        ], table


def test_a_stratified_mixture_resumes_on_other_topologies_with_every_batch_at_the_shares(tmp_path: Path) -> None:
    # 18 batches of 8 (each web 5, code 1 or 2, books 1 or 2) and one of 6, on 2 ranks x 2 workers
    job = mixture_job(STREAMS, epochs=1, batch_composition="stratified")
    then = [job.on(world_size=1), job.on(num_workers=1)]
    seen, segments = check_resume(tmp_path, job, then, checkpoint_every=3)
    planned = planned_ids(list(STREAMS), PER_EPOCH, SEED, 0, "stratified", job.loading.batch_size)
    assert seen[0] == planned, f"served {sum(seen[0].values())} of {PER_EPOCH} draws"
    weights = weights_of_run(tmp_path, segments)
    expected = np.zeros(158)
    expected[list(planned)] = list(planned.values())
    assert np.array_equal(weights[0], expected), "the weights hold each planned draw once"
    # Every batch trained, in any segment, is (part of) one block of the order; the full ones held
    # each stream at its share within one sample.
    held_in = planned_blocks(list(STREAMS), PER_EPOCH, SEED, 0, "stratified", job.loading.batch_size)
    for s in segments:
        for r in (r for rs in s.records.values() for r in rs):
            assert set.intersection(*(held_in[i] for i in r["ids"])), f"a batch crosses blocks: {r['ids']}"
    stream_of = np.repeat([0, 1, 2], [107, 40, 11])
    full = [
        r["ids"] for s in segments for rs in s.records.values() for r in rs if len(r["ids"]) == job.loading.batch_size
    ]
    assert len(full) >= 16, f"only {len(full)} full batches recorded"
    shares = [96 * 8 / 150, 32 * 8 / 150, 22 * 8 / 150]  # 5.12, 1.71, 1.17 samples a batch
    for ids in full:
        held = np.bincount(stream_of[ids], minlength=3)
        assert all(abs(h - q) < 1 for h, q in zip(held, shares, strict=True)), (ids, held)
    results = audit([tmp_path])
    assert results[0].ok and results[0].complete, format_audit(results)
    assert [(s.name, s.consumed, s.duplicates) for s in results[0].streams] == [
        ("web", 96, 0),
        ("code", 32, 0),
        ("books", 22, 0),
    ]


def test_a_mixture_changed_on_resume_serves_nothing_consumed_again_and_the_rest_at_the_new_shares(
    tmp_path: Path, trained_mixture_2x2: Path
) -> None:
    """The first segment (2 ranks x 2 workers, killed at step 6) is the session's shared one
    (tests/process/conftest.py), resumed from a copy under the new shares on 1 x 2, then 2 x 1."""
    before = MIXTURE  # 150 an epoch: web 96, code 32, books 22; code has 100 samples
    after = ({**before[0], "weight": 1}, {**before[1], "weight": 1}, before[2])  # web 64, code 64, books 22
    job = mixture_job(before, epochs=2)
    assert job == FIRST_MIXTURE_2X2
    changed = job.on(world_size=1).but(data=dict(streams=after, allow_mixture_change=True))
    then = [changed, changed.on(2, 1)]
    seen, segments = check_resume(tmp_path, job, then, checkpoint_every=3, trained=trained_mixture_2x2)
    assert "the mixture changed in epoch 0" in segments[1].output, segments[1].output[-3000:]
    # What the first segment's checkpoint consumed, and what the two segments after the change served.
    consumed = Counter(i for r in kept_records(segments[0], 3, [0, 1]) for i in r["ids"])
    rest = seen[0] - consumed
    assert sum(consumed.values()) == 48 and sum(rest.values()) == PER_EPOCH - 48, (consumed, rest)
    stream_of = np.repeat([0, 1, 2], [107, 100, 11])
    new_draws = [64, 64, 22]
    held = np.bincount(stream_of[list(rest.elements())], minlength=3)
    for s, name in enumerate(("web", "code", "books")):  # the new shares hold for the rest within one sample
        assert abs(held[s] - (PER_EPOCH - 48) * new_draws[s] / PER_EPOCH) < 1, (name, held)
    for i, n in rest.items():  # web and code had enough left: none of theirs again, none twice
        if stream_of[i] < 2:
            assert i not in consumed and n == 1, f"sample {i} served {n} time(s) after the change, {consumed[i]} before"
    # The weights hold exactly what was served: epoch 0 the records' counts, epoch 1 the new mixture's plan.
    weights = weights_of_run(tmp_path, segments)
    expected = np.zeros(218)
    expected[list(seen[0])] = list(seen[0].values())
    assert np.array_equal(weights[0], expected), "the weights of epoch 0 differ from what was served"
    planned = planned_ids(list(after), PER_EPOCH, SEED, 1)
    assert seen[1] == planned
    expected[:] = 0
    expected[list(planned)] = list(planned.values())
    assert np.array_equal(weights[1] - weights[0], expected)
    # The audit follows the change: epoch 0 is the 48 consumed before it and the rest after, per stream.
    results = audit([tmp_path])
    table = format_audit(results)
    assert [r.epoch for r in results] == [0, 1] and all(r.ok and r.complete for r in results), table
    assert (results[0].expected, results[0].consumed, results[0].duplicates) == (PER_EPOCH, PER_EPOCH, 0), table
    by_stream = Counter(
        {
            n: int(c)
            for n, c in zip(
                ("web", "code", "books"), np.bincount(stream_of[list(seen[0].elements())], minlength=3), strict=True
            )
        }
    )
    assert [(s.name, s.expected, s.consumed) for s in results[0].streams] == [
        (n, by_stream[n], by_stream[n]) for n in ("web", "code", "books")
    ], table
