"""A mixture changed on resume at the edges a user meets: a checkpoint written at an epoch's end (the
default CLI's), a change retried from the same checkpoint under yet another mixture after a crash,
and an audit given only the directory after the change. Real Lightning runs, DDP over gloo, spawned
DataLoader workers; exactly-once by the records, the weights and the audit."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lightning_sharding.loading.audit import audit, format_audit
from tests.support.data.streams import planned_ids
from tests.support.harness import (
    FIRST_MIXTURE_2X2,
    MIXTURE,
    Checks,
    Data,
    Faults,
    Job,
    Loading,
    Saves,
    Topology,
    Training,
    checkpoint_step,
    copy_segment,
    first_segment,
    kept_records,
    run_segment,
    served_per_epoch,
    weights_of_run,
)

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

STREAMS = (
    {"name": "web", "sizes": [37, 41, 29], "weight": 3},  # 107 samples
    {"name": "code", "sizes": [23, 17, 31, 29], "weight": 1},  # 100 samples
    {"name": "books", "sizes": [11], "repeat": 2.0},
)
PER_EPOCH = 150
SEED = 1234
SAMPLES = 218
CHECKS = Checks(audit=True, count_weights=True)


def reweighted(web: int, code: int) -> tuple[dict[str, object], ...]:
    return ({**STREAMS[0], "weight": web}, {**STREAMS[1], "weight": code}, STREAMS[2])


def test_a_change_at_an_epoch_boundary_goes_on_with_the_next_epoch_of_the_new_mixture(tmp_path: Path) -> None:
    first = Job(
        Topology(2, 1),
        Data(streams=STREAMS, samples_per_epoch=PER_EPOCH),
        Loading(seed=SEED),
        Training(epochs=1),
        Saves(every_n_epochs=1),
        checks=CHECKS,
    )
    seg0 = run_segment(tmp_path, "seg0", first)
    (end,) = sorted((tmp_path / "saves").glob("seg0-epoch-end-*.ckpt"))
    # Even shares and a longer epoch: a rest drawn for the finished epoch would be 30 samples.
    after, longer = reweighted(1, 1), PER_EPOCH + 30
    job = first.but(
        data=dict(streams=after, samples_per_epoch=longer, allow_mixture_change=True), training=dict(epochs=2)
    )
    seg1 = run_segment(tmp_path, "seg1", job.but(saves=Saves(), training=dict(resume_from=str(end))))
    assert "not trained" not in seg1.output, seg1.output[-3000:]
    assert "Lightning goes on with epoch 1, so nothing of epoch 0 is drawn under the new mixture" in seg1.output
    seen = served_per_epoch(kept_records(seg0, None, [0, 1]) + kept_records(seg1, None, [0, 1]))
    assert seen[0] == planned_ids(list(STREAMS), PER_EPOCH, SEED, 0)
    assert seen[1] == planned_ids(list(after), longer, SEED, 1), "epoch 1 is not the new mixture's plan"
    weights = weights_of_run(tmp_path, [seg0, seg1])
    expected = np.zeros(SAMPLES)
    for epoch in (0, 1):
        expected[list(seen[epoch])] += list(seen[epoch].values())
        assert np.array_equal(weights[epoch], expected), f"the weights at the end of epoch {epoch} differ"
    results = audit([tmp_path])
    table = format_audit(results)
    assert [(r.epoch, r.expected, r.consumed, r.ok, r.complete) for r in results] == [
        (0, PER_EPOCH, PER_EPOCH, True, True),
        (1, longer, longer, True, True),
    ], table
    per_stream = np.bincount(np.repeat([0, 1, 2], [107, 100, 11])[list(seen[1].elements())], minlength=3)
    assert [(s.name, s.expected, s.consumed) for s in results[1].streams] == [
        (name, int(n), int(n)) for name, n in zip(("web", "code", "books"), per_stream, strict=True)
    ], table


def test_a_change_retried_from_the_same_checkpoint_under_another_mixture_audits_exactly_once(
    tmp_path: Path, trained_mixture_2x2: Path
) -> None:
    """The run before the change is (a copy of) the session's shared mixture segment: 2 ranks x 2
    workers, a checkpoint at step 3, killed at step 6 (tests/process/conftest.py). The changes resume
    that checkpoint on 2 ranks x 1 worker for the rest of epoch 0."""
    before, after = tmp_path / "before", tmp_path / "after"
    assert STREAMS == MIXTURE
    seg0 = copy_segment(trained_mixture_2x2, before, "seg0", first_segment(FIRST_MIXTURE_2X2, checkpoint_every=3))
    (ckpt,) = [p for p in seg0.checkpoints if checkpoint_step(p) == 3]
    changed = Job(
        Topology(2, 1),
        Data(streams=STREAMS, samples_per_epoch=PER_EPOCH, allow_mixture_change=True),
        Loading(seed=SEED),
        Training(epochs=1, resume_from=str(ckpt)),
        faults=Faults(die_at_step=6),
        checks=CHECKS,
    )
    # A change to web 1 : code 1 that dies after 2 steps, then the same checkpoint under web 1 : code 3.
    seg1 = run_segment(
        after, "seg1", changed.but(data=dict(streams=reweighted(1, 1)), faults=Faults(die_at_step=5)), expect_death=True
    )
    seg2 = run_segment(after, "seg2", changed.but(data=dict(streams=reweighted(1, 3)), faults=Faults()))
    for segment in (seg1, seg2):
        assert "the mixture changed in epoch 0" in segment.output, segment.output[-3000:]
    consumed = Counter(i for r in kept_records(seg0, 3, [0, 1]) for i in r["ids"])
    rest = Counter(i for r in kept_records(seg2, None, [0, 1]) for i in r["ids"])
    stream_of = np.repeat([0, 1, 2], [107, 100, 11])
    assert all(i not in consumed for i in rest if stream_of[i] < 2), "a sample consumed before the change came again"
    assert sum(consumed.values()) + sum(rest.values()) == PER_EPOCH
    weights = weights_of_run(after, [seg2])
    expected = np.zeros(SAMPLES)
    expected[list(consumed + rest)] = list((consumed + rest).values())
    assert np.array_equal(weights[0], expected), "the weights hold other samples than the two segments served"
    results = audit([before, after])
    table = format_audit(results)
    assert [(r.epoch, r.expected, r.consumed, r.duplicates, r.ok, r.complete) for r in results] == [
        (0, PER_EPOCH, PER_EPOCH, 0, True, True)
    ], table
    # Only the directory after the change: the audit says which directory it lacks.
    with pytest.raises(ValueError, match="audit the run directories of the runs before the change too"):
        audit([after])
