"""What every subcommand shares: one-line user errors, integer arguments, data files, ``--plot`` files."""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from lightning_sharding.core.private import redact_url

PROG = "lightning-sharding"
#: The file reader format (``FILE_READERS``' names) of each data file extension.
FORMATS = {".tar": "tar", ".jsonl": "jsonl", ".parquet": "parquet", ".npy": "npy"}


class CliError(Exception):
    """A user error: printed as one line on stderr, exit status 2, no traceback."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, so ``main`` prints one line and returns."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see `{self.prog} --help`)", prog=self.prog)


def storage_options(text: str | None) -> dict[str, Any]:
    """The fsspec options of ``--storage-options JSON`` (``{}`` when not given), or a CliError
    naming the text that is no JSON object."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as err:
        raise CliError(f"--storage-options is not JSON ({err}): {text!r}") from None
    if not isinstance(options, dict):
        raise CliError(f"--storage-options must be a JSON object, not {text!r}")
    return options


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


def data_files(data: Sequence[str], fmt: str | None = None) -> tuple[list[str], str]:
    """The data files named on a command line (paths, URLs or globs, as a file reader takes them;
    a local directory stands for its files of one format) and their format: ``fmt``, else their
    extension. What cannot be told is a :class:`CliError` naming the argument and what to give."""
    for entry in data:
        if "://" not in entry and not glob.has_magic(entry) and not os.path.exists(entry):
            raise CliError(f"{entry!r} names no file or directory: give data files as paths, globs or URLs")
    urls = [_directory_files(entry, fmt) if os.path.isdir(entry) else entry for entry in data]
    if fmt is not None:
        return urls, fmt
    guessed = [FORMATS.get("." + _name(url).rpartition(".")[2].lower()) for url in urls]
    shown = " ".join(redact_url(url) for url in urls)
    found = {f for f in guessed if f is not None}
    if None in guessed:
        formats = ", ".join(sorted(set(FORMATS.values())))
        raise CliError(f"cannot tell the format of {shown} from its extension: give --format ({formats})")
    if len(found) > 1:
        kinds = ", ".join(sorted(found))
        raise CliError(f"{shown} are files of {len(found)} formats ({kinds}): name the files of one format at a time")
    return urls, found.pop()


def _directory_files(directory: str, fmt: str | None) -> str:
    """The glob of a local directory's data files: those of format ``fmt``, else of the one format there."""
    extension = {f: e for e, f in FORMATS.items()}
    if fmt is not None:
        return os.path.join(directory, f"*{extension[fmt]}")
    there = sorted({FORMATS[e] for e in (Path(n).suffix.lower() for n in os.listdir(directory)) if e in FORMATS})
    if len(there) != 1:
        holds = f"files of {len(there)} formats ({', '.join(there)})" if there else "no data file"
        example = os.path.join(directory, f"*{extension[there[0]] if there else '.tar'}")
        raise CliError(f"{directory} holds {holds}: give a glob of its data files, such as '{example}'")
    return os.path.join(directory, f"*{extension[there[0]]}")


def _name(url: str) -> str:
    """The file name of a URL or path, without a query (a signed URL's)."""
    return url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]


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
