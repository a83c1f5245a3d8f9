"""Non-replicable sources for the ``dispatch`` strategy: read once per rank, in one process.

A :class:`Source` yields elements of an epoch in a deterministic order; the element at index ``p``
of that order is epoch position ``p``, the unit the ledger counts. Every rank's dispatcher opens
the same order (it may depend on ``ctx.seed`` and ``ctx.epoch`` only) and keeps its own share.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from lightning_sharding.core.manifest import Item, Manifest
from lightning_sharding.core.world import WorkerContext, old_name

# The epoch length the ledger uses for a source whose length nobody knows (a queue): positions
# are still exact, only the total is a bound rather than a count.
UNKNOWN_LENGTH = 2**62


class Source(ABC):
    """A source that must not be copied into DataLoader workers: a cursor, a socket, a decoder.

    ``open`` runs in the rank's dispatch process (or in the training process with 0 workers);
    the source object is pickled there, so hold paths and options, not open handles.

    - A *seekable* source (``seekable = True``, the default) starts ``open(ctx, start)`` exactly
      at position ``start``: it seeks, or replays the order and skips (:func:`skip`). Resume is
      then exactly-once through the ledger, also on another number of ranks or workers.
    - A source that can do neither sets ``seekable = False``. Once a checkpoint is saved,
      :meth:`commit` gets the position below which everything was consumed; the source must
      resume from its last commit, and ``open(ctx, start)`` (``start`` is at least the commit
      of the checkpoint resumed from) skips forward from there. Elements consumed after the last
      checkpoint are delivered again after a crash, so delivery is at-least-once.
    """

    seekable: ClassVar[bool] = True

    @abstractmethod
    def open(self, ctx: WorkerContext, start: int) -> Iterable[Any]:
        """The elements of epoch ``ctx.epoch`` from position ``start`` on, in a deterministic order."""

    def length(self) -> int | None:
        """Elements per epoch, or ``None`` when unknown (then use ``even_batches="sync"``)."""
        return None

    def fingerprint(self) -> str:
        """Anything that changes when the data changes; stored in checkpoints and checked on resume."""
        return ""

    def commit(self, position: int, *, epoch: int) -> None:  # noqa: B027 - an optional hook
        """Every position of ``epoch`` below ``position`` is consumed and checkpointed.

        Called in the training process of every rank (with the same arguments) once the
        checkpoint holding it has been written. A queue's consumer acknowledges its offset here.
        """

    def describe(self) -> str:
        """A short name for error messages."""
        return type(self).__name__


def skip(elements: Iterable[Any], start: int) -> Iterator[Any]:
    """Replay-and-skip for a source that cannot seek: ``elements`` from index ``start`` on."""
    return itertools.islice(elements, start, None)


def source_manifest(source: Source) -> Manifest:
    """A one-item manifest for ``source``: its length (or :data:`UNKNOWN_LENGTH`) and fingerprint."""
    length = source.length()
    count = UNKNOWN_LENGTH if length is None else int(length)
    if count < 1:
        raise ValueError(f"{source.describe()}.length() returned {length}; a source must hold at least one element")
    return Manifest.from_items([Item(f"source:{source.describe()}", count, fingerprint=source.fingerprint())])


class SqliteSource(Source):
    """Rows of a SQLite query, read through one cursor per rank, as dicts of column to value.

    The query must have an ``ORDER BY`` that makes the order deterministic. It may use the named
    parameters ``:seed`` and ``:epoch`` (the shared seed and the epoch), for example to shuffle
    with ``ORDER BY (id * 2654435761 + :seed) % 4294967296, id``. Seeking uses ``OFFSET``.
    """

    def __init__(self, path: str | os.PathLike[str], query: str) -> None:
        self.path = os.fspath(path)
        self.query = query.strip().rstrip(";")
        if "order by" not in self.query.lower():
            raise ValueError(
                f"SqliteSource(query={query!r}) needs an ORDER BY: without one SQLite may return rows in "
                "another order on each open, and resuming would skip or repeat rows"
            )
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"SqliteSource: no database file at {self.path!r}")

    def _params(self, ctx: WorkerContext | None) -> dict[str, int]:
        values = {"seed": ctx.seed if ctx else 0, "epoch": ctx.epoch if ctx else 0}
        return {k: v for k, v in values.items() if f":{k}" in self.query}

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)

    def open(self, ctx: WorkerContext, start: int) -> Iterator[dict[str, Any]]:
        """Rows from position ``start`` on (``LIMIT -1 OFFSET start``)."""
        con = self._connect()
        try:
            cursor = con.execute(f"{self.query} LIMIT -1 OFFSET :_start", {**self._params(ctx), "_start": start})
            names = [d[0] for d in cursor.description]
            for row in cursor:
                yield dict(zip(names, row, strict=True))
        finally:
            con.close()

    def length(self) -> int:
        """The query's row count (``:seed``/``:epoch`` do not change it, only the order)."""
        con = self._connect()
        try:
            params = {k: 0 for k in self._params(None)}
            return int(con.execute(f"SELECT COUNT(*) FROM ({self.query})", params).fetchone()[0])
        except sqlite3.DatabaseError as err:  # a corrupt file or a query that does not fit it
            raise ValueError(f"SqliteSource({self.path!r}): cannot run the query on this database: {err}") from err
        finally:
            con.close()

    def fingerprint(self) -> str:
        """The file's size and modification time, and the query."""
        st = os.stat(self.path)
        return f"{st.st_size}:{st.st_mtime_ns}:{self.query}"

    def describe(self) -> str:
        """``SqliteSource(<path>)``."""
        return f"SqliteSource({self.path})"


if not TYPE_CHECKING:  # type checkers see only today's names

    def __getattr__(name: str) -> Any:
        """``ShardContext``, which this module offered before 0.2 (``WorkerContext`` now), warned."""
        return old_name(__name__, name)
