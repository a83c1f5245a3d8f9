"""One URL scheme for every file reader: plain paths, ``file://`` and ``s3://`` through fsspec.

Globs and lists of URLs expand to files with their size and a content fingerprint (mtime or
ETag), taken from the listing itself so a thousand shards cost one listing, not a thousand calls.
Transient storage errors are retried with exponential backoff; permanent ones (missing, forbidden)
fail at once with the URL in the message.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")

_GLOB_CHARS = "*?["
# Errors that a retry cannot fix: the object is not there, or we may not read it.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)
# Network errors of aiohttp/botocore that s3fs lets through; matched by name to avoid importing them.
_TRANSIENT_NAMES = {
    "ClientConnectorError",
    "ClientOSError",
    "ServerDisconnectedError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
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
            "reading files needs fsspec: pip install 'lightning-sharding[files]' (add [s3] for s3:// URLs)"
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
    if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__name__ in _TRANSIENT_NAMES:
        return True
    if _TRANSIENT_TEXT.search(str(err)):
        return True
    cause = err.__cause__ or err.__context__
    return cause is not None and cause is not err and is_transient(cause)


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
    """One listed file: its ``url`` as the user spelled its scheme, size in bytes, and fingerprint."""

    url: str
    size: int
    fingerprint: str


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it (fsspec caches the instances)."""
    fs, path = _fsspec().core.url_to_fs(url, **dict(storage_options or {}))
    return fs, path


def _fingerprint(info: Mapping[str, Any]) -> str:
    size = info.get("size")
    tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or info.get("created")
    return f"size={size};tag={str(tag).strip(chr(34))}"


def _display(url: str, fs: Any, path: str) -> str:
    """Keep the user's spelling: plain paths stay plain, URLs keep their scheme."""
    return str(fs.unstrip_protocol(path)) if "://" in url else path


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
    files: list[FileInfo] = []
    for url in entries:
        fs, path = filesystem(url, storage_options)
        if any(c in path for c in _GLOB_CHARS):
            found = with_retries(partial(fs.glob, path, detail=True), f"listing {url}", retry)
            matches = sorted((p, i) for p, i in found.items() if i.get("type", "file") == "file")
            if not matches:
                raise FileNotFoundError(f"no file matches {url!r}: check the pattern and the bucket or directory")
            files.extend(FileInfo(_display(url, fs, p), int(i["size"]), _fingerprint(i)) for p, i in matches)
            continue
        try:
            info = with_retries(partial(fs.info, path), f"reading the size of {url}", retry)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"data file {url!r} does not exist") from err
        except PermissionError as err:
            raise PermissionError(f"no permission to read data file {url!r}: {err}") from err
        if info.get("type", "file") != "file":
            raise IsADirectoryError(f"{url!r} is a directory; give a glob such as '{url.rstrip('/')}/*.tar'")
        files.append(FileInfo(_display(url, fs, path), int(info["size"]), _fingerprint(info)))
    return files


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
        blobs = with_retries(
            lambda: fs.cat_ranges([path] * len(s), s, e, on_error="raise"), f"reading {url}", retry or RetryPolicy()
        )
    for blob, lo, hi in zip(blobs, s, e, strict=True):
        if len(blob) != hi - lo:
            raise OSError(
                f"{url}: asked for bytes [{lo}, {hi}) and got {len(blob)}; the file is shorter than its index "
                "says (truncated or changed since the manifest was built: delete the manifest cache and restart)"
            )
    return blobs
