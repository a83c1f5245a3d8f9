"""The README's Python example, copied as a user would, runs under DDP and serves every sample."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT, free_port


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_readme_example_runs_as_copied(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    # The dispatch example is a script of its own (tests/test_dispatch.py runs it).
    blocks = [b for b in blocks if not b.startswith("# dispatch example")]
    assert len(blocks) >= 2, "the README lost its example"
    script = tmp_path / "example.py"
    script.write_text("\n".join(blocks))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s+800\s", line)]
    assert [(r[0], r[2]) for r in rows] == [("0", "800"), ("1", "800")], proc.stdout[-2000:]
