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

from tests.support.doc_blocks import PAGES, ROOT, blocks, normalized, steps
from tests.support.extras import EXTRA_OF

DOCS = ROOT / "docs"
PACKAGE = ROOT / "lightning_sharding"
MIN_LITERAL = 15  # a message template with less fixed text than this would match anything


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_block_runs_or_says_why_not(page: Path) -> None:
    steps(page)  # a malformed marker, or an output block after nothing that runs, raises here
    for block in blocks(page):
        for module in block.markers.get("needs", "").split():
            assert module in EXTRA_OF, (
                f"{block.where}: needs {module!r}, which tests/support/extras.py names no extra for"
            )
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


# What a message may advise that only a Python user can follow (the situation arises only there).
PYTHON_ONLY = {"reader", "datamodule", "cache_limit"}
DATA_GROUPS = (None, "files", "months", "mixture", "tokens", "pretrain", "images", "sqlite")
HYDRA_GROUPS = {"data", "sharding", "trainer", "model", "callbacks", "logger", "recipe"}


def _composes(override: str) -> bool:
    """Whether ``lightning-sharding-train`` takes ``override`` with some choice of the data group."""
    from hydra import compose, initialize_config_dir

    from lightning_sharding.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for group in DATA_GROUPS:
            try:
                compose("train", overrides=[*([f"data={group}"] if group else []), override])
                return True
            except Exception:  # noqa: BLE001 - not with this data option
                continue
    return False


def _python_options() -> set[str]:
    """The arguments a Python user can pass where these messages are raised."""
    import inspect

    import lightning_sharding.readers as readers
    from lightning_sharding import ShardedData, ShardedDataModule

    names = set(inspect.signature(ShardedDataModule).parameters) | set(inspect.signature(ShardedData).parameters)
    for name in readers.__all__:
        value = getattr(readers, name)
        if inspect.isclass(value):
            names |= set(inspect.signature(value).parameters)
    return names


def test_every_option_the_troubleshooting_page_advises_is_settable_where_the_message_is_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each `name=value` a message advises works where it is raised: a Hydra override
    (`data.on_error=skip`) is taken by lightning-sharding-train, a Python argument (`on_error='skip'`) is
    one the API takes, and that same advice raised under lightning-sharding-train is spelled as an
    override the command takes."""
    from lightning_sharding.core import spelling

    messages = [b for b in blocks(DOCS / "troubleshooting.md") if b.lang == "text" and "skip" not in b.markers]
    advice = re.compile(r"\b(?:pass|use|set|Resume with|give its old and new roots:) `?([\w.]+)=([^\s`,;)]+)")
    python_options = _python_options()
    checked: list[str] = []
    for block in messages:
        for name, value in advice.findall(normalized(block.text)):
            value = value.rstrip(".")
            if name.startswith(("data.", "trainer.", "sharding.")) or name in HYDRA_GROUPS:
                assert _composes(f"{name}={value}"), f"{block.where}: lightning-sharding-train refuses {name}={value}"
            else:
                assert name in python_options, f"{block.where}: {name}= is no argument of the Python API"
                if name in PYTHON_ONLY:
                    continue
                monkeypatch.setenv(spelling.ENV, "hydra")
                literal = ast.literal_eval(value) if value not in ("...",) else value
                override = spelling.option(name, literal)
                monkeypatch.delenv(spelling.ENV)
                assert _composes(override), f"{block.where}: under lightning-sharding-train it would say {override}"
            checked.append(name)
    for expected in ("allow_data_change", "allow_mixture_change", "on_error", "halo", "data.on_error"):
        assert expected in checked, f"the page no longer shows advice of {expected}: {sorted(set(checked))}"
    # And the package spells such advice through spelling.option, never as a Python literal.
    python = {name for name in checked if "." not in name and name not in HYDRA_GROUPS | PYTHON_ONLY}
    literal = re.compile(rf"\b(?:pass|use|or) `?(?:{'|'.join(sorted(python))})=")
    for path in PACKAGE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not literal.search(line), f"{path.relative_to(ROOT)}:{number} spells advice for Python only: {line}"


@pytest.mark.needs("pymdownx")
def test_the_sites_stylesheet_wraps_text_blocks_and_no_code() -> None:
    """docs/stylesheets/extra.css wraps the lines of a ```text block (a message, an output), which run
    past a 1280 px page, by the class that mkdocs.yml's pymdownx.highlight gives text blocks and no
    code block; it is the one stylesheet mkdocs.yml adds."""
    import markdown
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["extra_css"] == ["stylesheets/extra.css"]
    css = (DOCS / "stylesheets" / "extra.css").read_text()
    wrapped = re.search(r"\.([\w-]+) pre > code \{[^}]*white-space: pre-wrap", css)
    assert wrapped is not None, "extra.css wraps no block"
    extensions = [e for e in config["markdown_extensions"] if "highlight" in str(e) or "superfences" in str(e)]
    names = [next(iter(e)) if isinstance(e, dict) else e for e in extensions]
    options = {next(iter(e)): next(iter(e.values())) for e in extensions if isinstance(e, dict)}
    page = markdown.Markdown(extensions=names, extension_configs=options)
    for lang in ("text", "python", "console", "bash", "yaml"):
        page.reset()
        html = page.convert(f"```{lang}\nx = 1\n```")
        assert (f'class="{wrapped.group(1)} highlight"' in html) == (lang == "text"), html
