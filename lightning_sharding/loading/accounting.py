"""Which delivered batches the weights hold: the ledger decided from the trainer's progress.

A batch joins the ledger as pending once its training step has run, and becomes consumed once an
optimizer step has applied its gradient. Both facts are read from counters (the trainer's batch
progress, and the optimizer steps that returned) each time :meth:`StepAccounting.sync` is called,
so a checkpoint written from any hook, any callback position or a signal handler holds exactly the
batches whose gradients are in its weights. Lightning-free: the callback passes the numbers in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_sharding.core.ledger import Ledger


@dataclass(frozen=True)
class TrainerProgress:
    """The trainer's counters at one moment.

    ``started`` and ``processed`` count the batches of the current epoch whose training step
    began and finished (Lightning's ``batch_progress.current``); ``optimizer_steps`` counts the
    ``optimizer.step()`` calls that have returned. ``has_optimizer`` is False when there is no
    optimizer: every finished step then counts as applied.
    """

    started: int
    processed: int
    optimizer_steps: int
    has_optimizer: bool = True


class StepAccounting:
    """Moves delivered batches into the ledger as the trainer's progress says they were applied.

    One instance per fit. :meth:`start_epoch` when a new train iterator begins, :meth:`batch_starts`
    from the callback's ``on_train_batch_start``, :meth:`sync` from any point where the ledger is
    read (every batch end and every checkpoint save). ``sync`` runs at least once per batch, at
    the batch's end, so when an optimizer step has returned since the last commit, every pending
    batch went into that step.
    """

    def __init__(self) -> None:
        self._committed_step: int | None = None
        self._base: int | None = None
        self._accounted = 0
        self._step_at_batch_start = 0

    def start_epoch(self) -> None:
        """A new train iterator: nothing of it has been accounted yet."""
        self._base = None
        self._accounted = 0

    def start_run(self, optimizer_steps: int) -> None:
        """Training (re)starts: the restored ledger holds every step before it."""
        self._committed_step = optimizer_steps
        self.start_epoch()

    @property
    def batches_before(self) -> int | None:
        """Batches of the epoch trained before this iterator's first (a resume's), None before it starts."""
        return self._base

    def batch_starts(self, progress: TrainerProgress) -> None:
        """A batch is about to run its training step (called before Lightning counts it as started)."""
        if self._base is None:
            # Batches of this epoch trained before a resume are in the restored ledger already.
            self._base = progress.started
        self._step_at_batch_start = progress.optimizer_steps
        if self._committed_step is None:
            self._committed_step = progress.optimizer_steps

    def sync(self, progress: TrainerProgress, pop: Callable[[], Any], ledger: Ledger) -> list[Any]:
        """Record the batches whose step has run since the last call, commit what an optimizer step
        applied, and return the newly recorded provenances (oldest first).

        ``pop`` returns the provenance of the oldest delivered batch not yet accounted.
        """
        if self._base is None:
            return []
        started, processed = progress.started - self._base, progress.processed - self._base
        # A batch skipped by on_train_batch_start returning -1 is processed without being started.
        done = min(started, processed)
        if started > processed and progress.optimizer_steps != self._step_at_batch_start:
            # Saved inside the batch in flight, after its optimizer step: its gradient is in the weights.
            done = started
        recorded = []
        while self._accounted < done:
            provenance = pop()
            ledger.record(provenance.consumed_positions)
            recorded.append(provenance)
            self._accounted += 1
        if not progress.has_optimizer or progress.optimizer_steps != self._committed_step:
            ledger.commit()
            self._committed_step = progress.optimizer_steps
        return recorded
