"""The package root exports what a user writes in an example, in one sorted ``__all__``; every other
name lives in its module, and what the root exported before 0.2 trimmed it (0.1's names, and those 0.2
added before the trim) still imports from there for one release, with a DeprecationWarning naming its
home (lightning_sharding/_deprecated.py)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings

import pytest

import lightning_sharding
from lightning_sharding import _deprecated
from lightning_sharding._deprecated import RENAMED, ROOT_NAMES
from tests.support.harness import ROOT


def test_the_root_exports_one_sorted_list_of_at_most_25_names() -> None:
    names = lightning_sharding.__all__
    assert names == sorted(names)
    assert len([n for n in names if n != "__version__"]) <= 25, names
    assert len(set(names)) == len(names)
    # Written out as one literal list, which type checkers and the docs' tools read without running it.
    tree = ast.parse((ROOT / "lightning_sharding" / "__init__.py").read_text())
    assigned = [n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__"]
    assert len(assigned) == 1 and isinstance(assigned[0].value, ast.List)
    assert [ast.literal_eval(e) for e in assigned[0].value.elts] == names
    assert sorted(dir(lightning_sharding)) == sorted(names)


def test_every_exported_name_imports_without_a_warning() -> None:
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning);"
        "import lightning_sharding as ls; [getattr(ls, n) for n in ls.__all__]; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(ROOT_NAMES))
def test_a_name_the_root_no_longer_exports_still_imports_with_a_warning_naming_its_home(name: str) -> None:
    home = f"lightning_sharding.{ROOT_NAMES[name]}"
    assert name not in lightning_sharding.__all__
    _deprecated._warned.discard(name)  # warned once per process: as if for the first time
    with pytest.warns(DeprecationWarning, match=rf"lightning_sharding\.{name} .* import it from {home}"):
        value = getattr(lightning_sharding, name)
    new = RENAMED[name][1] if name in RENAMED else name  # a name 0.2 also gave a new word: the new name
    assert value is getattr(importlib.import_module(home), new)


def test_an_unknown_name_is_an_attribute_error_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
            lightning_sharding.NoSuchName  # noqa: B018


def test_a_dropped_name_warns_once_and_a_tool_probing_for_import_paths_finds_the_home() -> None:
    # jsonargparse (LightningCLI) writes a class by the shortest path its parents answer: were the root to
    # answer a dropped name, a saved config.yaml would name a path that the next release removes.
    from jsonargparse._util import get_import_path

    code = (
        "import warnings; warnings.simplefilter('always');"
        "from jsonargparse._util import get_import_path;"
        "from lightning_sharding.core.ledger import Ledger;"
        "from lightning_sharding.strategies.shard import ShardedLoader;"
        "from lightning_sharding.readers import FileReader;"
        "print(*(get_import_path(c) for c in (Ledger, ShardedLoader, FileReader)));"
        "import lightning_sharding as ls;"
        "w = warnings.catch_warnings(record=True); seen = w.__enter__();"
        "ls.Ledger; ls.Ledger; w.__exit__(None, None, None);"
        "print(len(seen), ls.Ledger is Ledger, 'Ledger' in vars(ls))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = proc.stdout.split("\n")
    assert lines[0].split() == [
        "lightning_sharding.core.ledger.Ledger",
        "lightning_sharding.strategies.shard.ShardedLoader",
        "lightning_sharding.readers.FileReader",
    ], proc.stderr[-3000:]
    assert "no longer exported" not in proc.stderr
    assert lines[1] == "1 True False", proc.stderr[-3000:]  # one warning for two uses; never cached in the root
    assert get_import_path(lightning_sharding.ShardedDataModule) == "lightning_sharding.ShardedDataModule"
