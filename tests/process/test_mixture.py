"""Mixtures under real DDP: three streams of different shares, killed mid-epoch and resumed on other
topologies; every planned draw is trained once, per stream, by the records, the weights and the audit.

2 ranks x 2 workers first, then 1 x 2, then 2 x 1 (the machine's budget is 2 x 2; the in-process
contract and mixture tests carry the other topologies).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_sharding.audit import audit, format_audit
from tests.harness import Job, check_resume, weights_of_run
from tests.jobs.streams_data import planned_ids

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

STREAMS = (
    {"name": "web", "sizes": [37, 41, 29], "weight": 3},  # 107 samples, down-sampled
    {"name": "code", "sizes": [23, 17], "weight": 1},  # 40 samples
    {"name": "books", "sizes": [11], "repeat": 2.0},  # 11 samples, each twice an epoch
)
PER_EPOCH = 150  # books 22, web 96, code 32
SEED = 1234


def test_a_mixture_resumes_on_other_topologies_serving_each_planned_draw_once(tmp_path: Path) -> None:
    job = Job(streams=STREAMS, samples_per_epoch=PER_EPOCH, audit=True, count_weights=True, epochs=2, seed=SEED)
    then = [Job(**{**job.__dict__, "world_size": 1}), Job(**{**job.__dict__, "num_workers": 1})]
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
