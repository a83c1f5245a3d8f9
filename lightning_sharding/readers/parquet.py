"""Parquet: every row group is an item, every row a sample, with column selection.

Indexing reads only each file's footer. A worker reads just the row group it needs (and only the
selected columns), keeps the last one, and gathers rows from it: as columns, with no per-sample
object, when every selected column is numeric (or equal-length numeric lists).
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.readers.base import Columns
from lightning_sharding.readers.files import FileReader
from lightning_sharding.readers.index import FileIndex
from lightning_sharding.readers.storage import FileInfo, filesystem, with_retries


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError("ParquetReader needs pyarrow: pip install 'lightning-sharding[files]'") from err
    return pq


def _column_values(column: Any) -> Any:
    """A column as a NumPy array when it is numeric or a list of equal-length numeric lists."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = column.type
    if pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
        lengths = column.value_lengths().to_numpy(zero_copy_only=False)
        if len(lengths) and column.null_count == 0 and (lengths == lengths[0]).all():
            values = column.flatten().to_numpy(zero_copy_only=False)
            return values.reshape(len(column), int(lengths[0]))
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        if column.null_count == 0:
            return column.to_numpy(zero_copy_only=False)
    return column.to_pylist()


class ParquetReader(FileReader):
    """Parquet files; items are row groups (``url#rg=N``), samples are rows as ``{column: value}``.

    Args:
        urls: files (see :class:`FileReader`).
        columns: the columns to read (``None`` reads all).
        **options: :class:`FileReader` options.
    """

    format = "parquet"

    def __init__(self, urls: str | list[str], *, columns: list[str] | None = None, **options: Any) -> None:
        super().__init__(urls, **options)
        self.columns = list(columns) if columns is not None else None
        self._groups: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_groups"] = OrderedDict()
        return state

    def scan(self, info: FileInfo) -> FileIndex:
        """Read the footer: one item per row group, with its row count."""
        fs, path = filesystem(info.url, self.storage_options)
        with fs.open(path, "rb") as f:
            meta = _pyarrow().ParquetFile(f).metadata
            counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            names = set(meta.schema.to_arrow_schema().names)
        missing = [c for c in (self.columns or []) if c not in names]
        if missing:
            raise ValueError(f"has no column(s) {missing}; it has {sorted(names)}")
        # Keep the footer so that reading a row group later costs no second request for it.
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        meta.write_metadata_file(sink)
        footer = np.frombuffer(sink.getvalue().to_pybytes(), dtype=np.uint8)
        # Row group 0 keeps it, the others an empty one: every item has the same arrays, so the files
        # of a listing or a data index share one set of arrays, whatever their row groups.
        arrays = [{"footer": footer if i == 0 else footer[:0]} for i in range(len(counts))]
        return FileIndex([f"rg={i}" for i in range(len(counts))], counts, arrays)

    def row_group(self, item: Item) -> Any:
        """The row group of ``item`` as a pyarrow table of the selected columns: from the shard cache's
        copy when there is one, else from storage (the footer kept in the index: no request for it)."""
        url, suffix = self.split_key(item)
        number = int(suffix.removeprefix("rg="))
        fs, path = filesystem(url, self.storage_options)

        footer = self.file_index(item).arrays[0]["footer"]
        metadata = _pyarrow().read_metadata(io.BytesIO(footer.tobytes()))

        def read() -> Any:
            with self.local_copy(item) as local, open(local, "rb") if local else fs.open(path, "rb") as f:
                return _pyarrow().ParquetFile(f, metadata=metadata).read_row_group(number, columns=self.columns)

        table = with_retries(read, f"reading {item.key}", self.retry)
        if table.num_rows != item.num_samples:
            raise ValueError(f"{item.key}: has {table.num_rows} rows, the manifest says {item.num_samples}")
        return table

    def columns_of(self, item: Item, table: Any) -> dict[str, Any]:
        """What a worker keeps of a row group's ``table``: each column's values (see :meth:`row_group`)."""
        return {name: _column_values(table.column(name)) for name in table.column_names}

    def _group(self, item: Item) -> dict[str, Any]:
        group = self._groups.get(item.key)
        if group is None:
            group = self.columns_of(item, self.row_group(item))
            self._groups[item.key] = group
            while len(self._groups) > 1:  # one row group per worker: batches are contiguous runs
                self._groups.popitem(last=False)
        return group

    def read_batch(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> list[Any]:
        """Rows ``indices`` of the item's row group."""
        group = self._group(item)
        taken = {
            name: (values[indices] if isinstance(values, np.ndarray) else [values[i] for i in indices])
            for name, values in group.items()
        }
        return [{name: column[k] for name, column in taken.items()} for k in range(len(indices))]

    def read_columns(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> Columns:
        """Rows ``indices`` as ``{column: array of shape (n, ...)}``: one take per column of the row
        group. A column of anything else (text, nulls, ragged lists) is read sample by sample."""
        group = self._group(item)
        other = [name for name, values in group.items() if not isinstance(values, np.ndarray)]
        if other:
            raise TypeError(f"{item.key}: column(s) {other} are not numeric arrays")
        return {name: values[indices] for name, values in group.items()}
