"""Every fit sweeps /dev/shm of what dead runs left (batch slots, shared arrays), with or without
workers: before, only making a slot pool swept, and a resume with 0 workers makes none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lightning_sharding import ShardedDataModule, SyntheticReader
from lightning_sharding.strategies._shared_memory import process_token


def dead_owner_token() -> str:
    """``<pid>.<start time>`` of a process that has exited, as a SIGKILLed training process leaves its names."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    token = process_token(child.pid)
    child.wait()
    assert token is not None and process_token(child.pid) != token
    return token


def test_setting_up_a_fit_without_workers_sweeps_what_a_killed_run_left() -> None:
    stale = Path("/dev/shm") / f"lsh-killedrun-{dead_owner_token()}-t0-w0.1-s0-g0"
    live = Path("/dev/shm") / f"lsh-liverun-{process_token()}-t0-w0.1-s0-g0"  # this process's: kept
    stale.write_bytes(b"\0" * 4096)
    live.write_bytes(b"\0" * 4096)
    try:
        dm = ShardedDataModule(SyntheticReader(num_items=2, samples_per_item=8), batch_size=4, num_workers=0)
        dm.setup("fit")
        assert not stale.exists(), "the file of a dead run is still in /dev/shm after setup('fit')"
        assert live.exists(), "a live process's file was swept"
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)
