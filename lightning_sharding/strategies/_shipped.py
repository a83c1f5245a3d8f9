"""A dataset's state that reaches a new worker through a file, not through the pipe that starts it.

A spawned or forkserver worker is started by writing into a pipe its preparation data, then the
pickled process: the DataLoader's worker loop with its dataset. The new process reads the
preparation data, imports the training script again (as ``__mp_main__``, 0.5-3 s), and only then
reads the rest. A pipe holds 64 KiB, and the dataset of a manifest of 10,000 shards pickles to
2 MB: the training process stays in its write until the worker has imported, and as the
DataLoader starts its workers one after another, they imported one at a time (2 workers took
twice as long as one; docs/performance.md, the first batch).

So a large state (:data:`INLINE_BYTES` and up) is pickled as before, in the launch and with
multiprocessing's own pickler (a shared array in it travels as it would have), into a file under
``/dev/shm``; the pipe carries the file's name (a small state, the pickle itself). The worker reads
the file and removes it: each launch writes its own, read once. A file whose worker never read it
(killed while it imported) is removed when the training process exits, or, if that process was
killed, by the next run's :func:`~lightning_sharding.strategies._shared_memory.sweep_dead` (the
name carries the owner's pid and start time). Without ``/dev/shm``, or when it is full, the state
goes through the pipe.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import secrets
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.context import get_spawning_popen
from typing import Any

import lightning_sharding.strategies._shared_memory as shared_memory
from lightning_sharding.core.private import create_file

# A state pickled to fewer bytes goes through the pipe: with the preparation data and the worker
# loop's other arguments it stays well under the pipe's 64 KiB.
INLINE_BYTES = 16 << 10
_RUN = secrets.token_hex(3)
_launches = itertools.count()
_written: dict[str, int] = {}  # the files written here (a worker removes what it reads): name -> writer's pid


@dataclass(frozen=True)
class Shipped:
    """Where a worker finds a state: a file under ``/dev/shm``, and its size."""

    name: str
    size: int


def ship(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as ``__getstate__`` returns it: itself outside a worker's launch; in one, pickled
    once, as ``{"_shipped": Shipped}`` naming the file that holds the pickle, or, when small (or no
    file could be written), as ``{"_pickled": bytes}``. Never pickled twice: pickling a shared array
    for a launch registers its file descriptor with the launch, and twice is an error."""
    if get_spawning_popen() is None:  # not a spawn or forkserver launch: a copy, a check, a fork
        return state
    data = bytes(reduction.ForkingPickler.dumps(state))
    if len(data) < INLINE_BYTES:
        return {"_pickled": data}
    owner = shared_memory.process_token()
    name = f"{shared_memory.PREFIX}{_RUN}-{owner}-d{next(_launches)}"
    try:
        with os.fdopen(create_file(shared_memory.SHM_DIR / name), "wb") as f:  # 0600, as every file of ours there
            f.write(data)
    except OSError:
        shared_memory.unlink(name)
        return {"_pickled": data}  # no /dev/shm, or it is full: the pipe carries it, as before
    if not _written:
        atexit.register(_remove_unread)
    _written[name] = os.getpid()
    return {"_shipped": Shipped(name, len(data))}


def unship(state: dict[str, Any]) -> dict[str, Any]:
    """The state ``__setstate__`` gets, read back from its file (then removed) when it was shipped."""
    if isinstance(state.get("_pickled"), bytes):
        inline: dict[str, Any] = pickle.loads(state["_pickled"])
        return inline
    shipped = state.get("_shipped")
    if not isinstance(shipped, Shipped):
        return state
    path = shared_memory.SHM_DIR / shipped.name
    try:
        data = path.read_bytes()
    finally:
        shared_memory.unlink(shipped.name)
    if len(data) != shipped.size:
        raise RuntimeError(f"the worker's state in {path} has {len(data)} bytes, not the {shipped.size} written")
    loaded: dict[str, Any] = pickle.loads(data)
    return loaded


def _remove_unread() -> None:
    """At exit: remove what this process wrote and no worker has read (a worker removes what it reads);
    a process forked from it (a ``ddp_fork`` rank) leaves its parent's alone."""
    for name, pid in list(_written.items()):
        if pid == os.getpid():
            shared_memory.unlink(name)
    _written.clear()
