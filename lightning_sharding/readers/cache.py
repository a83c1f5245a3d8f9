"""A local cache of remote files: each fetched once, kept across epochs and runs, evicted
least-recently-used when the cache is over its byte budget.

Names are derived from the URL and the file's fingerprint (size and ETag or mtime), so a changed
object gets a new name and its old copy ages out. A copy is written to the hidden
``.<name>.part-<host>-<pid>-<random>`` and renamed into place once complete and of the listed
size: a reader never sees a partial file, and a SIGKILL during a download leaves only a ``.part-``
file, never served, which the next cache on the machine removes: a writer holds the copy's fetch
lock while it writes, so a partial file whose fetch lock is free has no writer.

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
import numbers
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lightning_sharding.core.private import FILE_MODE, create_file, dir_mode, make_dirs, open_or_create

_PART = ".part-"  # in the hidden name of a download under way: .<name>.part-<host>-<pid>-<random>
_LOCK = ".lock"  # the end of a copy's fetch lock: .<name>.lock


def resolve_limit(limit: int | float, directory: Path) -> int:
    """``limit`` in bytes: an int as it is, a float in (0, 1] as that fraction of the disk space the
    cache may use (free space plus what the cache holds)."""
    if isinstance(limit, numbers.Integral) and not isinstance(limit, bool) and limit > 1:
        return int(limit)
    if limit == 1 and isinstance(limit, numbers.Integral) and not isinstance(limit, bool):
        raise ValueError("cache_limit=1 is one byte: give 1.0 for all of the free disk, or a number of bytes")
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or not 0 < limit <= 1:
        raise ValueError(
            f"cache_limit={limit!r}: give a number of bytes as an int (e.g. 50 * 2**30) or a fraction of "
            "the free disk as a float in (0, 1]"
        )
    return int(float(limit) * (shutil.disk_usage(directory).free + _held_bytes(directory)))


def _copies(directory: Path) -> list[os.DirEntry[str]]:
    """The complete copies: partial downloads and lock files are hidden (their names start with a dot)."""
    with os.scandir(directory) as entries:
        return [e for e in entries if e.is_file() and not e.name.startswith(".")]


def _held_bytes(directory: Path) -> int:
    return sum(e.stat().st_size for e in _copies(directory))


class ShardCache:
    """Whole remote files under ``directory``, at most ``limit`` bytes of them (see the module)."""

    def __init__(self, directory: str | os.PathLike[str], limit: int | float, mode: int = FILE_MODE) -> None:
        self.directory = Path(directory)
        self.mode = mode  # of every file made here (copies, partial downloads, locks); 0600 by default
        make_dirs(self.directory, dir_mode(mode))
        self.limit = resolve_limit(limit, self.directory)
        self.hits = 0
        self.fetches = 0
        self._over = self.directory / ".over-budget"  # there while copies in use keep it over budget
        self._host = socket.gethostname()
        self.sweep()

    def path(self, url: str, fingerprint: str) -> Path:
        """Where the copy of ``url`` with this fingerprint lives (a new fingerprint, a new name)."""
        digest = hashlib.sha256(f"{url}\0{fingerprint}".encode()).hexdigest()[:32]
        return self.directory / f"{digest}-{os.path.basename(url)[-80:]}"

    def sweep(self) -> None:
        """Remove the partial downloads whose writer is gone. A writer holds its copy's fetch lock
        from before it creates the partial file until it is renamed or removed (whatever the host,
        PID namespace or user), so a partial file whose fetch lock is free is dead."""
        with os.scandir(self.directory) as entries:
            for entry in entries:
                name, part, writer = entry.name[1:].rpartition(_PART)
                host_pid_random = writer.rsplit("-", 2)
                if not entry.name.startswith(".") or not part or len(host_pid_random) != 3:
                    continue  # a copy, a lock file, or a name of ours that only contains ".part-"
                if not host_pid_random[1].isdigit() or entry.name.endswith(_LOCK):
                    continue
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid != os.getuid():
                        continue  # another user's download, in a cache shared on purpose: theirs to clean
                with contextlib.suppress(OSError), self._lock_file(name) as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # its writer is at work
                    os.unlink(entry.path)

    def touch(self, url: str, fingerprint: str) -> bool:
        """Mark the copy of ``url`` most recently used, without opening or locking it; whether it is
        there (a copy evicted meanwhile is not, and a later :meth:`open` fetches it again)."""
        try:
            os.utime(self.path(url, fingerprint))
        except FileNotFoundError:
            return False
        return True

    @contextlib.contextmanager
    def open(self, url: str, fingerprint: str, size: int, fetch: Callable[[str], None]) -> Iterator[str | None]:
        """The local copy of ``url`` (fetched with ``fetch(partial_path)`` when missing), read-locked
        while the block runs; ``None`` when the file alone is larger than the budget."""
        if size > self.limit:
            yield None
            return
        path = self.path(url, fingerprint)
        fetched = False
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

    def _lock_file(self, name: str) -> Any:
        """The fetch lock of copy ``name``, opened (made given the cache's mode when missing)."""
        return os.fdopen(open_or_create(self.directory / f".{name}{_LOCK}", os.O_RDWR | os.O_APPEND, self.mode), "a+b")

    def _fetch(self, url: str, path: Path, size: int, fetch: Callable[[str], None]) -> bool:
        """Download ``url`` to ``path`` unless another process did meanwhile; whether this one did."""
        with self._lock_file(path.name) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():  # another process fetched it while this one waited
                return False
            part = path.with_name(f".{path.name}{_PART}{self._host}-{os.getpid()}-{secrets.token_hex(3)}")
            try:
                os.close(create_file(part, mode=self.mode))  # the download writes into it: its mode stays
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
            # Its (empty) lock file stays: removing it would let two processes fetch and replace the
            # copy at once, and a reader could then read a copy that no lock keeps.
        if held > self.limit:
            with contextlib.suppress(FileExistsError):
                os.close(create_file(self._over, mode=self.mode))
        else:
            self._over.unlink(missing_ok=True)


def _inode(path: Path) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return -1
