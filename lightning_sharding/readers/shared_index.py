"""Index once per job: the files are listed once and each indexed once, the ranks receive the items.

The DataModule opens :func:`collective` around building a manifest, at a point every rank reaches;
inside it, a :class:`~lightning_sharding.readers.files.FileReader`'s ``items()`` lists on the leaders
only and the other ranks receive rank 0's items through the process group:

- ``index_once_per="job"``: global rank 0 lists. The files to index are spread over every rank of
  the job (rank r indexes every ``world_size``-th one, :func:`on_every_rank`), the partial indexes
  are gathered, and every rank assembles the whole manifest. Each machine's local rank 0 writes the
  indexes into its ``cache_dir``, where the workers of every rank on it read them; a worker that
  finds no index there scans the one file it reads, once, and keeps it.
- ``"node"``: every node's local rank 0 leads, for nodes that share no disk: each fills its own
  node's cache, and the manifests of the leaders are compared before any sample is read.
- ``"rank"``: every rank lists and indexes for itself (the behaviour before this existed).

A leader's failure (a missing object, no permission) is raised on every rank, naming the leader,
so no rank is left waiting in a collective. Outside :func:`collective` (the CLI, one process,
DataLoader workers) ``items()`` lists and indexes by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

from lightning_sharding.core.world import World
from lightning_sharding.distributed.collectives import broadcast_object, gather_objects

INDEX_ONCE_PER = ("job", "node", "rank")
_WORLD: ContextVar[World | None] = ContextVar("lightning_sharding_index_world", default=None)
# Errors re-raised on the ranks that waited, as the leader's own kind where it is one of these.
_KINDS: dict[str, type[Exception]] = {k.__name__: k for k in (FileNotFoundError, PermissionError, ValueError)}
T = TypeVar("T")


def current_world() -> World | None:
    """The world of the :func:`collective` block being run (``None`` outside one, or for one rank)."""
    return _WORLD.get()


@contextmanager
def collective(world: World) -> Iterator[None]:
    """Every rank of ``world`` builds its manifests inside this block, in the same order."""
    token = _WORLD.set(world if world.world_size > 1 else None)
    try:
        yield
    finally:
        _WORLD.reset(token)


def check_index_once_per(value: str, owner: str) -> str:
    """``value`` if it is one of :data:`INDEX_ONCE_PER`, else a ValueError naming ``owner``."""
    if value not in INDEX_ONCE_PER:
        raise ValueError(f"`{owner}(index_once_per={value!r})` must be one of {list(INDEX_ONCE_PER)}")
    return value


def is_leader(world: World, per: str) -> bool:
    """Whether this rank lists and indexes under ``index_once_per=per``."""
    return per == "rank" or (world.rank == 0 if per == "job" else world.local_rank == 0)


def shared_items(build: Callable[[], T], per: str, what: str) -> T:
    """``build()`` on the leaders, rank 0's result on the others (inside :func:`collective`)."""
    world = _WORLD.get()
    if world is None or per == "rank":
        return build()
    leader = is_leader(world, per)
    items: T | None = None
    error: Exception | None = None
    if leader:
        try:
            items = build()
        except Exception as err:  # every rank must hear of it before anyone raises
            error = err
    raise_any(world, error, f"lists and indexes {what} for this job (index_once_per={per!r})")
    received = broadcast_object(items if world.rank == 0 else None, world.world_size)
    return items if leader and items is not None else received


def on_every_rank(work: Callable[[], T], world: World, what: str) -> list[T]:
    """``work()`` on every rank of ``world``, and every rank's result, in rank order (a collective
    call). A rank's failure is raised on every rank, naming the rank that failed."""
    result: T | None = None
    error: Exception | None = None
    try:
        result = work()
    except Exception as err:  # every rank must hear of it before anyone raises
        error = err
    raise_any(world, error, what)
    return gather_objects(result, world.world_size)


def raise_any(world: World, error: Exception | None, what: str) -> None:
    """Raise ``error`` here, or the first other rank's, on every rank (a collective call)."""
    failure = None if error is None else (type(error).__name__, str(error))
    failures = gather_objects(failure, world.world_size)
    if error is not None:
        raise error
    for rank, failed in enumerate(failures):
        if failed is not None:
            kind, message = failed
            raise _KINDS.get(kind, RuntimeError)(f"rank {rank} {what} and failed: {message}")
