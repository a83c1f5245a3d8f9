"""Token documents in object stores: the document readers' files read through the storage layer.

A document reader given URLs (``s3://``, ``gs://``, ``az://``, ``hf://``, ``file://``...) lists
and reads them with one of the :class:`~lightning_sharding.readers.files.FileReader` subclasses
here, as every file reader does: globs expanded by the store's listing, ``storage_options``,
retries of transient errors, each file's index read once per job in the main process (the
``.idx``, the positions of ``eos_id``, the Parquet list offsets) and kept in ``cache_dir``, and,
with ``cache_limit``, whole copies in the shard cache. Each item's index holds its documents'
token counts (``lengths``), where its token 0 lies in the file (``offset``, bytes) and the tokens'
``dtype``; a worker reads the token ranges of a batch with ranged reads, coalesced per file
(:func:`~lightning_sharding.readers.storage.read_ranges`), or from a memory map of the local copy
when the shard cache holds one (or the file is local).
"""

from __future__ import annotations

import contextlib
import io
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.manifest import Item
from lightning_sharding.readers.files import FileReader
from lightning_sharding.readers.index import FileIndex
from lightning_sharding.readers.npy import npy_header
from lightning_sharding.readers.parquet import ParquetReader
from lightning_sharding.readers.storage import FileInfo, digest_of, filesystem, read_ranges
from lightning_sharding.tokens.packing import ranges

Int64Array = npt.NDArray[np.int64]

# Megatron-LM's indexed dataset: the .idx header and its dtype codes (megatron/core/datasets/indexed_dataset.py).
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES: dict[int, Any] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEAD = len(MEGATRON_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequences, documents + 1


def megatron_index(raw: Any, path: str, bin_path: str, bin_size: int) -> tuple[np.dtype[Any], Int64Array]:
    """``(dtype, each document's token count)`` of the Megatron index ``raw`` (its bytes, or a memory
    map), read from ``path``, checked against its ``.bin`` (``bin_size`` bytes; -1: missing)."""
    head = bytes(raw[:_HEAD])
    if len(head) < _HEAD or not head.startswith(MEGATRON_MAGIC):
        raise ValueError(f"{path!r} is not a Megatron index: it does not start with {MEGATRON_MAGIC!r}")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(MEGATRON_MAGIC) :])
    if version != 1:
        raise ValueError(f"{path!r} is a Megatron index of version {version}; this reader reads version 1")
    if code not in MEGATRON_DTYPES or np.dtype(MEGATRON_DTYPES[code]).kind not in "iu":
        raise ValueError(f"{path!r}: dtype code {code} is not an integer token type")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    need = _HEAD + sequences * 4 + sequences * 8 + documents * 8
    if len(raw) < need:
        raise ValueError(
            f"{path!r} holds {len(raw)} bytes but its header promises {sequences} sequences and "
            f"{documents - 1} documents ({need} bytes): the index is truncated"
        )
    lengths = np.frombuffer(raw, dtype="<i4", count=sequences, offset=_HEAD).astype(np.int64)
    pointers = np.frombuffer(raw, dtype="<i8", count=sequences, offset=_HEAD + 4 * sequences)
    bounds = np.frombuffer(raw, dtype="<i8", count=documents, offset=_HEAD + 12 * sequences).astype(np.int64)
    expected = np.concatenate(([0], np.cumsum(lengths)[:-1])) * dtype.itemsize
    tokens = int(lengths.sum())
    if bin_size != tokens * dtype.itemsize or not np.array_equal(pointers, expected):
        what = "is missing" if bin_size < 0 else f"holds {bin_size} bytes"
        raise ValueError(
            f"{path!r} does not match {bin_path!r}: the index lists {tokens} tokens of {dtype} "
            f"({tokens * dtype.itemsize} bytes, back to back) but the .bin {what}; rebuild the index "
            "(or copy the .bin again: it may be truncated)"
        )
    if bounds.size == 0 or bounds[0] != 0 or bounds[-1] != sequences or np.any(np.diff(bounds) < 0):
        raise ValueError(f"{path!r}: its document boundaries do not run from 0 to {sequences} sequences")
    ends = np.concatenate(([0], np.cumsum(lengths)))
    return dtype, ends[bounds[1:]] - ends[bounds[:-1]]


def document_ends(tokens: npt.NDArray[np.integer[Any]], eos_id: int) -> Int64Array:
    """Where each document of a flat token array ends (one past its last token): after each
    ``eos_id``, and at the end for tokens after the last one."""
    ends = np.flatnonzero(tokens == eos_id) + 1
    if ends.size == 0 or ends[-1] != tokens.size:
        ends = np.append(ends, tokens.size)
    return ends.astype(np.int64)


def checked_tokens(tokens: npt.NDArray[Any], path: str) -> npt.NDArray[np.integer[Any]]:
    """``tokens`` (a token file's array), refused naming ``path`` unless it is a 1-d integer array."""
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(
            f"{path!r} holds an array of shape {tokens.shape} and dtype {tokens.dtype}: "
            "token files are 1-d arrays of integer token ids"
        )
    if tokens.size == 0:
        raise ValueError(f"{path!r} holds no tokens: remove it from the paths")
    return tokens


def token_column(column: Any, path: str, name: str, group: int) -> tuple[Int64Array, npt.NDArray[np.integer[Any]]]:
    """``(offsets from 0, values)`` of the token-list column ``name`` of row group ``group`` of
    ``path`` (a pyarrow array), refused naming them unless it holds lists of integers, none null."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise ValueError(f"{path!r}: column {name!r} holds {kind}, not lists of integer token ids")
    if column.null_count:
        raise ValueError(f"{path!r}: column {name!r} has {column.null_count} null rows in row group {group}")
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    return offsets - offsets[0], values


class TokenStore(FileReader):
    """The files of a document reader given URLs (see the module): each item's index holds
    ``lengths`` (its documents' token counts), ``offset`` (bytes before its token 0) and ``dtype``."""

    format = "tokens"

    def __init__(self, urls: str | Sequence[str], **options: Any) -> None:
        super().__init__(urls, **options)
        self._maps: OrderedDict[str, npt.NDArray[np.integer[Any]]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_maps"] = OrderedDict()  # each process maps its files itself
        return state

    def document_lengths(self, item: Item) -> Int64Array:
        """From the item's index (read once per job when listing)."""
        return np.asarray(self.index_of(item)["lengths"], dtype=np.int64)

    def _layout(self, item: Item) -> tuple[np.dtype[Any], int]:
        index = self.index_of(item)
        return np.dtype(str(index["dtype"][0])), int(index["offset"][0])

    @contextlib.contextmanager
    def _local(self, item: Item) -> Iterator[str | None]:
        """A local path of the file of ``item``: the file itself (``file://``), the shard cache's copy
        (``cache_limit``, fetched when missing), or ``None``: read it by range."""
        url, _ = self.split_key(item)
        fs, path = filesystem(url, self.storage_options)
        if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            yield path
            return
        with self.local_copy(item) as copy:
            yield copy

    def _map(self, item: Item, path: str) -> npt.NDArray[np.integer[Any]]:
        """The tokens of ``item`` memory-mapped from the local file ``path`` (the last few kept: a map
        stays valid when the cache evicts its copy, whose space returns when the map is dropped)."""
        found = self._maps.get(item.key)
        if found is None:
            dtype, offset = self._layout(item)
            found = np.memmap(path, dtype=dtype, mode="r", offset=offset).view(np.ndarray)
            self._maps[item.key] = found
            while len(self._maps) > 4:
                self._maps.popitem(last=False)
        return found

    def read_spans(self, item: Item, starts: Int64Array, stops: Int64Array) -> npt.NDArray[np.integer[Any]]:
        """Tokens ``[starts[k], stops[k])`` of ``item``, one after another: one gather from a local
        map, else ranged reads of the file, the ranges near each other read with one request."""
        with self._local(item) as local:
            if local is not None:
                return np.take(self._map(item, local), ranges(starts, stops))
        dtype, offset = self._layout(item)
        size = dtype.itemsize
        blobs = read_ranges(
            self.split_key(item)[0], offset + starts * size, offset + stops * size, self.storage_options, self.retry
        )
        return np.frombuffer(b"".join(blobs), dtype=dtype)

    def token_array(self, item: Item) -> npt.NDArray[np.integer[Any]] | None:
        """A memory map of the file's local copy (or the local file), ``None`` when it is read by range."""
        if item.key in self._maps:
            return self._maps[item.key]
        with self._local(item) as local:
            return None if local is None else self._map(item, local)

    @staticmethod
    def index(lengths: Int64Array, offset: int, dtype: np.dtype[Any], **more: str) -> FileIndex:
        """A file's index: one item of ``lengths`` documents, its tokens ``offset`` bytes in
        (``more``: strings kept beside them)."""
        arrays = {
            "lengths": np.asarray(lengths, dtype=np.int64),
            "offset": np.array([offset], dtype=np.int64),
            "dtype": np.array([dtype.str]),
            **{name: np.array([value]) for name, value in more.items()},
        }
        return FileIndex([""], [int(len(lengths))], [arrays])


class MegatronStore(TokenStore):
    """Megatron ``.bin`` files (the items), each indexed from the ``.idx`` beside it."""

    format = "megatron"

    def scan(self, info: FileInfo) -> FileIndex:
        """Read the ``.idx`` whole (12 bytes a sequence and 8 a document) and check it against the ``.bin``'s size."""
        idx_url = info.url[: -len(".bin")] + ".idx"
        fs, path = filesystem(idx_url, self.storage_options)
        try:
            raw = fs.cat_file(path, start=0)  # a ranged GET from 0: s3fs asks no size first (one request)
        except FileNotFoundError:
            raise ValueError(f"{idx_url!r} does not exist: a Megatron .bin needs its .idx beside it") from None
        dtype, lengths = megatron_index(raw, idx_url, info.url, info.size)
        # The .idx's content id, as the local reader takes it: the item's id names both files.
        idx = digest_of(io.BytesIO(raw), len(raw)).split(";")[1]
        return self.index(lengths, 0, dtype, idx=idx)

    def items(self) -> Sequence[Item]:
        """The ``.bin`` files, each known by its content and its ``.idx``'s, as the local reader knows it
        (a checkpoint of local files resumes from the same files given as URLs, or with options)."""
        return [replace(it, content=f"{it.content};idx={self.index_of(it)['idx'][0]}") for it in super().items()]


class TokenFilesStore(TokenStore):
    """Flat token files (``.npy``, or raw ``.bin`` of ``dtype``), read whole once to find ``eos_id``."""

    format = "token-files"

    def __init__(self, urls: str | Sequence[str], eos_id: int, dtype: np.dtype[Any] | None, **options: Any) -> None:
        super().__init__(urls, **options)
        self.eos_id = eos_id
        self.dtype = dtype

    def options_key(self) -> str:
        """The end of a document and the dtype of raw files make the documents."""
        return f"eos={self.eos_id};dtype={self.dtype}"

    def scan(self, info: FileInfo) -> FileIndex:
        """Read the file (its tokens are the index) and find its documents' ends."""
        if not info.url.endswith((".npy", ".bin")):
            raise ValueError(f"{info.url!r} is not a .npy or .bin file")
        if self.dtype is None and info.url.endswith(".bin"):
            raise ValueError(f"{info.url!r} holds raw tokens: give their dtype= (uint16, int32, ...)")
        (data,) = read_ranges(info.url, [0], [info.size], self.storage_options, self.retry)
        offset, dtype = 0, self.dtype
        if info.url.endswith(".npy"):
            try:
                shape, fortran, dtype, offset = npy_header(io.BytesIO(data))
            except ValueError as err:
                raise ValueError(f"{info.url!r} is not a readable token file: {err}") from err
            if len(shape) != 1 or len(data) < offset + int(np.prod(shape)) * dtype.itemsize:
                raise ValueError(f"{info.url!r} holds an array of shape {shape}: token files are 1-d arrays")
        assert dtype is not None
        if (len(data) - offset) % dtype.itemsize:
            raise ValueError(
                f"{info.url!r} holds {len(data) - offset} bytes of tokens, not a whole number of {dtype} tokens "
                f"({dtype.itemsize} bytes each): give the file's dtype="
            )
        tokens = checked_tokens(np.frombuffer(data, dtype=dtype, offset=offset), info.url)
        return self.index(np.diff(document_ends(tokens, self.eos_id), prepend=0), offset, dtype)

    def items(self) -> Sequence[Item]:
        """The files, each known by its content and ``eos_id``, as the local reader knows it."""
        return [replace(it, content=f"{it.content};eos={self.eos_id}") for it in super().items()]


class ParquetTokensStore(ParquetReader):
    """Parquet row groups (the items) of token lists: their offsets read once per job when listing,
    a row group's column read whole by a worker (from the shard cache's copy when it holds one)."""

    format = "parquet-tokens"

    def __init__(self, urls: str | Sequence[str], column: str, **options: Any) -> None:
        super().__init__(list([urls] if isinstance(urls, str) else urls), columns=[column], **options)
        self.column = column

    def options_key(self) -> str:
        """The column read."""
        return f"column={self.column}"

    def scan(self, info: FileInfo) -> FileIndex:
        """The footer (as :class:`ParquetReader` keeps it) and each row group's documents' lengths."""
        index = super().scan(info)
        fs, path = filesystem(info.url, self.storage_options)
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            for group, arrays in enumerate(index.arrays):
                column = parquet.read_row_group(group, columns=[self.column]).column(self.column)
                offsets, _ = token_column(column, info.url, self.column, group)
                arrays["lengths"] = np.diff(offsets)
        return index

    def columns_of(self, item: Item, table: Any) -> dict[str, Any]:
        """The row group's token values (and their offsets), checked."""
        group = int(self.split_key(item)[1].removeprefix("rg="))
        offsets, values = token_column(table.column(self.column), self.split_key(item)[0], self.column, group)
        return {"offsets": offsets, "values": values}

    def document_lengths(self, item: Item) -> Int64Array:
        """From the item's index (read once per job when listing)."""
        return np.asarray(self.index_of(item)["lengths"], dtype=np.int64)

    def read_spans(self, item: Item, starts: Int64Array, stops: Int64Array) -> npt.NDArray[np.integer[Any]]:
        """One gather from the row group's token values (the worker keeps its last row group)."""
        return np.take(self._group(item)["values"], ranges(starts, stops))
