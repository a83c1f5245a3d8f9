"""The docs say what the code does: every block is runnable or says why not, every message of the
troubleshooting page is one the code raises, every public name has a reference entry, and every
test, benchmark or module path the pages name exists. (tests/process/test_readme.py runs the blocks.)
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from tests.doc_blocks import PAGES, ROOT, blocks, normalized, steps
from tests.extras import EXTRA_OF

DOCS = ROOT / "docs"
PACKAGE = ROOT / "lightning_sharding"
MIN_LITERAL = 15  # a message template with less fixed text than this would match anything


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_block_runs_or_says_why_not(page: Path) -> None:
    steps(page)  # a malformed marker, or an output block after nothing that runs, raises here
    for block in blocks(page):
        for module in block.markers.get("needs", "").split():
            assert module in EXTRA_OF, f"{block.where}: needs {module!r}, which tests/extras.py names no extra for"
        runnable = block.lang in ("python", "py", "bash", "sh", "shell", "console")
        if runnable and "skip" not in block.markers and "file" not in block.markers:
            assert ".venv/bin/" not in block.text, f"{block.where}: a block that runs uses the PATH, not .venv/bin"


def test_the_readme_example_is_the_one_getting_started_writes() -> None:
    """getting-started.md writes squares.py without running it, since the README's test runs the same code."""
    readme = [b for b in blocks(ROOT / "README.md") if b.lang == "python"]
    page = [b for b in blocks(DOCS / "getting-started.md") if b.lang == "python"]
    squares = [page[0].text, *[b.text for b in page[1:] if b.text.startswith("# (continued)")]]
    assert page[0].title == "squares.py" and "file" in page[0].markers
    assert [b.text for b in readme[: len(squares)]] == squares


def _pattern(node: ast.expr) -> str:
    """A regular expression for the messages an f-string (or a sum of them) can produce."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(re.sub(r"\s+", " ", node.value))
    if isinstance(node, ast.JoinedStr):
        return "".join(_pattern(part) if not isinstance(part, ast.FormattedValue) else "(.*?)" for part in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _pattern(node.left) + _pattern(node.right)
    if isinstance(node, ast.IfExp):
        return f"(?:{_pattern(node.body)}|{_pattern(node.orelse)})"
    return "(.*?)"


def _message_patterns() -> list[re.Pattern[str]]:
    """What the package raises and warns: one pattern per message with enough fixed text to tell it."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            call = node.exc if isinstance(node, ast.Raise) else node
            if isinstance(call, ast.Call) and call.args:
                pattern = _pattern(call.args[0])
                if len(re.sub(r"\(\.\*\?\)|\\", "", pattern)) >= MIN_LITERAL:
                    found.append(re.compile(pattern))
    return found


def test_every_message_of_the_troubleshooting_page_is_one_the_code_raises() -> None:
    patterns = _message_patterns()
    messages = [b for b in blocks(DOCS / "troubleshooting.md") if b.lang == "text" and "skip" not in b.markers]
    assert len(messages) >= 40
    for block in messages:
        text = normalized(block.text)
        assert any(p.fullmatch(text) for p in patterns), (
            f"{block.where}: no raise or warning of the package says {text!r}"
        )


def _documented() -> set[int]:
    """The objects the ``::: name`` entries of docs/reference/ render (by id)."""
    found = set()
    for page in (DOCS / "reference").glob("*.md"):
        for entry in re.findall(r"^::: (\S+)", page.read_text(), re.M):
            parts = entry.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    value = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attribute in parts[cut:]:
                    value = getattr(value, attribute)
                found.add(id(value))
                break
    return found


@pytest.mark.parametrize(
    "module",
    ["lightning_sharding", "lightning_sharding.readers", "lightning_sharding.strategies", "lightning_sharding.config"],
)
def test_every_public_name_has_an_api_reference_entry(module: str) -> None:
    documented = _documented()
    namespace = importlib.import_module(module)
    for name in namespace.__all__:
        if name.startswith("_") or name.isupper():  # __version__, and constants such as CONF_DIR
            continue
        assert id(getattr(namespace, name)) in documented, f"{module}.{name} has no '::: ' entry in docs/reference/"


PATH_IN_TEXT = re.compile(
    r"`((?:tests|benchmarks|lightning_sharding|docs|recipes)/[\w/.-]+?\.(?:py|md|yaml|png))(?:::(\w+))?`"
)


@pytest.mark.parametrize(
    "page", [p for p in PAGES if p.name != "architecture.md"], ids=lambda page: str(page.relative_to(ROOT))
)  # architecture.md names modules relative to the package (``recipes/data.py``), not to the repository
def test_every_file_and_test_a_page_names_exists(page: Path) -> None:
    for path, test in PATH_IN_TEXT.findall(page.read_text()):
        assert (ROOT / path).exists(), f"{page.relative_to(ROOT)} names {path}, which does not exist"
        if test:
            assert f"def {test}(" in (ROOT / path).read_text(), f"{page.relative_to(ROOT)} names {path}::{test}"


def test_the_readmes_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
