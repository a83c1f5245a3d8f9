"""The reader interface: list the items once in the main process, read samples inside workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.manifest import Item, Manifest
from lightning_sharding.core.world import WorkerContext, old_name

# A batch read as columns: one array of shape (n, ...), or a dict of such arrays by field.
Columns = npt.NDArray[Any] | dict[str, npt.NDArray[Any]]


class Reader(ABC):
    """How a data set becomes items and samples.

    ``items()`` runs once, in the main process, to build the manifest. ``read`` (or the faster
    ``read_batch``) runs inside DataLoader workers; the reader is pickled into them, so keep it
    small: paths and options, not open files.
    """

    # How far ahead a worker tells :meth:`ahead` about (0: it is never called).
    fetch_ahead: int = 0
    # Whether the reader builds whole batches from the epoch order's positions (:meth:`read_sequences`,
    # packed token sequences) instead of reading samples one item at a time.
    reads_sequences: bool = False
    # How many items of one batch a worker reads at once, each in a thread: more than 1 for a reader
    # whose reads wait on storage (remote files, :class:`~lightning_sharding.readers.files.FileReader`).
    read_threads: int = 1

    @abstractmethod
    def items(self) -> Sequence[Item]:
        """Every item with its sample count, in a stable order."""

    def manifest(self) -> Manifest:
        """The manifest of ``items()`` (a reader of several streams adds their mixture)."""
        return Manifest.from_items(self.items())

    @abstractmethod
    def read(self, item: Item, index: int, ctx: WorkerContext) -> Any:
        """Sample ``index`` (``0 <= index < item.num_samples``) of ``item``."""

    def read_sequences(self, order: Any, positions: npt.NDArray[np.int64], items: Sequence[Item]) -> Any:
        """The batch of ``positions`` of the epoch ``order`` over the manifest's ``items``, built
        whole (only when :attr:`reads_sequences`; no ``transform`` or ``collate_fn`` runs on it)."""
        raise NotImplementedError(f"{type(self).__name__} reads samples, not sequences")

    def worker_modules(self) -> list[str]:
        """Modules a worker imports to read, beyond the reader's own (a storage's package): a
        forkserver imports them once, before its workers start, instead of each worker at its first
        read. Name only modules whose import starts no thread. None by default."""
        return []

    def ahead(self, now: Sequence[Item], upcoming: Sequence[Item]) -> None:
        """The items of this worker's current batch, and the items the plan reads after it, nearest
        first (from the next ``fetch_ahead`` on): a reader may start fetching them. Nothing by default."""
        return None

    def first_reads(self, reads: Sequence[tuple[Item, npt.NDArray[np.int64]]], workers: int) -> int:
        """Called in the training process just before it starts ``workers`` DataLoader workers that
        wait on imports before they run (spawned ones, or a forkserver's first), with the reads
        ``(item, sample indices)`` of each worker's first batch: a reader whose reads wait on storage
        may fetch their bytes meanwhile and keep them in its state, which is pickled into every
        worker; a worker's read of those samples then asks the store for nothing. Returns how many
        reads it fetched; none by default. See :meth:`drop_first_reads`."""
        return 0

    def drop_first_reads(self) -> None:
        """Forget what :meth:`first_reads` fetched: in the training process once its workers started,
        in a worker once its first batch is read."""
        return None

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call, sent with each batch and logged by the callback: a file
        reader counts ``cache_hits``, ``cache_misses`` and ``fetch_wait_s``. None by default."""
        return {}

    def read_batch(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> list[Any]:
        """Samples ``indices`` (shape ``(n,)``) of one item, in that order.

        Override it when the storage reads many samples faster at once (a memory map, a row group).
        """
        return [self.read(item, int(i), ctx) for i in indices]

    def scrub(self, text: str) -> str:
        """``text`` (an error's message) without the secrets this reader holds: a reader of URLs with
        credentials in them replaces those with the URL as shown (see :mod:`lightning_sharding.core.private`)."""
        return text

    def scrubbed(self, err: BaseException) -> BaseException:
        """``err`` itself, or, when it or an exception it was raised from shows a secret :meth:`scrub`
        removes, a new error of its message scrubbed, to raise without the chain."""
        seen: set[int] = set()
        current: BaseException | None = err
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            shown = f"{current!r} {current}"  # an OSError's filename is in its str, not its repr
            if self.scrub(shown) != shown:
                message = self.scrub(str(err))
                return type(err)(message) if type(err).__module__ == "builtins" else OSError(message)
            current = current.__cause__ or current.__context__
        return err

    def read_columns(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> Columns:
        """Samples ``indices`` of one item as columns: one array of shape ``(n, ...)``, or a dict of
        such arrays, exactly what PyTorch's default collate makes of :meth:`read_batch`'s samples.

        Override it when the storage holds columns (a memory map, a row group, computed data): a
        batch with no ``transform`` and the default ``collate_fn`` is then read with no per-sample
        Python object. A subclass that overrides ``read_batch`` below it turns it off (see
        :attr:`columnar`), so its own samples are never bypassed.
        """
        raise NotImplementedError(f"{type(self).__name__} reads samples, not columns")

    @property
    def columnar(self) -> bool:
        """Whether :meth:`read_columns` stands for :meth:`read_batch`: a class overrides it, and no
        subclass of that class overrides ``read_batch``."""
        mro = type(self).__mro__
        columns = next(i for i, cls in enumerate(mro) if "read_columns" in cls.__dict__)
        batch = next(i for i, cls in enumerate(mro) if "read_batch" in cls.__dict__)
        return mro[columns] is not Reader and columns <= batch


if not TYPE_CHECKING:  # type checkers see only today's names

    def __getattr__(name: str) -> Any:
        """``ShardContext``, which this module offered before 0.2 (``WorkerContext`` now), warned."""
        return old_name(__name__, name)
