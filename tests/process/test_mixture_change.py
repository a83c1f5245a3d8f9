"""A mixture changed on resume at the edges a user meets: a checkpoint written at an epoch's end (the
default CLI's), a change retried from the same checkpoint under yet another mixture after a crash,
and an audit given only the directory after the change. Real Lightning runs, DDP over gloo, spawned
DataLoader workers; exactly-once by the records, the weights and the audit."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.loading.audit import audit, format_audit
from lightning_sharding.mixture import change_mixture, mixture_of
from lightning_sharding.mixture.composition import apportion
from tests.support.data.streams import planned_ids
from tests.support.data.tokens import packed_mixture, token_counts, write_corpus
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
    check_resume,
    checkpoint_step,
    copy_segment,
    first_segment,
    kept_records,
    run_segment,
    served_per_epoch,
    weights_at_epoch_ends,
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


def test_a_packed_mixture_resumed_with_other_token_shares_trains_each_token_once_in_the_weights(
    tmp_path: Path,
) -> None:
    """Two token streams (corpora of distinct token ids) packed with ``concat``, at shares in tokens:
    2 ranks x 1 worker, a checkpoint at step 3, killed at step 6; resumed from that checkpoint on
    1 x 2 with other shares (``allow_mixture_change``). The tokens trained before the change are
    never trained again in epoch 0, the rest is drawn at the new shares, epoch 1 is the new mixture's,
    the weights count every trained token once, every checkpoint's ledger names its weights, and the
    audit trail follows the change."""
    import torch

    web = write_corpus(tmp_path / "web", files=3, documents=16)
    total = web + write_corpus(tmp_path / "code", files=2, documents=12, seed=1, first_token=web + 1)
    dirs = [str(tmp_path / "web"), str(tmp_path / "code")]
    spec = {"streams": dirs, "seq_len": 16, "mode": "concat"}
    shares = {"before": [{"tokens": 600}, {"tokens": 200}], "after": [{"tokens": 200}, {"tokens": 450}]}

    def mixed(topology: Topology, when: str) -> Job:
        data = Data(tokens={**spec, "shares": shares[when]}, allow_mixture_change=when == "after")
        return Job(topology, data, Loading(batch_size=3), Training(epochs=2), checks=CHECKS)

    out = tmp_path / "run"
    seen, (seg0, seg1) = check_resume(
        out, mixed(Topology(2, 1), "before"), [mixed(Topology(1, 2), "after")], checkpoint_every=3
    )
    assert seg0.returncode != 0 and "the mixture changed in epoch 0" in seg1.output, seg1.output[-3000:]
    readers = {when: packed_mixture(dirs, {**spec, "shares": shares[when]}) for when in shares}
    manifests = {when: r.manifest() for when, r in readers.items()}

    def trained(state: dict[str, object]) -> np.ndarray:
        """How often the ledger ``state`` says each token id was trained in its epoch."""
        consumed = RangeSet.from_state(np.asarray(state["consumed"]))
        seed, epoch = int(state["seed"]), int(state["epoch"])  # type: ignore[call-overload]
        if "change" not in state:  # epoch 0 before the change, or epoch 1
            when = "before" if epoch == 0 else "after"
            order = manifests[when].order(seed, epoch)
            return token_counts(readers[when], manifests[when], order, consumed.to_array(), total + 1)
        before = state["change"]["before"]  # type: ignore[index]
        change = change_mixture(before, manifests["after"], shuffle=True)
        new = consumed.intersection(RangeSet.interval(0, change.rest)).to_array()
        old = manifests["before"].order(seed, epoch), RangeSet.from_state(np.asarray(before["consumed"])).to_array()
        return token_counts(readers["before"], manifests["before"], *old, total + 1) + token_counts(
            readers["after"], manifests["after"], change, new, total + 1
        )

    # Epoch 0: the tokens of the sequences trained before the change and those of the rest, each once.
    (step3,) = [p for p in seg0.checkpoints if checkpoint_step(p) == 3]
    state = torch.load(step3, map_location="cpu", weights_only=True)["lightning_sharding"]
    change = change_mixture(state, manifests["after"], shuffle=True)
    first = trained(state)
    rest = token_counts(readers["after"], manifests["after"], change, np.arange(change.rest), total + 1)
    assert first.max() == 1 and rest.max() == 1 and not (first * rest).any(), "a token came twice in epoch 0"
    assert Counter({t - 1: 1 for t in np.flatnonzero(first + rest).tolist()}) == seen[0]
    # The rest at the new shares: each stream's sequences, its share of the rest under the new draws.
    draws = mixture_of(manifests["after"]).draws  # type: ignore[union-attr]
    assert [r.planned for r in change.report] == apportion(change.rest, list(draws))
    assert abs(int(rest[1 : web + 1].sum()) - 16 * change.report[0].planned) < 16, "the rest's web tokens"
    after = manifests["after"]
    planned = token_counts(
        readers["after"], after, after.order(int(state["seed"]), 1), np.arange(after.total), total + 1
    )
    assert Counter({t - 1: int(n) for t, n in enumerate(planned.tolist()) if n}) == seen[1], "epoch 1"
    weights = weights_at_epoch_ends(out, "seg1")
    np.testing.assert_array_equal(weights[0], first + rest, err_msg="the weights after epoch 0")
    np.testing.assert_array_equal(weights[1], first + rest + planned, err_msg="the weights after epoch 1")
    # Every checkpoint's ledger holds exactly the tokens its weights hold (within epoch 0, and in epoch 1).
    checked = 0
    for path in [step3, *seg1.checkpoints]:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        ledger, w = ckpt["lightning_sharding"], ckpt["state_dict"]["w"].numpy()
        done = weights[0] if int(ledger["epoch"]) == 1 else np.zeros(total + 1)
        np.testing.assert_array_equal(w, done + trained(ledger), err_msg=f"{path.name}: ledger and weights")
        checked += "change" in ledger
    assert checked >= 1, "no checkpoint of the changed epoch was checked"
    results = audit([out])
    assert [(r.epoch, r.expected, r.consumed, r.duplicates, r.ok, r.complete) for r in results] == [
        (0, change.total, change.total, 0, True, True),
        (1, after.total, after.total, 0, True, True),
    ], format_audit(results)
