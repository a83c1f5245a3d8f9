"""The ledger: the only data state that is checkpointed.

``{version, seed, epoch, manifest summary, consumed}`` (and a controlled mixture's ``decisions``),
where ``consumed`` is a range set of epoch positions whose training step completed and whose
gradients are in an applied optimizer step.
Positions of a completed step still waiting for an optimizer step (gradient accumulation) are
``pending``: they are never written to a checkpoint.
Positions a resume with ``skip=`` left out (a loss spike's data) are ``skipped``: never trained, not
served again in their epoch, and kept apart from ``consumed`` so the ledger still matches the weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.history import HISTORY_KEY, flat_ranges, history_state, ranges_of_flat, segments_of
from lightning_sharding.core.rangeset import RangeSet, is_run

LEDGER_VERSION = 1
CHANGED_VERSION = 2  # a ledger of an epoch whose mixture changed on resume: earlier releases refuse it
CONTROLLED_VERSION = 3  # a ledger of a mixture under online control (its decisions): earlier releases refuse it
SKIPPED_VERSION = 4  # a ledger with samples left out by skip=: earlier releases, which would train them, refuse it
CHECKPOINT_KEY = "lightning_sharding"  # where a Lightning checkpoint holds the ledger
GLOBAL_STEP_KEY = "global_step"  # the optimizer step whose weights the checkpointed ledger matches
SKIPPED_KEY, SKIP_AHEAD_KEY, SKIPS_KEY = "skipped", "skip_ahead", "skips"  # what a skip= resume left out
LOOP_STATE_KEY = "ledger"  # a ShardedData state, {"ledger": (entry,)}: DCP stores a tuple whole


def loop_state_entry(state: Any) -> Mapping[str, Any] | None:
    """The ledger entry of a ``ShardedData`` state (``{"ledger": (entry,)}``), or None if ``state`` is none."""
    held = state.get(LOOP_STATE_KEY) if isinstance(state, Mapping) else None
    if isinstance(held, tuple | list) and len(held) == 1 and isinstance(held[0], Mapping) and "consumed" in held[0]:
        return held[0]
    return None


def ledger_step_mismatch(state: Mapping[str, Any], global_step: int | None) -> str | None:
    """Why a checkpoint's ledger may not match its weights, or None when it records their step.

    ``state`` is the checkpoint's ledger entry, ``global_step`` the checkpoint's own optimizer step.
    """
    recorded = state.get(GLOBAL_STEP_KEY)
    if recorded is None:
        return (
            "its data ledger does not record the optimizer step it matches (it was written by an earlier "
            "lightning_sharding, which could leave out a step in flight or an accumulation window): samples "
            "trained just before the save may be trained once more after the resume"
        )
    if global_step is not None and int(recorded) != int(global_step):
        return (
            f"its data ledger matches optimizer step {int(recorded)} but its weights are of global_step "
            f"{int(global_step)}: the samples of the steps in between may be lost or trained twice"
        )
    return None


class RunBuffer:
    """Runs ``[start, stop)`` of positions in plain lists, a run that continues the last one joined
    to it: what a training step adds to the ledger, in O(1) Python. :meth:`take` gives them as one
    :class:`RangeSet` (one vectorised merge) and empties the buffer; it holds at most :attr:`LIMIT`
    runs, merging into one set past that, so a ledger never read keeps little."""

    LIMIT = 4096

    __slots__ = ("_held", "starts", "stops")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.stops: list[int] = []
        self._held: RangeSet | None = None  # runs merged already, past LIMIT

    def __bool__(self) -> bool:
        return bool(self.starts) or self._held is not None

    def add(self, start: int, stop: int) -> None:
        """One more run."""
        if self.stops and self.stops[-1] == start:
            self.stops[-1] = stop
            return
        self.starts.append(start)
        self.stops.append(stop)
        if len(self.starts) >= self.LIMIT:
            self._held = self.take()

    def extend(self, other: RunBuffer) -> None:
        """The runs of ``other`` too."""
        if other._held is not None:
            self._held = other._held if self._held is None else self._held | other._held
        for start, stop in zip(other.starts, other.stops, strict=True):
            self.add(start, stop)

    def move_to(self, other: RunBuffer) -> None:
        """Give every run to ``other`` (:meth:`extend`), leaving this buffer empty: an optimizer step's
        one run, a step's usual case, joined to the last without a loop."""
        if self._held is None and len(self.starts) == 1:
            other.add(self.starts[0], self.stops[0])
            self.starts.clear()
            self.stops.clear()
            return
        other.extend(self)
        self.starts, self.stops, self._held = [], [], None

    def take(self) -> RangeSet:
        """Every run held, as one set; the buffer is left empty."""
        runs = RangeSet(np.asarray(self.starts, dtype=np.int64), np.asarray(self.stops, dtype=np.int64))
        held, self._held = self._held, None
        self.starts, self.stops = [], []
        return runs if held is None else held | runs


class CheckpointMismatchError(ValueError):
    """A checkpoint's data ledger does not fit the data or this version of lightning_sharding."""


class Ledger:
    """Consumed epoch positions for one ``(seed, epoch)`` of one manifest."""

    VERSION = LEDGER_VERSION
    KEYS = ("version", "seed", "epoch", "total", "manifest", "consumed")

    def __init__(
        self,
        *,
        seed: int,
        total: int,
        manifest: Mapping[str, Any],
        epoch: int = 0,
        change: Mapping[str, Any] | None = None,
    ) -> None:
        # ``change``: the epoch's mixture changed on resume; ``before`` is the ledger state it changed
        # from, ``next_total`` the samples of the epochs after it (see :mod:`~lightning_sharding.mixture.change`).
        self.change: dict[str, Any] | None = dict(change) if change is not None else None
        self.seed = int(seed)
        self.total = int(total)
        self.manifest: dict[str, Any] = dict(manifest)
        self.epoch = int(epoch)
        # Recorded and committed positions wait as runs ``[start, stop)`` in plain lists (O(1) a batch)
        # until ``pending`` or ``consumed`` is read, which merges them into its range set at once.
        self._consumed, self._consumed_runs = RangeSet(), RunBuffer()
        self._pending, self._pending_runs = RangeSet(), RunBuffer()
        # A mixture under online control: every decision made so far, as Decision.state() dicts, in
        # the order made; kept across epochs (an epoch starts at the shares of the last one). None: not controlled.
        self.decisions: list[dict[str, Any]] | None = None
        # One entry per run that trained into this ledger (lightning_sharding.core.history): bookkeeping
        # only, never read by the plan; a state without it (an earlier release's) starts none.
        self.history: list[dict[str, Any]] = []
        # Left out by a resume with ``skip=``: this epoch's positions, later epochs' (``{epoch: positions}``),
        # and one record per skip applied (what was asked, at which checkpoint step, how many samples).
        self.skipped = RangeSet()
        self.skip_ahead: dict[int, RangeSet] = {}
        self.skips: list[dict[str, Any]] = []

    @property
    def fingerprint(self) -> str:
        """The manifest fingerprint this ledger belongs to."""
        return str(self.manifest["fingerprint"])

    def start_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` with nothing consumed (no-op when already there)."""
        if epoch != self.epoch:
            if self.change is not None:  # the changed epoch is over: ordinary epochs of the new mixture
                self.total = int(self.change["next_total"])
                self.change = None
            self.epoch = int(epoch)
            self.consumed = RangeSet()
            self.pending = RangeSet()
            self.skipped = self.skip_ahead.pop(self.epoch, RangeSet())
            self.skip_ahead = {e: r for e, r in self.skip_ahead.items() if e > self.epoch}

    @property
    def consumed(self) -> RangeSet:
        """Positions whose gradients are in an applied optimizer step."""
        if self._consumed_runs:
            self._consumed = self._consumed | self._consumed_runs.take()
        return self._consumed

    @consumed.setter
    def consumed(self, value: RangeSet) -> None:
        self._consumed, self._consumed_runs = value, RunBuffer()

    @property
    def pending(self) -> RangeSet:
        """Positions of completed training steps waiting for an optimizer step."""
        if self._pending_runs:
            self._pending = self._pending | self._pending_runs.take()
        return self._pending

    @pending.setter
    def pending(self, value: RangeSet) -> None:
        self._pending, self._pending_runs = value, RunBuffer()

    def record(self, positions: npt.ArrayLike) -> None:
        """Mark positions (shape ``(n,)``) of a completed training step as pending: a run of
        consecutive positions (what a plan's batch holds) in O(1) Python, any others as a range set."""
        p = np.asarray(positions, dtype=np.int64).reshape(-1)
        if p.size == 0:
            return
        first, last = p[0].item(), p[-1].item()
        if last - first == p.size - 1 and (p.size < 3 or is_run(p)):
            self._pending_runs.add(first, first + p.size)
        else:
            self._pending = self.pending | RangeSet.from_positions(p)

    def commit(self) -> None:
        """An optimizer step has applied every pending position's gradient: they are consumed."""
        if self._pending:  # a range set recorded: merge all at once
            self.consumed = self.consumed | self.pending
            self.pending = RangeSet()
        elif self._pending_runs:  # only runs: they move over as runs
            self._pending_runs.move_to(self._consumed_runs)

    def merge(self, consumed: RangeSet) -> None:
        """Add positions other ranks consumed (after a gather)."""
        self.consumed = self.consumed | consumed

    @property
    def trained(self) -> RangeSet:
        """Positions whose training step has run in this run, consumed or pending: not served again."""
        return self.consumed | self.pending

    @property
    def settled(self) -> RangeSet:
        """Positions not to be served again this epoch: :attr:`trained` or skipped. What the plan leaves out."""
        trained = self.trained
        return trained | self.skipped if self.skipped else trained

    def skip(self, positions: Mapping[int, RangeSet]) -> None:
        """Leave out ``{epoch: positions}`` (this epoch's or later ones'), never served in their epoch."""
        for epoch, ranges in positions.items():
            if epoch < self.epoch or not ranges:
                continue
            if epoch == self.epoch:
                self.skipped = self.skipped | ranges
            else:
                self.skip_ahead[epoch] = self.skip_ahead.get(epoch, RangeSet()) | ranges

    @property
    def done(self) -> RangeSet:
        """The old name of :attr:`trained` (deprecated in 0.2, goes away in the next release)."""
        warnings.warn(
            "Ledger.done is Ledger.trained since lightning_sharding 0.2 (consumed or pending positions); "
            "the old name goes away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.trained

    def state_dict(self) -> dict[str, Any]:
        """The checkpointed state; pending positions are left out on purpose."""
        version = self.VERSION if self.change is None else CHANGED_VERSION
        version = CONTROLLED_VERSION if self.decisions is not None else version
        state = {
            "version": SKIPPED_VERSION if self.skipped or self.skip_ahead else version,
            "seed": self.seed,
            "epoch": self.epoch,
            "total": self.total,
            "manifest": dict(self.manifest),
            "consumed": self.consumed.to_state(),
        }
        if self.change is not None:
            state["change"] = self.change
        if self.decisions is not None:
            state["decisions"] = [dict(d) for d in self.decisions]
        if self.history:  # an optional key: earlier releases read the state without it
            state[HISTORY_KEY] = history_state(self.history)
        if self.skipped or self.skip_ahead or self.skips:  # optional keys too (a skip= resume)
            state[SKIPPED_KEY] = flat_ranges(self.skipped)
            state[SKIP_AHEAD_KEY] = [[e, *flat_ranges(r)] for e, r in sorted(self.skip_ahead.items())]
            state[SKIPS_KEY] = [dict(s) for s in self.skips]
        return state

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Ledger:
        """Rebuild a ledger; a missing key or an unknown version is a :class:`CheckpointMismatchError`."""
        if not isinstance(state, Mapping):
            raise CheckpointMismatchError(f"malformed ledger state: expected a mapping, got {type(state).__name__}")
        missing = [k for k in cls.KEYS if k not in state]
        if missing:
            raise CheckpointMismatchError(f"malformed ledger state: missing key(s) {missing}")
        version = state["version"]
        if version == CHANGED_VERSION and isinstance(state.get("change"), Mapping):
            pass
        elif version == CONTROLLED_VERSION and isinstance(state.get("decisions"), list):
            pass
        elif version == SKIPPED_VERSION and state.get(SKIPPED_KEY) is not None:
            pass
        elif version != cls.VERSION:
            raise CheckpointMismatchError(
                f"the checkpoint's data ledger has version {version!r}; this lightning_sharding reads version "
                f"{cls.VERSION}. Resume with the lightning_sharding release that wrote it."
            )
        if not isinstance(state["manifest"], Mapping) or "fingerprint" not in state["manifest"]:
            raise CheckpointMismatchError("malformed ledger state: 'manifest' has no 'fingerprint'")
        ledger = cls(
            seed=state["seed"],
            total=state["total"],
            manifest=state["manifest"],
            epoch=state["epoch"],
            change=state.get("change"),
        )
        ledger.consumed = RangeSet.from_state(np.asarray(state["consumed"]))
        if state.get("decisions") is not None:
            ledger.decisions = [dict(d) for d in state["decisions"]]
        ledger.history = segments_of(state)
        if state.get(SKIPPED_KEY) is not None:
            ledger.skipped = ranges_of_flat(state[SKIPPED_KEY])
        for epoch, *flat in state.get(SKIP_AHEAD_KEY) or []:
            ledger.skip_ahead[int(epoch)] = ranges_of_flat(flat)
        ledger.skips = [dict(s) for s in state.get(SKIPS_KEY) or []]
        if ledger.consumed and int(ledger.consumed.ends[-1]) > ledger.total:
            raise CheckpointMismatchError(
                f"malformed ledger state: consumed position {int(ledger.consumed.ends[-1]) - 1} "
                f"is outside an epoch of {ledger.total} samples"
            )
        return ledger
