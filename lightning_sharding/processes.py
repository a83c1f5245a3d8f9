"""The helper processes of one rank (DataLoader workers, a dispatch process): who they are, which died.

PyTorch reports a dead worker as ``DataLoader worker (pid 1234) is killed by signal: Killed.``:
no rank, no worker id, and on a multi-rank job no hint of which of many logs to read. The loaders
re-raise that as :class:`HelperProcessError` naming the rank, the worker and how it ended; the
callback adds the same sentence to an error raised elsewhere (PyTorch raises it from a ``SIGCHLD``
handler, that is, inside whatever the training process was running at the time).
"""

from __future__ import annotations

import signal
from typing import Any


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


def reraise_if_dead(processes: dict[str, Any], rank: int, err: BaseException, doing: str) -> None:
    """Raise :class:`HelperProcessError` from ``err`` when one of ``processes`` died; else return."""
    found = dead(processes, rank)
    if found:
        raise HelperProcessError(
            f"{'; '.join(found)} while {doing}. Training cannot continue without it: look for an out-of-memory "
            "kill (dmesg) or a crash in native code, then resume from the last checkpoint"
        ) from err
