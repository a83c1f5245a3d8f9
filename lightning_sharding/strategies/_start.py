"""How a rank's helper processes (DataLoader workers, a dispatch process) start: the start method.

``multiprocessing_context=None`` (the default) is, on Linux, ``"forkserver"`` with torch, this package
and the modules of what the workers run preloaded: the server imports them once per training
process, and each worker is forked from it in milliseconds. It is as safe as ``"spawn"``: the server
is a new interpreter (exec'd, not forked), so no CUDA context, thread or lock of the training
process reaches it, whenever it starts. From the second worker on it is nearly as fast as ``"fork"``.
docs/performance.md#worker-start has the figures the default was chosen from.

Where a forkserver cannot serve, the default is what Python's is: ``"spawn"`` on macOS (forking a
process that loaded Apple's frameworks is unsafe) and Windows, and ``"fork"`` in a notebook or an
interactive session, whose classes no new process can import. ``"spawn"``, ``"fork"`` or a context
are passed through as PyTorch takes them (``multiprocessing.set_start_method`` is not consulted: a
process that multiprocessing spawned, such as a ``ddp_spawn`` rank, has it set by no choice of yours).

A spawned or forkserver worker runs the training script's top level again (as ``__mp_main__``), so
the well-known heavy packages that top level imported (``import lightning.pytorch as pl``) are
preloaded too: the server pays for them once instead of every worker. Other modules of the script
are not (one that starts a thread at import would put it into every worker); add yours with
``multiprocessing.set_forkserver_preload``, whose list is kept. The garbage collector pauses while
the server imports, and what it imported is frozen (:func:`gc.freeze`) before it forks a worker
(``lightning_sharding.preload.pause`` and ``resume``, first and last in the list).
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

from lightning_sharding.core.spelling import option

START_METHODS: tuple[str, ...] = ("forkserver", "spawn", "fork")
# What every worker imports, whatever it reads: torch and the worker side of every strategy.
BASE_PRELOAD: tuple[str, ...] = ("torch", "lightning_sharding.strategies._worker")
# The packages of a training script's imports that the server preloads: heavy, and known to start no
# thread and touch no device when imported.
SAFE_TO_PRELOAD = frozenset(
    (
        "torch",
        "lightning",
        "pytorch_lightning",
        "lightning_fabric",
        "lightning_sharding",
        "numpy",
        "hydra",
        "omegaconf",
        "pyarrow",
    )
)

# First and last in a forkserver's preload list: the collector pauses while the server imports.
_PRELOAD_FRAME = ("lightning_sharding.preload.pause", "lightning_sharding.preload.resume")

_started_by: int | None = None  # the pid of the process whose loader started the forkserver
_served: int | None = None  # the pid of the forkserver that started a helper process of this process
_importing: int | None = None  # the pid of the forkserver this process started, while it may still import


def start_method(requested: str | BaseContext | None) -> str:
    """The start method a loader uses for ``multiprocessing_context=requested`` (see the module)."""
    if isinstance(requested, BaseContext):
        return requested.get_start_method()
    if requested is not None:
        return requested
    # Not multiprocessing's global start method: a process that multiprocessing spawned (a ddp_spawn
    # rank) has it set to its parent's, by no choice of the user's.
    if not sys.platform.startswith("linux"):
        return "spawn"
    return "fork" if _interactive() else "forkserver"


def check_start_method(requested: Any, owner: str) -> None:
    """Raise a ValueError naming ``owner`` unless ``requested`` is a start method this platform has."""
    if requested is None or isinstance(requested, BaseContext):
        return
    available = [m for m in START_METHODS if m in multiprocessing.get_all_start_methods()]
    if requested not in available:
        raise ValueError(
            f"`{owner}(multiprocessing_context={requested!r})` must be one of {available} "
            f"(or None: {start_method(None)!r} here)"
        )


def preload_modules(*used: Any) -> list[str]:
    """The modules a forkserver imports for workers that run ``used`` (readers, transforms, datasets):
    :data:`BASE_PRELOAD`, the module of each object's class or function, what a reader names in its
    ``worker_modules()`` (a storage's package, such as ``s3fs``), and the modules of the training
    script's imports from :data:`SAFE_TO_PRELOAD`. ``__main__`` is left out (a worker runs it again)."""
    names = list(BASE_PRELOAD)
    for obj in used:
        if obj is not None:
            names.append(_module_of(obj))
            asked = getattr(obj, "worker_modules", None)  # a reader's storage package (Reader.worker_modules)
            names += list(asked()) if callable(asked) else []
    names += _imported_by_main()
    return [n for n in dict.fromkeys(names) if n and n not in ("__main__", "__mp_main__", "builtins")]


def worker_context(requested: str | BaseContext | None, *used: Any) -> BaseContext:
    """The multiprocessing context for helper processes that run ``used``; for the forkserver, the
    server is started here (it imports while the caller goes on) with :func:`preload_modules`."""
    if isinstance(requested, BaseContext):
        return requested
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "a new worker ran the training script's top level again, and it started training: put the "
            'code that trains under `if __name__ == "__main__":` (a spawned or forkserver worker imports '
            f"the script as __mp_main__), or pass {option('multiprocessing_context', 'fork')}"
        )
    method = start_method(requested)
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        _start_forkserver(preload_modules(*used))
    return context


def _interactive() -> bool:
    """A notebook or an interactive interpreter: its ``__main__`` has no file for a new process to import."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__file__", None) is not None or getattr(main, "__spec__", None) is not None:
        return False
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "get_ipython" in vars(main)


def slow_to_start(method: str) -> bool:
    """Whether helper processes started now with ``method`` wait on imports before they run: spawned
    ones always (each imports torch); a forkserver's until it has started one for this process (its
    preload is done by then); forked ones never."""
    if method == "spawn":
        return True
    if method != "forkserver":
        return False
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid is None or pid != _served


def forkserver_importing() -> bool:
    """Whether this process started a forkserver that has started no helper process for it yet: its
    preload (torch: about a second of one core) may be under way, and work that can wait should let
    it run first (the setup's indexing threads: :func:`~lightning_sharding.readers.files.indexing_yields`)."""
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid is not None and pid == _importing and pid != _served


def note_started(method: str) -> None:
    """Helper processes were just started with ``method``: a forkserver's preload is done from now on."""
    global _served
    if method == "forkserver":
        _served = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


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
    global _started_by, _importing
    if _started_by == os.getpid():
        return
    running = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    # What the user asked multiprocessing.set_forkserver_preload for stays asked for; the garbage
    # collector pauses while the server imports them all (lightning_sharding.preload).
    asked = getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None) or []
    multiprocessing.get_context("forkserver").set_forkserver_preload(framed_preload(asked, modules))
    forkserver.ensure_running()
    _started_by = os.getpid()
    started = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    _importing = started if started != running else None  # a server that ran already imported before


def framed_preload(asked: list[str], modules: list[str]) -> list[str]:
    """A forkserver's preload list: what was ``asked`` before (the user's, or a previous server's list),
    then ``modules``, each once, between :data:`_PRELOAD_FRAME`'s two modules."""
    wanted = [m for m in dict.fromkeys([*asked, *modules]) if m not in _PRELOAD_FRAME]
    return [_PRELOAD_FRAME[0], *wanted, _PRELOAD_FRAME[1]]


def _module_of(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, functools.partial):
        return _module_of(obj.func)
    if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return getattr(obj, "__module__", None) or ""
    return type(obj).__module__


def _imported_by_main() -> list[str]:
    """The modules of :data:`SAFE_TO_PRELOAD` that the training script's top level bound to names:
    imported modules, and the modules of imported classes and functions (``from lightning.pytorch
    import Trainer``)."""
    main = sys.modules.get("__main__")
    found = []
    for value in list(vars(main).values()) if main is not None else ():
        if isinstance(value, types.ModuleType):
            found.append(value.__name__)
        elif isinstance(value, (type, types.FunctionType)):
            found.append(getattr(value, "__module__", "") or "")
    return [name for name in found if name.split(".")[0] in SAFE_TO_PRELOAD]


def _forget_inherited_forkserver() -> None:
    """In a child forked from a process with a forkserver (Lightning's ``ddp_fork`` ranks), forget
    the parent's server: multiprocessing would ask ``waitpid`` about a process that is not the
    child's own and fail with ``ChildProcessError`` at the first worker. The child starts its own."""
    global _started_by, _served, _importing
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
    _started_by = _served = _importing = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_forkserver)
