"""NumPy ``.npy`` files: one item per file, one sample per row (or per run of tokens).

Only the header is read to index a file. Local files are memory-mapped and rows are gathered from
the map without reading the rest; remote files are read row by row with ranged requests.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.readers.base import Columns
from lightning_sharding.readers.files import FileReader
from lightning_sharding.readers.index import FileIndex
from lightning_sharding.readers.storage import FileInfo, filesystem


def npy_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """``(shape, fortran_order, dtype, offset of the data)`` of the ``.npy`` file open in ``f``, read
    from its start (``f`` is left at the data)."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    return shape, fortran, dtype, f.tell()


class NpyReader(FileReader):
    """``.npy`` arrays; sample ``i`` is row ``i`` (``array[i]``), as ``{key: row}`` or the bare row.

    Args:
        urls: files (see :class:`FileReader`).
        sample_length: for 1-d arrays (token files), cut the array into consecutive samples of
            this many elements; a tail shorter than that is not served.
        key: the sample dict's key; ``None`` makes each sample the bare array.
        **options: :class:`FileReader` options.
    """

    format = "npy"

    def __init__(
        self, urls: str | list[str], *, sample_length: int | None = None, key: str | None = "x", **options: Any
    ) -> None:
        super().__init__(urls, **options)
        if sample_length is not None and sample_length < 1:
            raise ValueError(f"`NpyReader(sample_length={sample_length})` must be positive")
        self.sample_length = sample_length
        self.key = key
        self._maps: OrderedDict[str, np.ndarray[Any, Any]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_maps"] = OrderedDict()
        return state

    def options_key(self) -> str:
        """The sample length changes the sample count."""
        return f"sample_length={self.sample_length}"

    def scan(self, info: FileInfo) -> FileIndex:
        """Read the header; check that the file holds all the data the header promises."""
        fs, path = filesystem(info.url, self.storage_options)
        with fs.open(path, "rb") as f:
            shape, fortran, dtype, offset = npy_header(f)
        if dtype.hasobject:
            raise ValueError("holds Python objects; save plain numeric arrays")
        if fortran and len(shape) > 1:
            raise ValueError("is in Fortran order; save it with np.save(np.ascontiguousarray(a))")
        if not shape:
            raise ValueError("holds a 0-d scalar; a sample needs at least one dimension")
        expected = offset + math.prod(shape) * dtype.itemsize
        if info.size >= 0 and info.size < expected:
            raise ValueError(
                f"is truncated: the header promises shape {shape} of {dtype} ({expected} bytes), "
                f"the file has {info.size}"
            )
        row_shape = shape[1:]
        count = shape[0]
        if self.sample_length is not None:
            if len(shape) != 1:
                raise ValueError(f"has shape {shape}; sample_length= needs a 1-d array")
            count, row_shape = shape[0] // self.sample_length, (self.sample_length,)
        arrays = {
            "offset": np.array([offset], dtype=np.int64),
            "row_shape": np.array(row_shape, dtype=np.int64),
            "dtype": np.array([dtype.str]),
        }
        return FileIndex([""], [int(count)], [arrays])

    def check_indexes(self, files: Sequence[FileInfo], indexes: Sequence[FileIndex]) -> None:
        """Every file's rows must have the first file's shape and dtype: batches stack rows of many files."""
        first = None
        for info, idx in zip(files, indexes, strict=True):
            arrays = idx.arrays[0]
            layout = (tuple(int(n) for n in arrays["row_shape"]), np.dtype(str(arrays["dtype"][0])))
            if first is None:
                first = (info.url, layout)
            elif layout != first[1]:
                raise ValueError(
                    f"{info.url}: holds rows of shape {layout[0]} and dtype {layout[1]}, but the first file "
                    f"{first[0]} holds rows of shape {first[1][0]} and dtype {first[1][1]}; every file must "
                    "have the same row shape and dtype (convert it, or read the two kinds with two readers)"
                )

    def _array(self, url: str) -> np.ndarray[Any, Any] | None:
        """A read-only memory map of a local file (``None`` for remote files)."""
        mm = self._maps.get(url)
        if mm is None:
            fs, path = filesystem(url, self.storage_options)
            if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
                return None
            mm = np.load(path, mmap_mode="r", allow_pickle=False)
            if self.sample_length is not None:
                n = mm.shape[0] // self.sample_length
                mm = mm[: n * self.sample_length].reshape(n, self.sample_length)
            self._maps[url] = mm
            while len(self._maps) > 8:
                self._maps.popitem(last=False)
        return mm

    def rows(self, item: Item, indices: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
        """Rows ``indices`` of ``item`` as one array of shape ``(n, *row_shape)``."""
        url, _ = self.split_key(item)
        mm = self._array(url)
        if mm is not None:
            return np.asarray(mm[indices])
        idx = self.index_of(item)
        dtype = np.dtype(str(idx["dtype"][0]))
        row_shape = tuple(int(s) for s in idx["row_shape"])
        row_bytes = math.prod(row_shape) * dtype.itemsize
        starts = int(idx["offset"][0]) + indices * row_bytes
        blobs = self.read_ranges(item, starts, starts + row_bytes)
        return np.frombuffer(bytearray(b"".join(blobs)), dtype=dtype).reshape(len(indices), *row_shape)

    def read_batch(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> list[Any]:
        """Gather the rows in one call, then split them into samples."""
        rows = self.rows(item, indices)
        return list(rows) if self.key is None else [{self.key: row} for row in rows]

    def read_columns(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> Columns:
        """The rows in one array of shape ``(n, *row_shape)`` (under ``key``, when given)."""
        rows = self.rows(item, indices)
        return rows if self.key is None else {self.key: rows}
