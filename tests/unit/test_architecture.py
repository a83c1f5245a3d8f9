"""The layout docs/architecture.md promises: every module says what it is about, no import cycles,
a strategy's rules only in its strategy, and no Lightning in what workers import."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT

PACKAGE = ROOT / "lightning_sharding"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its body (inside functions too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    # The package root only re-exports names lazily (its __getattr__).
    return {m for m in found if m in known and m not in (name, "lightning_sharding")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_every_module_names_what_it_is_about() -> None:
    # Cohesion, not length, shapes a module (the 300-line cap is gone): its docstring names its one thing.
    silent = [name for name, path in modules().items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert silent == [], f"modules without a docstring saying what they are about: {silent}"


def test_no_import_cycle_inside_the_package() -> None:
    found = modules()
    graph = {name: imports(name, path, set(found)) for name, path in found.items()}
    assert cycles(graph) == []
    # The check finds a cycle where there is one.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_strategy_rules_live_only_in_the_strategies() -> None:
    pattern = re.compile(r"strategy\s*[!=]=|isinstance\([^)]*(DispatchLoader|BroadcastLoader|DaliLoader|ShardedLoader)")
    outside = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in modules().values()
        if "strategies" not in path.parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert outside == []


@pytest.mark.timeout(60)
def test_what_workers_import_imports_no_lightning() -> None:
    code = (
        "import sys, lightning_sharding.strategies as s, lightning_sharding.lightning.keeper;"
        "import lightning_sharding.core.options;"
        "assert len(s.strategy_names()) >= 4;"  # loads every built-in strategy module
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
