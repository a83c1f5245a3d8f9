"""Tokenized documents: readers whose items are files of token ids and whose samples are documents.

A :class:`DocumentReader` lists its files with each one's documents and their token counts, read
from an index, never from the tokens themselves where the format has one; inside workers it
reads runs of tokens (:meth:`DocumentReader.read_tokens`), which packing
(:mod:`~lightning_sharding.tokens.packing`) turns into sequences. Two formats here:

- :class:`TokenFiles`: flat token files (``.npy`` of integers, or raw ``.bin`` of a given dtype),
  split into documents after each ``eos_id``;
- :class:`IndexedTokens`: Megatron-LM's indexed dataset (``prefix.bin`` + ``prefix.idx``), its
  index memory-mapped and checked against its ``.bin``;
- :class:`ParquetTokens`: Parquet files with a column of token lists (``input_ids``), row groups
  as items (needs the ``files`` extra, pyarrow).
"""

from __future__ import annotations

import glob
import os
import struct
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.identity import common_root
from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.readers.base import Reader
from lightning_sharding.readers.storage import local_content_digest
from lightning_sharding.tokens.packing import ranges

Int64Array = npt.NDArray[np.int64]


class DocumentReader(Reader):
    """Items are files of token ids; samples are documents (runs of tokens).

    Subclasses give :meth:`items` (a file's ``num_samples`` is its documents),
    :meth:`document_lengths` and :meth:`read_tokens`, where an item's tokens are its documents one
    after another. A document read alone (:meth:`read`) is a 1-d int64 array of its tokens.
    """

    @abstractmethod
    def document_lengths(self, item: Item) -> Int64Array:
        """The token count of each document of ``item``, shape ``(item.num_samples,)``."""

    @abstractmethod
    def read_tokens(self, item: Item, start: int, stop: int) -> npt.NDArray[np.integer[Any]]:
        """Tokens ``[start, stop)`` of ``item`` (its documents one after another), shape ``(stop - start,)``."""

    def read_spans(self, item: Item, starts: Int64Array, stops: Int64Array) -> npt.NDArray[np.integer[Any]]:
        """Tokens ``[starts[k], stops[k])`` of ``item`` for every ``k``, one after another, shape
        ``(sum(stops - starts),)``; by default one :meth:`read_tokens` each (a memory-mapped file
        gathers them at once)."""
        parts = [self.read_tokens(item, a, b) for a, b in zip(starts.tolist(), stops.tolist(), strict=True)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def token_array(self, item: Item) -> npt.NDArray[np.integer[Any]] | None:
        """All of ``item``'s tokens as one array (a memory map), which a stretch of packed sequences
        reads with a slice a span; ``None`` (the default): it reads them with :meth:`read_spans`."""
        return None

    def lengths(self, items: Sequence[Item]) -> Int64Array:
        """Every document's token count, item after item, shape ``(num_documents,)``."""
        parts = [np.asarray(self.document_lengths(it), dtype=np.int64) for it in items]
        for item, part in zip(items, parts, strict=True):
            if part.shape != (item.num_samples,):
                raise ValueError(
                    f"{type(self).__name__}.document_lengths gave {part.size} lengths for item {item.key!r} "
                    f"of {item.num_samples} documents"
                )
            empty = np.flatnonzero(part <= 0)
            if empty.size:
                raise ValueError(
                    f"document {int(empty[0])} of {item.key!r} holds no tokens ({empty.size} empty document(s) "
                    "in the file): remove empty documents from the data"
                )
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def read(self, item: Item, index: int, ctx: WorkerContext) -> Any:
        """Document ``index`` of ``item``: its tokens, int64, shape ``(length,)``."""
        lengths = self._item_lengths(item)
        start = int(lengths[:index].sum())
        return np.asarray(self.read_tokens(item, start, start + int(lengths[index])), dtype=np.int64)

    def _item_lengths(self, item: Item) -> Int64Array:
        cache: dict[str, Int64Array] = self.__dict__.setdefault("_lengths_cache", {})
        if item.key not in cache:
            cache[item.key] = np.asarray(self.document_lengths(item), dtype=np.int64)
        return cache[item.key]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lengths_cache", "_maps")}


def _expand(paths: str | Sequence[str], suffixes: tuple[str, ...], owner: str) -> list[str]:
    """``paths``: a glob, or a list of paths and globs; every match, sorted within each glob."""
    entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    found: list[str] = []
    for entry in map(os.fspath, entries):
        matched = sorted(glob.glob(entry)) if glob.has_magic(entry) else [entry]
        if not matched:
            raise ValueError(f"{owner}: {entry!r} matches no file")
        found.extend(matched)
    for path in found:
        if not path.endswith(suffixes):
            raise ValueError(f"{owner}: {path!r} is not a {' or '.join(suffixes)} file")
        if not os.path.exists(path):
            raise ValueError(f"{owner}: {path!r} does not exist")
    if len(set(found)) != len(found):
        raise ValueError(f"{owner}: a file is listed twice in {paths!r}")
    return found


def _names(paths: Sequence[str]) -> list[str]:
    """Each path relative to the folder the paths share (what a checkpoint knows a file by)."""
    absolute = [os.path.abspath(p) for p in paths]
    root = common_root(absolute)
    return [p[len(root) :] for p in absolute]


class TokenFiles(DocumentReader):
    """Flat files of token ids, split into documents after each ``eos_id`` (the ``eos_id`` ends
    its document; tokens after the last one are a last document).

    Args:
        paths: a glob or a list of paths and globs of ``.npy`` (1-d integer arrays) or ``.bin``
            files (raw tokens of ``dtype``).
        eos_id: the token that ends a document.
        dtype: the token type of ``.bin`` files (``uint16``, ``int32``...); ``.npy`` files say their own.
    """

    def __init__(self, paths: str | Sequence[str], eos_id: int, dtype: str | None = None) -> None:
        name = type(self).__name__
        self.paths = _expand(paths, (".npy", ".bin"), name)
        if isinstance(eos_id, bool) or not isinstance(eos_id, int) or eos_id < 0:
            raise ValueError(f"{name}(eos_id={eos_id!r}) must be a token id (an integer >= 0)")
        self.eos_id = eos_id
        if any(p.endswith(".bin") for p in self.paths) and dtype is None:
            raise ValueError(f"{name}: .bin files hold raw tokens: give their dtype= (uint16, int32, ...)")
        self.dtype = np.dtype(dtype) if dtype is not None else None
        if self.dtype is not None and self.dtype.kind not in "iu":
            raise ValueError(f"{name}(dtype={dtype!r}) must be an integer type")

    def _map(self, path: str) -> npt.NDArray[np.integer[Any]]:
        maps: dict[str, Any] = self.__dict__.setdefault("_maps", {})
        if path not in maps:
            try:
                if path.endswith(".npy"):
                    arr = np.load(path, mmap_mode="r")
                else:
                    assert self.dtype is not None
                    arr = np.memmap(path, dtype=self.dtype, mode="r")
            except (OSError, ValueError) as err:
                raise ValueError(f"{path!r} is not a readable token file: {err}") from err
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(
                    f"{path!r} holds an array of shape {arr.shape} and dtype {arr.dtype}: "
                    "token files are 1-d arrays of integer token ids"
                )
            maps[path] = arr.view(np.ndarray)  # a plain array: gathers skip memmap's Python
        return maps[path]  # type: ignore[no-any-return]

    def _ends(self, path: str) -> Int64Array:
        """Where each document of ``path`` ends (one past its last token); one scan per process."""
        found: dict[str, Int64Array] = self.__dict__.setdefault("_lengths_cache", {})
        key = f"ends:{path}"
        if key not in found:
            tokens = self._map(path)
            ends = np.flatnonzero(tokens == self.eos_id) + 1
            if ends.size == 0 or ends[-1] != tokens.size:
                ends = np.append(ends, tokens.size)
            found[key] = ends.astype(np.int64)
        return found[key]

    def items(self) -> Sequence[Item]:
        """One item per file, with its documents; files are named under the folder they share."""
        items = []
        for path, name in zip(self.paths, _names(self.paths), strict=True):
            ends = self._ends(path)
            if self._map(path).size == 0:
                raise ValueError(f"{path!r} holds no tokens: remove it from the paths")
            st = os.stat(path)
            fingerprint = f"size={st.st_size},mtime={st.st_mtime_ns},eos={self.eos_id}"
            content = f"{local_content_digest(path)};eos={self.eos_id}"
            items.append(Item(path, int(ends.size), fingerprint, name, content))
        return items

    def document_lengths(self, item: Item) -> Int64Array:
        """From the positions of ``eos_id`` in the file (read once per process)."""
        return np.diff(self._ends(item.key), prepend=0)

    def read_tokens(self, item: Item, start: int, stop: int) -> npt.NDArray[np.integer[Any]]:
        """A slice of the memory-mapped file."""
        return np.asarray(self._map(item.key)[start:stop])

    def read_spans(self, item: Item, starts: Int64Array, stops: Int64Array) -> npt.NDArray[np.integer[Any]]:
        """One gather from the memory-mapped file."""
        return np.take(self._map(item.key), ranges(starts, stops))

    def token_array(self, item: Item) -> npt.NDArray[np.integer[Any]]:
        """The memory-mapped file (a plain array over the map: slices skip memmap's Python)."""
        return self._map(item.key).view(np.ndarray)


class ParquetTokens(DocumentReader):
    """Parquet files with a column of token lists (``input_ids``, as Hugging Face ``datasets``
    writes a tokenized data set): every row group is an item, every row a document, whose length
    is read from the list column's offsets when listing (the column is read once, in the main
    process). A worker keeps the last row group it read and gathers tokens from it.

    Args:
        paths: a glob or a list of paths and globs of ``.parquet`` files (local).
        column: the column of token lists.
    """

    def __init__(self, paths: str | Sequence[str], column: str = "input_ids") -> None:
        self.paths = _expand(paths, (".parquet",), type(self).__name__)
        self.column = column

    def _file(self, path: str) -> Any:
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError("ParquetTokens needs pyarrow: pip install 'lightning-sharding[files]'") from err
        try:
            return pq.ParquetFile(path)
        except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a file that is not Parquet
            raise ValueError(f"{path!r} is not a readable Parquet file: {err}") from err

    def _row_group(self, path: str, group: int) -> tuple[Int64Array, npt.NDArray[np.integer[Any]]]:
        """``(offsets, values)`` of the token column in row group ``group`` of ``path`` (the last kept)."""
        key = f"{path}#rg={group}"
        maps: dict[str, Any] = self.__dict__.setdefault("_maps", {})
        if key not in maps:
            import pyarrow as pa

            parquet = self._file(path)
            names = parquet.schema_arrow.names
            if self.column not in names:
                raise ValueError(f"{path!r} has no column {self.column!r}; its columns are {names}")
            column = parquet.read_row_group(group, columns=[self.column]).column(self.column).combine_chunks()
            kind = column.type
            if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
                raise ValueError(f"{path!r}: column {self.column!r} holds {kind}, not lists of integer token ids")
            if column.null_count:
                raise ValueError(
                    f"{path!r}: column {self.column!r} has {column.null_count} null rows in row group {group}"
                )
            offsets = column.offsets.to_numpy().astype(np.int64)
            values = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
            maps.clear()  # one row group at a time
            maps[key] = (offsets - offsets[0], values)
        return maps[key]  # type: ignore[no-any-return]

    def items(self) -> Sequence[Item]:
        """One item per row group (``path#rg=N``), with its rows as documents."""
        items = []
        for path, name in zip(self.paths, _names(self.paths), strict=True):
            meta = self._file(path).metadata
            st = os.stat(path)
            content = local_content_digest(path)
            for group in range(meta.num_row_groups):
                rows = meta.row_group(group).num_rows
                fingerprint = f"size={st.st_size},mtime={st.st_mtime_ns}"
                items.append(Item(f"{path}#rg={group}", rows, fingerprint, f"{name}#rg={group}", content))
        return items

    def _where(self, item: Item) -> tuple[str, int]:
        path, _, group = item.key.rpartition("#rg=")
        return path, int(group)

    def document_lengths(self, item: Item) -> Int64Array:
        """From the list column's offsets."""
        offsets, _ = self._row_group(*self._where(item))
        return np.diff(offsets)

    def read_tokens(self, item: Item, start: int, stop: int) -> npt.NDArray[np.integer[Any]]:
        """A slice of the row group's token values."""
        return np.asarray(self._row_group(*self._where(item))[1][start:stop])

    def read_spans(self, item: Item, starts: Int64Array, stops: Int64Array) -> npt.NDArray[np.integer[Any]]:
        """One gather from the row group's token values."""
        return np.take(self._row_group(*self._where(item))[1], ranges(starts, stops))


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


class IndexedTokens(DocumentReader):
    """Megatron-LM's indexed dataset: ``prefix.bin`` (the tokens) and ``prefix.idx`` (the index).

    The ``.idx`` holds, little-endian: the magic ``MMIDIDX\\0\\0``, the version (``<Q``, 1), the
    dtype code (``<B``: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16), the sequence count
    ``S`` and the document count ``D + 1`` (``<Q`` each), then ``S`` int32 sequence lengths, ``S``
    int64 byte offsets into the ``.bin``, and ``D + 1`` int64 document boundaries (sequence
    indices, from 0 to ``S``). A document is its sequences, one after another; the lengths come
    from the index alone. An index that does not match its ``.bin`` (another size, offsets that
    are not back to back) is refused naming the file.

    Args:
        prefixes: one prefix or a list of prefixes (paths without ``.bin``/``.idx``), or globs of
            ``.idx`` files.
    """

    def __init__(self, prefixes: str | Sequence[str]) -> None:
        entries = [prefixes] if isinstance(prefixes, (str, os.PathLike)) else list(prefixes)
        idx = [e if str(e).endswith(".idx") else f"{os.fspath(e)}.idx" for e in entries]
        self.prefixes = [p[: -len(".idx")] for p in _expand(idx, (".idx",), type(self).__name__)]

    def _index(self, prefix: str) -> tuple[np.dtype[Any], Int64Array, Int64Array]:
        """``(dtype, lengths, document boundaries)`` of ``prefix``, checked against its ``.bin``."""
        maps: dict[str, Any] = self.__dict__.setdefault("_maps", {})
        if prefix in maps:
            return maps[prefix]  # type: ignore[no-any-return]
        path = f"{prefix}.idx"
        try:
            with open(path, "rb") as f:
                head = f.read(len(MEGATRON_MAGIC) + 8 + 1 + 8 + 8)
        except OSError as err:
            raise ValueError(f"{path!r} cannot be read: {err}") from err
        if len(head) < len(MEGATRON_MAGIC) + 25 or not head.startswith(MEGATRON_MAGIC):
            raise ValueError(f"{path!r} is not a Megatron index: it does not start with {MEGATRON_MAGIC!r}")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[len(MEGATRON_MAGIC) :])
        if version != 1:
            raise ValueError(f"{path!r} is a Megatron index of version {version}; this reader reads version 1")
        if code not in MEGATRON_DTYPES or np.dtype(MEGATRON_DTYPES[code]).kind not in "iu":
            raise ValueError(f"{path!r}: dtype code {code} is not an integer token type")
        dtype = np.dtype(MEGATRON_DTYPES[code])
        offset = len(head)
        need = offset + sequences * 4 + sequences * 8 + documents * 8
        size = os.path.getsize(path)
        if size < need:
            raise ValueError(
                f"{path!r} holds {size} bytes but its header promises {sequences} sequences and "
                f"{documents - 1} documents ({need} bytes): the index is truncated"
            )
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        lengths = np.frombuffer(raw, dtype="<i4", count=sequences, offset=offset).astype(np.int64)
        pointers = np.frombuffer(raw, dtype="<i8", count=sequences, offset=offset + 4 * sequences)
        bounds = np.frombuffer(raw, dtype="<i8", count=documents, offset=offset + 12 * sequences).astype(np.int64)
        bin_path = f"{prefix}.bin"
        bin_size = os.path.getsize(bin_path) if os.path.exists(bin_path) else -1
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
        maps[prefix] = (dtype, lengths, bounds)
        return maps[prefix]  # type: ignore[no-any-return]

    def items(self) -> Sequence[Item]:
        """One item per prefix, with its documents; named by the ``.bin`` under the folder they share."""
        items = []
        bins = [f"{p}.bin" for p in self.prefixes]
        for prefix, path, name in zip(self.prefixes, bins, _names(bins), strict=True):
            _, _, bounds = self._index(prefix)
            st = os.stat(path)
            content = f"{local_content_digest(path)};idx={local_content_digest(prefix + '.idx').split(';')[1]}"
            items.append(Item(path, int(bounds.size - 1), f"size={st.st_size},mtime={st.st_mtime_ns}", name, content))
        return items

    def document_lengths(self, item: Item) -> Int64Array:
        """From the index: each document's sequences' lengths, summed."""
        _, lengths, bounds = self._index(item.key[: -len(".bin")])
        ends = np.concatenate(([0], np.cumsum(lengths)))
        return ends[bounds[1:]] - ends[bounds[:-1]]

    def read_tokens(self, item: Item, start: int, stop: int) -> npt.NDArray[np.integer[Any]]:
        """A slice of the memory-mapped ``.bin``."""
        return np.asarray(self._bin(item)[start:stop])

    def read_spans(self, item: Item, starts: Int64Array, stops: Int64Array) -> npt.NDArray[np.integer[Any]]:
        """One gather from the memory-mapped ``.bin``."""
        return np.take(self._bin(item), ranges(starts, stops))

    def token_array(self, item: Item) -> npt.NDArray[np.integer[Any]]:
        """The memory-mapped ``.bin``."""
        return self._bin(item)

    def _bin(self, item: Item) -> npt.NDArray[np.integer[Any]]:
        maps: dict[str, Any] = self.__dict__.setdefault("_maps", {})
        key = f"bin:{item.key}"
        if key not in maps:
            dtype, _, _ = self._index(item.key[: -len(".bin")])
            # A plain array over the map: gathers skip memmap's Python.
            maps[key] = np.memmap(item.key, dtype=dtype, mode="r").view(np.ndarray)
        return maps[key]  # type: ignore[no-any-return]


def write_indexed(prefix: str, documents: Sequence[npt.ArrayLike], dtype: Any = np.uint16) -> None:
    """Write ``documents`` (arrays of token ids) as a Megatron indexed dataset ``prefix.bin`` +
    ``prefix.idx``, one sequence per document (as Megatron's preprocessing writes them)."""
    code = next(c for c, t in MEGATRON_DTYPES.items() if np.dtype(t) == np.dtype(dtype))
    arrays = [np.asarray(d, dtype=dtype) for d in documents]
    if not arrays:
        raise ValueError(f"write_indexed({prefix!r}): no documents to write")
    lengths = np.array([a.size for a in arrays], dtype="<i4")
    pointers = (np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)[:-1])) * np.dtype(dtype).itemsize).astype("<i8")
    with open(f"{prefix}.bin", "wb") as f:
        for a in arrays:
            f.write(a.tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MEGATRON_MAGIC + struct.pack("<QBQQ", 1, code, len(arrays), len(arrays) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(arrays) + 1, dtype="<i8").tobytes())
