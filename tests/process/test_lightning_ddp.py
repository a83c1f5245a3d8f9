"""Exactly-once under a real Lightning Trainer, DDP over gloo (2 ranks) and real DataLoader workers.

The first case starts its ranks with Lightning's own launcher (strategy ``ddp``: ``python job.py``
runs again for rank 1) and workers from the package's default forkserver; the kill-and-resume case
runs under ``ddp_spawn``, where Lightning pickles the DataModule and callbacks into ranks that a
launcher process spawns, with spawned workers: the shard strategy's exactly-once chain under spawn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.harness import (
    FIRST_2X2,
    FIRST_2X2_EVERY,
    Data,
    Job,
    Loading,
    Topology,
    Training,
    assert_exactly_once,
    check_resume,
    checkpoint_step,
    first_segment,
    kept_records,
    load_segment,
    run_segment,
    served_per_epoch,
)

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

TOTAL = sum(Job().data.sizes)


def test_two_epochs_serve_every_sample_once_in_different_orders(tmp_path: Path) -> None:
    """Cases (a) and (b): 2 ranks x 2 workers, two epochs. No seed is given: rank 0 draws one and
    broadcasts it (ranks with different seeds would plan different orders and break coverage)."""
    job = Job(Topology(launcher="ddp"), loading=Loading(seed=None), training=Training(epochs=2))
    segment = run_segment(tmp_path, "run", job)
    records = kept_records(segment, None)
    assert_exactly_once(served_per_epoch(records), TOTAL, epochs=2)
    orders = [[i for r in records if r["epoch"] == e for i in r["ids"]] for e in (0, 1)]
    assert orders[0] != orders[1], "epoch 1 repeated epoch 0's order"
    # Both ranks ran the same number of steps per epoch (DDP would hang otherwise).
    steps = {rank: len(recs) for rank, recs in segment.records.items()}
    assert len(set(steps.values())) == 1, steps
    assert segment.report is not None
    assert [e["consumed"] for e in segment.report["epochs"]] == [TOTAL, TOTAL]


def test_mid_epoch_checkpoint_kill_and_resume_is_exactly_once_with_persistent_workers(tmp_path: Path) -> None:
    """Cases (c) and (d): save at step 4, SIGKILL at step 7, resume from step 4 on the same topology.

    Two epochs, so the resumed run also crosses an epoch boundary with the same (persistent)
    workers. Fresh workers resume in every other kill-and-resume test (test_elastic, test_faults).
    """
    loading = Loading(persistent_workers=True, start_method="spawn")  # the shard strategy's chain under spawn
    job = Job(Topology(launcher="spawn"), loading=loading, training=Training(epochs=2))
    seen, segments = check_resume(tmp_path, job, [job], checkpoint_every=4)
    assert_exactly_once(seen, TOTAL, epochs=2)
    # The killed segment really trained past its checkpoint: those steps are the ones re-served.
    assert max(r["gs"] for r in segments[0].records[0]) > 4


@pytest.mark.parametrize(
    ("policy", "batch_size", "steps", "padding", "dropped"),
    [("pad", 4, 5, 0, 0), ("pad", 1, 17, 1, 0), ("drop", 4, 4, 0, 1)],
    ids=["pad-split", "pad-flagged", "drop"],
)
def test_uneven_sample_count_reports_padding_or_drop(
    tmp_path: Path, policy: str, batch_size: int, steps: int, padding: int, dropped: int
) -> None:
    """Case (e): 33 samples over 2 ranks are 17 + 16, which never divides evenly.

    Batch 4: 5 batches against 4. ``pad`` splits the short rank's last batch in two (no padding),
    ``drop`` leaves one sample. Batch 1: 17 batches against 16 samples needs one flagged padding sample.
    """
    job = Job(Topology(num_workers=1), Data(sizes=(10, 12, 11)), Loading(batch_size=batch_size, even_batches=policy))
    segment = run_segment(tmp_path, "run", job)
    seen = served_per_epoch(kept_records(segment, None))
    assert_exactly_once(seen, 33, epochs=1, missing_ok=dropped)
    assert len(seen[0]) == 33 - dropped
    assert [len(recs) for recs in segment.records.values()] == [steps, steps]
    assert sum(r["pad"] for recs in segment.records.values() for r in recs) == padding
    assert segment.report is not None
    report = segment.report["epochs"][0]
    assert (report["padding"], report["dropped"], report["consumed"]) == (padding, dropped, 33 - dropped)
    assert f"{33 - dropped:>9} {padding:>7} {dropped:>7}" in segment.output  # the printed summary


def test_checkpoint_loads_with_weights_only_and_holds_the_gathered_ledger(trained_2x2: Path) -> None:
    """Lightning writes only rank 0's file: it must still hold both ranks' consumed samples. The
    checkpoint is the step-3 one of the session's shared 2 ranks x 2 workers segment (tests/process/conftest.py)."""
    segment = load_segment(trained_2x2, "seg0", first_segment(FIRST_2X2, checkpoint_every=FIRST_2X2_EVERY))
    first = next(p for p in segment.checkpoints if checkpoint_step(p) == 3)
    ckpt = torch.load(first, weights_only=True)
    state = ckpt["lightning_sharding"]
    assert state["writer"]["world_size"] == 2
    consumed = state["consumed"]
    served = sum((b - a) for a, b in consumed.tolist())
    assert served == 3 * 8 * 2  # 3 steps x batch 8 x 2 ranks


def test_ranks_that_list_different_data_fail_clearly_instead_of_overlapping(tmp_path: Path) -> None:
    segment = run_segment(tmp_path, "run", Job(Topology(num_workers=0), Data(skew_rank1=True)), expect_death=True)
    assert "rank 1 lists other data than rank 0: num_items was 5, now 6" in segment.output
    assert not any(segment.records.values()), "no step may run on inconsistent data"
