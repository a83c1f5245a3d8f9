"""Fetch ahead: a worker's background threads put the files of its next items into the local
shard cache, in the order the plan gives, while the worker reads the current one.

The worker tells them, at every batch, which items come next (:meth:`Prefetcher.want`); ``depth``
threads take them in that order, so up to ``depth`` files download at once (a store's latency is
paid once per round, not once per file), and an older wish is forgotten when a newer one arrives.
A file already cached costs one ``utime`` (it stays the most recently used); one that another
process or thread is fetching is waited for on the cache's lock, never fetched twice. A failed
prefetch is dropped: the worker's own read fetches the file again and raises what it finds, so an
error is never lost nor raised twice.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Callable, Sequence

from lightning_sharding.core.manifest import Item


def check_prefetch(reader: str, cache_limit: object, files: object, max_bytes: object) -> tuple[int, int | None]:
    """``(prefetch_files, prefetch_bytes)`` of a reader's arguments, or an error naming the bad one."""
    if isinstance(files, bool) or not isinstance(files, numbers.Integral) or files < 0:
        raise ValueError(f"`{reader}(prefetch_files={files!r})` must be an int >= 0")
    if files and cache_limit is None:
        raise ValueError(f"`{reader}(prefetch_files={files})` fetches into the local shard cache: set cache_limit= too")
    if max_bytes is None:
        return int(files), None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Integral) or max_bytes < 1:
        raise ValueError(f"`{reader}(prefetch_bytes={max_bytes!r})` must be a number of bytes >= 1, or None")
    if not files:
        raise ValueError(
            f"`{reader}(prefetch_bytes={max_bytes})` caps what prefetch_files= fetches ahead: set prefetch_files= "
            "too (the most files ahead, and downloads at once)"
        )
    return int(files), int(max_bytes)


def files_ahead(
    now: Sequence[Item],
    upcoming: Sequence[Item],
    file_of: Callable[[Item], str],
    size_of: Callable[[Item], int],
    files: int,
    max_bytes: int | None = None,
) -> list[Item]:
    """What to have locally, nearest first: one item of each file of ``now`` (the batch being read),
    then one of each next file of ``upcoming``, at most ``files`` of them and, with ``max_bytes``,
    only while their sizes add up to at most that (a file larger than what is left ends the list:
    it is read when its turn comes, not ahead)."""
    current = {file_of(i): i for i in now}
    later: dict[str, Item] = {}
    held = 0
    for item in upcoming:
        name = file_of(item)
        if name in current or name in later:
            continue
        if len(later) == files or (max_bytes is not None and held + size_of(item) > max_bytes):
            break
        held += size_of(item)
        later[name] = item
    return [*current.values(), *later.values()]


class Prefetcher:
    """Fetch ``fetch(item)`` for the items of the newest wish, in order, ``threads`` at once; an item
    whose ``key`` is being fetched already is not fetched again by another thread."""

    def __init__(self, fetch: Callable[[Item], None], threads: int, key: Callable[[Item], str]) -> None:
        self._fetch = fetch
        self._key = key
        self._wanted: list[Item] = []
        self._busy: set[str] = set()
        self._wish = threading.Condition()
        for k in range(threads):
            threading.Thread(target=self._run, name=f"lightning-sharding-prefetch-{k}", daemon=True).start()

    def want(self, items: Sequence[Item]) -> None:
        """The items wanted locally next, nearest first (replaces the previous wish)."""
        with self._wish:
            self._wanted = [i for i in items if self._key(i) not in self._busy]
            self._wish.notify_all()

    def _run(self) -> None:
        while True:
            with self._wish:
                while not self._wanted:
                    self._wish.wait()
                item = self._wanted.pop(0)
                self._busy.add(self._key(item))
            try:
                self._fetch(item)
            except Exception:  # noqa: BLE001 - the worker's own read of this file raises it, named
                pass
            finally:
                with self._wish:
                    self._busy.discard(self._key(item))
