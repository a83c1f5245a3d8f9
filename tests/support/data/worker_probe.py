"""A reader whose samples tell what its worker process sees of the training process's memory: the
value of a module global and the state of a lock that the training process changed after importing
this module, and the state of its garbage collector (tests/process/test_worker_start.py)."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Sequence
from typing import Any

from lightning_sharding import Reader
from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import WorkerContext

MARKER = "as imported"
LOCK = threading.Lock()


class ProbeReader(Reader):
    """Two items of 8 samples; each sample: its id, its worker's pid and parent's pid, what the
    worker sees of :data:`MARKER` and :data:`LOCK`, whether its collector runs, and how many objects
    it holds frozen (:func:`gc.get_freeze_count`)."""

    def items(self) -> Sequence[Item]:
        return [Item("a", 8), Item("b", 8)]

    def read(self, item: Item, index: int, ctx: WorkerContext) -> Any:
        free = LOCK.acquire(blocking=False)
        if free:
            LOCK.release()
        return {
            "id": (0 if item.key == "a" else 8) + index,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "marker": MARKER,
            "lock_free": free,
            "gc_enabled": gc.isenabled(),
            "gc_frozen": gc.get_freeze_count(),
        }
