"""A kill at any moment, also inside a save, on the pattern of docs/how-to/own-loop.md's examples.

tests/jobs/loop_job.py saves and resumes with that page's ``checkpoints.py`` as the page writes it
(``docs``): every save into a new directory ``ckpt/step-<steps>``, a resume from the newest complete
one, the last two kept. Each chain SIGKILLs the job inside a save, resumes on 1 rank, is killed inside
another save, and resumes on 2 ranks to the end. The model counts in its weights how often each
sample's gradient was applied: every complete checkpoint's ledger must hold exactly the samples its
weights hold, and each epoch's end weights every sample once.

200 samples in batches of 8, a step per batch and a checkpoint every 3 steps: 13 steps an epoch on 2
ranks, 25 on 1. Segment a (2 ranks) is killed in the save of step 9 and leaves 3 and 6 complete; b
resumes from 6 on 1 rank, saves 9 again over what the kill left, and 12, and is killed in the save of
15; c resumes from 12 on 2 ranks (4 steps left of epoch 0, 13 of epoch 1) and trains to the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.jobs.loop_job import docs_checkpoints
from tests.process.test_loops import SIZES, assert_epoch_ends, assert_ledger_matches_weights, manifest_of, run_loop
from tests.support.doc_blocks import ROOT, blocks

PAGE = ROOT / "docs" / "how-to" / "own-loop.md"
DONE = {"dcp": ".metadata", "fabric": "complete"}  # the file that makes a checkpoint complete (checkpoints.py)


def complete(out: Path, save: str) -> list[int]:
    """The steps of the complete checkpoints in ``out``."""
    return sorted(int(p.name[5:]) for p in (out / "ckpt").glob("step-*") if (p / DONE[save]).exists())


def segment(out: Path, name: str, save: str, ranks: int, kill: dict[str, Any] | None = None, **loop: Any) -> list[int]:
    """Run a segment (killed inside a save if ``kill``); check that every complete checkpoint's ledger
    matches its weights; their steps."""
    options = dict(docs=True, save=save, save_every=3, workers=1, ranks=ranks, kill_in_save=kill)
    run_loop(out, name, expect_death=kill is not None, **options, **loop)
    manifest = manifest_of(None, None)
    for step in complete(out, save):
        path = out / "ckpt" / f"step-{step:06d}"
        assert_ledger_matches_weights(path if save == "dcp" else path / "state.ckpt", manifest, sum(SIZES), out / "tmp")
    return complete(out, save)


def files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_dcp_loop_killed_inside_its_saves_resumes_from_the_newest_complete_checkpoint_exactly_once(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    # Rank 1 has written its part of step 9's checkpoint; rank 0 waits for it to write .metadata.
    kill = {"step": 9, "rank": 1, "moment": "dcp parts"}
    assert segment(tmp_path, "a", "dcp", 2, kill, launcher="torchrun") == [3, 6]
    assert "__1_0.distcp" in files(ckpt / "step-000009") and ".metadata" not in files(ckpt / "step-000009")
    # Every part of step 15's checkpoint and its .metadata.tmp are written; the rename is not done.
    kill = {"step": 15, "rank": 0, "moment": "dcp metadata"}
    assert segment(tmp_path, "b", "dcp", 1, kill, launcher="torchrun") == [9, 12]  # 3 and 6 removed
    assert ".metadata.tmp" in files(ckpt / "step-000015") and ".metadata" not in files(ckpt / "step-000015")
    assert segment(tmp_path, "c", "dcp", 2, launcher="torchrun") == [24, 27]
    assert files(ckpt) == ["step-000024", "step-000027"]  # what the kills left was saved over, then removed
    assert_epoch_ends(tmp_path, ["a", "b", "c"], manifest_of(None, None), sum(SIZES), epochs=2)


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_fabric_loop_killed_inside_its_saves_resumes_from_the_newest_complete_checkpoint_exactly_once(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    # Half of step 9's file is at its path, as a copy into place leaves it.
    kill = {"step": 9, "rank": 0, "moment": "fabric write"}
    assert segment(tmp_path, "a", "fabric", 2, kill, launcher="fabric") == [3, 6]
    assert files(ckpt / "step-000009") == ["state.ckpt"]
    with pytest.raises(RuntimeError):
        torch.load(ckpt / "step-000009" / "state.ckpt", weights_only=True)
    # Step 15's file is whole, but the job is killed before fabric.save returned.
    kill = {"step": 15, "rank": 0, "moment": "fabric written"}
    assert segment(tmp_path, "b", "fabric", 1, kill, launcher="fabric") == [9, 12]  # 3 and 6 removed
    assert files(ckpt / "step-000015") == ["state.ckpt"]
    torch.load(ckpt / "step-000015" / "state.ckpt", weights_only=True)
    assert segment(tmp_path, "c", "fabric", 2, launcher="fabric") == [24, 27]
    assert files(ckpt) == ["step-000024", "step-000027"]
    assert_epoch_ends(tmp_path, ["a", "b", "c"], manifest_of(None, None), sum(SIZES), epochs=2)


@pytest.mark.timeout(60)
def test_the_pages_examples_save_and_resume_with_the_helpers_the_job_runs() -> None:
    checkpoints = docs_checkpoints()  # the page's checkpoints.py, which the job above runs
    assert (checkpoints.DCP_DONE, checkpoints.FABRIC_DONE) == (DONE["dcp"], DONE["fabric"])
    scripts = {b.title: b.text for b in blocks(PAGE) if b.title in ("fabric_loop.py", "dcp_loop.py")}
    for script, kind in (("fabric_loop.py", "fabric"), ("dcp_loop.py", "dcp")):
        text = scripts[script]
        assert f"from checkpoints import {kind}_resume, {kind}_save" in text, script
        assert f"{kind}_resume(" in text and text.count(f"{kind}_save(") == 2, script
        assert ".save(" not in text, f"{script} saves other than by checkpoints.py"
    # lightning.fabric would import lightning.pytorch with it (the lightning package imports both)
    assert "from lightning_fabric import Fabric" in scripts["fabric_loop.py"]
    assert "lightning.fabric" not in scripts["fabric_loop.py"]
