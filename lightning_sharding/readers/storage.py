"""One URL scheme for every file reader: plain paths and any URL fsspec opens.

S3 (``s3://``), Google Cloud Storage (``gs://``), Azure Blob Storage and Data Lake Gen2
(``az://``, ``abfs://``) and the Hugging Face Hub (``hf://``) each need their fsspec package,
installed by an extra of this package (:data:`STORAGES`); a URL whose package is missing fails
with the URL and the ``pip install`` that fixes it.

Globs and lists of URLs expand to files with their size and a content fingerprint (mtime or
ETag), taken from the listing itself so a thousand shards cost one listing, not a thousand calls.
Transient storage errors are retried with exponential backoff; permanent ones (missing, forbidden)
fail at once with the URL in the message.
"""

from __future__ import annotations

import bisect
import fnmatch
import hashlib
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from lightning_sharding.core.identity import common_root
from lightning_sharding.core.private import URL_CREDENTIALS

T = TypeVar("T")

_GLOB_CHARS = "*?["
_DATA_INDEX = "lightning_sharding.index/"  # readers/data_index.py::INDEX_DIR: a glob's matches leave it out
# Errors that a retry cannot fix: the object is not there, or we may not read it.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)
# Network errors the stores' clients raise, matched by the name of the error's class or of any of its
# bases, to avoid importing them: aiohttp and botocore (s3fs, gcsfs, adlfs), requests (gcsfs),
# azure-core (adlfs), httpx (huggingface_hub).
_TRANSIENT_NAMES = {
    "ClientConnectionError",  # aiohttp: ClientOSError, ServerDisconnectedError, ClientConnectorError...
    "ClientPayloadError",
    "EndpointConnectionError",  # botocore
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "ConnectionError",  # requests: ProxyError (what gcsfs raises for a 502), ConnectTimeout...
    "Timeout",
    "ChunkedEncodingError",
    "ServiceRequestError",  # azure-core
    "ServiceResponseError",
    "NetworkError",  # httpx: ConnectError, ReadError, WriteError...
    "TimeoutException",
    "ProxyError",
    "RemoteProtocolError",
}
# HTTP statuses a retry may fix, read from an error's ``code`` (gcsfs), ``status_code`` (azure-core)
# or ``response.status_code`` (huggingface_hub).
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}

# URL scheme -> the package fsspec opens it with, and the extra of this package that installs it.
STORAGES: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
    "hf": ("huggingface_hub", "hf"),
}
# What a storage needs in ``storage_options`` when opening it fails for want of credentials.
_CREDENTIALS = {
    "azure": "storage_options={'account_name': ..., and 'account_key', 'sas_token', 'connection_string' "
    "or 'anon': True}, or the AZURE_STORAGE_ACCOUNT_NAME environment variable",
    "gcs": "storage_options={'token': 'anon' | 'google_default' | a service-account JSON path, 'project': ...}",
    "hf": "storage_options={'token': ...} or log in with `hf auth login`",
    "s3": "storage_options={'key': ..., 'secret': ...} or the usual AWS environment variables",
}


# Throttling and server-side errors as S3 reports them ("An error occurred (503) when calling ...").
_TRANSIENT_TEXT = re.compile(
    r"SlowDown|ServiceUnavailable|InternalError|RequestTimeout|Throttl|\((?:500|502|503|504)\)"
)


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError as err:  # pragma: no cover - fsspec is a dependency of the file extras
        raise ImportError(
            "reading files needs fsspec: pip install 'lightning-sharding[files]' "
            "(and [s3], [gcs], [azure] or [hf] for s3://, gs://, az:// or hf:// URLs)"
        ) from err
    return fsspec


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all, waiting ``backoff * 2**k`` seconds (at most ``max_wait``) after try ``k``."""

    attempts: int = 5
    backoff: float = 0.2
    max_wait: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff < 0:
            raise ValueError(f"RetryPolicy(attempts={self.attempts}, backoff={self.backoff}): need attempts >= 1")


def is_transient(err: BaseException) -> bool:
    """Whether a retry may succeed: connection resets, timeouts, throttling, server errors."""
    if isinstance(err, _PERMANENT):
        return False
    if isinstance(err, (ConnectionError, TimeoutError)) or _TRANSIENT_NAMES & {c.__name__ for c in type(err).__mro__}:
        return True
    if _TRANSIENT_TEXT.search(str(err)) or _status(err) in _TRANSIENT_STATUS:
        return True
    cause = err.__cause__ or err.__context__
    return cause is not None and cause is not err and is_transient(cause)


def _status(err: BaseException) -> int | None:
    """The HTTP status an object store's client put on ``err``, if any."""
    for owner, name in ((err, "code"), (err, "status_code"), (getattr(err, "response", None), "status_code")):
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def with_retries(call: Callable[[], T], what: str, policy: RetryPolicy) -> T:
    """``call()``, retried on transient errors; the final error says what was tried and how often."""
    for attempt in range(policy.attempts):
        try:
            return call()
        except Exception as err:
            if not is_transient(err) or attempt == policy.attempts - 1:
                if attempt:
                    raise OSError(f"{what} failed after {attempt + 1} attempts: {err!r}") from err
                raise
            time.sleep(min(policy.max_wait, policy.backoff * 2**attempt))
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass(frozen=True)
class FileInfo:
    """One listed file: its ``url`` as the user spelled its scheme, size in bytes, and fingerprint
    (size and ETag or mtime: what keys the index cache). ``name`` is its URL relative to the root
    of the files listed with it, and ``content`` an id of its bytes from the store (``size=N;etag=...``;
    empty where the store gives only a time, for :func:`content_digest` to fill)."""

    url: str
    size: int
    fingerprint: str
    name: str = ""
    content: str = ""


def scheme_of(url: str) -> str:
    """``url``'s scheme, of the innermost filesystem of a chained URL; ``file`` for a plain path."""
    return url.split("://", 1)[0].rsplit("::", 1)[-1] if "://" in url else "file"


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it (fsspec caches the instances).

    A scheme whose package is not installed, an unknown scheme, and a storage that cannot be
    opened with ``storage_options`` (no account, no credentials) are errors naming the URL and what
    to do.
    """
    scheme = scheme_of(url)
    package, extra = STORAGES.get(scheme, ("", ""))
    options = dict(storage_options or {})
    real = (options.pop(URL_CREDENTIALS, None) or {}).get(url, url)  # a URL shown redacted: open the real one
    try:
        fs, path = _fsspec().core.url_to_fs(real, **options)
    except ImportError as err:
        cause = err.__cause__ or err  # fsspec's own message only says which package it wanted
        if not package:
            raise ImportError(f"{url!r}: its filesystem could not be imported ({err}: {cause})") from err
        raise ImportError(
            f"{url!r}: {scheme}:// URLs need {package}, which could not be imported ({cause}): "
            f"pip install 'lightning-sharding[{extra}]'"
        ) from err
    except ValueError as err:
        if "Protocol not known" in str(err):
            unknown = str(err).rsplit(":", 1)[-1].strip()
            case = " (schemes are lower case)" if unknown != unknown.lower() else ""
            raise ValueError(
                f"{url!r}: no filesystem reads {unknown}:// URLs{case}; use a path or one of "
                f"{', '.join(f'{s}://' for s in STORAGES)} (or another protocol fsspec knows)"
            ) from err
        if extra in _CREDENTIALS:
            raise ValueError(f"{url!r}: could not open its storage ({err}); pass {_CREDENTIALS[extra]}") from err
        raise
    return fs, path


# What a store's listing gives of a file's bytes, by the key it uses, and the label a content id gives it.
_CONTENT_TAGS = {"ETag": "etag", "etag": "etag", "blob_id": "blob", "generation": "generation"}
# A local file up to this size is hashed whole; a larger one in DIGEST_BLOCKS blocks spread over it.
DIGEST_WHOLE = 4 << 20
DIGEST_BLOCKS = 16
DIGEST_BLOCK = 64 << 10


def content_of(info: Mapping[str, Any]) -> str:
    """A listed file's content id from what its store says of its bytes (``""``: the store gives only a time)."""
    for key, label in _CONTENT_TAGS.items():
        if info.get(key):
            return f"size={info.get('size')};{label}={str(info[key]).strip(chr(34))}"
    return ""


def content_digest(url: str, size: int, storage_options: Mapping[str, Any] | None = None) -> str:
    """A content id of a file whose store gives no ETag (a local file): its size and a BLAKE2 digest
    of its bytes, whole up to :data:`DIGEST_WHOLE`, else of :data:`DIGEST_BLOCKS` blocks spread over
    it (first and last included), so a copy or a touch keeps it and a rewrite changes it."""
    fs, path = filesystem(url, storage_options)
    with fs.open(path, "rb") as f:
        return digest_of(f, size)


def local_content_digest(path: str) -> str:
    """:func:`content_digest` of a local file, read without fsspec."""
    with open(path, "rb") as f:
        return digest_of(f, os.fstat(f.fileno()).st_size)


def digest_of(f: Any, size: int) -> str:
    """The content id ``size=N;digest=...`` of the open binary file ``f`` of ``size`` bytes."""
    if size <= DIGEST_WHOLE:
        return bytes_digest(f.read(), size)
    digest = hashlib.blake2b(digest_size=16)
    for k in range(DIGEST_BLOCKS):
        f.seek((size - DIGEST_BLOCK) * k // (DIGEST_BLOCKS - 1))
        digest.update(f.read(DIGEST_BLOCK))
    return f"size={size};digest={digest.hexdigest()}"


def bytes_digest(data: bytes | memoryview, size: int | None = None) -> str:
    """:func:`digest_of` a file of at most :data:`DIGEST_WHOLE` bytes, from its bytes already read."""
    return f"size={len(data) if size is None else size};digest={hashlib.blake2b(data, digest_size=16).hexdigest()}"


def fingerprint_of(info: Mapping[str, Any]) -> str:
    """A listed file's size and content tag, as each store's fsspec ``info`` reports them."""
    size = info.get("size")
    # ETag (S3, GCS, Azure), the blob's git hash (Hugging Face Hub), else a modification time.
    tag = info.get("ETag") or info.get("etag") or info.get("blob_id") or info.get("generation")
    tag = tag or info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("created")
    return f"size={size};tag={str(tag).strip(chr(34))}"


def spelled_like(url: str, pattern: str, path: str) -> str:
    """The file at ``path`` (a match of the glob ``url``, which its filesystem strips to
    ``pattern``) as the user spells it: the URL's own directory before the first glob character
    (scheme, ``container@account`` host, ``simplecache::`` chain and all), then the rest of the
    match. Plain paths stay plain."""
    if "://" not in url:
        return path
    cut_url = url.rfind("/", 0, min(url.find(c) for c in _GLOB_CHARS if c in url)) + 1
    cut_path = pattern.rfind("/", 0, min(pattern.find(c) for c in _GLOB_CHARS if c in pattern)) + 1
    if not path.startswith(pattern[:cut_path]):  # pragma: no cover - a filesystem that renames its matches
        raise ValueError(f"{url!r} matched {path!r}, which is not under {pattern[:cut_path]!r}")
    return url[:cut_url] + path[cut_path:]


def list_files(
    urls: str | Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> list[FileInfo]:
    """Expand ``urls`` (one URL, a glob, or a list of either) into files, in a stable order.

    A glob's matches are sorted; a list keeps its order. A glob that matches nothing, or a file
    that does not exist, is an error naming it.
    """
    retry = retry or RetryPolicy()
    entries = [urls] if isinstance(urls, str) else list(urls)
    if not entries:
        raise ValueError("no data URLs were given: pass a path, a glob or a list of URLs")
    listed: list[tuple[str, int, str, str]] = []  # each file's URL, size, fingerprint and content id
    seen: dict[tuple[int, str], str] = {}  # (filesystem, canonical URL) -> how it was named first
    hidden = (storage_options or {}).get(URL_CREDENTIALS) or {}
    for url in entries:
        fs, path = filesystem(url, storage_options)
        if url not in hidden and any(c in path for c in _GLOB_CHARS):  # a signed URL's "?" is no glob
            found = _local_glob(fs, path)
            if found is None:
                found = with_retries(partial(fs.glob, path, detail=True), f"listing {url}", retry)
            # a link is its file (fsspec calls it "other"); the data index's own files are no data
            found_all = list(found)
            found = {p: _followed(fs, p) if i.get("islink") else i for p, i in found.items() if _DATA_INDEX not in p}
            matches = sorted((p, i) for p, i in found.items() if i.get("type", "file") == "file")
            if not matches:
                left = (
                    " (a data index's files, lightning_sharding.index/, are no data)"
                    if any(_DATA_INDEX in p for p in found_all)
                    else ""
                )
                raise FileNotFoundError(f"no file matches {url!r}{left}: check the pattern and the bucket or directory")
            found_files = [(spelled_like(url, path, p), p, i) for p, i in matches]
        else:
            found_files = [(url if "://" in url else path, path, _info(fs, path, url, retry))]
        for display, p, i in found_files:
            if len(entries) > 1:  # one glob matches each file once (10,000 canonical names: 0.05 s)
                canonical = (id(fs), str(fs.unstrip_protocol(p)))
                if canonical in seen:  # its samples would be read twice an epoch
                    also = "" if seen[canonical] == display else f" (also as {seen[canonical]!r})"
                    raise ValueError(f"{display!r} is named twice in the URLs{also}: name each file once")
                seen[canonical] = display
            listed.append((display, int(i["size"]), fingerprint_of(i), content_of(i)))
    root = len(common_root([url for url, _, _, _ in listed]))
    return [FileInfo(url, size, fingerprint, url[root:], content) for url, size, fingerprint, content in listed]


def _followed(fs: Any, path: str) -> Any:
    """The listing of the file a symbolic link names, or an error naming a broken link."""
    try:
        return fs.info(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is a broken symbolic link: fix or remove it, or narrow the glob") from None


def _local_glob(fs: Any, pattern: str) -> dict[str, dict[str, Any]] | None:
    """The matches of a local glob whose last part alone has glob characters (``/data/*.tar``), as
    fsspec's ``glob(detail=True)`` gives them (dot files too, links followed), from one ``scandir``:
    fsspec asks ``stat`` of each file through its path handling (0.1 ms a file here). ``None`` for
    another glob or filesystem, for fsspec to expand."""
    directory, _, last = pattern.rpartition("/")
    if type(fs).__name__ != "LocalFileSystem" or "**" in last or any(c in directory for c in _GLOB_CHARS):
        return None
    found: dict[str, dict[str, Any]] = {}
    try:
        entries = list(os.scandir(directory or "/"))
    except OSError:
        return None  # a missing directory: fsspec says what it says
    # "*.tar" is a suffix: 10,000 regular-expression matches took 0.1 s here, endswith a tenth of it.
    suffix = last[1:] if last.startswith("*") and not any(c in last[1:] for c in _GLOB_CHARS) else None
    for entry in entries:
        if entry.name.endswith(suffix) if suffix is not None else fnmatch.fnmatchcase(entry.name, last):
            path = f"{directory}/{entry.name}"
            try:
                st = entry.stat()
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"{path} is a broken symbolic link (to {os.readlink(path)!r}): fix or remove it, or narrow the glob"
                ) from None
            kind = "file" if stat.S_ISREG(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode) else "other"
            found[path] = {"size": st.st_size, "mtime": st.st_mtime, "type": kind}  # "other": a FIFO, a device
    return found


def _info(fs: Any, path: str, url: str, retry: RetryPolicy) -> Any:
    """The listing of one named file, or an error naming it."""
    try:
        info = with_retries(partial(fs.info, path), f"reading the size of {url}", retry)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"data file {url!r} does not exist") from err
    except PermissionError as err:
        raise PermissionError(f"no permission to read data file {url!r}: {err}") from err
    if info.get("type", "file") != "file":
        raise IsADirectoryError(f"{url!r} is a directory; give a glob such as '{url.rstrip('/')}/*.tar'")
    return info


# Ranges of one remote file this close (bytes between them) are read with one request: a request
# costs the store's latency (tens of ms), the bytes in between a fraction of a millisecond each KiB.
# A small shard whose samples a batch takes whole is read in one request, not one per sample.
MERGE_GAP = 256 << 10


def merged_ranges(starts: list[int], ends: list[int], gap: int) -> tuple[list[int], list[int]]:
    """The fewest ``[start, end)`` spans, sorted, that cover every range, joining ranges at most ``gap``
    bytes apart."""
    lo: list[int] = []
    hi: list[int] = []
    for a, b in sorted(zip(starts, ends, strict=True)):
        if hi and a <= hi[-1] + gap:
            hi[-1] = max(hi[-1], b)
        else:
            lo.append(a)
            hi.append(b)
    return lo, hi


def cut_ranges(spans: list[bytes], span_starts: list[int], starts: list[int], ends: list[int]) -> list[bytes]:
    """Each range ``[starts[i], ends[i])`` cut from the read ``spans`` (sorted, starting at ``span_starts``)
    that holds it; a span read short gives a short range, which the caller names."""
    out = []
    for a, b in zip(starts, ends, strict=True):
        k = bisect.bisect_right(span_starts, a) - 1
        offset = a - span_starts[k]
        out.append(bytes(spans[k][offset : offset + b - a]))
    return out


def read_ranges(
    url: str,
    starts: Iterable[int],
    ends: Iterable[int],
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> list[bytes]:
    """The bytes ``[start, end)`` of ``url`` for every pair (concurrent requests on object stores)."""
    fs, path = filesystem(url, storage_options)
    s, e = [int(x) for x in starts], [int(x) for x in ends]
    if not s:
        return []
    if type(fs).__name__ == "LocalFileSystem":  # fsspec would open the file once per range
        with open(path, "rb") as f:
            blobs = [os.pread(f.fileno(), hi - lo, lo) for lo, hi in zip(s, e, strict=True)]
    else:
        first, last = merged_ranges(s, e, MERGE_GAP)
        got = with_retries(
            lambda: fs.cat_ranges([path] * len(first), first, last, on_error="raise"),
            f"reading {url}",
            retry or RetryPolicy(),
        )
        blobs = got if (first, last) == (s, e) else cut_ranges(got, first, s, e)
    for blob, lo, hi in zip(blobs, s, e, strict=True):
        if len(blob) != hi - lo:
            raise OSError(
                f"{url}: asked for bytes [{lo}, {hi}) and got {len(blob)}; the file is shorter than its index "
                "says (truncated or changed since the manifest was built: delete the manifest cache and restart)"
            )
    return blobs
