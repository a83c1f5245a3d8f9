"""Recipe ``sqlite``: a non-replicable source (a SQLite cursor) read through strategy ``dispatch``.

One dispatch process per rank reads the query; the DataLoader workers decode the rows. Until 0.2 the
recipe was ``stream`` (this module ``recipes.stream``); both old names still work, warned.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lightning_sharding.core.world import SampleContext
from lightning_sharding.lightning.datamodule import ShardedDataModule
from lightning_sharding.readers.sources import SqliteSource
from lightning_sharding.readers.synthetic import regression_arrays
from lightning_sharding.recipes.data import datamodule, generated


def write_table(path: Path, rows: int, dim: int) -> None:
    """A table ``samples(id INTEGER PRIMARY KEY, x BLOB, y REAL)`` of ``rows`` regression rows;
    ``x`` holds ``dim`` float32 values."""
    ids = np.arange(rows, dtype=np.int64)
    x, y = regression_arrays(ids, dim)
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE samples (id INTEGER PRIMARY KEY, x BLOB, y REAL)")
        con.executemany(
            "INSERT INTO samples VALUES (?, ?, ?)",
            ((int(i), xi.tobytes(), float(yi)) for i, xi, yi in zip(ids, x, y, strict=True)),
        )
    con.close()


def decode(row: Mapping[str, Any], ctx: SampleContext | None = None) -> dict[str, Any]:
    """A row ``{"id", "x": float32 bytes, "y"}`` -> ``{"id", "x": (dim,), "y"}`` (runs in the workers)."""
    return {"id": int(row["id"]), "x": np.frombuffer(row["x"], dtype=np.float32).copy(), "y": np.float32(row["y"])}


def sqlite_rows(
    *,
    path: str | None,
    query: str,
    rows: int,
    dim: int,
    sharding: Mapping[str, Any],
    audit_dir: str | None = None,
    **options: Any,
) -> ShardedDataModule:
    """``data=sqlite``: rows of ``query`` on the database ``path`` (generated when ``path`` is empty)."""
    if not path:
        where = generated(
            options["cache_dir"], f"sqlite-{rows}x{dim}", lambda d: write_table(d / "samples.db", rows, dim)
        )
        path = str(where / "samples.db")
    return datamodule(options, sharding, source=SqliteSource(path, query), transform=decode, audit_dir=audit_dir)
