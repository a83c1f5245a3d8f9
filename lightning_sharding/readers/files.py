"""The base of every file reader: list URLs, index each file once (in parallel), cache the index.

A file's index (sample count, byte offsets, row groups) is a pure function of its content, so it
is cached under a name derived from the URL, the file's fingerprint (size and mtime or ETag) and
the reader's options. The next start loads it instead of scanning; a changed file gets a new
fingerprint and is scanned again. Workers find the same cache file from the item alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import warnings
from abc import abstractmethod
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from typing_extensions import override

from lightning_sharding.core.manifest import Item
from lightning_sharding.core.private import URL_CREDENTIALS, check_mode, hide_credentials, scrub
from lightning_sharding.core.world import WorkerContext, World
from lightning_sharding.distributed.collectives import gather_objects
from lightning_sharding.readers.base import Reader
from lightning_sharding.readers.cache import ShardCache, resolve_limit
from lightning_sharding.readers.data_index import changed_because, data_index_there, read_data_index
from lightning_sharding.readers.index import (
    INDEX_VERSION,
    FileIndex,
    ListingIndex,
    Progress,
    default_cache_dir,
    write_atomically,
)
from lightning_sharding.readers.prefetch import Prefetcher, check_prefetch, files_ahead
from lightning_sharding.readers.shared_index import (
    check_index_once_per,
    current_world,
    on_every_rank,
    raise_any,
    shared_items,
)
from lightning_sharding.readers.storage import (
    STORAGES,
    FileInfo,
    RetryPolicy,
    content_digest,
    filesystem,
    list_files,
    scheme_of,
    with_retries,
)

Indexed = tuple[FileIndex, str, bool]  # a file's index, its content id, and whether it was scanned now
# Whether local files are indexed leaving a core to the forkserver's imports (indexing_yields).
_YIELDING: ContextVar[bool] = ContextVar("lightning_sharding_indexing_yields", default=False)
REMOTE_SCAN_THREADS = 16  # indexing remote files waits on the store: threads overlap the waits
REMOTE_READ_THREADS = 16  # a batch's remote files, read at once: their waits overlap (Reader.read_threads)
# The bytes of the workers' first batches the training process fetches while they start
# (FileReader.first_reads), counted in every copy: each worker is sent them all with the reader.
FIRST_READ_BYTES = 32 << 20
# How long the training process waits for those fetches: what is not in by then, each worker reads.
FIRST_READ_SECONDS = 1.0
BATCH_BYTES = 32 << 20  # bytes of local files read into one buffer for one scan_batch
_SUB = "#"  # item key = url, or url#suffix for items inside a file (Parquet row groups)


class FileReader(Reader):
    """A reader of files named by paths or URLs (``s3://``, ``gs://``, ``az://``, ``hf://``...), globs or lists of them.

    Subclasses set ``format`` and implement :meth:`scan` (index one file, in the main process) and
    :meth:`read_batch` (inside workers, using :meth:`index_of`).

    Args:
        urls: a path or URL, a glob, or a list of them.
        storage_options: passed to fsspec, e.g. ``{"client_kwargs": {"endpoint_url": ...}}`` for S3.
        cache_dir: where file indexes are cached; ``None`` uses :func:`default_cache_dir`.
        cache_limit: keep whole remote files in ``cache_dir/shards``, at most this many bytes (an
            int) or this fraction of the free disk (a float in (0, 1]), evicting the least recently
            used; each file is then fetched once, not read by range every epoch. ``None``: no copies.
            Local files are never copied. See :mod:`lightning_sharding.readers.cache`.
        prefetch_files: with ``cache_limit``, each worker fetches the files of its next items into
            the cache in the background, up to this many files ahead, in the order the plan gives.
        prefetch_bytes: with ``prefetch_files``, fetch ahead only while those files add up to at
            most this many bytes (``None``: no cap).
        scan_threads: files indexed in parallel when the manifest is built; ``None`` chooses: 16
            for remote files (bound by the store's latency); for local ones, one per core when the
            reader indexes them in batches (tar shards), else one (a walk in Python holds the
            interpreter). The choice is printed with the progress line; a job spreads the files over
            its ranks (``index_once_per="job"``).
        index_once_per: who lists and indexes in a distributed job: ``"job"`` (global rank 0; the
            others receive the items), ``"node"`` (each node's local rank 0, for nodes that share no
            disk) or ``"rank"`` (every rank). See :mod:`lightning_sharding.readers.shared_index`.
        retry: retries of transient storage errors.
        data_index: an index written with the data by ``lightning-sharding index DATA_URL``
            (:mod:`~lightning_sharding.readers.data_index`): ``None`` uses the one in the files'
            common directory if there is one, a URL or path the one there, ``False`` none. A first
            start takes each unchanged file's index from it instead of reading the file.
        cache_mode: the file mode of what goes into ``cache_dir`` (indexes, listings, copies, lock
            files): ``0o600``, its owner's only, by default, whatever the umask; ``0o660`` to share a
            cache with the directory's group (every member reads and adds; directories made for it are
            ``0o2770``, setgid). ``0o640`` lets the group read what is there, but not add to it.
    """

    format: ClassVar[str] = "file"

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        scan_threads: int | None = None,
        retry: RetryPolicy | None = None,
        cache_limit: int | float | None = None,
        index_once_per: str = "job",
        prefetch_files: int = 0,
        prefetch_bytes: int | None = None,
        cache_mode: int | None = None,
        data_index: str | bool | None = None,
    ) -> None:
        if isinstance(urls, str):
            urls = [urls]
        # Credentials in a URL (a password, a signed query) stay in storage_options, which only the
        # storage layer reads: item keys, summaries, checkpoints and messages show the URL redacted.
        self.urls, hidden = hide_credentials([os.fspath(u) for u in urls])
        self.storage_options = dict(storage_options or {})
        if hidden:
            self.storage_options[URL_CREDENTIALS] = hidden
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.cache_mode = check_mode(cache_mode, f"{type(self).__name__}(cache_mode")
        if scan_threads is not None and scan_threads < 1:
            raise ValueError(f"`{type(self).__name__}(scan_threads={scan_threads})` must be at least 1")
        self.scan_threads = scan_threads
        self.retry = retry or RetryPolicy()
        if cache_limit is not None:
            resolve_limit(cache_limit, Path("."))  # a bad value fails here, not in a worker
        self.cache_limit = cache_limit
        self.fetch_ahead, self.fetch_bytes = check_prefetch(
            type(self).__name__, cache_limit, prefetch_files, prefetch_bytes
        )
        self._prefetcher: Prefetcher | None = None
        self._stats: defaultdict[str, float] = defaultdict(float)
        self.index_once_per = check_index_once_per(index_once_per, type(self).__name__)
        if not (data_index is None or data_index is False or isinstance(data_index, (str, os.PathLike))):
            raise ValueError(
                f"`{type(self).__name__}(data_index={data_index!r})` must be None (use the index beside the data if "
                "there is one), False (never) or the URL of the directory `lightning-sharding index` wrote"
            )
        self.data_index = os.fspath(data_index) if isinstance(data_index, os.PathLike) else data_index
        self._shards: ShardCache | None = None
        self._indexes: OrderedDict[str, FileIndex] = OrderedDict()
        # The listing's index (one directory for every file, readers/index.py::ListingIndex) and each
        # file's number in it, known once items() ran; opened lazily in each process.
        self._listing_index: tuple[str, dict[str, int]] | None = None
        self._opened_listing: ListingIndex | None = None
        self._lock = threading.Lock()
        self.last_scan: dict[str, int] = {"files": 0, "scanned": 0, "cached": 0}
        # This process's last listing: its items and files (for _attach_listing), and its files' JSON.
        self._listed: tuple[Sequence[Item], Sequence[FileInfo]] | None = None
        self._listing_memo: tuple[Sequence[FileInfo], str] | None = None
        # What first_reads fetched: (url, starts, ends) -> the bytes of those ranges.
        self._first: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[bytes]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_indexes"] = OrderedDict()  # workers load what they need
        state["_opened_listing"] = None  # its memory maps: each process maps the files itself
        state["_lock"] = None  # a lock does not pickle: __setstate__ makes a new one
        # Each process opens the shared shard cache, starts its prefetch thread and counts, itself.
        state["_shards"] = None
        state["_prefetcher"] = None
        state["_stats"] = defaultdict(float)
        state["_listed"] = state["_listing_memo"] = None  # the listing's files: the main process's alone
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_first", {})  # a reader pickled before first_reads existed
        self._lock = threading.Lock()

    @property
    def read_threads(self) -> int:  # type: ignore[override]  # a class attribute of Reader's
        """A batch's items read at once in a worker: :data:`REMOTE_READ_THREADS` when the files are
        remote (each read waits on the store; with 16 items a batch on a store 50 ms away, the first
        batch waited 16 x 50 ms and more), else 1 (a local read waits on nothing a thread would overlap)."""
        return REMOTE_READ_THREADS if any(scheme_of(url) != "file" for url in self.urls) else 1

    def worker_modules(self) -> list[str]:
        """fsspec, through which every read opens its file, and the package of each remote storage of
        the URLs (``s3fs``: a second to import), which a forkserver then imports while the training
        process lists. None of them starts a thread when imported."""
        schemes = dict.fromkeys(scheme_of(url) for url in self.urls)
        return list(dict.fromkeys(["fsspec", *(STORAGES[s][0] for s in schemes if s in STORAGES)]))

    # -- what subclasses provide ------------------------------------------------------------

    def options_key(self) -> str:
        """The options that change how a file is indexed (part of the cache name and fingerprint)."""
        return ""

    def check_indexes(self, files: Sequence[FileInfo], indexes: Sequence[FileIndex]) -> None:
        """Check that the files agree with each other (same row shape...); raise naming the odd one.

        Runs before the listing is cached, so a listing that failed it is checked again next time.
        """

    @abstractmethod
    def scan(self, info: FileInfo) -> FileIndex:
        """Index one file: its items, their sample counts and the offsets needed to seek."""

    # Files a call of scan_batch indexes at most; 0: the reader indexes each file alone (scan_content).
    batch_files: ClassVar[int] = 0

    def scan_batch(self, files: Sequence[FileInfo]) -> list[tuple[FileIndex, str | None] | None]:
        """Index many local files at once (a reader whose scan is array operations over them all sets
        :attr:`batch_files`): per file its index and content id, or ``None`` for a file it leaves to
        :meth:`scan_content` (a large one, or one with a fault to name)."""
        return [None] * len(files)

    def scan_content(self, info: FileInfo) -> tuple[FileIndex, str | None]:
        """:meth:`scan`, and the file's content id when scanning read the whole file (a small local
        one), to spare a second read for it (see :func:`~lightning_sharding.readers.storage.bytes_digest`)."""
        return self.scan(info), None

    # -- manifest -----------------------------------------------------------------------------

    def items(self) -> Sequence[Item]:
        """List the files, load or build every file's index in parallel, and return the items.

        In a distributed job's setup, only the leaders of ``index_once_per`` list; with ``"job"``,
        the files to index are spread over every rank (:mod:`~lightning_sharding.readers.shared_index`).
        The item list of a listing seen before (same files, same fingerprints) comes from one small
        cache file, so a restart costs one listing and one read.
        """
        try:
            world = current_world()
            if world is not None and self.index_once_per == "job":
                items = self._spread(world)
            else:
                items = shared_items(self._list_and_index, self.index_once_per, self._what())
            self._attach_listing(items)
            return items
        except Exception as err:
            clean = self.scrubbed(err)
            if clean is err:
                raise
            raise clean from None  # the original's chain would show the credentials

    def scrub(self, text: str) -> str:
        """``text`` with the credentials of this reader's URLs redacted."""
        return scrub(text, self.storage_options.get(URL_CREDENTIALS) or {})

    def _what(self) -> str:
        return f"{self.format} files {self.urls}"

    def _list_and_index(self) -> Sequence[Item]:
        files, cached = self._listing()
        if cached is not None:
            self._listed = (cached, files)
            return cached
        indexed = self._index_files(files, f"indexing {len(files)} {self.format} file(s)")
        return self._assemble(files, indexed, write=True)

    def _spread(self, world: World) -> Sequence[Item]:
        """Rank 0 lists; rank r indexes files r, r + W, r + 2W...; every rank assembles the manifest
        from the gathered indexes, and each machine's local rank 0 caches the ones it did not index."""
        files, cached, look = shared_items(self._listing_looked, "job", self._what())
        if cached is not None:
            return cached
        share = files[world.rank :: world.world_size]
        what = f"indexing {len(share)} of {len(files)} {self.format} file(s) on rank {world.rank} of {world.world_size}"
        nodes = gather_objects(world.node_rank, world.world_size)  # the ranks of a machine share its cores
        done = on_every_rank(
            lambda: self._index_files(
                share, what, show=world.rank == 0, ranks_here=nodes.count(world.node_rank), look=look
            ),
            world,
            f"indexes its share of {self._what()} for this job (index_once_per='job')",
        )
        indexed: list[Indexed] = [None] * len(files)  # type: ignore[list-item]
        for rank, results in enumerate(done):
            indexed[rank :: world.world_size] = results
        # This machine's local rank 0 writes the listing's index, where the workers of all its ranks read;
        # its failure (a full or unwritable cache_dir) reaches every rank, as an indexing failure does.
        items: list[Item] | None = None
        error: Exception | None = None
        try:
            items = self._assemble(files, indexed, write=world.local_rank == 0)
        except Exception as err:
            error = err
        raise_any(world, error, f"writes the index of {self._what()} into its cache_dir")
        assert items is not None
        return items

    def _listing_looked(self) -> tuple[list[FileInfo], list[Item] | None, bool]:
        """:meth:`_listing`, and whether there may be a data index to read (the lister looks, once
        for the job: a store answers a missing object's request like any other)."""
        files, cached = self._listing()
        return files, cached, cached is None and data_index_there(self, files)

    def _listing(self) -> tuple[list[FileInfo], list[Item] | None]:
        """The files, and their items when this listing was seen before (its cache file)."""
        files = list_files(self.urls, self.storage_options, self.retry)
        try:
            cached = json.loads(self._listing_path(files).read_text())
            self.last_scan = {"files": len(files), "scanned": 0, "cached": len(files)}
            return files, [Item(key, int(count), tag, name, content) for key, count, tag, name, content in cached]
        except (OSError, ValueError, TypeError):
            return files, None  # first start with this listing

    def _listing_path(self, files: Sequence[FileInfo], suffix: str = ".json") -> Path:
        # The listing's items with their names and content ids (a version-2 listing: 0.1's had neither);
        # with suffix ".d", the directory of its files' indexes. A start asks for it three times of the
        # same files: their JSON (10,000 files: 20 ms) is kept for the last list asked about.
        memo = getattr(self, "_listing_memo", None)
        if memo is None or memo[0] is not files:
            memo = self._listing_memo = (files, json.dumps([(f.url, f.fingerprint) for f in files]))
        return self._cache_path("listing-2", memo[1], suffix)

    def _latest_path(self) -> Path:
        """Where the last listing's index of these URLs is named (a changed file makes a new listing)."""
        return self._cache_path("latest-listing", json.dumps(self.urls), ".json")

    def _previous_listing(self) -> Callable[[FileInfo], FileIndex | None]:
        """The index of a file that the last listing of these URLs held unchanged (same fingerprint),
        so that a listing with one file changed indexes that file alone."""
        try:
            latest = json.loads(self._latest_path().read_text())
            numbers = {(url, fingerprint): i for i, (url, fingerprint) in enumerate(latest["files"])}
            listing = ListingIndex(self._latest_path().parent / str(latest["listing"]))
        except (OSError, ValueError, KeyError, TypeError):
            return lambda info: None

        def previous(info: FileInfo) -> FileIndex | None:
            number = numbers.get((info.url, info.fingerprint))
            if number is None:
                return None
            try:
                return listing.file(number)
            except (OSError, ValueError, KeyError, IndexError):
                return None

        return previous

    def _attach_listing(self, items: Sequence[Item]) -> None:
        """Where this process and its workers find the listing's index: computed from the items, so
        every rank finds its own machine's copy under its own ``cache_dir``."""
        listed = getattr(self, "_listed", None)
        self._listed = None
        if listed is not None and listed[0] is items:  # this process's own listing: its files are known
            directory = self._listing_path(listed[1], ".d")
            self._listing_index = (str(directory), {f.url: i for i, f in enumerate(listed[1])})
            self._opened_listing = None
            return
        files: dict[str, FileInfo] = {}
        for item in items:
            url = self.split_key(item)[0]
            if url not in files:
                files[url] = FileInfo(url, -1, self.file_fingerprint(item))
        directory = self._listing_path(list(files.values()), ".d")
        self._listing_index = (str(directory), {url: i for i, url in enumerate(files)})
        self._opened_listing = None

    def _index_files(
        self, files: Sequence[FileInfo], what: str, show: bool = True, ranks_here: int = 1, look: bool = True
    ) -> list[tuple[FileIndex, str, bool]]:
        """Each file's index (from the cache, a data index, or scanned and saved), content id, and
        whether it was scanned; ``ranks_here``: the ranks of this machine indexing at once (they share
        its cores); ``look``: whether to look for a data index (the job's lister found one)."""
        threads = self.indexing_threads(files, ranks_here)
        progress = Progress(f"{what}, {threads} thread(s)", len(files), every=5.0 if show else float("inf"))
        if not files:
            return []
        before = self._previous_listing()
        kept = self._kept_indexes()
        known: list[tuple[FileIndex, str] | None] = []
        for info in files:
            idx = (self._cached(info) if kept else None) or before(info)
            known.append(None if idx is None else (idx, info.content))
        data_index = read_data_index(self, files) if look and any(k is None for k in known) else None
        sorted_out = data_index.sort_out(files, known) if data_index is not None else None
        maybe = sorted_out.maybe if sorted_out is not None else {}

        def one(i: int) -> Indexed:
            info, (idx, content) = files[i], known[i] or (None, files[i].content)
            if i in maybe:
                number, fingerprint, stored = maybe[i]
                content = self._digest(info)
                if content == stored:
                    idx = data_index.index(number)  # type: ignore[union-attr]
                else:
                    sorted_out.changed.append((info, changed_because(info, fingerprint)))  # type: ignore[union-attr]
            scanned = idx is None
            if idx is None:  # a remote file's index is kept at once (a slow walk); a local one with the listing's
                idx, read = self._scan_and_save(info, save=scheme_of(info.url) != "file")
                content = content or read or ""
            progress.step()
            return idx, content or self._digest(info), scanned

        def many(batch: list[int]) -> list[Indexed]:
            done: list[Indexed] = []
            for i, got in zip(batch, self.scan_batch([files[i] for i in batch]), strict=True):
                if got is None:  # left to the file's own scan (which names its fault)
                    done.append(one(i))
                else:
                    progress.step()
                    done.append((got[0], files[i].content or got[1] or self._digest(files[i]), True))
            return done

        indexed: list[Indexed] = [None] * len(files)  # type: ignore[list-item]
        for i, k in enumerate(known):  # known with its content id (a data index's, a store's): nothing to read
            if k is not None and k[1] and i not in maybe:
                indexed[i] = (k[0], k[1], False)
        progress.step(sum(1 for got in indexed if got is not None))
        batches = self._batches([i for i, idx in enumerate(known) if idx is None and i not in maybe], files)
        alone = [
            i for i, idx in enumerate(known) if indexed[i] is None and (idx is not None or i in maybe or not batches)
        ]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            scanned = [(batch, pool.submit(many, batch)) for batch in batches]
            for i, result in zip(alone, pool.map(one, alone), strict=False):
                indexed[i] = result
            for batch, future in scanned:
                for i, result in zip(batch, future.result(), strict=False):
                    indexed[i] = result
        progress.done()
        if data_index is not None and sorted_out is not None and sorted_out.stale():
            data = " ".join(f"'{self.scrub(url)}'" for url in self.urls)
            data += f" --option {self.options_key()}" if self.options_key() else ""
            data += f" --output {self.scrub(self.data_index)}" if isinstance(self.data_index, str) else ""
            warnings.warn(sorted_out.warning(data_index, data), stacklevel=3)
        return indexed

    def _batches(self, todo: list[int], files: Sequence[FileInfo]) -> list[list[int]]:
        """``todo`` (files to scan) cut into batches for :meth:`scan_batch`, when the reader scans local
        files in batches (at most :attr:`batch_files` files and :data:`BATCH_BYTES` bytes each); none else."""
        if not self.batch_files or not todo or any(scheme_of(files[i].url) != "file" for i in todo):
            return []
        batches: list[list[int]] = [[]]
        size = 0
        for i in todo:
            if batches[-1] and (len(batches[-1]) >= self.batch_files or size + files[i].size > BATCH_BYTES):
                batches.append([])
                size = 0
            batches[-1].append(i)
            size += files[i].size
        return batches

    def _assemble(
        self, files: Sequence[FileInfo], indexed: Sequence[tuple[FileIndex, str, bool]], write: bool
    ) -> list[Item]:
        """The items of ``files`` from their indexes; ``write``: into the listing's cache file too."""
        indexes = [idx for idx, _, _ in indexed]
        self.check_indexes(files, indexes)
        scanned = sum(1 for _, _, was in indexed if was)
        self.last_scan = {"files": len(files), "scanned": scanned, "cached": len(files) - scanned}
        items: list[Item] = []
        for info, (idx, content, _) in zip(files, indexed, strict=True):
            tag = f"{info.fingerprint};{self.format}:{self.options_key()}"
            for suffix, count in zip(idx.suffixes, idx.counts, strict=True):
                sub = _SUB + suffix if suffix else ""
                items.append(Item(info.url + sub, int(count), tag, info.name + sub, content))
        if write:
            directory = self._listing_path(files, ".d")
            if ListingIndex.save(directory, indexes, self.cache_mode):  # the next listing of these URLs starts from it
                latest = {"listing": directory.name, "files": [[f.url, f.fingerprint] for f in files]}
                write_atomically(self._latest_path(), json.dumps(latest).encode(), self.cache_mode)
            else:
                for info, (idx, _, was) in zip(files, indexed, strict=True):  # arrays that do not line up
                    if was:
                        idx.save(self._cache_path(info.url, info.fingerprint), self.cache_mode)
            rows = [[it.key, it.num_samples, it.fingerprint, it.name, it.content] for it in items]
            write_atomically(self._listing_path(files), json.dumps(rows).encode(), self.cache_mode)
        self._listed = (items, files)
        return items

    def indexing_threads(self, files: Sequence[FileInfo], ranks_here: int = 1) -> int:
        """Threads to index ``files`` with: ``scan_threads``; else, when any file is remote, 16 (waits
        on the store overlap); for local files, one per core when the reader scans them in batches of
        array operations (reads, hashes and array loops leave the interpreter's lock: 2 threads took
        0.79 s where 1 took 1.50 s on 2,000 shards here), else 1 (a walk in Python holds the lock).
        ``ranks_here`` ranks of this machine indexing at once share its cores, less one while this
        rank's forkserver imports (:func:`indexing_yields`)."""
        if self.scan_threads is not None:
            return max(1, min(self.scan_threads, len(files)))
        if any(scheme_of(f.url) != "file" for f in files):
            return max(1, min(REMOTE_SCAN_THREADS, len(files)))
        left = 1 if _YIELDING.get() else 0  # a core for the forkserver's imports
        cores = max(1, len(os.sched_getaffinity(0)) // max(1, ranks_here) - left)  # this rank's share of them
        return max(1, min(cores if self.batch_files else 1, len(files)))

    def _digest(self, info: FileInfo) -> str:
        """The content id of a file whose store gives no ETag: a digest of its bytes (with retries)."""
        try:
            return with_retries(
                lambda: content_digest(info.url, info.size, self.storage_options), f"reading {info.url}", self.retry
            )
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{info.url}: the file disappeared while indexing it ({err})") from err

    def _cache_path(self, url: str, fingerprint: str, suffix: str = ".npz") -> Path:
        name = json.dumps([INDEX_VERSION, self.format, self.options_key(), url, fingerprint])
        digest = hashlib.sha256(name.encode()).hexdigest()[:32]
        return (self.cache_dir or default_cache_dir()) / "index" / f"{self.format}-{digest}{suffix}"

    def _kept_indexes(self) -> bool:
        """Whether the cache directory holds any single file's index of this format (a remote file's,
        or one of a listing whose arrays did not line up): if not, none is looked for, file by file."""
        try:
            with os.scandir((self.cache_dir or default_cache_dir()) / "index") as entries:
                return any(e.name.startswith(f"{self.format}-") and e.name.endswith(".npz") for e in entries)
        except OSError:
            return False

    def _cached(self, info: FileInfo) -> FileIndex | None:
        path = self._cache_path(info.url, info.fingerprint)
        try:
            return FileIndex.load(path)
        except (OSError, ValueError, KeyError):
            return None  # missing or from an interrupted write: scan again

    def _scan_and_save(self, info: FileInfo, save: bool = True) -> tuple[FileIndex, str | None]:
        """The file's index, scanned (and kept in the cache directory when ``save``), and its content
        id when scanning gave it."""
        try:
            idx, content = with_retries(lambda: self.scan_content(info), f"indexing {info.url}", self.retry)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{info.url}: the file disappeared while indexing it ({err})") from err
        except PermissionError as err:
            raise PermissionError(f"{info.url}: no permission to read this file ({err})") from err
        except Exception as err:
            raise ValueError(f"{info.url}: cannot index this {self.format} file: {err}") from err
        if len(idx.suffixes) != len(idx.counts):
            raise RuntimeError(f"{type(self).__name__}.scan({info.url}) returned mismatched suffixes and counts")
        if save:
            idx.save(self._cache_path(info.url, info.fingerprint), self.cache_mode)
        return idx, content

    # -- inside workers -----------------------------------------------------------------------

    def read(self, item: Item, index: int, ctx: WorkerContext) -> Any:
        """One sample, through the reader's ``read_batch``."""
        return self.read_batch(item, np.array([index], dtype=np.int64), ctx)[0]

    @staticmethod
    def split_key(item: Item) -> tuple[str, str]:
        """``(url, suffix)`` of an item key."""
        url, _, suffix = item.key.partition(_SUB)
        return url, suffix

    def file_fingerprint(self, item: Item) -> str:
        """The file part of the item's fingerprint (size and mtime or ETag)."""
        return item.fingerprint.split(f";{self.format}:", 1)[0]

    def _file_size(self, item: Item) -> int:
        return int(self.file_fingerprint(item).split(";", 1)[0].removeprefix("size="))

    def index_of(self, item: Item) -> dict[str, npt.NDArray[Any]]:
        """The index arrays of ``item``, from a small per-process cache, the cache dir, or a fresh scan."""
        idx = self.file_index(item)
        return idx.arrays[idx.suffixes.index(self.split_key(item)[1])]

    def file_index(self, item: Item) -> FileIndex:
        """The index of the file that holds ``item``."""
        url, _ = self.split_key(item)
        with self._lock:
            idx = self._indexes.get(url)
            if idx is not None:
                self._indexes.move_to_end(url)
        if idx is None:
            fingerprint = self.file_fingerprint(item)
            idx = self._cached(FileInfo(url, -1, fingerprint)) or self._from_listing(url)
            if idx is None:  # the cache was cleared since the manifest was built
                fs, path = filesystem(url, self.storage_options)
                size = int(with_retries(lambda: fs.size(path), f"reading the size of {url}", self.retry))
                idx, _ = self._scan_and_save(FileInfo(url, size, fingerprint))
            with self._lock:
                self._indexes[url] = idx
                while len(self._indexes) > 16:
                    self._indexes.popitem(last=False)
        return idx

    def _from_listing(self, url: str) -> FileIndex | None:
        """The index of ``url`` from the listing's index, if this process knows one that holds it."""
        if self._listing_index is None or url not in self._listing_index[1]:
            return None
        try:
            if self._opened_listing is None:
                self._opened_listing = ListingIndex(Path(self._listing_index[0]))
            return self._opened_listing.file(self._listing_index[1][url])
        except (OSError, ValueError, KeyError, IndexError):
            return None  # cleared or half-written: scan again

    def read_ranges(self, item: Item, starts: npt.ArrayLike, ends: npt.ArrayLike) -> list[bytes]:
        """Bytes ``[starts[i], ends[i])`` of the file of ``item``, from its local copy when the reader
        keeps one (``cache_limit``), else from storage with this reader's options and retries."""
        from lightning_sharding.readers.storage import read_ranges

        s, e = np.asarray(starts).tolist(), np.asarray(ends).tolist()
        if self._first:  # fetched by the training process while this worker started (first_reads)
            got = self._first.pop((self.split_key(item)[0], tuple(s), tuple(e)), None)
            if got is not None:
                return got
        with self.local_copy(item) as local:
            if local is not None:
                return read_ranges(local, s, e)
            return read_ranges(self.split_key(item)[0], s, e, self.storage_options, self.retry)

    @contextlib.contextmanager
    def local_copy(self, item: Item, count: bool = True) -> Iterator[str | None]:
        """The path of a whole local copy of the file of ``item``, kept from eviction while the block
        runs; ``None`` without ``cache_limit``, for a local file, or for a file larger than the budget.
        ``count``: a read of the worker's (counted in :meth:`take_stats`), not a prefetch."""
        if self.cache_limit is None:  # every read by range asks for this: resolve no filesystem for it
            yield None
            return
        url, _ = self.split_key(item)
        fs, path = filesystem(url, self.storage_options)
        if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            yield None
            return
        if self._shards is None:
            shards = (self.cache_dir or default_cache_dir()) / "shards"
            self._shards = ShardCache(shards, self.cache_limit, self.cache_mode)
        fingerprint = self.file_fingerprint(item)
        size = self._file_size(item)

        def fetch(part: str) -> None:
            with_retries(lambda: fs.get_file(path, part), f"downloading {url}", self.retry)

        present = self._shards.path(url, fingerprint).exists()
        asked = time.perf_counter()
        with self._shards.open(url, fingerprint, size, fetch) as local:
            if count and local is not None:
                self._stats["cache_hits" if present else "cache_misses"] += 1
                self._stats["fetch_wait_s"] += 0.0 if present else time.perf_counter() - asked
            yield local

    def byte_ranges(
        self, item: Item, indices: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
        """The byte ranges ``(starts, ends)`` of its file that a read of samples ``indices`` of ``item``
        asks :meth:`read_ranges` for, where the reader knows them without reading (``None``: it does
        not, and :meth:`first_reads` leaves such reads to the workers)."""
        return None

    @override
    def first_reads(self, reads: Sequence[tuple[Item, npt.NDArray[np.int64]]], workers: int) -> int:
        """Fetch the byte ranges of ``reads`` (the workers' first batches, :meth:`byte_ranges`) here,
        in the training process, while its ``workers`` start: a forkserver's first workers wait for
        its imports (about a second and a half), spawned ones for their own, and a fresh worker makes
        a new store client (0.1-0.3 s) before it asks for anything. The bytes go to every worker
        with the reader, and a worker's first read of each range takes them instead of asking the store.

        Only remote files read straight from the store (no ``cache_limit``), in the order given (the
        first worker's first), while the copies sent to the workers add up to at most
        :data:`FIRST_READ_BYTES`. Each fetch is tried once by this reader's retries (the store client's
        own still apply), and what is not fetched within :data:`FIRST_READ_SECONDS` is left, as a
        failed fetch is, to the worker's own read, which retries and raises as it always does."""
        if self.cache_limit is not None:
            return 0
        budget = FIRST_READ_BYTES // max(1, workers)
        wanted: list[tuple[str, list[int], list[int]]] = []
        total = 0
        for item, indices in reads:
            url = self.split_key(item)[0]
            ranges = self.byte_ranges(item, indices) if scheme_of(url) != "file" else None
            if ranges is None:
                continue
            s, e = np.asarray(ranges[0]).tolist(), np.asarray(ranges[1]).tolist()
            total += sum(e) - sum(s)
            if total > budget:
                break
            wanted.append((url, s, e))
        if not wanted:
            return 0
        from lightning_sharding.readers.storage import read_ranges

        once = RetryPolicy(attempts=1)

        def fetch(read: tuple[str, list[int], list[int]]) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], Any]:
            url, s, e = read
            try:
                return (url, tuple(s), tuple(e)), read_ranges(url, s, e, self.storage_options, once)
            except Exception:  # noqa: BLE001 - the worker's own read of it retries and raises, named
                return (url, tuple(s), tuple(e)), None

        pool = ThreadPoolExecutor(min(len(wanted), self.read_threads), thread_name_prefix="lsh-first")
        futures = [pool.submit(fetch, read) for read in wanted]
        done, _ = wait(futures, timeout=FIRST_READ_SECONDS)
        pool.shutdown(wait=False, cancel_futures=True)  # a fetch still under way ends on its own, unused
        self._first = {key: got for key, got in (f.result() for f in done) if got is not None}
        return len(self._first)

    @override
    def drop_first_reads(self) -> None:
        self._first = {}

    def take_stats(self) -> dict[str, float]:
        """This process's shard-cache reads since the last call: hits, misses, seconds waited."""
        stats, self._stats = dict(self._stats), defaultdict(float)
        return stats

    def ahead(self, now: Sequence[Item], upcoming: Sequence[Item]) -> None:
        """Fetch into the shard cache, in background threads, the files of ``now`` (the worker's
        batch), then the next files of ``upcoming`` (the plan's next items): see :func:`files_ahead`."""
        if self.fetch_ahead and self.cache_limit is not None:
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(self._have_copy, self.fetch_ahead, key=lambda i: self.split_key(i)[0])
            size = self._file_size
            wanted = files_ahead(
                now, upcoming, lambda i: self.split_key(i)[0], size, self.fetch_ahead, self.fetch_bytes
            )
            self._prefetcher.want(wanted)

    def _have_copy(self, item: Item) -> None:
        """Make sure the file of ``item`` is in the shard cache (what a prefetch thread does). The
        worker asks at every batch for its current and next files, which are mostly there already:
        such a copy costs one ``utime`` (it stays most recently used), not a locked open of it."""
        if self._shards is not None and self._shards.touch(self.split_key(item)[0], self.file_fingerprint(item)):
            return
        with self.local_copy(item, count=False):
            pass


@contextlib.contextmanager
def indexing_yields(yields: bool = True) -> Iterator[None]:
    """When ``yields``, local files indexed in the block leave one of the rank's cores to other work:
    the loader's setup asks it while its forkserver imports torch (about a second of one core), which
    the workers, and so the first batch, wait for. With 2 cores, 2 indexing threads held that import
    to two thirds of a core, and the workers started 0.2-0.3 s after the index was done
    (docs/performance.md, the first batch)."""
    token = _YIELDING.set(yields)
    try:
        yield
    finally:
        _YIELDING.reset(token)
