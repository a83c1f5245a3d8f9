"""``skip=``: a resume from a checkpoint written before a loss spike leaves the spike's data out.

The session's shared first segment (tests/process/conftest.py: 2 ranks x 2 workers, a checkpoint at
step 3, killed at step 6) stands for the run that spiked: the resume from its step-3 checkpoint, on
another topology, skips steps 3-4. What those steps trained is known independently, from the records
that the killed run's model kept of every batch it trained (the sample ids it read), and counted in the
weights: each skipped sample never gets a gradient, every other one gets exactly one.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_sharding.loading.audit import audit, format_audit
from lightning_sharding.tokens import PackedReader
from tests.process.test_packing import job as packed_job
from tests.process.test_packing import planned_tokens
from tests.support.data.streams import planned_ids
from tests.support.data.tokens import write_corpus
from tests.support.harness import (
    FIRST_2X2,
    FIRST_MIXTURE_2X2,
    Segment,
    Topology,
    check_resume,
    checkpoint_step,
    first_segment,
    run_segment,
    weights_at_epoch_ends,
    weights_of_run,
)
from tests.support.replay import assert_replay_matches_audit

pytestmark = [pytest.mark.timeout(600), pytest.mark.processes]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "lightning_sharding.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def trained_at(segment: Segment, steps: tuple[int, ...]) -> list[int]:
    """The sample ids (of packed tokens: token ids less one) every rank of ``segment`` trained at global
    ``steps``, by the records its model kept of each batch (``gs``: the step count after the batch)."""
    return [i for records in segment.records.values() for r in records if r["gs"] - 1 in steps for i in r["ids"]]


def test_a_resume_with_skip_leaves_the_spike_steps_out_and_trains_every_other_sample_once(
    tmp_path: Path, trained_2x2: Path
) -> None:
    """The resume on 1 rank x 3 workers is killed after its own checkpoint at step 6 too, and requeued
    on 2 ranks x 1 worker with the same ``skip=`` from that checkpoint, which applied it already."""
    total = sum(FIRST_2X2.data.sizes)
    resume = FIRST_2X2.on(world_size=1, num_workers=3).but(training=dict(skip="3-4"))
    requeue = resume.on(world_size=2, num_workers=1)
    _, segments = check_resume(tmp_path, FIRST_2X2, [resume, requeue], checkpoint_every=3, trained=trained_2x2)
    killed, resumed, requeued = segments
    # What the killed run trained at steps 3 and 4 (a record's gs is the step count after its batch),
    # by its own records: every rank's, each sample id read.
    spike = sorted(trained_at(killed, (3, 4)))
    assert len(spike) == 2 * 2 * FIRST_2X2.loading.batch_size, "two steps of 2 ranks' batches of 8"
    assert len(set(spike)) == len(spike)

    # In the weights: the epoch gave every sample exactly one gradient but the skipped ones, which got none.
    (w,) = weights_of_run(tmp_path, segments).values()
    assert np.isin(w, (0.0, 1.0)).all(), np.unique(w)
    assert np.flatnonzero(w == 0).tolist() == spike

    # Said at the resume, once, and in the summary of the run that ends the epoch.
    assert "skip= steps 3-4: 32 sample(s) of epoch 0 left out" in resumed.output, resumed.output[-3000:]
    assert "2 data-parallel rank(s) x 2 worker(s)" in resumed.output
    assert "skip= steps 3-4 was applied at the resume from step 3 already" in requeued.output, requeued.output[-3000:]
    assert "skip= steps 3-4 at the resume from step 3: left out 32 of epoch 0" in requeued.output

    # The audit counts them as skipped, not missing, and exactly-once holds for the rest.
    (row,) = audit([tmp_path])
    assert (row.consumed, row.duplicates, row.missing, row.skipped, row.skipped_trained) == (total - 32, 0, 0, 32, 0)
    proc = cli("audit", str(tmp_path))
    assert proc.returncode == 0 and "exactly-once (32 skipped on resume)" in proc.stdout, proc.stdout + proc.stderr

    # The last run's checkpoints record the skip; inspect shows it. Their history, whose resume at step 3
    # planned without the skipped samples, names every step as the audit trail recorded it.
    written = max(requeued.checkpoints, key=checkpoint_step)
    assert_replay_matches_audit(written, tmp_path, first_steps=range(12))
    state = torch.load(written, map_location="cpu", weights_only=True)["lightning_sharding"]
    assert state["skips"][0]["asked"] == "steps 3-4" and state["skips"][0]["counts"] == [[0, 32]]
    proc = cli("inspect", str(written))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skipped      32 samples of epoch 0 (skip= steps 3-4 at the resume from step 3)" in proc.stdout, proc.stdout


def test_a_mixture_resumed_with_skip_trains_every_other_draw_once(tmp_path: Path, trained_mixture_2x2: Path) -> None:
    """The session's shared mixture segment (three streams, 150 draws an epoch, one stream drawn twice
    an epoch), resumed from its step-3 checkpoint on 1 rank x 2 workers for two epochs, skipping steps
    3-4: epoch 0's weights are its planned draws less those the killed run trained at steps 3-4, epoch
    1's every planned draw (a skip leaves out one epoch's draws, not the samples for good)."""
    resume = FIRST_MIXTURE_2X2.on(world_size=1, num_workers=2).but(training=dict(skip="3-4"))
    _, segments = check_resume(tmp_path, FIRST_MIXTURE_2X2, [resume], checkpoint_every=3, trained=trained_mixture_2x2)
    killed = segments[0]
    spike = Counter(trained_at(killed, (3, 4)))
    assert sum(spike.values()) == 32
    data = FIRST_MIXTURE_2X2.data
    streams, seed = list(data.streams or ()), FIRST_MIXTURE_2X2.loading.seed or 0
    weights = weights_of_run(tmp_path, segments)
    for epoch, left_out in ((0, spike), (1, Counter())):
        planned = planned_ids(streams, data.samples_per_epoch, seed, epoch) - left_out
        expected = np.zeros(weights[epoch].size)
        expected[list(planned)] = list(planned.values())
        before = weights[epoch - 1] if epoch else 0.0
        np.testing.assert_array_equal(weights[epoch] - before, expected, err_msg=f"epoch {epoch}")
    results = audit([tmp_path])
    assert [(r.epoch, r.skipped, r.missing, r.duplicates, r.ok, r.complete) for r in results] == [
        (0, 32, 0, 0, True, True),
        (1, 0, 0, 0, True, True),
    ], format_audit(results)


def test_packed_tokens_resumed_with_skip_train_every_other_planned_token_once(tmp_path: Path) -> None:
    """Packed (best_fit) token sequences of Megatron files, 2 ranks x 2 workers killed after a checkpoint at
    step 3, resumed on 1 x 2 skipping steps 3-4 and one document: in the weights (one per token id),
    epoch 0 trains every planned token once but those of the sequences of those steps, which the killed
    run's records name, and of the sequences holding the document (another document's tokens beside
    it in a sequence go too); epoch 1 trains every one."""
    from lightning_sharding.core.rangeset import RangeSet
    from tests.support.data.tokens import packed_reader, packed_spec

    corpus = tmp_path / "corpus"
    total = write_corpus(corpus, files=4, documents=24)
    planned = planned_tokens(corpus, "best_fit")
    first = packed_job(corpus, "best_fit", Topology(2, 2)).but(checks=dict(audit=True))
    out, trained = tmp_path / "run", tmp_path / "first"
    killed = run_segment(trained, "seg0", first_segment(first, checkpoint_every=3), expect_death=True)
    # A document none of whose sequences the checkpoint holds or the spike's steps trained, by the epoch's order.
    (ckpt,) = [p for p in killed.checkpoints if checkpoint_step(p) == 3]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["lightning_sharding"]
    reader = PackedReader(packed_reader(str(corpus)), packed_spec(first.data.tokens or {}))
    order = reader.manifest().order(int(state["seed"]), 0)
    rows, docs, starts, stops = order.pieces(np.arange(order.total))
    spike = trained_at(killed, (3, 4))
    spiked_rows = {int(r) for r, d, a in zip(rows, docs, starts, strict=True) if order_token(order, d, a) in set(spike)}
    taken = RangeSet.from_state(np.asarray(state["consumed"])).to_array().tolist() + sorted(spiked_rows)
    document = next(d for d in sorted(set(docs.tolist())) if not set(rows[docs == d].tolist()) & set(taken))
    held = rows[docs == document]
    resume = packed_job(corpus, "best_fit", Topology(1, 2)).but(
        checks=dict(audit=True), training=dict(skip={"steps": "3-4", "documents": [document]})
    )
    segments = check_resume(out, first, [resume], checkpoint_every=3, trained=trained)[1]
    assert f"the sequences of documents {document}: " in segments[1].output, segments[1].output[-3000:]
    weights = weights_at_epoch_ends(out, "seg1")
    expected = np.zeros(total + 1)
    expected[planned] = 1.0
    skipped = np.zeros(total + 1)
    skipped[np.asarray(spike) + 1] = 1.0  # a record's ids are token ids less one (tests/jobs/parts.py)
    for r, d, a, b in zip(rows, docs, starts, stops, strict=True):
        if r in held:  # every token of the sequences holding the document, its own and its neighbours'
            skipped[order_token(order, d, a) + 1 : order_token(order, d, b) + 1] = 1.0
    np.testing.assert_array_equal(weights[0], expected - skipped, err_msg="epoch 0: all planned tokens but the skipped")
    np.testing.assert_array_equal(weights[1] - weights[0], expected, err_msg="epoch 1: every planned token")
    rows_audited = audit([out])
    skipped_sequences = 12 + len(set(held.tolist()))
    assert [(r.skipped, r.missing, r.duplicates, r.ok) for r in rows_audited] == [
        (skipped_sequences, 0, 0, True),
        (0, 0, 0, True),
    ], rows_audited


def order_token(order: Any, document: int, offset: int) -> int:
    """The id less one of token ``offset`` of ``document`` (the corpus numbers tokens 1..T in file
    order, documents one after another: tests/support/data/tokens.py)."""
    epochs = order.epochs
    return int(np.concatenate(([0], np.cumsum(epochs.lengths)))[document]) + int(offset)


def test_skip_in_a_fit_that_resumes_no_checkpoint_is_refused_before_any_step() -> None:
    from lightning_sharding import ShardedDataModule, SyntheticReader
    from lightning_sharding.core.skip import SkipError
    from lightning_sharding.train import Regressor
    from tests.support.harness import cpu_trainer

    dm = ShardedDataModule(SyntheticReader(sizes=[16]), batch_size=4, skip="3-4")
    model = Regressor(dim=8, hidden=4, learning_rate=0.01)
    with pytest.raises(SkipError, match=r"starts from no checkpoint: pass .* ckpt_path=PATH"):
        cpu_trainer(max_epochs=1).fit(model, datamodule=dm)
    assert model.global_step == 0


def test_a_skip_across_an_epoch_end_with_accumulation_leaves_out_each_epochs_share(tmp_path: Path) -> None:
    """An uninterrupted reference run (2 ranks x 2 workers, accumulation 2, two epochs of 7 steps)
    names by its audit trail what steps 5-7 trained: the last two steps of epoch 0 (the last a single
    micro-batch) and the first of epoch 1. A resume from its step-3 checkpoint on 1 x 3 with
    ``skip="5-7"`` leaves those out of each epoch (the next epoch's share waits in the ledger): in the
    weights, each epoch trains every sample once but its own skipped ones."""
    from lightning_sharding.core.order import EpochOrder
    from tests.support.replay import audited_steps

    sizes = FIRST_2X2.data.sizes
    job = FIRST_2X2.but(training=dict(epochs=2, accumulate=2), saves=dict(checkpoint_every=3))
    ref = run_segment(tmp_path / "ref", "ref", job)
    (ckpt,) = [p for p in ref.checkpoints if checkpoint_step(p) == 3]
    trail = audited_steps(tmp_path / "ref")
    assert max(trail) == 13, sorted(trail)  # 13 batches a rank an epoch: 7 steps, the last of one micro-batch
    seed, first = FIRST_2X2.loading.seed or 0, np.concatenate(([0], np.cumsum(sizes)))
    left_out = {}
    for epoch, steps in ((0, (5, 6)), (1, (7,))):
        positions = np.asarray([p for s in steps for held in trail[s].values() for p in held], dtype=np.int64)
        items, index = EpochOrder(sizes, seed, epoch).locate(positions)
        left_out[epoch] = first[items] + index
    assert (left_out[0].size, left_out[1].size) == (40, 32)  # step 6: the last 8 samples of epoch 0
    resume = job.on(world_size=1, num_workers=3).but(training=dict(resume_from=str(ckpt), skip="5-7"))
    run = run_segment(tmp_path / "run", "seg1", resume)
    assert "40 sample(s) of epoch 0; 32 sample(s) of epoch 1 left out" in run.output, run.output[-3000:]
    weights = weights_at_epoch_ends(tmp_path / "run", "seg1")
    total = sum(sizes)
    for epoch, before in ((0, np.zeros(total)), (1, weights[0])):
        expected = np.ones(total)
        expected[left_out[epoch]] = 0.0
        np.testing.assert_array_equal(weights[epoch] - before, expected, err_msg=f"epoch {epoch}")
