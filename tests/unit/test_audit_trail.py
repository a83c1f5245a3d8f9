"""The audit trail's format on disk: a trail written by an earlier release (its run headers say
``"kind": "segment"``) reads as it always did, and what :class:`AuditWriter` writes reads back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lightning_sharding.loading.audit import AuditWriter, audit, format_audit

# Two runs of 2 data-parallel ranks, 12 samples an epoch, as release 0.8 wrote them: the first run
# was killed after its checkpoint at step 1 and trained step 2 too, which the second run trains again.
HEADER = {"world_size": 2, "global_world_size": 2, "num_workers": 0, "seed": 5, "total": 12, "fingerprint": "f"}
OLD_TRAIL = {
    "20250101T000000-1-rank0.jsonl": [
        {
            "kind": "segment",
            "version": 1,
            "segment": "20250101T000000-1",
            "rank": 0,
            "started": 1.0,
            "global_rank": 0,
            "start_step": 0,
            "resumed_from": None,
            **HEADER,
        },
        {"kind": "step", "epoch": 0, "gs": 1, "pos": [[0, 3]], "pad": 0},
        {"kind": "step", "epoch": 0, "gs": 2, "pos": [[3, 6]], "pad": 0},
    ],
    "20250101T000000-1-rank1.jsonl": [
        {
            "kind": "segment",
            "version": 1,
            "segment": "20250101T000000-1",
            "rank": 1,
            "started": 1.0,
            "global_rank": 1,
            "start_step": 0,
            "resumed_from": None,
            **HEADER,
        },
        {"kind": "step", "epoch": 0, "gs": 1, "pos": [[6, 9]], "pad": 0},
        {"kind": "step", "epoch": 0, "gs": 2, "pos": [[9, 12]], "pad": 0},
    ],
    "20250101T000100-2-rank0.jsonl": [
        {
            "kind": "segment",
            "version": 1,
            "segment": "20250101T000100-2",
            "rank": 0,
            "started": 2.0,
            "global_rank": 0,
            "start_step": 1,
            "resumed_from": "last.ckpt",
            **HEADER,
        },
        {"kind": "step", "epoch": 0, "gs": 2, "pos": [[3, 6]], "pad": 0},
        {"kind": "epoch_end", "epoch": 0, "gs": 2, "dropped": 0},
    ],
    "20250101T000100-2-rank1.jsonl": [
        {
            "kind": "segment",
            "version": 1,
            "segment": "20250101T000100-2",
            "rank": 1,
            "started": 2.0,
            "global_rank": 1,
            "start_step": 1,
            "resumed_from": "last.ckpt",
            **HEADER,
        },
        {"kind": "step", "epoch": 0, "gs": 2, "pos": [[9, 12]], "pad": 0},
        {"kind": "epoch_end", "epoch": 0, "gs": 2, "dropped": 0},
    ],
}


def test_a_trail_of_an_earlier_release_reads_and_cuts_the_killed_run_at_the_resumed_step(tmp_path: Path) -> None:
    for name, lines in OLD_TRAIL.items():
        (tmp_path / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (result,) = audit([tmp_path])
    assert (result.expected, result.consumed, result.duplicates, result.missing) == (12, 12, 0, 0)
    assert result.ok and result.complete


def test_what_the_writer_writes_reads_back_and_a_changed_seed_is_named(tmp_path: Path) -> None:
    for run, started, seed in (("first", 1.0, 5), ("second", 2.0, 6)):
        header = {**HEADER, "seed": seed, "started": started, "global_rank": 0, "start_step": 0}
        writer = AuditWriter(tmp_path / run, run, 0, {**header, "world_size": 1, "resumed_from": None})
        writer.step(0, 1, np.arange(12, dtype=np.int64), num_padding=0)
        writer.epoch_end(0, 1, dropped=0)
        writer.close()
    (first,) = audit([tmp_path / "first"])
    assert first.ok and first.complete and first.consumed == 12
    with pytest.raises(ValueError, match="audit: run second has seed=6 but run first has 5"):
        audit([tmp_path / "first", tmp_path / "second"])


def test_a_missing_draw_under_online_decisions_is_named_by_its_stream_phase_and_decision(tmp_path: Path) -> None:
    """One rank, 12 samples over streams a and b, a decision at step 2 from position 6 on (b only):
    a step that never trained position 7 leaves b's phase 1 short, and the table names the decision."""
    from lightning_sharding.mixture import Decision

    streams = [{"name": "a", "draws": 6}, {"name": "b", "draws": 6}]
    header = {**HEADER, "world_size": 1, "global_world_size": 1, "streams": streams, "decisions": []}
    writer = AuditWriter(tmp_path, "run", 0, {"started": 1.0, "global_rank": 0, "start_step": 0, **header})
    writer.step(0, 1, np.arange(0, 3), 0)
    writer.step(0, 2, np.arange(3, 6), 0)
    writer.decision(Decision(0, 6, {"b": 1.0}, 2).state())
    writer.step(0, 3, np.array([6, 8]), 0)
    writer.step(0, 4, np.arange(9, 12), 0)
    writer.epoch_end(0, 4, 0)
    writer.close()
    [result] = audit([tmp_path])
    table = format_audit([result])
    assert not result.ok and result.missing == 1, table
    assert [(s.name, s.expected, s.consumed) for s in result.streams] == [("a", 3, 3), ("b", 9, 8)], table
    assert "MISMATCH: stream 'b', phase 1 (the decision of step 2)" in table, table
    assert "stream 'a', phase" not in table, table
