"""The layout docs/architecture.md promises: every module says what it is about, no import cycles,
the layers (the core imports no torch, Lightning or feature; strategies no Lightning; only
mixture/ reaches inside mixture/, only tokens/ inside tokens/; no order's type tested outside its
module), a strategy's rules only in its strategy, and no Lightning in what workers import. Each
layering rule is also run on a planted package that breaks it, so a rule that cannot fail is caught."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import ROOT

PACKAGE = ROOT / "lightning_sharding"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its body (inside functions too)."""
    # The package root only re-exports names lazily (its __getattr__).
    return {m for m in all_imports(name, path) if m in known and m not in (name, "lightning_sharding")}


def all_imports(name: str, path: Path) -> set[str]:
    """Every module name ``name`` imports anywhere (inside functions and ``TYPE_CHECKING`` too),
    absolute, with each ``from X import y`` counted as both ``X`` and ``X.y``."""
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
    return found


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
        "import sys, lightning_sharding.strategies as s, lightning_sharding.loading.keeper;"
        "import lightning_sharding.strategies.options;"
        "assert len(s.strategy_names()) >= 4;"  # loads every built-in strategy module
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# The core's only imports outside the standard library and itself.
CORE_MAY_IMPORT = {"numpy", "typing_extensions"}
ORDER_TYPES = (
    r"EpochOrder|MixtureOrder|MixtureChange|ChangedMixture|Mixture|StreamOrder|RestStream|PackedOrder|PackedEpochs"
)
# Where each order type is defined: the only place that may test for it.
ORDER_HOMES = ("lightning_sharding.core.order", "lightning_sharding.mixture.", "lightning_sharding.tokens.")
# The layers, lowest first: a module imports only modules of its own layer or of those below it, and
# nothing below the Lightning glue imports Lightning (the loading engine serves Fabric and torchrun loops).
LAYERS = {"core": 0, "distributed": 1, "readers": 2, "tokens": 3, "mixture": 4, "strategies": 5, "loading": 6}
LAYERS |= {"lightning": 7}
TOP = 8  # the entry points (config, recipes, cli, train) and the package root, which re-exports lazily
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def layer_of(module: str) -> int | None:
    """The layer of a module of the package (``None``: not the package's)."""
    parts = module.split(".")
    if parts[0] != "lightning_sharding":
        return None
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


# The features: kinds of order, each a package whose modules only it imports (the rest import the package).
FEATURES = ("mixture", "tokens")


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules ``name`` imports anywhere (inside functions and ``TYPE_CHECKING`` too): ``X`` of
    ``import X`` and of ``from X import y``, and ``X.y`` where that is a module of the package (``known``)."""
    found = all_imports(name, path)
    return {m for m in found if m in known or m.rpartition(".")[0] not in found}


def layering_violations(found: dict[str, Path]) -> list[str]:
    """Every import or type test of the package ``found`` (module name -> file) that breaks a layer."""
    out = []
    known = set(found) | set(modules())
    for name, path in found.items():
        imported = sorted(imported_modules(name, path, known))
        inside = name.split(".")[1] if "." in name else ""
        for module in imported:
            top = module.split(".")[0]
            core = module == "lightning_sharding.core" or module.startswith("lightning_sharding.core.")
            if inside == "core" and top == "lightning_sharding" and not core:
                out.append(f"{name} (core) imports {module}: the core knows no feature, strategy or glue")
            elif inside == "core" and top != "lightning_sharding":
                if top not in CORE_MAY_IMPORT and top not in sys.stdlib_module_names:
                    out.append(f"{name} (core) imports {module}: the core is pure (stdlib and numpy)")
            below, above = LAYERS.get(inside, TOP), layer_of(module)
            if top in LIGHTNING and below < LAYERS["lightning"]:
                out.append(f"{name} ({inside}) imports {module}: below the Lightning glue, nothing imports Lightning")
            elif above is not None and above > below and inside != "core":  # the core has its own rule
                out.append(f"{name} ({inside}) imports {module}: a layer imports only its own and those below it")
            for feature in FEATURES:
                if inside != feature and module.startswith(f"lightning_sharding.{feature}."):
                    out.append(f"{name} imports {module}: outside {feature}/, import from lightning_sharding.{feature}")
        if not name.startswith(ORDER_HOMES):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(rf"isinstance\([^)]*\b({ORDER_TYPES})\b", line):
                    out.append(f"{name}:{number} tests an order's type: {line.strip()}")
    return out


def test_the_layers_hold() -> None:
    assert layering_violations(modules()) == []


def test_the_layering_check_finds_a_planted_violation_of_each_rule(tmp_path: Path) -> None:
    planted = {
        "core/order.py": "import torch\n",
        "core/plan.py": "from lightning_sharding.mixture import Mixture\n",
        "core/ledger.py": "def f():\n    from lightning_sharding.strategies.shard import PlanSampler\n",
        "strategies/shard.py": "import lightning.pytorch as pl\n",
        "strategies/broadcast.py": "from lightning_sharding.loading.keeper import LedgerKeeper\n",
        "distributed/collectives.py": "from lightning_sharding.strategies.options import LoaderOptions\n",
        "loading/engine.py": "def f():\n    from lightning.pytorch.callbacks import Checkpoint\n",
        "loading/loop.py": "from lightning_sharding.lightning.datamodule import ShardedDataModule\n",
        "readers/tar.py": "import lightning_fabric\n",
        "cli/plan.py": "from lightning_sharding.mixture.order import MixtureOrder\n",
        "lightning/datamodule.py": "from lightning_sharding.tokens.packing import Packing\n",
        "tokens/reader.py": "from lightning_sharding.tokens.batch import packed_batch\nisinstance(o, PackedOrder)\n",
        "lightning/keeper.py": "ok = isinstance(order, MixtureOrder)\n",
        "mixture/change.py": "from lightning_sharding.mixture.order import Mixture\nok = isinstance(o, Mixture)\n",
        "core/manifest.py": "import numpy as np\nimport json\nfrom lightning_sharding.core.order import EpochOrder\n",
    }
    found = {}
    for relative, code in planted.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
        found["lightning_sharding." + relative.removesuffix(".py").replace("/", ".")] = path
    violations = layering_violations(found)
    for culprit in ["core.order (core) imports torch", "core.plan (core) imports lightning_sharding.mixture"]:
        assert any(culprit in v for v in violations), culprit
    assert any("core.ledger (core) imports lightning_sharding.strategies.shard" in v for v in violations)
    assert any(
        "strategies.shard (strategies) imports lightning.pytorch: below the Lightning glue" in v for v in violations
    )
    upward = "a layer imports only its own and those below it"
    for culprit in [
        "strategies.broadcast (strategies) imports lightning_sharding.loading.keeper",
        "distributed.collectives (distributed) imports lightning_sharding.strategies.options",
        "loading.loop (loading) imports lightning_sharding.lightning.datamodule",
    ]:
        assert any(v.startswith(f"lightning_sharding.{culprit}: {upward}") for v in violations), culprit
    assert any("loading.engine (loading) imports lightning.pytorch.callbacks: below the" in v for v in violations)
    assert any("readers.tar (readers) imports lightning_fabric: below the Lightning glue" in v for v in violations)
    assert any("cli.plan imports lightning_sharding.mixture.order" in v for v in violations)
    assert any("lightning.datamodule imports lightning_sharding.tokens.packing" in v for v in violations)
    assert any("lightning.keeper:1 tests an order's type" in v for v in violations)
    # What the rules allow: mixture/ reaching inside itself, the core importing the core, numpy, stdlib.
    assert not any(m in v for m in ("mixture.change", "core.manifest", "tokens.reader") for v in violations), violations
    assert len(violations) == 12, violations


def test_the_top_level_holds_only_folders_the_root_the_entry_and_the_version() -> None:
    loose = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if p.is_file()
        and p.suffix == ".py"
        and p.name not in ("__init__.py", "__main__.py", "_version.py", "_deprecated.py", "train.py")
    )
    assert loose == [], f"modules at the package's top level, not in a folder: {loose}"


def test_the_architecture_page_names_every_module() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = [
        str(path.relative_to(PACKAGE)) for path in modules().values() if f"`{path.relative_to(PACKAGE)}`" not in page
    ]
    assert unnamed == [], f"modules docs/architecture.md does not name: {unnamed}"
