"""The helper processes of one rank (DataLoader workers, a dispatch process): who they are, which died.

PyTorch reports a dead worker as ``DataLoader worker (pid 1234) is killed by signal: Killed.``:
no rank, no worker id, and on a multi-rank job no hint of which of many logs to read. It raises
that from a ``SIGCHLD`` handler, that is, inside whatever the training process runs at the time
(a collective of a checkpoint, or the launcher formatting an earlier error, which it then loses),
and again at every later child exit. :func:`watch` wraps that handler once per process: the error
becomes a :class:`HelperProcessError` naming the rank, the worker and the signal, raised once. The
loaders also re-raise the errors a dead worker causes while they wait for batches the same way.
"""

from __future__ import annotations

import os
import re
import signal
import threading
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
    # ends (EOFError), or PyTorch's own "DataLoader worker (pid N) ..." errors. Not an exception a
    # worker raised ("Caught ... in DataLoader worker process 0"): that one needs no waiting.
    return isinstance(err, (OSError, EOFError)) or "DataLoader worker (pid" in str(err)


def reraise_if_dead(
    helpers: Callable[[], dict[str, Any]], rank: int, iterator: Any, err: BaseException, doing: str
) -> None:
    """Raise :class:`HelperProcessError` from ``err`` when one of ``helpers()`` died; else return.

    A connection reset by a killed worker can arrive before its exit status: give it a moment.
    """
    deadline = time.monotonic() + (SETTLE_SECONDS if _may_be_a_death(err) else 0.0)
    found: list[str] = []
    while True:
        try:
            found = dead(helpers(), rank)
            if found or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        except RuntimeError:  # PyTorch's SIGCHLD handler, raising about the same death meanwhile
            if time.monotonic() >= deadline:
                break
    if not found:
        return
    stop_workers(iterator)
    raise HelperProcessError(
        f"{'; '.join(found)} while {doing}. Training cannot continue without it: look for an out-of-memory "
        "kill (dmesg) or a crash in native code, then resume from the last checkpoint"
    ) from err


_NAMES: dict[int, str] = {}  # worker pid -> "rank R: DataLoader worker I", for the SIGCHLD handler
_REPORTED: set[int] = set()
_WRAPPED: list[bool] = []


class DoneEvent:
    """PyTorch's workers-done event as the training process uses it: this process alone sets it, so
    whether it is set is known here without taking its lock. A worker SIGKILLed while it held that
    lock (a worker checks the event at every task) holds it forever, and PyTorch, asking the event
    in the very status check that was to report the death, hung (seen with forkserver workers,
    whose deaths only that check finds). ``set`` gives up on the lock after a second: the workers
    stop on the end marker in their queues all the same."""

    def __init__(self, event: Any) -> None:
        self._event = event
        self._set = False

    def is_set(self) -> bool:
        """Whether this process set it."""
        return self._set

    def set(self) -> None:
        """Set it here, and for the workers unless a dead one holds its lock."""
        self._set = True
        cond = self._event._cond
        if cond.acquire(timeout=1.0):
            try:
                self._event._flag.acquire(False)
                self._event._flag.release()
                cond.notify_all()
            finally:
                cond.release()


def watch(iterator: Any, rank: int) -> None:
    """Name the workers of a DataLoader iterator in errors about their death (see module docstring),
    and keep a dead worker's lock from hanging the report of its death (:class:`DoneEvent`)."""
    event = getattr(iterator, "_workers_done_event", None)
    if event is not None and not isinstance(event, DoneEvent) and hasattr(event, "_cond"):
        iterator._workers_done_event = DoneEvent(event)
    for name, process in worker_processes(iterator).items():
        _NAMES[process.pid] = f"rank {rank}: {name}"
    while len(_NAMES) > 1024:  # fresh workers every epoch: keep the recent ones
        del _NAMES[next(iter(_NAMES))]
    if _WRAPPED or threading.current_thread() is not threading.main_thread():
        return
    torch_handler = signal.getsignal(signal.SIGCHLD)
    if not callable(torch_handler):  # PyTorch set none (no workers yet)
        return

    def handler(signum: int, frame: Any) -> None:
        try:
            torch_handler(signum, frame)
        except RuntimeError as err:
            found = re.search(r"pid (\d+)", str(err))
            pid = int(found.group(1)) if found else -1
            if pid in _REPORTED:  # raised once already: not again inside the handling of that error
                return
            _REPORTED.add(pid)
            if pid not in _NAMES:
                raise
            raise HelperProcessError(
                f"{_NAMES[pid]} (pid {pid}) {_exit_status(pid)}. Training cannot continue without it: look for an "
                "out-of-memory kill (dmesg) or a crash in native code, then resume from the last checkpoint"
            ) from err

    signal.signal(signal.SIGCHLD, handler)
    _WRAPPED.append(True)


def _exit_status(pid: int) -> str:
    """How a dead child ended, read without reaping it (PyTorch's own handler leaves it unreaped too)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        info = None
    if info is None:
        return "died"
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return how_it_ended(-info.si_status)
    return how_it_ended(info.si_status)
