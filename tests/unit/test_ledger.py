"""Ledger: pending vs consumed, epochs, and strict checkpoint round trips."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sharding.core.ledger import LEDGER_VERSION, CheckpointMismatchError, Ledger
from lightning_sharding.core.rangeset import RangeSet

TOTAL = 200
MANIFEST = {"fingerprint": "abc123", "num_items": 3, "total": TOTAL, "first_key": "a", "last_key": "c"}

steps = st.lists(st.lists(st.integers(0, TOTAL - 1), max_size=20), max_size=12)


def new_ledger(epoch: int = 0) -> Ledger:
    return Ledger(seed=7, total=TOTAL, manifest=MANIFEST, epoch=epoch)


@settings(max_examples=200, deadline=None)
@given(steps, st.lists(st.booleans(), min_size=12, max_size=12))
def test_record_and_commit_against_a_set_model(batches: list[list[int]], commit_after: list[bool]) -> None:
    ledger = new_ledger()
    consumed: set[int] = set()
    pending: set[int] = set()
    for positions, commit in zip(batches, commit_after, strict=False):
        ledger.record(np.array(positions, dtype=np.int64))
        pending |= set(positions)
        if commit:
            ledger.commit()
            consumed |= pending
            pending = set()
        assert ledger.consumed.to_array().tolist() == sorted(consumed)
        assert ledger.pending.to_array().tolist() == sorted(pending)
        assert ledger.trained.to_array().tolist() == sorted(consumed | pending)
        assert (ledger.total - len(ledger.consumed)) == TOTAL - len(consumed)
        # Pending positions never reach a checkpoint.
        state = ledger.state_dict()
        assert RangeSet.from_state(state["consumed"]).to_array().tolist() == sorted(consumed)
        assert "pending" not in state
        assert Ledger.from_state_dict(state).pending == RangeSet()


def test_pending_is_not_checkpointed_until_commit() -> None:
    ledger = new_ledger()
    ledger.record([3, 4, 5])
    assert len(ledger.state_dict()["consumed"]) == 0
    assert Ledger.from_state_dict(ledger.state_dict()).consumed == RangeSet()
    ledger.commit()
    assert RangeSet.from_state(ledger.state_dict()["consumed"]) == RangeSet.interval(3, 6)


def test_merge_adds_other_ranks_positions() -> None:
    ledger = new_ledger()
    ledger.record([1])
    ledger.commit()
    ledger.merge(RangeSet.from_ranges([(10, 12), (0, 1)]))
    assert ledger.consumed.ranges() == [(0, 2), (10, 12)]


def test_start_epoch_clears_and_same_epoch_keeps() -> None:
    ledger = new_ledger(epoch=2)
    ledger.record([1, 2])
    ledger.commit()
    ledger.record([9])
    ledger.start_epoch(2)
    assert ledger.consumed == RangeSet.interval(1, 3) and ledger.pending == RangeSet.interval(9, 10)
    ledger.start_epoch(3)
    assert ledger.epoch == 3
    assert ledger.consumed == RangeSet() and ledger.pending == RangeSet()
    assert (ledger.total - len(ledger.consumed)) == TOTAL
    assert ledger.state_dict()["epoch"] == 3


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, TOTAL), st.integers(0, 30)), max_size=8),
    st.integers(-(2**62), 2**62),
    st.integers(0, 10**6),
)
def test_state_dict_round_trip(ranges: list[tuple[int, int]], seed: int, epoch: int) -> None:
    ledger = Ledger(seed=seed, total=TOTAL, manifest=MANIFEST, epoch=epoch)
    ledger.merge(RangeSet.from_ranges((s, min(s + n, TOTAL)) for s, n in ranges))
    state = ledger.state_dict()
    assert set(state) == set(Ledger.KEYS)
    assert state["version"] == LEDGER_VERSION
    for consumed in (state["consumed"], state["consumed"].tolist()):  # arrays or lists (e.g. after YAML/JSON)
        restored = Ledger.from_state_dict({**state, "consumed": consumed})
        assert (restored.seed, restored.epoch, restored.total) == (seed, epoch, TOTAL)
        assert restored.manifest == MANIFEST
        assert restored.fingerprint == MANIFEST["fingerprint"]
        assert restored.consumed == ledger.consumed
        assert restored.pending == RangeSet()
        assert np.array_equal(restored.state_dict()["consumed"], state["consumed"])


def test_state_dict_manifest_is_a_copy() -> None:
    ledger = new_ledger()
    state = ledger.state_dict()
    state["manifest"]["fingerprint"] = "changed"
    assert ledger.fingerprint == "abc123"


@pytest.mark.parametrize("key", Ledger.KEYS)
def test_missing_key_is_named(key: str) -> None:
    state = new_ledger().state_dict()
    del state[key]
    with pytest.raises(CheckpointMismatchError, match=f"'{key}'"):
        Ledger.from_state_dict(state)


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_unknown_version_is_named(version: Any) -> None:
    state = {**new_ledger().state_dict(), "version": version}
    with pytest.raises(CheckpointMismatchError, match=f"version {version!r}"):
        Ledger.from_state_dict(state)


@pytest.mark.parametrize(
    ("consumed", "position"), [([[0, TOTAL + 1]], TOTAL), ([[5, 6], [TOTAL + 9, TOTAL + 10]], TOTAL + 9)]
)
def test_consumed_outside_total_is_rejected(consumed: list[list[int]], position: int) -> None:
    state = {**new_ledger().state_dict(), "consumed": np.array(consumed, dtype=np.int64)}
    with pytest.raises(CheckpointMismatchError, match=f"position {position} is outside an epoch of {TOTAL}"):
        Ledger.from_state_dict(state)


def test_consumed_up_to_total_is_accepted() -> None:
    state = {**new_ledger().state_dict(), "consumed": np.array([[0, TOTAL]], dtype=np.int64)}
    restored = Ledger.from_state_dict(state)
    assert restored.total - len(restored.consumed) == 0


def test_non_mapping_state_is_rejected() -> None:
    with pytest.raises(CheckpointMismatchError, match="expected a mapping"):
        Ledger.from_state_dict([1, 2, 3])  # type: ignore[arg-type]


def test_checkpoint_mismatch_is_a_value_error() -> None:
    assert issubclass(CheckpointMismatchError, ValueError)


runs = st.lists(
    st.one_of(
        st.tuples(st.integers(0, TOTAL - 1), st.integers(0, 24)).map(
            lambda r: list(range(r[0], min(r[0] + r[1], TOTAL)))
        ),
        st.lists(st.integers(0, TOTAL - 1), max_size=8),  # any positions: not a run
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(runs, st.lists(st.booleans(), min_size=40, max_size=40), st.integers(2, 6))
def test_runs_are_kept_as_lists_and_read_as_the_same_sets(
    batches: list[list[int]], commit_after: list[bool], limit: int
) -> None:
    """A batch of consecutive positions is recorded in O(1) Python, as a run; whatever is read
    (pending, consumed, done, the state) is the set a range set would hold, also past the buffer's limit."""
    ledger = new_ledger()
    consumed: set[int] = set()
    pending: set[int] = set()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lightning_sharding.core.ledger.RunBuffer.LIMIT", limit)
        for k, (batch, commit) in enumerate(zip(batches, commit_after, strict=False)):
            ledger.record(np.asarray(batch, dtype=np.int64))
            pending |= set(batch)
            if commit:
                ledger.commit()
                consumed |= pending
                pending = set()
            if k % 3 == 0:  # read at times, not at others
                assert set(ledger.pending.to_array().tolist()) == pending
            assert set(ledger.consumed.to_array().tolist()) == consumed
        assert set(ledger.trained.to_array().tolist()) == consumed | pending
        assert ledger.state_dict()["consumed"].tolist() == RangeSet.from_positions(sorted(consumed)).to_state().tolist()


def test_a_run_of_positions_is_recorded_without_a_range_set() -> None:
    ledger = new_ledger()
    ledger.record(np.arange(8, 16))
    ledger.record(np.arange(16, 24))  # continues the last run: joined
    assert ledger._pending_runs.starts == [8] and ledger._pending_runs.stops == [24]
    ledger.commit()
    ledger.record(np.array([30, 32, 31]))  # not a run: a range set
    assert not ledger._pending_runs and ledger.pending == RangeSet([30], [33])
    ledger.commit()
    assert ledger.consumed == RangeSet([8, 30], [24, 33])
