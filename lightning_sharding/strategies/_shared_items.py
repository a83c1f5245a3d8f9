"""``SharedItems``: the items one rank's batches need, each loaded ahead into a shared array.

Every name is registered before its file exists, so exit-time cleanup never misses one; a run
killed by SIGKILL leaves files that the next run's first pool sweeps away.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import numpy.typing as npt

import lightning_sharding.strategies._shared_memory as shared_memory
from lightning_sharding.readers.windows import WindowedReader
from lightning_sharding.strategies._shared_memory import SharedArray

# Bytes read from storage per call while filling a shared array: bounds the loader's own memory.
CHUNK_BYTES = 64 << 20
_RUN = secrets.token_hex(3)
_generations = itertools.count()
_swept = threading.Lock()
_swept_once: list[bool] = []


def _unlink_all(names: set[str]) -> None:
    for name in list(names):
        shared_memory.unlink(name)
    names.clear()


class SharedItems:
    """One rank's items in shared arrays for one pass over an epoch plan (main process only).

    ``issue`` hands out an item's shared array (loading it now if the prefetch has not) and counts
    the batch; ``release`` counts it back; ``done_issuing`` says no later batch will need the item.
    An array is unlinked when both hold. At most ``1 + depth`` arrays are loading or live unless
    the current batch needs another.
    """

    def __init__(self, reader: WindowedReader, rank: int, depth: int) -> None:
        with _swept:
            if not _swept_once:  # once per process: leftovers of killed runs on this machine
                shared_memory.sweep_dead()
                _swept_once.append(True)
        self.reader = reader
        self.depth = depth
        token = shared_memory.process_token()
        self._prefix = f"{shared_memory.PREFIX}{_RUN}-{token}-r{rank}-g{next(_generations)}"
        self._loads = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lsh-broadcast")
        self._futures: dict[int, Future[SharedArray]] = {}
        self._names: dict[int, str] = {}
        self._refs: dict[int, int] = {}
        self._issuing: set[int] = set()
        self._upcoming: list[int] = []
        # Every name is registered before its file exists, so exit-time cleanup never misses one.
        self.created: set[str] = set()
        self._finalizer = weakref.finalize(self, _unlink_all, self.created)

    def _start(self, item: int) -> Future[SharedArray]:
        future = self._futures.get(item)
        if future is None:
            name = f"{self._prefix}-n{next(self._loads)}-i{item}"
            self.created.add(name)
            self._names[item] = name
            future = self._futures[item] = self._executor.submit(self._load, item, name)
        return future

    def _load(self, item: int, name: str) -> SharedArray:
        reader = self.reader
        pieces = reader.pieces_with_halo(item)
        shape, dtype = reader.signature(pieces[0][0])
        steps = sum(stop - start for _, start, stop in pieces)
        step_bytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        per_chunk = max(1, CHUNK_BYTES // step_bytes)

        def chunks() -> Iterator[npt.NDArray[Any]]:
            for key, start, stop in pieces:
                for lo in range(start, stop, per_chunk):
                    hi = min(stop, lo + per_chunk)
                    data = np.asarray(reader.load(key, lo, hi))
                    if data.shape != (hi - lo, *shape) or data.dtype != dtype:
                        raise ValueError(
                            f"item {key!r}: load({lo}, {hi}) returned shape {data.shape} and dtype {data.dtype}, "
                            f"expected {(hi - lo, *shape)} and {dtype} like the first item"
                        )
                    yield data

        return shared_memory.write_shared_array(name, chunks(), (steps, *shape), dtype)

    def upcoming(self, items: Sequence[int]) -> None:
        """The items the following batches will need, in order: the prefetch queue."""
        self._upcoming = [i for i in items if i not in self._futures]
        self._pump()

    def _pump(self) -> None:
        while self._upcoming and len(self._futures) < 1 + self.depth:
            self._start(self._upcoming.pop(0))

    def issue(self, items: Iterable[int]) -> dict[int, SharedArray]:
        """The shared arrays of ``items`` for one batch (waits while one is loading); counts the batch."""
        got: dict[int, SharedArray] = {}
        for item in items:
            if item in self._upcoming:
                self._upcoming.remove(item)
            try:
                got[item] = self._start(item).result()
            except Exception as err:
                raise RuntimeError(
                    f"loading item {self.reader.pieces_with_halo(item)[0][0]!r} into shared memory failed: {err}"
                ) from err
            self._refs[item] = self._refs.get(item, 0) + 1
            self._issuing.add(item)
        return got

    def done_issuing(self, item: int) -> None:
        """No batch issued from now on needs ``item``."""
        self._issuing.discard(item)
        self._maybe_unlink(item)

    def release(self, items: Iterable[int]) -> None:
        """A batch that used ``items`` came back from its worker."""
        for item in items:
            self._refs[item] -= 1
            self._maybe_unlink(item)

    def _maybe_unlink(self, item: int) -> None:
        if self._refs.get(item, 0) > 0 or item in self._issuing or item not in self._futures:
            return
        wait([self._futures.pop(item)])  # a load still running finishes before its file goes
        name = self._names.pop(item)
        shared_memory.unlink(name)
        self.created.discard(name)
        self._refs.pop(item, None)
        self._pump()

    @property
    def live(self) -> list[str]:
        """Names of the shared arrays loading or alive now."""
        return sorted(self._names.values())

    def close(self) -> None:
        """Stop prefetching and unlink every shared array of this pool (idempotent)."""
        for future in self._futures.values():
            future.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._futures.clear()
        self._names.clear()
        self._upcoming.clear()
        _unlink_all(self.created)
