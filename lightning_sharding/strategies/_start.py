"""How a rank's helper processes (DataLoader workers, a dispatch process) start: the start method.

``multiprocessing_context=None`` (the default) is ``"forkserver"`` where the platform has it, with
torch, this package and the modules of what the workers run preloaded: the server imports them once
per training process, and each worker is forked from it in milliseconds. It is as safe as
``"spawn"`` (the server is a fresh interpreter started before any CUDA context or thread of the
training process could leak into it) and, from the second worker on, nearly as fast as ``"fork"``.
docs/performance.md#worker-start has the figures the default was chosen from.

A spawned or forkserver worker runs the training script's top level again (as ``__mp_main__``), so
the modules that top level imported (``import lightning.pytorch as pl``) are preloaded too: the
server pays for them once instead of every worker. ``"spawn"`` and ``"fork"`` are passed through
as PyTorch takes them.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import types
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from typing import Any

DEFAULT_START_METHOD = "forkserver"
START_METHODS: tuple[str, ...] = ("forkserver", "spawn", "fork")
# What every worker imports, whatever it reads: torch and the worker side of every strategy.
BASE_PRELOAD: tuple[str, ...] = ("torch", "lightning_sharding.strategies._worker")

_started_by: int | None = None  # the pid of the process whose loader started the forkserver


def start_method(requested: str | None) -> str:
    """The start method a loader uses for ``multiprocessing_context=requested``."""
    if requested is None:
        return DEFAULT_START_METHOD if DEFAULT_START_METHOD in multiprocessing.get_all_start_methods() else "spawn"
    return requested


def check_start_method(requested: Any, owner: str) -> None:
    """Raise a ValueError naming ``owner`` unless ``requested`` is a start method this platform has."""
    if requested is None:
        return
    available = [m for m in START_METHODS if m in multiprocessing.get_all_start_methods()]
    if requested not in available:
        raise ValueError(
            f"`{owner}(multiprocessing_context={requested!r})` must be one of {available} "
            f"(or None: {start_method(None)!r}, with torch and the package preloaded)"
        )


def preload_modules(*used: Any) -> list[str]:
    """The modules a forkserver imports for workers that run ``used`` (readers, transforms, datasets):
    :data:`BASE_PRELOAD`, the module of each object's class or function, and what the training
    script's top level imported. Modules of ``__main__`` itself are left out (a worker runs it again)."""
    names = list(BASE_PRELOAD)
    for obj in used:
        if obj is not None:
            names.append(_module_of(obj))
    names += _imported_by_main()
    return [n for n in dict.fromkeys(names) if n and n not in ("__main__", "__mp_main__", "builtins")]


def worker_context(requested: str | None, *used: Any) -> BaseContext:
    """The multiprocessing context for helper processes that run ``used``; for the forkserver, the
    server is started here (it imports while the caller goes on) with :func:`preload_modules`."""
    method = start_method(requested)
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        _start_forkserver(preload_modules(*used))
    return context


def leave_forkserver(_worker_id: int | None = None) -> None:
    """Run first in a helper process (a DataLoader's ``worker_init_fn``): close the forkserver's "alive"
    pipe that multiprocessing hands every process the server starts. A server lives while anyone
    holds that pipe, and a worker lives while its parent, the server, does: after a SIGKILL of the
    training process the workers would keep each other's server alive, and so themselves, forever.
    Closed here, the server exits with the training process and PyTorch's watchdog stops the workers."""
    server: Any = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is None or _started_by == os.getpid():
        return  # not started by a forkserver, or the server is this process's own
    try:
        os.close(alive)
    except OSError:
        pass
    server._forkserver_alive_fd = None


def _start_forkserver(modules: list[str]) -> None:
    """Start this process's forkserver with ``modules`` preloaded, unless it runs already (then the
    modules it lacks are imported by each worker)."""
    global _started_by
    if _started_by == os.getpid():
        return
    # What the user asked multiprocessing.set_forkserver_preload for stays asked for.
    asked = getattr(forkserver._forkserver, "_preload_modules", None) or []
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(dict.fromkeys([*asked, *modules])))
    forkserver.ensure_running()
    _started_by = os.getpid()


def _module_of(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, functools.partial):
        return _module_of(obj.func)
    if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return getattr(obj, "__module__", None) or ""
    return type(obj).__module__


def _imported_by_main() -> list[str]:
    """The modules the training script's top level bound to names: imported modules, and the modules
    of imported classes and functions (``from lightning.pytorch import Trainer``)."""
    main = sys.modules.get("__main__")
    found = []
    for value in vars(main).values() if main is not None else ():
        if isinstance(value, types.ModuleType):
            found.append(value.__name__)
        elif isinstance(value, (type, types.FunctionType)):
            found.append(getattr(value, "__module__", "") or "")
    return [name for name in found if not name.startswith("_")]


def _forget_inherited_forkserver() -> None:
    """In a child forked from a process with a forkserver (Lightning's ``ddp_fork`` ranks), forget
    the parent's server: multiprocessing would ask ``waitpid`` about a process that is not the
    child's own and fail with ``ChildProcessError`` at the first worker. The child starts its own."""
    global _started_by
    server: Any = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is None:
        return
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        try:
            os.close(alive)
        except OSError:
            pass
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
    _started_by = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_forkserver)
