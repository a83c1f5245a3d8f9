"""StepAccounting in-process: which delivered batches a save at any moment counts, from the counters alone.

The process tests (tests/process/test_weights.py) show the same against real weights; these walk every
moment of a step one counter at a time.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.loading.accounting import StepAccounting, TrainerProgress
from lightning_sharding.strategies import Provenance


class Run:
    """Batches of 4 positions delivered in order, and the trainer's counters as Lightning moves them."""

    def __init__(self, batches: int = 8, accumulate: int = 1, has_optimizer: bool = True) -> None:
        self.ledger = Ledger(seed=0, total=4 * batches, manifest={"fingerprint": "f"})
        self.delivered = deque(Provenance(0, np.arange(4 * b, 4 * b + 4), 0) for b in range(batches))
        self.accounting = StepAccounting()
        self.accounting.start_run(0)
        self.accumulate, self.has_optimizer = accumulate, has_optimizer
        self.started = self.processed = self.steps = 0

    def progress(self) -> TrainerProgress:
        return TrainerProgress(self.started, self.processed, self.steps, self.has_optimizer)

    def sync(self) -> list[int]:
        """A save (or a batch end) now: the positions the ledger would write."""
        self.accounting.sync(self.progress(), self.delivered.popleft, self.ledger)
        return sorted(p for a, b in self.ledger.consumed.ranges() for p in range(a, b))

    def batch_start(self) -> None:
        self.accounting.batch_starts(self.progress())
        self.started += 1

    def optimizer_step(self) -> None:
        if self.started % self.accumulate == 0:
            self.steps += 1

    def batch(self) -> None:
        """One whole batch, ending with the callback's own sync at its on_train_batch_end."""
        self.batch_start()
        self.optimizer_step()
        self.processed += 1
        self.sync()


def test_a_save_at_any_moment_of_a_step_counts_exactly_the_applied_batches() -> None:
    run = Run()
    run.batch()
    run.batch()
    assert run.sync() == list(range(8))
    run.batch_start()  # a save from on_train_batch_start: batch 3 has not run
    assert run.sync() == list(range(8))
    # after backward, before the optimizer step (on_before_optimizer_step, a signal inside the step)
    assert run.sync() == list(range(8))
    run.optimizer_step()  # optimizer.step() returned; Lightning has not counted the batch processed yet
    assert run.sync() == list(range(12))
    run.processed += 1  # on_train_batch_end of a callback ahead of ShardingCallback
    assert run.sync() == list(range(12))
    assert run.sync() == list(range(12))  # ShardingCallback's own sync: nothing counted twice


@pytest.mark.parametrize("save_after", range(1, 8))
def test_accumulation_counts_only_windows_whose_step_was_applied(save_after: int) -> None:
    run = Run(accumulate=3)
    for _ in range(save_after):
        run.batch()
    applied = (save_after // 3) * 3
    assert run.sync() == list(range(4 * applied))
    assert len(run.ledger.pending) == 4 * (save_after - applied)


def test_a_batch_skipped_by_on_train_batch_start_is_not_counted() -> None:
    run = Run()
    run.batch()
    run.accounting.batch_starts(run.progress())
    run.processed += 1  # on_train_batch_start returned -1: processed without being started
    assert run.sync() == list(range(4))
    assert len(run.delivered) == 7


def test_after_a_resume_the_epochs_earlier_batches_are_not_counted_again() -> None:
    run = Run()
    run.started = run.processed = 5  # Lightning's counters restored from a checkpoint of this epoch
    run.batch()
    assert run.sync() == list(range(4))


def test_without_an_optimizer_every_finished_step_counts() -> None:
    run = Run(has_optimizer=False)
    run.batch_start()
    run.processed += 1
    assert run.sync() == list(range(4))


def test_nothing_is_counted_before_the_first_batch_starts() -> None:
    run = Run()
    run.processed = 3  # a save from on_train_start of a resumed run
    assert run.sync() == []
    assert len(run.delivered) == 8
