"""Exactly-once measured in the model's weights, whoever writes the checkpoint and whenever.

The job's model holds one weight per sample id, moved by exactly 1 each time that sample's gradient
is applied (``Job(count_weights=True)``, tests/jobs/parts.py::RecordingModel). So a checkpoint's
weights say which samples its optimizer steps hold, and its ledger must say the same: every
checkpoint a run writes is compared sample by sample, then every one of them is resumed on another
topology (1 rank, no workers) and one on the same topology, and every finished epoch must have
added exactly 1 to every sample's weight.

Real processes throughout: a real Trainer, DDP over gloo (ddp_spawn or torchrun), real workers,
Lightning's own SLURM auto-requeue handler on a real SIGUSR1, Lightning's OnExceptionCheckpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.harness import (
    Checks,
    Faults,
    Job,
    Loading,
    Saves,
    Topology,
    Training,
    assert_checkpoint_matches_weights,
    assert_weights_count_once,
    run_segment,
    weights_at_epoch_ends,
)

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

SIZES = Job().data.sizes
TOTAL = sum(SIZES)  # 200 samples: 13 batches of 8 per rank and epoch on 2 ranks (the last one padded)


def _check_every_checkpoint(out: Path) -> list[Path]:
    """Compare every checkpoint the run wrote with its weights; returns them, oldest first."""
    written = sorted(
        [*out.glob("saves/*.ckpt"), *out.glob("checkpoints/*.ckpt"), *out.glob("hpc_ckpt_*.ckpt")],
        key=lambda p: p.stat().st_mtime,
    )
    for path in written:
        epoch, consumed = assert_checkpoint_matches_weights(path, SIZES)
        print(f"{path.name}: epoch {epoch}, {consumed} consumed, ledger matches weights")
    return written


def _resume_each_elsewhere(out: Path, checkpoints: list[Path], job: Job) -> None:
    """Resume from every checkpoint on 1 rank x 0 workers (one process, one Trainer each), training
    to the end: every epoch must add exactly 1 to every weight."""
    each = tuple(str(p) for p in checkpoints)
    training = Training(epochs=job.training.epochs, accumulate=job.training.accumulate, resume_each=each)
    resumed = Job(Topology(world_size=1, num_workers=0), training=training, checks=Checks(count_weights=True))
    run_segment(out, "elsewhere", resumed)
    for path in checkpoints:
        epoch, consumed = assert_checkpoint_matches_weights(path, SIZES)
        # The checkpoint's earlier epochs are whole (its weights say so). A checkpoint of a finished
        # epoch resumes into the next one, or first ends the saved epoch (saved at validation end).
        weights = weights_at_epoch_ends(out, f"elsewhere-{path.stem}")
        first = epoch + 1 if consumed == TOTAL and epoch not in weights else epoch
        assert_weights_count_once(weights, TOTAL, job.training.epochs, first_epoch=first)


def test_checkpoints_saved_from_any_hook_hold_what_the_weights_hold(tmp_path: Path) -> None:
    """2 ranks x 2 workers under ddp_spawn, 2 epochs, no accumulation. Saves come from a user callback before and
    after ShardingCallback, the LightningModule's on_train_batch_end, Lightning's SLURM handler on
    SIGUSR1 inside a step (after backward, before the optimizer step) and between steps,
    ModelCheckpoint every 4 steps and every epoch, and ModelCheckpoint at validation end with an
    integer val_check_interval that falls on each epoch's last batch."""
    job = Job(
        Topology(launcher="spawn"),  # Lightning's ddp_spawn (the accumulation case below runs under torchrun)
        loading=Loading(persistent_workers=True),  # workers (train and validation) start once, not at every epoch
        training=Training(epochs=2),
        saves=Saves(
            callbacks=(
                {"name": "user-before", "batches": [3, 20]},
                {"name": "user-after", "batches": [5], "after": True},
                {"name": "signal-in-step", "batches": [9], "hook": "signal_in_step"},
                {"name": "signal-between", "batches": [11], "hook": "signal_between_steps"},
            ),
            module_saves=(7,),
            checkpoint_every=4,
            every_n_epochs=1,
            val_check_interval=13,
        ),
        checks=Checks(count_weights=True),
    )
    run_segment(tmp_path, "seg0", job)
    assert_weights_count_once(weights_at_epoch_ends(tmp_path, "seg0"), TOTAL, epochs=2)
    written = _check_every_checkpoint(tmp_path)
    names = {p.name for p in written}
    assert {"user-before-b3.ckpt", "user-before-b20.ckpt", "user-after-b5.ckpt", "module-b7.ckpt"} <= names
    assert len([n for n in names if n.startswith("hpc_ckpt_")]) == 2, names
    assert len([n for n in names if "-val-end-" in n]) == 2 and len([n for n in names if "-epoch-end-" in n]) == 2
    assert len([n for n in names if n.startswith("seg0-epoch=")]) == 26 // 4, names

    _resume_each_elsewhere(tmp_path, written, job)
    # The same topology, from the save a callback ahead of ShardingCallback made mid-step.
    same = job.but(saves=Saves(), training=dict(resume_from=str(tmp_path / "saves" / "user-before-b3.ckpt")))
    run_segment(tmp_path, "same", same)
    resumed = weights_at_epoch_ends(tmp_path, "same")
    assert_weights_count_once(resumed, TOTAL, epochs=2)


def test_checkpoints_inside_an_accumulation_window_and_on_exception(tmp_path: Path) -> None:
    """2 ranks x 2 workers under torchrun, accumulate_grad_batches=3 (steps after batches 3, 6, 9, 12
    and the epoch's last, 13). Saves inside a window (batches 4 and 5, before and after
    ShardingCallback), at a window's end (6), from the module (8), on SIGUSR1 inside a step (9),
    ModelCheckpoint at every step, and OnExceptionCheckpoint when training_step raises in batch 11."""
    job = Job(
        Topology(launcher="torchrun"),
        training=Training(accumulate=3),
        saves=Saves(
            callbacks=(
                {"name": "user-before", "batches": [4, 6]},
                {"name": "user-after", "batches": [5], "after": True},
                {"name": "signal-in-step", "batches": [9], "hook": "signal_in_step"},
            ),
            module_saves=(8,),
            checkpoint_every=1,
        ),
        faults=Faults(raise_in_step_at_batch=11),
        checks=Checks(count_weights=True),
    )
    died = run_segment(tmp_path, "seg0", job, expect_death=True)
    assert "deliberate failure in training_step of batch 11" in died.output
    written = _check_every_checkpoint(tmp_path)
    names = {p.name for p in written}
    assert {"user-before-b4.ckpt", "user-before-b6.ckpt", "user-after-b5.ckpt", "module-b8.ckpt"} <= names
    assert "seg0-on-exception.ckpt" in names and any(n.startswith("hpc_ckpt_") for n in names)
    # Inside the window nothing of it is in the weights yet: b4 and b5 hold the same 48 samples as step 1.
    for name in ("user-before-b4.ckpt", "user-after-b5.ckpt"):
        assert assert_checkpoint_matches_weights(tmp_path / "saves" / name, SIZES) == (0, 48)
    assert assert_checkpoint_matches_weights(tmp_path / "saves" / "user-before-b6.ckpt", SIZES) == (0, 96)
    # The exception came in batch 11's forward pass: the weights hold 3 steps of 3 batches x 2 ranks x 8.
    assert assert_checkpoint_matches_weights(tmp_path / "saves" / "seg0-on-exception.ckpt", SIZES) == (0, 144)

    _resume_each_elsewhere(tmp_path, written, job)
    same = job.but(
        saves=Saves(), faults=Faults(), training=dict(resume_from=str(tmp_path / "saves" / "seg0-on-exception.ckpt"))
    )
    resumed = run_segment(tmp_path, "same", same)
    assert_weights_count_once(weights_at_epoch_ends(tmp_path, "same"), TOTAL, epochs=1)
    # One torchrun, two ranks on one node: the summary's rank map says so.
    assert "ranks: rank 0 = node 0 local 0 | rank 1 = node 0 local 1" in resumed.output
