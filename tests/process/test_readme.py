"""The README's Python examples, copied as a user would, run as written.

Each ```python block is one script, except that a block whose first line is ``# (continued)``
continues the block before it. The first script is the main example: it must train under DDP and
serve every sample of both epochs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT, free_port


def readme_scripts() -> list[str]:
    scripts: list[str] = []
    for block in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S):
        if block.startswith("# dispatch example"):  # tests/process/test_dispatch.py runs it, with its database
            continue
        if block.startswith("# (continued)") and scripts:
            scripts[-1] += "\n" + block
        else:
            scripts.append(block)
    return scripts


def run_script(source: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "example.py"
    script.write_text(source)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["LIGHTNING_SHARDING_CACHE"] = str(tmp_path / "cache")
    cmd = [sys.executable, str(script)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_readme_main_example_runs_as_copied(tmp_path: Path) -> None:
    proc = run_script(readme_scripts()[0], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s+800\s", line)]
    assert [(r[0], r[2]) for r in rows] == [("0", "800"), ("1", "800")], proc.stdout[-2000:]


@pytest.mark.processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("number", range(1, len(readme_scripts())))
def test_every_other_readme_example_runs_as_copied(tmp_path: Path, number: int) -> None:
    proc = run_script(readme_scripts()[number], tmp_path)
    assert proc.returncode == 0, f"README example {number}:\n{readme_scripts()[number]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"README example {number} printed nothing"
