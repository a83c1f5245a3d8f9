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

Each reads local paths through memory maps, and URLs (``s3://``, ``gs://``, ``az://``, ``hf://``,
``file://``...) through the storage layer of the file readers, with their options
(:mod:`~lightning_sharding.tokens.stores`).
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
from lightning_sharding.tokens.stores import (
    MEGATRON_DTYPES,
    MEGATRON_MAGIC,
    MegatronStore,
    ParquetTokensStore,
    TokenFilesStore,
    checked_tokens,
    document_ends,
    megatron_index,
    token_column,
)

Int64Array = npt.NDArray[np.int64]


class DocumentReader(Reader):
    """Items are files of token ids; samples are documents (runs of tokens).

    Subclasses give :meth:`items` (a file's ``num_samples`` is its documents),
    :meth:`document_lengths` and :meth:`read_tokens`, where an item's tokens are its documents one
    after another. A document read alone (:meth:`read`) is a 1-d int64 array of its tokens.

    A reader given URLs keeps in :attr:`store` the file reader that lists and reads them
    (:mod:`~lightning_sharding.tokens.stores`): its prefetch (:meth:`ahead`), counters
    (:meth:`take_stats`) and redaction of credentials (:meth:`scrub`) are the reader's.
    """

    #: The storage layer's reader of the files when they are URLs (or file reader options are given), else ``None``.
    store: Any = None

    def ahead(self, now: Sequence[Item], upcoming: Sequence[Item]) -> None:
        """As the store does (fetches into the shard cache with ``prefetch_files``)."""
        if self.store is not None:
            self.store.ahead(now, upcoming)

    def take_stats(self) -> dict[str, float]:
        """The store's shard-cache counters."""
        return self.store.take_stats() if self.store is not None else {}

    def scrub(self, text: str) -> str:
        """``text`` without the credentials of the store's URLs."""
        return self.store.scrub(text) if self.store is not None else text

    def worker_modules(self) -> list[str]:
        """The store's (fsspec and the storage's package)."""
        return self.store.worker_modules() if self.store is not None else []

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


def _remote(entries: Sequence[Any], options: dict[str, Any]) -> bool:
    """Whether a document reader of ``entries`` reads through the storage layer: some are URLs, or
    file reader options (``storage_options``, ``cache_dir``...) are given."""
    return bool(options) or any("://" in os.fspath(e) for e in entries)


def _entries(paths: str | Sequence[str]) -> list[Any]:
    return [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)


def _read_store(store: Any, item: Item, start: int, stop: int) -> npt.NDArray[np.integer[Any]]:
    """Tokens ``[start, stop)`` of ``item`` from ``store``."""
    return store.read_spans(item, np.array([start], dtype=np.int64), np.array([stop], dtype=np.int64))  # type: ignore[no-any-return]


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
            files (raw tokens of ``dtype``), or URLs and globs of URLs (``s3://bucket/tokens/*.npy``):
            each is then read whole once per job to find its documents, and a worker reads its
            tokens by range (or from the shard cache).
        eos_id: the token that ends a document.
        dtype: the token type of ``.bin`` files (``uint16``, ``int32``...); ``.npy`` files say their own.
        **options: for URLs, the options of :class:`~lightning_sharding.readers.files.FileReader`
            (``storage_options``, ``cache_dir``, ``cache_limit``, ``prefetch_files``, ``retry``...).
    """

    def __init__(self, paths: str | Sequence[str], eos_id: int, dtype: str | None = None, **options: Any) -> None:
        name = type(self).__name__
        if isinstance(eos_id, bool) or not isinstance(eos_id, int) or eos_id < 0:
            raise ValueError(f"{name}(eos_id={eos_id!r}) must be a token id (an integer >= 0)")
        self.eos_id = eos_id
        self.dtype = np.dtype(dtype) if dtype is not None else None
        if self.dtype is not None and self.dtype.kind not in "iu":
            raise ValueError(f"{name}(dtype={dtype!r}) must be an integer type")
        entries = _entries(paths)
        if _remote(entries, options):
            self.paths = [os.fspath(e) for e in entries]
            self.store = TokenFilesStore(self.paths, eos_id, self.dtype, **options)
            bins = any(".bin" in p.rsplit("/", 1)[-1] for p in self.paths)
        else:
            self.paths = _expand(paths, (".npy", ".bin"), name)
            bins = any(p.endswith(".bin") for p in self.paths)
        self.fetch_ahead = getattr(self.store, "fetch_ahead", 0)
        if bins and dtype is None:
            raise ValueError(f"{name}: .bin files hold raw tokens: give their dtype= (uint16, int32, ...)")

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
            maps[path] = checked_tokens(arr.view(np.ndarray), path)  # a plain array: gathers skip memmap's Python
        return maps[path]  # type: ignore[no-any-return]

    def _ends(self, path: str) -> Int64Array:
        """Where each document of ``path`` ends (one past its last token); one scan per process."""
        found: dict[str, Int64Array] = self.__dict__.setdefault("_lengths_cache", {})
        key = f"ends:{path}"
        if key not in found:
            found[key] = document_ends(self._map(path), self.eos_id)
        return found[key]

    def items(self) -> Sequence[Item]:
        """One item per file, with its documents; files are named under the folder they share."""
        if self.store is not None:
            return self.store.items()  # type: ignore[no-any-return]
        items = []
        for path, name in zip(self.paths, _names(self.paths), strict=True):
            ends = self._ends(path)
            st = os.stat(path)
            fingerprint = f"size={st.st_size},mtime={st.st_mtime_ns},eos={self.eos_id}"
            content = f"{local_content_digest(path)};eos={self.eos_id}"
            items.append(Item(path, int(ends.size), fingerprint, name, content))
        return items

    def document_lengths(self, item: Item) -> Int64Array:
        """From the positions of ``eos_id`` in the file (read once per process; for URLs, once per job)."""
        if self.store is not None:
            return self.store.document_lengths(item)  # type: ignore[no-any-return]
        return np.diff(self._ends(item.key), prepend=0)

    def read_tokens(self, item: Item, start: int, stop: int) -> npt.NDArray[np.integer[Any]]:
        """A slice of the memory-mapped file."""
        if self.store is not None:
            return _read_store(self.store, item, start, stop)
        return np.asarray(self._map(item.key)[start:stop])

    def read_spans(self, item: Item, starts: Int64Array, stops: Int64Array) -> npt.NDArray[np.integer[Any]]:
        """One gather from the memory-mapped file (for a URL: ranged reads, or the shard cache's copy)."""
        if self.store is not None:
            return self.store.read_spans(item, starts, stops)  # type: ignore[no-any-return]
        return np.take(self._map(item.key), ranges(starts, stops))

    def token_array(self, item: Item) -> npt.NDArray[np.integer[Any]] | None:
        """The memory-mapped file (a plain array over the map: slices skip memmap's Python); for a
        URL, a map of its local copy, ``None`` while it is read by range."""
        if self.store is not None:
            return self.store.token_array(item)  # type: ignore[no-any-return]
        return self._map(item.key).view(np.ndarray)


class ParquetTokens(DocumentReader):
    """Parquet files with a column of token lists (``input_ids``, as Hugging Face ``datasets``
    writes a tokenized data set): every row group is an item, every row a document, whose length
    is read from the list column's offsets when listing (the column is read once, in the main
    process). A worker keeps the last row group it read and gathers tokens from it.

    Args:
        paths: a glob or a list of paths and globs of ``.parquet`` files, or URLs and globs of URLs
            (``s3://bucket/tokens/*.parquet``): the footers and list offsets are then read once
            per job, and a worker reads a row group's column whole (or from the shard cache).
        column: the column of token lists.
        **options: for URLs, the options of :class:`~lightning_sharding.readers.files.FileReader`
            (``storage_options``, ``cache_dir``, ``cache_limit``, ``prefetch_files``, ``retry``...).
    """

    def __init__(self, paths: str | Sequence[str], column: str = "input_ids", **options: Any) -> None:
        entries = _entries(paths)
        if _remote(entries, options):
            self.paths = [os.fspath(e) for e in entries]
            self.store = ParquetTokensStore(self.paths, column, **options)
        else:
            self.paths = _expand(paths, (".parquet",), type(self).__name__)
        self.fetch_ahead = getattr(self.store, "fetch_ahead", 0)
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
            parquet = self._file(path)
            names = parquet.schema_arrow.names
            if self.column not in names:
                raise ValueError(f"{path!r} has no column {self.column!r}; its columns are {names}")
            column = parquet.read_row_group(group, columns=[self.column]).column(self.column)
            maps.clear()  # one row group at a time
            maps[key] = token_column(column, path, self.column, group)
        return maps[key]  # type: ignore[no-any-return]

    def items(self) -> Sequence[Item]:
        """One item per row group (``path#rg=N``), with its rows as documents."""
        if self.store is not None:
            return self.store.items()  # type: ignore[no-any-return]
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
        if self.store is not None:
            return self.store.document_lengths(item)  # type: ignore[no-any-return]
        offsets, _ = self._row_group(*self._where(item))
        return np.diff(offsets)

    def read_tokens(self, item: Item, start: int, stop: int) -> npt.NDArray[np.integer[Any]]:
        """A slice of the row group's token values."""
        if self.store is not None:
            return _read_store(self.store, item, start, stop)
        return np.asarray(self._row_group(*self._where(item))[1][start:stop])

    def read_spans(self, item: Item, starts: Int64Array, stops: Int64Array) -> npt.NDArray[np.integer[Any]]:
        """One gather from the row group's token values."""
        if self.store is not None:
            return self.store.read_spans(item, starts, stops)  # type: ignore[no-any-return]
        return np.take(self._row_group(*self._where(item))[1], ranges(starts, stops))


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
            ``.idx`` files; or URLs of them (``s3://bucket/tokens/part-*.idx``): each ``.idx`` is then
            read once per job (when listing, kept in ``cache_dir``), and a worker reads the token
            ranges of a batch from the ``.bin`` by range, those near each other with one request (or
            from the shard cache's copy, with ``cache_limit``).
        **options: for URLs, the options of :class:`~lightning_sharding.readers.files.FileReader`
            (``storage_options``, ``cache_dir``, ``cache_limit``, ``prefetch_files``, ``retry``...).
    """

    def __init__(self, prefixes: str | Sequence[str], **options: Any) -> None:
        entries = _entries(prefixes)
        idx = [e if str(e).endswith(".idx") else f"{os.fspath(e)}.idx" for e in entries]
        if _remote(entries, options):  # the store lists the .bin files and reads each one's .idx
            self.prefixes = [p[: -len(".idx")] for p in map(os.fspath, idx)]
            self.store = MegatronStore([f"{p}.bin" for p in self.prefixes], **options)
        else:
            self.prefixes = [p[: -len(".idx")] for p in _expand(idx, (".idx",), type(self).__name__)]
        self.fetch_ahead = getattr(self.store, "fetch_ahead", 0)

    def _index(self, prefix: str) -> tuple[np.dtype[Any], Int64Array]:
        """``(dtype, each document's token count)`` of ``prefix``, checked against its ``.bin``."""
        maps: dict[str, Any] = self.__dict__.setdefault("_maps", {})
        if prefix in maps:
            return maps[prefix]  # type: ignore[no-any-return]
        path = f"{prefix}.idx"
        try:
            raw: Any = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else b""
        except OSError as err:
            raise ValueError(f"{path!r} cannot be read: {err}") from err
        bin_path = f"{prefix}.bin"
        bin_size = os.path.getsize(bin_path) if os.path.exists(bin_path) else -1
        maps[prefix] = megatron_index(raw, path, bin_path, bin_size)
        return maps[prefix]  # type: ignore[no-any-return]

    def items(self) -> Sequence[Item]:
        """One item per prefix, with its documents; named by the ``.bin`` under the folder they share."""
        if self.store is not None:
            return self.store.items()  # type: ignore[no-any-return]
        items = []
        bins = [f"{p}.bin" for p in self.prefixes]
        for prefix, path, name in zip(self.prefixes, bins, _names(bins), strict=True):
            _, lengths = self._index(prefix)
            st = os.stat(path)
            content = f"{local_content_digest(path)};idx={local_content_digest(prefix + '.idx').split(';')[1]}"
            items.append(Item(path, int(lengths.size), f"size={st.st_size},mtime={st.st_mtime_ns}", name, content))
        return items

    def document_lengths(self, item: Item) -> Int64Array:
        """From the index: each document's sequences' lengths, summed."""
        if self.store is not None:
            return self.store.document_lengths(item)  # type: ignore[no-any-return]
        return self._index(item.key[: -len(".bin")])[1]

    def read_tokens(self, item: Item, start: int, stop: int) -> npt.NDArray[np.integer[Any]]:
        """A slice of the memory-mapped ``.bin``."""
        if self.store is not None:
            return _read_store(self.store, item, start, stop)
        return np.asarray(self._bin(item)[start:stop])

    def read_spans(self, item: Item, starts: Int64Array, stops: Int64Array) -> npt.NDArray[np.integer[Any]]:
        """One gather from the memory-mapped ``.bin`` (for a URL: ranged reads, or the shard cache's copy)."""
        if self.store is not None:
            return self.store.read_spans(item, starts, stops)  # type: ignore[no-any-return]
        return np.take(self._bin(item), ranges(starts, stops))

    def token_array(self, item: Item) -> npt.NDArray[np.integer[Any]] | None:
        """The memory-mapped ``.bin``; for a URL, a map of its local copy, ``None`` while it is read by range."""
        if self.store is not None:
            return self.store.token_array(item)  # type: ignore[no-any-return]
        return self._bin(item)

    def _bin(self, item: Item) -> npt.NDArray[np.integer[Any]]:
        maps: dict[str, Any] = self.__dict__.setdefault("_maps", {})
        key = f"bin:{item.key}"
        if key not in maps:
            dtype, _ = self._index(item.key[: -len(".bin")])
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
