"""A local cache of remote files: each fetched once, kept across epochs and runs, evicted
least-recently-used when the cache is over its byte budget.

Names are derived from the URL and the file's fingerprint (size and ETag or mtime), so a changed
object gets a new name and its old copy ages out. A copy is written to the hidden
``.<name>.part-<host>-<pid>-<random>`` and renamed into place once complete and of the listed
size: a reader never sees a partial file, and a SIGKILL during a download leaves only a ``.part-``
file, never served, which the next cache on that host removes once its writer is dead.

Every read holds a shared ``flock`` on the copy; eviction takes an exclusive one without waiting
and skips a copy that is in use, so a file being read is never removed; while such copies keep the
cache over its budget a marker file says so, and every read that ends evicts again. Processes that want the
same missing file queue on an exclusive ``flock`` of ``.<name>.lock``, so it is fetched once. All of
this works across ranks, workers and runs that share the directory on one machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

_PART, _LOCK = ".part-", ".lock"


def resolve_limit(limit: int | float, directory: Path) -> int:
    """``limit`` in bytes: an int as it is, a float in (0, 1] as that fraction of the disk space the
    cache may use (free space plus what the cache holds)."""
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        raise ValueError(
            f"cache_limit={limit!r}: give a number of bytes (e.g. 50 * 2**30) or a fraction of free disk in (0, 1]"
        )
    if isinstance(limit, int):
        return limit
    if limit > 1:
        raise ValueError(f"cache_limit={limit!r}: a fraction of free disk must be at most 1; give bytes as an int")
    return int(limit * (shutil.disk_usage(directory).free + _held_bytes(directory)))


def _copies(directory: Path) -> list[os.DirEntry[str]]:
    """The complete copies: partial downloads and lock files are hidden (their names start with a dot)."""
    with os.scandir(directory) as entries:
        return [e for e in entries if e.is_file() and not e.name.startswith(".")]


def _held_bytes(directory: Path) -> int:
    return sum(e.stat().st_size for e in _copies(directory))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShardCache:
    """Whole remote files under ``directory``, at most ``limit`` bytes of them (see the module)."""

    def __init__(self, directory: str | os.PathLike[str], limit: int | float) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.limit = resolve_limit(limit, self.directory)
        self.hits = self.fetches = 0
        self._over = self.directory / ".over-budget"  # there while copies in use keep it over budget
        self._host = socket.gethostname()
        self.sweep()

    def path(self, url: str, fingerprint: str) -> Path:
        """Where the copy of ``url`` with this fingerprint lives (a new fingerprint, a new name)."""
        digest = hashlib.sha256(f"{url}\0{fingerprint}".encode()).hexdigest()[:32]
        return self.directory / f"{digest}-{os.path.basename(url)[-80:]}"

    def sweep(self) -> None:
        """Remove the partial downloads of dead processes on this host."""
        with os.scandir(self.directory) as entries:
            for entry in entries:
                _, part, tail = entry.name.rpartition(_PART)
                writer = tail.rsplit("-", 2)
                if not part or len(writer) != 3 or writer[0] != self._host or not writer[1].isdigit():
                    continue
                if not _alive(int(writer[1])):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    @contextlib.contextmanager
    def open(self, url: str, fingerprint: str, size: int, fetch: Callable[[str], None]) -> Iterator[str | None]:
        """The local copy of ``url`` (fetched with ``fetch(partial_path)`` when missing), read-locked
        while the block runs; ``None`` when the file alone is larger than the budget."""
        if size > self.limit:
            yield None
            return
        path, fetched = self.path(url, fingerprint), False
        while True:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                fetched = self._fetch(url, path, size, fetch) or fetched
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if os.fstat(fd).st_ino == _inode(path):  # not evicted between the open and the lock
                    os.utime(path)  # most recently used
                    self.hits += not fetched
                    yield str(path)
                    return
            finally:
                os.close(fd)
                if self._over.exists():  # a copy in use kept the cache over its budget: try again now
                    self.evict()

    def _fetch(self, url: str, path: Path, size: int, fetch: Callable[[str], None]) -> bool:
        """Download ``url`` to ``path`` unless another process did meanwhile; whether this one did."""
        with open(path.with_name(f".{path.name}{_LOCK}"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():  # another process fetched it while this one waited
                return False
            part = path.with_name(f".{path.name}{_PART}{self._host}-{os.getpid()}-{secrets.token_hex(3)}")
            try:
                fetch(str(part))
                got = os.path.getsize(part)
                if got != size:
                    raise OSError(f"{url}: downloaded {got} bytes, the listing says {size} (changed while reading?)")
                os.replace(part, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
            self.fetches += 1
            self.evict(keep=path)
            return True

    def evict(self, keep: Path | None = None) -> None:
        """Remove least-recently-used copies not in use until the cache is within its budget."""
        copies = sorted(_copies(self.directory), key=lambda e: e.stat().st_mtime)
        held = sum(e.stat().st_size for e in copies)
        for entry in copies:
            if held <= self.limit:
                break
            if keep is not None and entry.path == str(keep):
                continue
            with contextlib.suppress(FileNotFoundError), open(entry.path, "rb") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # being read
                os.unlink(entry.path)
                held -= entry.stat().st_size
            # Its lock file goes too: at worst two processes racing for the next fetch both download it.
            Path(entry.path).with_name(f".{entry.name}{_LOCK}").unlink(missing_ok=True)
        if held > self.limit:
            self._over.touch()
        else:
            self._over.unlink(missing_ok=True)


def _inode(path: Path) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return -1
