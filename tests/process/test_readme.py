"""The code blocks of the README and of docs/, copied as a user would, run as written.

Each page runs in a folder of its own, its blocks in order: Python blocks as scripts, shell and
console blocks with bash, with this virtualenv's ``python``, ``lightning-sharding-train`` and
``lightning-sharding`` on the PATH. tests/support/doc_blocks.py says how a block continues another, names
its file, checks its printed output, or opts out with a reason. The README's first script is the
main example: it must train under DDP and serve every sample of both epochs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.doc_blocks import PAGES, ROOT, Step, needs, normalized, steps
from tests.support.extras import require

STEP_TIMEOUT = 420  # seconds for one script or shell block (a DDP example on a loaded 2-core machine: 220)
# The pages with most to run first, so that two test processes end together.
RUNNING = sorted(
    (page for page in PAGES if any(step.action != "write" for step in steps(page))),
    key=lambda page: -sum(step.action != "write" for step in steps(page)),
)


def page_env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIGHTNING_SHARDING_CACHE": str(tmp_path / "cache")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("MASTER_PORT", None)  # Lightning and torchrun --standalone pick a free port for each run
    return env


def run_step(step: Step, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if step.action == "shell":
        cmd = ["bash", "-euo", "pipefail", "-c", step.text]
    else:
        cmd = [sys.executable, step.path]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT)


def check_main_example(proc: subprocess.CompletedProcess[str]) -> None:
    """The README's example trains 2 epochs on 2 ranks: both summary rows consumed all 800 samples."""
    rows = [line.split() for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s+800\s", line)]
    assert [(r[0], r[2]) for r in rows] == [("0", "800"), ("1", "800")], proc.stdout[-2000:]


@pytest.mark.processes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", RUNNING, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_block_of_the_page_runs_as_written(tmp_path: Path, page: Path) -> None:
    require(*needs(page))
    env = page_env(tmp_path)
    scripts = 0
    for step in steps(page):
        where = ", ".join(block.where for block in step.blocks)
        if step.action in ("write", "script"):
            (tmp_path / step.path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / step.path).write_text(step.text + "\n")
        if step.action == "write":
            continue
        proc = run_step(step, tmp_path, env)
        shown = f"{where}:\n{step.text}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, f"exit status {proc.returncode} at {shown}"
        printed = normalized(proc.stdout)
        for line in step.expected:
            assert normalized(line) in printed, f"{where} did not print {line!r}:\n{proc.stdout[-3000:]}"
        if page.name == "README.md" and step.action == "script":
            scripts += 1
            if scripts == 1:
                check_main_example(proc)


@pytest.mark.timeout(60)
def test_the_trainer_free_examples_run_where_they_moved() -> None:
    """The Fabric and DCP loops left the README for the own-loop page: there they still run, killed
    and resumed (tests/process/test_loop_kills.py kills their pattern inside its saves)."""
    page = ROOT / "docs" / "how-to" / "own-loop.md"
    assert page in RUNNING
    commands = "\n".join(step.text for step in steps(page) if step.action == "shell")
    assert "python fabric_loop.py 12\npython fabric_loop.py" in commands
    assert "dcp_loop.py 12\ntorchrun --standalone --nproc-per-node 1 dcp_loop.py" in commands
