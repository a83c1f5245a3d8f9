"""The strategy that docs/how-to/own-strategy.md (once the README's "Your own strategy") writes against
the base classes passes the resume contract every built-in strategy passes
(tests/unit/test_strategy_contract.py), as copied from the page; tests/process/test_readme.py trains with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lightning_sharding.strategies.base as strategy_base
import tests.unit.test_strategy_contract as contract
from tests.support.harness import ROOT


def readme_strategy_source() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "how-to" / "own-strategy.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if 'name = "in_process"' in b]
    return block


@pytest.mark.parametrize(("before", "after", "read"), contract.TOPOLOGIES)
def test_the_readme_strategy_resumes_on_another_topology_serving_every_sample_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: int, after: int, read: int
) -> None:
    monkeypatch.setattr(strategy_base, "_REGISTRY", dict(strategy_base._REGISTRY))  # registered for this test only
    exec(compile(readme_strategy_source(), "docs/how-to/own-strategy.md", "exec"), {"__name__": "readme_strategy"})
    contract.test_a_checkpoint_resumes_on_another_topology_serving_every_sample_once(
        tmp_path, "in_process", before, after, read
    )
