"""Real non-replicable sources for the dispatch tests: a SQLite file and a TCP stream on loopback.

Everything here is module level so it pickles into the dispatch process and the workers. torch is
imported inside the transforms only: the dispatch process unpickles this module and never needs it.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lightning_sharding.core.world import SampleContext, WorkerContext
from lightning_sharding.readers.sources import Source, SqliteSource

# The order rotates with the epoch, so a batch leaking from one epoch into the next has wrong ids.
ROTATING_QUERY = "SELECT id, payload FROM samples ORDER BY (id + :epoch * 17) % (SELECT COUNT(*) FROM samples), id"


def make_db(path: Path, n: int) -> Path:
    """A SQLite file with rows ``(id, payload)`` for ids ``0..n-1``."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE samples (id INTEGER PRIMARY KEY, payload TEXT)")
    con.executemany("INSERT INTO samples VALUES (?, ?)", [(i, f"row-{i}") for i in range(n)])
    con.commit()
    con.close()
    return path


def row_to_sample(row: dict[str, Any], ctx: SampleContext) -> dict[str, Any]:
    """The replicable per-sample transform: a row becomes tensors ``{"id", "x" (8,), "y"}``."""
    import torch

    i = int(row["id"])
    x = np.sin(i * 0.618 + np.arange(8)).astype(np.float32)
    return {"id": torch.tensor(i), "x": torch.from_numpy(x), "y": torch.tensor(float(x.sum()))}


def _mark_fault(db_path: str) -> None:
    """Note when a fault happened (next to the database), so a test can time how fast it surfaces."""
    Path(db_path).with_suffix(".fault").write_text(str(time.time()))


class FailingSqlite(SqliteSource):
    """Raises when the dispatcher reaches ``fail_at`` (a corrupt row)."""

    def __init__(self, path: str, query: str, fail_at: int) -> None:
        super().__init__(path, query)
        self.fail_at = fail_at

    def open(self, ctx: WorkerContext, start: int) -> Iterator[dict[str, Any]]:
        for position, row in enumerate(super().open(ctx, start), start):
            if position == self.fail_at:
                _mark_fault(self.path)
                raise ValueError(f"corrupt row at position {position}")
            yield row


class DyingSqlite(SqliteSource):
    """SIGKILLs the process reading it (the dispatcher) when it reaches ``die_at``."""

    def __init__(self, path: str, query: str, die_at: int) -> None:
        super().__init__(path, query)
        self.die_at = die_at

    def open(self, ctx: WorkerContext, start: int) -> Iterator[dict[str, Any]]:
        for position, row in enumerate(super().open(ctx, start), start):
            if position == self.die_at:
                _mark_fault(self.path)
                os.kill(os.getpid(), signal.SIGKILL)
            yield row


class ProgressSqlite(SqliteSource):
    """Writes the highest position the dispatcher has read, to measure how far it runs ahead."""

    def __init__(self, path: Path, progress: Path) -> None:
        super().__init__(path, ROTATING_QUERY)
        self.progress = str(progress)

    def open(self, ctx: WorkerContext, start: int) -> Iterator[dict[str, Any]]:
        for position, row in enumerate(super().open(ctx, start), start):
            Path(self.progress).write_text(str(position))
            yield row


def slow_transform(row: dict[str, Any], ctx: SampleContext) -> dict[str, Any]:
    """:func:`row_to_sample`, 20 ms slower: workers slower than the source."""
    time.sleep(0.02)
    return row_to_sample(row, ctx)


class TcpStream(Source):
    """A stream of ids from :class:`LogServer`: it cannot seek, it resumes where it was committed."""

    seekable = False

    def __init__(self, port: int) -> None:
        self.port = port

    def _call(self, line: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        sock.sendall(line.encode() + b"\n")
        return sock

    def open(self, ctx: WorkerContext, start: int) -> Iterator[dict[str, Any]]:
        with self._call(f"OPEN {ctx.epoch}") as sock, sock.makefile("r") as lines:
            first = int(lines.readline().split()[1])  # "FROM <position>"
            if first > start:
                raise RuntimeError(
                    f"the stream resumes at position {first}, after the checkpoint's {start}: "
                    "positions in between are lost; resume from the newest checkpoint"
                )
            for position, line in enumerate(lines, first):
                if position >= start:
                    yield {"id": int(line)}

    def commit(self, position: int, *, epoch: int) -> None:
        with self._call(f"COMMIT {epoch} {position}") as sock:
            sock.recv(16)

    def describe(self) -> str:
        return f"TcpStream(127.0.0.1:{self.port})"


class LogServer:
    """A tiny log server on 127.0.0.1: each ``OPEN`` streams ids from the epoch's committed offset."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.commits: list[tuple[int, int]] = []
        self.committed: dict[int, int] = {}
        self.opens = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            self._answer(conn)
        except OSError:  # the reader went away (a killed rank)
            pass

    def _answer(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rw") as f:
            words = f.readline().split()
            if words[0] == "OPEN":
                self.opens += 1
                first = self.committed.get(int(words[1]), 0)
                f.write(f"FROM {first}\n" + "".join(f"{i}\n" for i in range(first, self.n)))
            elif words[0] == "COMMIT":
                epoch, position = int(words[1]), int(words[2])
                self.commits.append((epoch, position))
                self.committed[epoch] = max(self.committed.get(epoch, 0), position)
                f.write("OK\n")

    def stop(self) -> None:
        self._server.close()


def make_source(spec: dict[str, Any]) -> Source:
    """The source a job config names: ``{"kind": "sqlite" | "tcp", ...}``."""
    if spec["kind"] == "tcp":
        return TcpStream(spec["port"])
    query = spec.get("query", ROTATING_QUERY)
    if spec.get("fail_at") is not None:
        return FailingSqlite(spec["path"], query, spec["fail_at"])
    if spec.get("die_at") is not None:
        return DyingSqlite(spec["path"], query, spec["die_at"])
    return SqliteSource(spec["path"], query)
