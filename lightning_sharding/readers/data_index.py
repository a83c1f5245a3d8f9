"""An index written with the data: ``lightning-sharding index DATA_URL``.

A job's first start indexes every file it lists (a tar shard's headers, a JSONL file's lines). An
index written once beside the data, as LitData's and Streaming's converted formats carry one, lets
every later job on any machine read it instead: one listing and a few reads, then no file is
opened before training reads it.

It is a directory ``lightning_sharding.index`` (:data:`INDEX_DIR`) in the files' common directory
(or where ``--output`` says), holding ``meta.json`` and a subdirectory of the arrays of a
:class:`~lightning_sharding.readers.index.ListingIndex` (one ``.npy`` per array). ``meta.json``
names the arrays' subdirectory, the reader's format and options, and per file its name relative to
the index's directory, its fingerprint (size and modification time or ETag) and content id. A
rewrite uploads new arrays first and ``meta.json`` last, so a reader sees the old index or the new.

A reader (``data_index=`` of :class:`~lightning_sharding.readers.files.FileReader`) takes a file's
index from it when the file is unchanged: the same fingerprint, or the same content id (an ETag the
listing gives, or for a local file copied or touched since, a digest of its bytes). A file changed
since, or not in the index, is indexed as if there were none, and a warning names it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from lightning_sharding.core.identity import common_root
from lightning_sharding.core.private import dir_mode, make_dirs
from lightning_sharding.readers.index import FileIndex, ListingIndex, default_cache_dir
from lightning_sharding.readers.storage import DIGEST_WHOLE, FileInfo, filesystem, list_files, scheme_of, with_retries

INDEX_DIR = "lightning_sharding.index"
DATA_INDEX_VERSION = 1
SHOWN = 5  # changed files named in a warning, then a count


class FileReader(Protocol):
    """What this module uses of a :class:`~lightning_sharding.readers.files.FileReader` (which
    imports this module: named here, not imported)."""

    @property
    def format(self) -> str:
        """The files' format (``tar``...)."""

    urls: list[str]
    data_index: str | Literal[False] | None
    storage_options: dict[str, Any]
    cache_dir: Path | None
    cache_mode: int
    retry: Any

    def scrub(self, text: str) -> str:
        """``text`` with credentials redacted."""

    def options_key(self) -> str:
        """The options that change an index."""

    def check_indexes(self, files: Sequence[FileInfo], indexes: Sequence[FileIndex]) -> None:
        """Raise when the files do not agree with each other."""

    def _index_files(
        self, files: Sequence[FileInfo], what: str, show: bool = True
    ) -> list[tuple[FileIndex, str, bool]]: ...


SHARED_MODE = 0o644  # an index beside the data is read by whoever reads the data (its copies: the umask's)


@dataclass
class DataIndex:
    """An index read from where the data is: per file (by its name under :attr:`root`) its number in
    :attr:`listing`, its fingerprint and content id."""

    where: str  # its directory's URL, credentials redacted (what messages show)
    roots: tuple[str, ...]  # where its files were when it was written, and its own parent directory
    files: dict[str, tuple[int, str, str]]
    listing: ListingIndex

    def entry(self, info: FileInfo) -> tuple[int, str, str] | None:
        """``(number, fingerprint, content)`` of a listed file, ``None`` when the index does not hold it.

        A file is known by its name under the directory its files were in when it was written, or,
        moved since, under the index's own parent directory (moved with it), or else under the
        common directory of the files listed with it now."""
        for root in self.roots:
            if info.url.startswith(root):
                found = self.files.get(info.url[len(root) :])
                if found is not None:
                    return found
        return self.files.get(info.name)

    def index(self, number: int) -> FileIndex:
        """The index of the file ``number``."""
        return self.listing.file(number)

    def sort_out(self, files: Sequence[FileInfo], known: list[tuple[FileIndex, str] | None]) -> SortedOut:
        """Fill ``known[i]`` (index, content id) for each file it holds unchanged (the same fingerprint,
        or the same content id from the store) and is not known yet; sort the others out."""
        out = SortedOut()
        for i, info in enumerate(files):
            if known[i] is not None:
                continue
            entry = self.entry(info)
            if entry is None:
                out.missing.append(info)
            elif entry[1] == info.fingerprint or (info.content and info.content == entry[2]):
                known[i] = (self.index(entry[0]), info.content or entry[2])
            elif info.content:  # the store's content id says it changed
                out.changed.append((info, changed_because(info, entry[1])))
            elif info.size > DIGEST_WHOLE:  # its content id samples it: it cannot tell a change inside
                out.unsure.append(info)
            else:
                out.maybe[i] = entry
        return out


@dataclass
class SortedOut:
    """The files a data index could not give at once: ``maybe`` (local files touched or copied since,
    by number: ``(number in the index, fingerprint, content id)``; a digest of the file decides),
    ``changed`` (with why), ``missing`` (not in it), ``unsure`` (large local files with a new time)."""

    maybe: dict[int, tuple[int, str, str]] = field(default_factory=dict)
    changed: list[tuple[FileInfo, str]] = field(default_factory=list)
    missing: list[FileInfo] = field(default_factory=list)
    unsure: list[FileInfo] = field(default_factory=list)

    def stale(self) -> bool:
        """Whether any file was not taken from the index."""
        return bool(self.changed or self.missing or self.unsure)

    def warning(self, index: DataIndex, data: str) -> str:
        """The warning naming them (changed files in order of their URLs)."""
        changed = sorted(self.changed, key=lambda c: c[0].url)
        return stale_warning(index, changed, self.missing, self.unsure, data)


def default_location(urls: Sequence[str]) -> str | None:
    """Where the index of files at ``urls`` is by default: in their common directory."""
    root = common_root(list(urls))
    return root + INDEX_DIR if root else None


def read_data_index(reader: FileReader, files: Sequence[FileInfo]) -> DataIndex | None:
    """The data index ``reader`` is told to use (``data_index``), or the one beside ``files`` when it
    is ``None``; ``None`` when there is none. A named one that is missing or damaged is an error; one
    beside the data that cannot be read (no permission, damaged) or was written for another format or
    other options is not used, and a warning says so."""
    if reader.data_index is False or not files:
        return None
    named = isinstance(reader.data_index, str)
    location = index_location(str(reader.data_index)) if named else default_location([f.url for f in files])
    if location is None:
        return None
    shown = reader.scrub(location)
    try:
        return _read(reader, location, shown)
    except _NoIndex:
        if named:
            raise FileNotFoundError(
                f"data_index={reader.scrub(str(reader.data_index))!r}: there is no data index at {shown} (no "
                "meta.json); write one with `lightning-sharding index DATA_URL --output DIR` and pass DIR, or "
                "leave data_index unset"
            ) from None
        return None
    except Exception as err:  # noqa: BLE001 - no permission to look, a damaged index: index without it
        message = f"the data index {shown} cannot be used ({type(err).__name__}: {reader.scrub(str(err))})"
        if named:
            raise ValueError(
                f"{message}: write it again with `lightning-sharding index`, or pass data_index=False"
            ) from None
        warnings.warn(
            f"{message}: the files are indexed without it. Write it again with `lightning-sharding index`, or "
            "pass data_index=False not to look for it",
            stacklevel=3,
        )
        return None


def data_index_there(reader: FileReader, files: Sequence[FileInfo]) -> bool:
    """Whether :func:`read_data_index` may find an index for ``files`` (one request, for the job's
    lister): a named one is looked for in any case, and a doubt (no permission to ask) says yes."""
    if reader.data_index is False or not files:
        return False
    if isinstance(reader.data_index, str):
        return True
    location = default_location([f.url for f in files])
    if location is None:
        return False
    try:
        fs, path = filesystem(location, reader.storage_options)
        fs.cat_file(f"{path}/meta.json", start=0, end=1)  # its first byte: a GET, as read_data_index asks
        return True
    except FileNotFoundError:
        return False
    except Exception:  # noqa: BLE001 - read_data_index says what it is
        return True


class _NoIndex(Exception):
    """No ``meta.json`` where the index was looked for."""


def index_location(directory: str) -> str:
    """The index directory of ``directory`` (what ``--output`` named), or ``directory`` itself when it
    is one (ends with :data:`INDEX_DIR`)."""
    directory = directory.rstrip("/")
    return directory if directory.rsplit("/", 1)[-1] == INDEX_DIR else f"{directory}/{INDEX_DIR}"


def _read(reader: FileReader, location: str, shown: str) -> DataIndex | None:
    fs, path = filesystem(location, reader.storage_options)
    try:
        # From byte 0: a range, for which s3fs asks no size (a HEAD, one more round trip) first.
        raw = with_retries(lambda: fs.cat_file(f"{path}/meta.json", start=0), f"reading {shown}", reader.retry)
    except OSError as err:
        if isinstance(err, FileNotFoundError) or isinstance(err.__cause__, FileNotFoundError):
            raise _NoIndex from None  # missing, maybe after a transient error and a retry
        raise
    meta = json.loads(raw)
    theirs = (meta.get("version"), meta.get("format"), meta.get("options"))
    ours = (DATA_INDEX_VERSION, reader.format, reader.options_key())
    if theirs != ours:
        warnings.warn(
            f"the data index {shown} was written for {theirs[1]} files with options {theirs[2]!r} (version "
            f"{theirs[0]}); this {type(reader).__name__} reads {ours[1]} files with options {ours[2]!r} (version "
            f"{ours[0]}): the files are indexed without it. Write it again with `lightning-sharding index`"
            + (f" --option {ours[2]}" if ours[2] else ""),
            stacklevel=4,
        )
        return None
    name = str(meta["arrays"])
    if not re.fullmatch(r"arrays-[0-9A-Za-z-]+", name):
        raise ValueError(f"meta.json names arrays {name!r}, not a directory it writes")
    arrays = f"{path}/{name}"
    if scheme_of(location) == "file":
        local = Path(arrays)
    else:  # fetched once into the cache directory, where its arrays are memory-mapped
        digest = hashlib.sha256(location.encode()).hexdigest()[:16]
        local = (reader.cache_dir or default_cache_dir()) / "data-index" / f"{digest}-{name}"
        if not local.is_dir():
            tmp = local.with_name(f".{local.name}.{secrets.token_hex(4)}.tmp")
            make_dirs(tmp, dir_mode(reader.cache_mode))
            try:
                get = lambda: fs.get(f"{arrays}/", str(tmp) + "/", recursive=True)  # noqa: E731
                with_retries(get, f"reading {shown}", reader.retry)
                for fetched in tmp.iterdir():
                    fetched.chmod(reader.cache_mode)
                os.rename(tmp, local)
            except OSError:
                if not local.is_dir():  # not another rank of this machine's copy, there first
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    listing = ListingIndex(local)
    entries = meta["files"]
    if listing.files() != len(entries):  # every array opens (a truncated one does not) and fits meta.json
        raise ValueError(f"its arrays hold {listing.files()} files and its meta.json {len(entries)}")
    roots = (str(meta.get("root", "")), location[: location.rfind("/") + 1])
    files_of = {name: (number, fingerprint, content) for number, (name, fingerprint, content) in enumerate(entries)}
    return DataIndex(shown, tuple(r for r in roots if r), files_of, listing)


def stale_warning(
    index: DataIndex,
    changed: Sequence[tuple[FileInfo, str]],
    missing: Sequence[FileInfo],
    unsure: Sequence[FileInfo],
    data: str,
) -> str:
    """What a warning says of the files the index could not give: changed since it was written, not
    in it, or large local files with a new modification time (their content id samples them, so it
    cannot vouch for what lies between its samples)."""

    def named(infos: Sequence[FileInfo], why: Sequence[str] | None = None) -> str:
        shown = [
            f"{info.url} ({w})" if why else info.url for info, w in zip(infos, why or [""] * len(infos), strict=False)
        ]
        more = f" and {len(infos) - SHOWN} more" if len(infos) > SHOWN else ""
        return ", ".join(shown[:SHOWN]) + more

    parts = []
    if changed:
        parts.append(
            f"{len(changed)} file(s) changed since it was written: "
            + named([info for info, _ in changed], [why for _, why in changed])
        )
    if missing:
        parts.append(f"{len(missing)} file(s) are not in it: {named(missing)}")
    if unsure:
        parts.append(
            f"{len(unsure)} file(s) over {DIGEST_WHOLE >> 20} MiB have a new modification time, and their content "
            f"id, which samples them, cannot vouch for their headers: {named(unsure)} (a copy that keeps the times, "
            "cp -p or rsync -t, keeps the index)"
        )
    return (
        f"the data index {index.where} is stale: {'; '.join(parts)}. They were indexed now, the others taken "
        f"from it. Write it again with `lightning-sharding index {data}` to start without indexing them"
    )


def changed_because(info: FileInfo, fingerprint: str) -> str:
    """Why a file differs from its entry (of ``fingerprint``), in words."""
    was, now = fingerprint.split(";", 1)[0], info.fingerprint.split(";", 1)[0]
    return f"{was} -> {now}" if was != now else "same size, other content"


def write_data_index(reader: FileReader, output: str | None = None) -> dict[str, Any]:
    """Index the files of ``reader`` (taking unchanged ones from an index already there) and write
    the index into ``output`` (a directory URL, see :func:`index_location`; default: the files' common
    directory). Returns what was written: ``url``, ``files``, ``samples``, ``indexed`` (files walked
    now), ``seconds``."""
    start = time.perf_counter()
    files = list_files(reader.urls, reader.storage_options, reader.retry)
    location = index_location(output) if output else default_location([f.url for f in files])
    if location is None:
        raise ValueError(
            f"the files of {reader.scrub(str(reader.urls))} share no directory to write their index into: "
            "give one with --output"
        )
    shown = reader.scrub(location)
    fs, path = filesystem(location, reader.storage_options)
    previous = _previous_arrays(fs, path)
    reader.data_index = False
    if previous:  # the index there, if sound, is reused: only its changed files are walked
        try:
            if _read(reader, location, shown) is not None:
                reader.data_index = location
        except Exception:  # noqa: BLE001 - a damaged index is written anew, all of it
            pass
    root = common_root([f.url for f in files])  # the files' names in it are relative to their directory
    indexed = reader._index_files(files, f"indexing {len(files)} {reader.format} file(s) for {shown}")
    indexes = [idx for idx, _, _ in indexed]
    reader.check_indexes(files, indexes)
    arrays = f"arrays-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(4)}"
    meta = {
        "version": DATA_INDEX_VERSION,
        "format": reader.format,
        "options": reader.options_key(),
        "arrays": arrays,
        "root": root,
        "files": [
            [f.url[len(root) :], f.fingerprint, content] for f, (_, content, _) in zip(files, indexed, strict=False)
        ],
    }
    with tempfile.TemporaryDirectory(prefix="lightning-sharding-index-") as tmp:
        if not ListingIndex.save(Path(tmp) / arrays, indexes, SHARED_MODE):
            raise ValueError(
                f"the {reader.format} files of {reader.scrub(str(reader.urls))} have index arrays of different names "
                "or shapes: they cannot share one data index"
            )
        (Path(tmp) / "meta.json").write_text(json.dumps(meta))
        try:
            fs.makedirs(path, exist_ok=True)  # on an object store: nothing to make
            put = lambda: fs.put(f"{tmp}/{arrays}", f"{path}/{arrays}", recursive=True)  # noqa: E731
            with_retries(put, f"writing {shown}", reader.retry)
            with_retries(lambda: fs.put_file(f"{tmp}/meta.json", f"{path}/meta.json"), f"writing {shown}", reader.retry)
        except OSError as err:
            raise OSError(
                f"cannot write the data index into {shown} ({type(err).__name__}: {reader.scrub(str(err))}): give "
                "--output a directory you may write, and pass it to the jobs' readers as data_index"
            ) from None
    if previous:  # the arrays the last meta.json named; a writer's at the same time keeps its own
        try:
            fs.rm(f"{path}/{previous}", recursive=True)
        except OSError:
            pass  # removed by another writer
    return {
        "url": shown,
        "files": len(files),
        "samples": int(sum(sum(idx.counts) for idx in indexes)),
        "indexed": sum(1 for _, _, scanned in indexed if scanned),
        "seconds": time.perf_counter() - start,
    }


def _previous_arrays(fs: Any, path: str) -> str | None:
    """The arrays directory the index at ``path`` names now (``None``: no index there; ``""``: one
    that names none)."""
    try:
        meta = json.loads(fs.cat_file(f"{path}/meta.json"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return ""  # damaged: written anew, and nothing of it reused
    name = str(meta.get("arrays", "")) if isinstance(meta, dict) else ""
    return name if re.fullmatch(r"arrays-[0-9A-Za-z-]+", name) else ""
