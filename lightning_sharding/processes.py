"""The helper processes of one rank (DataLoader workers, a dispatch process): who they are, which died.

PyTorch reports a dead worker as ``DataLoader worker (pid 1234) is killed by signal: Killed.``:
no rank, no worker id, and on a multi-rank job no hint of which of many logs to read. The loaders
re-raise that as :class:`HelperProcessError` naming the rank, the worker and how it ended; the
callback adds the same sentence to an error raised elsewhere (PyTorch raises it from a ``SIGCHLD``
handler, that is, inside whatever the training process was running at the time).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

SETTLE_SECONDS = 2.0  # how long an error that may come from a dying worker waits for its exit status


class HelperProcessError(RuntimeError):
    """A helper process of a rank (a DataLoader worker, the dispatch process) died."""


def how_it_ended(exitcode: int) -> str:
    """``"was killed by SIGKILL"`` or ``"exited with code 3"``."""
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def worker_processes(iterator: Any) -> dict[str, Any]:
    """``{"DataLoader worker <id>": process}`` of a multi-process DataLoader iterator (empty otherwise).

    The iterator's ``_workers`` list is indexed by worker id (PyTorch starts worker ``i`` as ``_workers[i]``).
    """
    return {f"DataLoader worker {i}": w for i, w in enumerate(getattr(iterator, "_workers", None) or [])}


def dead(processes: dict[str, Any], rank: int) -> list[str]:
    """One sentence per process of ``processes`` that ended abnormally, naming the rank and the pid."""
    return [
        f"rank {rank}: {name} (pid {p.pid}) {how_it_ended(p.exitcode)}"
        for name, p in processes.items()
        if p.exitcode not in (None, 0)
    ]


def stop_workers(iterator: Any) -> None:
    """Shut down a DataLoader iterator's workers; this also unregisters them from PyTorch's SIGCHLD
    handler, which would otherwise raise about a dead one again at every later child exit."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _may_be_a_death(err: BaseException) -> bool:
    # How a killed worker first shows: its half-sent tensor's socket resets (OSError), its queue
    # ends (EOFError), or PyTorch's own "DataLoader worker (pid N) ..." errors.
    return isinstance(err, (OSError, EOFError)) or "DataLoader worker" in str(err)


def reraise_if_dead(
    helpers: Callable[[], dict[str, Any]], rank: int, iterator: Any, err: BaseException, doing: str
) -> None:
    """Raise :class:`HelperProcessError` from ``err`` when one of ``helpers()`` died; else return.

    A connection reset by a killed worker can arrive before its exit status: give it a moment.
    """
    deadline = time.monotonic() + (SETTLE_SECONDS if _may_be_a_death(err) else 0.0)
    found: list[str] = []
    while not found:
        try:
            found = dead(helpers(), rank)
            if not found and time.monotonic() >= deadline:
                return
            time.sleep(0.02)
        except RuntimeError:  # PyTorch's SIGCHLD handler, raising about the same death meanwhile
            continue
    stop_workers(iterator)
    raise HelperProcessError(
        f"{'; '.join(found)} while {doing}. Training cannot continue without it: look for an out-of-memory "
        "kill (dmesg) or a crash in native code, then resume from the last checkpoint"
    ) from err
