"""Index once per job: one process lists and indexes the files, the other ranks receive the items.

The DataModule opens :func:`collective` around building a manifest, at a point every rank reaches;
inside it, a :class:`~lightning_sharding.readers.files.FileReader`'s ``items()`` lists and indexes on
the leaders only and the other ranks receive rank 0's items through the process group:

- ``index_once_per="job"``: global rank 0 leads. It writes the file indexes to its ``cache_dir``,
  where the workers of every rank on its machine (or on any machine sharing that directory) read
  them; a worker that finds no index there scans the one file it reads, once, and keeps it.
- ``"node"``: every node's local rank 0 leads, for nodes that share no disk: each fills its own
  node's cache, and the manifests of the leaders are compared before any sample is read.
- ``"rank"``: every rank lists and indexes for itself (the behaviour before this existed).

A leader's failure (a missing object, no permission) is raised on every rank, naming the leader,
so no rank is left waiting in a collective. Outside :func:`collective` (the CLI, one process,
DataLoader workers) ``items()`` lists and indexes by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import World
from lightning_sharding.distributed.collectives import broadcast_object, gather_objects

INDEX_ONCE_PER = ("job", "node", "rank")
_WORLD: ContextVar[World | None] = ContextVar("lightning_sharding_index_world", default=None)
# Errors re-raised on the ranks that waited, as the leader's own kind where it is one of these.
_KINDS: dict[str, type[Exception]] = {k.__name__: k for k in (FileNotFoundError, PermissionError, ValueError)}


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


def shared_items(build: Callable[[], Sequence[Item]], per: str, what: str) -> Sequence[Item]:
    """``build()`` on the leaders, rank 0's result on the others (inside :func:`collective`)."""
    world = _WORLD.get()
    if world is None or per == "rank":
        return build()
    leader = is_leader(world, per)
    items: Sequence[Item] | None = None
    error: Exception | None = None
    if leader:
        try:
            items = build()
        except Exception as err:  # every rank must hear of it before anyone raises
            error = err
    failure = None if error is None else (type(error).__name__, str(error))
    failures = gather_objects(failure, world.world_size)
    if error is not None:
        raise error
    for rank, failed in enumerate(failures):
        if failed is not None:
            kind, message = failed
            raise _KINDS.get(kind, RuntimeError)(
                f"rank {rank} lists and indexes {what} for this job (index_once_per={per!r}) and failed: {message}"
            )
    received = broadcast_object(items if world.rank == 0 else None, world.world_size)
    return items if leader and items is not None else received
