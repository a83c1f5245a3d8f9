"""Fetch ahead: a worker's background threads put the files of its next items into the local
shard cache, in the order the plan gives, while the worker reads the current one.

The worker tells them, at every batch, which items come next (:meth:`Prefetcher.want`); ``depth``
threads take them in that order, so up to ``depth`` files download at once (a store's latency is
paid once per round, not once per file), and an older wish is forgotten when a newer one arrives.
A file already cached costs a ``stat``; one that another process or thread is fetching is waited
for on the cache's lock, never fetched twice. A failed prefetch is dropped: the worker's own read
fetches the file again and raises what it finds, so an error is never lost nor raised twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from lightning_sharding.manifest import Item


class Prefetcher:
    """Fetch ``fetch(item)`` for the items of the newest wish, in order, ``threads`` at once; an item
    whose ``key`` is being fetched already is not fetched again by another thread."""

    def __init__(self, fetch: Callable[[Item], None], threads: int, key: Callable[[Item], str]) -> None:
        self._fetch, self._key = fetch, key
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
