"""Segments that several process tests start from, trained once a test session.

A session fixture runs once per pytest-xdist worker process; to train once a run, the first worker
to ask trains under a file lock in the run's shared temporary directory (the parent of each worker's
base directory) and the others wait for it and read the result, as pytest-xdist documents. A test
never resumes in the shared directory itself: ``check_resume(..., trained=...)`` copies it first.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from tests.support.harness import FIRST_2X2, FIRST_2X2_EVERY, FIRST_MIXTURE_2X2, first_segment, run_segment


def _train_first_2x2(out: Path) -> None:
    run_segment(out, "seg0", first_segment(FIRST_2X2, checkpoint_every=FIRST_2X2_EVERY), expect_death=True)


def _train_first_mixture_2x2(out: Path) -> None:
    run_segment(out, "seg0", first_segment(FIRST_MIXTURE_2X2, checkpoint_every=3), expect_death=True)


def _once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, train: Callable[[Path], None]) -> Path:
    """``train(directory)`` once a test run; the directory it filled. A failure is kept too, and
    raised again for every test that asks (rather than trained again)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: a session fixture runs once
        out = tmp_path_factory.mktemp(name, numbered=False)
        train(out)
        return out
    root = tmp_path_factory.getbasetemp().parent  # shared by the workers of this run only
    out, done, failed = root / name, root / f"{name}.done", root / f"{name}.failed"
    with FileLock(str(root / f"{name}.lock")):
        if failed.exists():
            pytest.fail(f"training the shared segment {name} failed (in another worker):\n{failed.read_text()}")
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            try:
                train(out)
            except BaseException as err:
                failed.write_text(f"{type(err).__name__}: {err}")
                raise
            done.write_text("")
    return out


@pytest.fixture(scope="session")
def trained_2x2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory where ``first_segment(FIRST_2X2, checkpoint_every=3)`` ran as segment ``seg0``
    (killed at step 6, its checkpoint at step 3 in ``checkpoints/``). Read it, or resume from a copy
    with ``check_resume(out, FIRST_2X2, then, checkpoint_every=3, trained=trained_2x2)``."""
    return _once_per_run(tmp_path_factory, "trained-first-2x2", _train_first_2x2)


@pytest.fixture(scope="session")
def trained_mixture_2x2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory where ``first_segment(FIRST_MIXTURE_2X2, checkpoint_every=3)`` ran as segment
    ``seg0`` (killed at step 6, its checkpoint at step 3 in ``checkpoints/``)."""
    return _once_per_run(tmp_path_factory, "trained-first-mixture-2x2", _train_first_mixture_2x2)
