"""The code blocks of README.md and docs/, read as a page's steps, for the tests that run them.

A page runs in a folder of its own, its blocks in order:

- ```python (or ```py): a script, run with ``python FILE``. A block whose first line is
  ``# (continued)`` continues the script before it. ``title="NAME.py"`` names the file, so a later
  block can import it or run it.
- ```bash (or ```sh, ```shell): run with ``bash -euo pipefail``.
- ```console: its ``$ `` lines (with ``\\`` continuations) are run the same way; the rest is output.
- Any other block (```text, ```yaml...) is not run. One with ``title="PATH"`` is written to PATH.

HTML comments on the lines just before a block's fence change that, and say why:

- ``<!-- docs-test: skip (reason) -->``: not run (it needs a GPU, a cloud account, a second node...).
- ``<!-- docs-test: file (reason) -->``: written to its ``title`` path, not run (later blocks run it).
- ``<!-- docs-test: needs MODULE ... -->``: the page runs only where MODULE is installed; elsewhere
  the test skips naming the extra, as tests/support/extras.py does (and fails under CI, which has them all).
- ``<!-- docs-test: output -->`` on an output block (```text, or a ```console block's output lines):
  each of its lines must appear, spaces aside, in what the step before it (or its own commands) printed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SCRIPT = ("python", "py")
SHELL = ("bash", "sh", "shell")
KINDS = ("skip", "file", "needs", "output")
MARKER = re.compile(r"^<!-- docs-test: (\w+)(?: (.*?))? -->$")
FENCE = re.compile(r"^```(\S*)(.*)$")
TITLE = re.compile(r'title="([^"]+)"')


@dataclass
class Block:
    """One fenced block: where it is, its language, its ``title`` and its docs-test marker."""

    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    title: str | None
    text: str
    markers: dict[str, str] = field(default_factory=dict)  # skip | file | needs | output -> reason or modules

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        kind = self.lang in SCRIPT or self.lang in SHELL or self.lang == "console"
        return kind and "skip" not in self.markers and "file" not in self.markers


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, in order; a malformed marker is a ValueError naming its line."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a code block that never closes")
        title = TITLE.search(opening.group(2))
        block = Block(page, i + 1, opening.group(1), title.group(1) if title else None, "\n".join(lines[i + 1 : end]))
        k = i - 1
        while k >= 0 and lines[k].startswith("<!-- docs-test"):
            marker = MARKER.match(lines[k].strip())
            if marker is None or marker.group(1) not in KINDS:
                raise ValueError(f"{block.where}: {lines[k]!r} is not <!-- docs-test: {'|'.join(KINDS)} ... -->")
            if marker.group(1) in ("skip", "file") and not marker.group(2):
                raise ValueError(f"{block.where}: {lines[k]!r} gives no reason")
            block.markers[marker.group(1)] = (marker.group(2) or "").strip()
            k -= 1
        found.append(block)
        i = end + 1
    return found


@dataclass
class Step:
    """What the test does for one or more blocks: write a file, run a script or a shell command."""

    action: str  # "write" | "script" | "shell"
    path: str  # the file written or run ("" for a shell step)
    text: str
    blocks: list[Block]
    expected: list[str] = field(default_factory=list)  # output lines that must appear


def console_commands(text: str) -> tuple[str, list[str]]:
    """A console block's commands (joined into one shell script) and its output lines."""
    commands: list[str] = []
    output: list[str] = []
    continued = False
    for line in text.splitlines():
        if continued or line.startswith("$ "):
            commands.append(line[2:] if line.startswith("$ ") and not continued else line)
            continued = line.endswith("\\")
        else:
            output.append(line)
    return "\n".join(commands), output


def steps(page: Path) -> list[Step]:
    """The page's steps, in order (README.md's first two bash blocks are CI's, and marked skip)."""
    plan: list[Step] = []
    for block in blocks(page):
        if "output" in block.markers and block.lang != "console":  # what the step before printed
            if not plan or plan[-1].action == "write":
                raise ValueError(f"{block.where}: an output block must follow a block that runs")
            plan[-1].expected += [line for line in block.text.splitlines() if line.strip()]
        elif block.lang in SCRIPT and "skip" not in block.markers:
            if block.text.startswith("# (continued)"):
                previous = next((s for s in reversed(plan) if s.action != "shell" and s.path.endswith(".py")), None)
                if previous is None:
                    raise ValueError(f"{block.where}: '# (continued)' with no script before it")
                previous.text += "\n" + block.text
                previous.blocks.append(block)
                continue
            path = block.title or f"block_{block.line}.py"
            plan.append(Step("write" if "file" in block.markers else "script", path, block.text, [block]))
        elif block.lang in SHELL and block.runs:
            plan.append(Step("shell", "", block.text, [block]))
        elif block.lang == "console" and block.runs:
            commands, output = console_commands(block.text)
            expected = [line for line in output if line.strip()] if "output" in block.markers else []
            plan.append(Step("shell", "", commands, [block], expected))
        elif block.title is not None and "skip" not in block.markers:
            plan.append(Step("write", block.title, block.text, [block]))
    return plan


def needs(page: Path) -> list[str]:
    """The modules the page's blocks need."""
    return [m for b in blocks(page) for m in b.markers.get("needs", "").split()]


def normalized(text: str) -> str:
    return " ".join(text.split())
