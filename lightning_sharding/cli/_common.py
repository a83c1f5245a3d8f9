"""What every subcommand shares: one-line user errors, integer arguments, ``--plot`` files."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

PROG = "lightning-sharding"


class CliError(Exception):
    """A user error: printed as one line on stderr, exit status 2, no traceback."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, so ``main`` prints one line and returns."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see `{self.prog} --help`)", prog=self.prog)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small: it must be {low} or more")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _check_plot_path(text: str | None) -> Path | None:
    """``--plot``'s path, checked before any work: its directory must exist."""
    if text is None:
        return None
    path = Path(text)
    if path.is_dir():
        raise CliError(f"--plot {text}: is a directory; give an image file name such as plan.png")
    if not path.parent.is_dir():
        raise CliError(f"--plot {text}: the directory {path.parent} does not exist")
    return path


def _require_matplotlib(path: Path) -> None:
    """Refuse ``--plot`` where matplotlib is missing, before the work whose result it would draw."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise CliError(
            f"--plot {path}: drawing a plot needs matplotlib, which is not installed: "
            'pip install "lightning-sharding[plot]"'
        )


def _draw(function: Callable[..., None], path: Path, *args: Any) -> None:
    from lightning_sharding.cli.plots import MatplotlibMissingError

    try:
        function(path, *args)
    except MatplotlibMissingError as err:
        raise CliError(str(err)) from None
    except (OSError, ValueError) as err:
        raise CliError(f"--plot {path}: {err}") from None


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"
