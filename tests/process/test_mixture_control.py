"""A mixture under online control (MixtureController) under real DDP: decisions made every few steps
from per-stream losses, killed mid-epoch and resumed on other topologies. The weights hold exactly
what an uninterrupted run given the same decisions holds, and each epoch's planned draws once.

2 ranks x 2 workers first, then 1 x 2, then 2 x 1, as the other mixture tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_sharding.loading.audit import audit, format_audit
from tests.support.data.streams import planned_under_decisions
from tests.support.harness import (
    Checks,
    Data,
    Job,
    Loading,
    Training,
    check_resume,
    kept_records,
    run_segment,
    weights_of_run,
)

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

STREAMS = (
    {"name": "web", "sizes": [37, 41, 29], "weight": 3},  # 107 samples
    {"name": "code", "sizes": [23, 17], "weight": 1},  # 40 samples
    {"name": "books", "sizes": [11], "weight": 1},  # 11 samples: repeats when a decision favours it
)
PER_EPOCH = 150
SEED = 1234
TOTAL = 158
# A schedule over training: books only from sample 100 (epoch 0, position 100), then from sample 200
# (epoch 1, position 50) a ramp of 64 samples back to all three; the controller decides in between.
SCHEDULE = (
    {"samples": 0, "shares": {"web": 3, "code": 1, "books": 1}},
    {"samples": 100, "shares": {"books": 1}},
    {"samples": 200, "shares": {"web": 1, "code": 1, "books": 1}, "ramp": 64},
)


def controlled_job(controller: dict[str, object], epochs: int = 2) -> Job:
    return Job(
        data=Data(streams=STREAMS, samples_per_epoch=PER_EPOCH, controller=controller, schedule=SCHEDULE),
        loading=Loading(seed=SEED),
        training=Training(epochs=epochs),
        checks=Checks(audit=True, count_weights=True),
    )


def test_online_decisions_resume_on_other_topologies_training_what_the_same_decisions_plan(tmp_path: Path) -> None:
    """Decisions every 4 steps (a rotating policy: one stream 3, the next 1, the third nothing) beside
    a schedule of three phases over training (one a ramp), the job SIGKILLed on 2 x 2 and on 1 x 2
    and finished on 2 x 1. The decisions the checkpoints hold are replayed, the later ones made
    again; the final ledger's decisions, replayed by an uninterrupted run on 1 rank without workers,
    give the same weights, sample by sample."""
    job = controlled_job({"every": 4, "policy": "rotate"})
    then = [job.on(world_size=1), job.on(num_workers=1)]
    seen, segments = check_resume(tmp_path / "chain", job, then, checkpoint_every=3)
    decisions = json.loads((tmp_path / "chain" / f"decisions-{segments[-1].name}.json").read_text())
    assert len(decisions) >= 4 and {d["epoch"] for d in decisions} == {0, 1}, decisions
    # Each kill came after a decision the checkpoint did not hold (steps 4 and 8 after checkpoints
    # at 3 and 6): the resumed segments made those again, on their own topology.
    assert [d["step"] for d in decisions] == sorted(d["step"] for d in decisions)
    weights = weights_of_run(tmp_path / "chain", segments)
    previous = np.zeros(TOTAL)
    for epoch in (0, 1):
        planned = planned_under_decisions(list(STREAMS), PER_EPOCH, SEED, epoch, decisions, SCHEDULE)
        assert sum(planned.values()) == PER_EPOCH
        assert seen[epoch] == planned, f"epoch {epoch}: served {sum(seen[epoch].values())} of {PER_EPOCH} draws"
        expected = np.zeros(TOTAL)
        expected[list(planned)] = list(planned.values())
        assert np.array_equal(weights[epoch] - previous, expected), f"epoch {epoch}"
        previous = weights[epoch]
    # Each decision was handed the samples of the 4 steps before it, over all ranks: also the first one
    # after each resume, from the statistics its checkpoint kept of the steps before it.
    kept = kept_records(segments[0], 3) + kept_records(segments[1], 6) + kept_records(segments[2], None)
    per_step = Counter()
    for record in kept:
        per_step[record["gs"]] += len(record["ids"])
    handed = {}
    for segment in segments:  # a later segment made again what an earlier one made after its checkpoint
        for line in (tmp_path / "chain" / f"stats-{segment.name}.jsonl").read_text().splitlines():
            handed[json.loads(line)["step"]] = sum(json.loads(line)["samples"].values())
    steps = [d["step"] for d in decisions]
    assert [handed[s] for s in steps] == [sum(per_step[g] for g in range(s - 3, s + 1)) for s in steps], handed
    # The decisions moved the draws: books (11 samples) repeats under the shares that favour it.
    assert max(planned_under_decisions(list(STREAMS), PER_EPOCH, SEED, 0, decisions, SCHEDULE).values()) > 1
    # An uninterrupted run given the same decisions (policy None: a replay) trains the same weights.
    replay = Job(
        data=Data(
            streams=STREAMS,
            samples_per_epoch=PER_EPOCH,
            controller={"every": 4, "decisions": decisions},
            schedule=SCHEDULE,
        ),
        loading=Loading(seed=SEED),
        training=Training(epochs=2),
        checks=Checks(count_weights=True),
    ).on(world_size=1, num_workers=0)
    run_segment(tmp_path / "replay", "replay", replay)
    again = weights_of_run(tmp_path / "replay", [])
    found = {int(p.stem.rsplit("epoch", 1)[1]): np.load(p) for p in (tmp_path / "replay").glob("w-replay-epoch*.npy")}
    assert sorted(found) == [0, 1] and all(np.array_equal(found[e], weights[e]) for e in (0, 1)), again
    replayed = json.loads((tmp_path / "replay" / "decisions-replay.json").read_text())
    assert replayed == decisions
    # The audit trail says the same, per stream and per phase: the decisions the runs made, replayed
    # from the checkpoints and made again after each kill, are what it checks each phase against.
    results = audit([tmp_path / "chain"])
    table = format_audit(results)
    assert all(r.ok and r.complete for r in results) and "MISMATCH" not in table, table
    for r in results:
        planned = planned_under_decisions(list(STREAMS), PER_EPOCH, SEED, r.epoch, decisions, SCHEDULE)
        per_stream = [
            sum(n for i, n in planned.items() if lo <= i < hi) for lo, hi in ((0, 107), (107, 147), (147, 158))
        ]
        assert [s.expected for s in r.streams] == [s.consumed for s in r.streams] == per_stream, table
        within = [d for d in decisions if d["epoch"] == r.epoch and d["position"] < PER_EPOCH]
        scheduled = {0: 1, 1: 1 + 16}[r.epoch]  # epoch 0: books only from 100; epoch 1: the ramp's 16 steps and its end
        assert [len(s.phases) for s in r.streams] == [1 + scheduled + len(within)] * 3, table
    # inspect lists the decisions the last checkpoint holds.
    last = sorted((tmp_path / "chain" / "checkpoints").glob("seg2-*.ckpt"))[-1]
    shown = subprocess.run(
        [sys.executable, "-m", "lightning_sharding.cli", "inspect", str(last)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    held = torch.load(last, weights_only=True)["lightning_sharding"]["decisions"]
    assert f"controlled   {len(held)} decision(s)" in shown and f"decision     step {held[0]['step']}: " in shown, shown


def test_token_streams_under_a_controller_and_a_schedule_in_tokens_train_each_planned_token(tmp_path: Path) -> None:
    """Two corpora of distinct token ids, packed with ``best_fit``, under decisions every 3 steps and a
    schedule over training in tokens (the second corpus alone from token 600, back to both with a
    ramp from token 1,200): 2 x 2 killed, 1 x 2 killed, 2 x 1 to the end of two epochs. Each epoch's
    weights hold every token of its planned sequences as often as the decisions and the schedule plan it."""
    from tests.support.data.tokens import planned_tokens, write_corpus

    first = write_corpus(tmp_path / "web", files=3, documents=16)
    total = first + write_corpus(tmp_path / "code", files=2, documents=12, seed=1, first_token=first + 1)
    schedule = (
        {"tokens": 0, "shares": {"s0": 1, "s1": 1}},
        {"tokens": 600, "shares": {"s1": 1}},
        {"tokens": 1200, "shares": {"s0": 1, "s1": 1}, "ramp": 320},
    )
    spec = {"streams": [str(tmp_path / "web"), str(tmp_path / "code")], "seq_len": 16, "mode": "best_fit"}

    def job(world: int, workers: int) -> Job:
        data = Data(tokens=spec, controller={"every": 3, "policy": "rotate"}, schedule=schedule)
        return (
            Job(data=data, loading=Loading(batch_size=3, seed=SEED), training=Training(epochs=2))
            .on(world_size=world, num_workers=workers)
            .but(checks=dict(count_weights=True))
        )

    out = tmp_path / "run"
    _, segments = check_resume(out, job(2, 2), [job(1, 2), job(2, 1)], checkpoint_every=3)
    decisions = json.loads((out / "decisions-seg2.json").read_text())
    assert len(decisions) >= 4, decisions
    weights = weights_of_run(out, segments)
    previous = np.zeros(total + 1)
    for epoch in (0, 1):
        planned = planned_tokens(spec["streams"], {**spec, "schedule": list(schedule)}, SEED, epoch, decisions)
        expected = np.zeros(total + 1)
        expected[: planned.size] = planned
        assert np.array_equal(weights[epoch] - previous, expected), f"epoch {epoch}"
        previous = weights[epoch]
    # The schedule moved the draws: the second corpus's tokens are planned more than once in epoch 0.
    assert (
        planned_tokens(spec["streams"], {**spec, "schedule": list(schedule)}, SEED, 0, decisions)[first + 1 :].max() > 1
    )
