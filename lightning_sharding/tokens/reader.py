"""``PackedReader``: a reader of documents whose epochs are packed sequences, read batch by batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.manifest import Item, Manifest
from lightning_sharding.core.rangeset import is_run
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.readers.base import Reader
from lightning_sharding.tokens.batch import Buffers, ConcatRun, packed_batch
from lightning_sharding.tokens.documents import DocumentReader
from lightning_sharding.tokens.packing import PackedEpochs, Packing, distinct, ranges

# The tokens of a stretch of consecutive ``concat`` sequences built at once (ConcatRun): about 2^16 (a
# larger stretch builds slower a token on this project's machine, a smaller one pays its calls more often).
STRETCH_TOKENS = 1 << 16


class PackedReader(Reader):
    """The documents of ``documents``, packed by ``packing`` into sequences: the manifest's epochs
    are :class:`~lightning_sharding.tokens.packing.PackedEpochs`, so the ledger counts sequences,
    and a worker reads a whole batch of sequences at once (:meth:`read_sequences`, what
    :mod:`~lightning_sharding.tokens.batch` describes). ``ShardedDataModule(packing=...)`` makes one."""

    reads_sequences = True

    def __init__(self, documents: DocumentReader, packing: Packing) -> None:
        if not isinstance(documents, DocumentReader):
            raise TypeError(
                f"packing needs a reader of tokenized documents (IndexedTokens, ParquetTokens, TokenFiles or another "
                f"DocumentReader), got {type(documents).__name__}"
            )
        if not isinstance(packing, Packing):
            raise TypeError(f"packing= takes a Packing(seq_len=..., mode=...), got {packing!r}")
        self.documents = documents
        self.packing = packing
        self.fetch_ahead = documents.fetch_ahead
        self._run: ConcatRun | None = None
        self._readers: tuple[Any, ...] | None = None  # (items, epochs, read, name, fill) of the last stretch
        self._buffers = Buffers()

    def __getstate__(self) -> dict[str, Any]:
        # A worker builds its own stretches.
        return {**self.__dict__, "_run": None, "_readers": None, "_buffers": Buffers()}

    def scrub(self, text: str) -> str:
        """``text`` without the secrets of the documents' reader."""
        return self.documents.scrub(text)

    def items(self) -> Sequence[Item]:
        """The documents' files."""
        return self.documents.items()

    def manifest(self) -> Manifest:
        """The files, each document's length (from the reader's index) and the packing."""
        items = tuple(self.items())
        return Manifest(items, self.epochs(items))

    def epochs(self, items: Sequence[Item]) -> PackedEpochs:
        """The packed epochs of ``items`` (already listed): each document's length and the packing."""
        counts = Manifest(tuple(items)).counts
        return PackedEpochs(self.documents.lengths(items), counts, self.packing)

    def read(self, item: Item, index: int, ctx: WorkerContext) -> Any:
        """Document ``index`` of ``item`` (packed batches come from :meth:`read_sequences`)."""
        return self.documents.read(item, index, ctx)

    def ahead(self, now: Sequence[Item], upcoming: Sequence[Item]) -> None:
        """As the documents' reader does."""
        self.documents.ahead(now, upcoming)

    def take_stats(self) -> dict[str, float]:
        """The documents' reader's counters."""
        return self.documents.take_stats()

    def worker_modules(self) -> list[str]:
        """The documents' reader's (a store's package, for a forkserver to import once)."""
        return self.documents.worker_modules()

    def read_sequences(self, order: Any, positions: npt.NDArray[np.int64], items: Sequence[Item]) -> dict[str, Any]:
        """The batch of the sequences at ``positions`` of ``order`` (a packed order), over the
        manifest's ``items``."""
        epochs: PackedEpochs = order.epochs
        documents, seq_len = self.documents, self.packing.seq_len
        rows = len(positions)
        start = int(positions[0]) if rows else 0
        if rows and order.mode == "concat" and not documents.fetch_ahead and is_run(positions):
            run = self._run
            if run is not None and run.holds(order, start, rows):
                return run.batch(start, rows)
            if (start + rows) * seq_len <= epochs.tokens:  # no sequence of it is the epoch's last, padded
                # This batch and the next ones, built at once, up to the epoch's last full sequence.
                ahead = max(1, min(16, STRETCH_TOKENS // (rows * seq_len)))
                stop = min(start + ahead * rows, epochs.tokens // seq_len)
                read, name, fill = self._stretch_readers(items, epochs)
                self._run = ConcatRun(order, start, stop, read, self.packing, name, fill, self._buffers)
                return self._run.batch(start, rows)
        first = epochs.first_document
        pieces = order.pieces(positions)
        if documents.fetch_ahead:  # this batch's files, then those of the sequences after it
            now = distinct(np.searchsorted(first, pieces[1], side="right") - 1)
            later = order.items_from(int(positions.max()) + 1, 8 * documents.fetch_ahead + 1) if len(positions) else []
            documents.ahead([items[i] for i in now.tolist()], [items[i] for i in np.asarray(later).tolist()])
        read, name = self._spans(items, epochs), self._namer(items, epochs)
        return packed_batch(rows, pieces, epochs.lengths, read, self.packing, name)

    def _stretch_readers(self, items: Sequence[Item], epochs: PackedEpochs) -> tuple[Any, Any, Any]:
        """``(read, name, fill)`` for a stretch over ``items``, made once for the same items and epochs."""
        made = self._readers
        if made is None or made[0] is not items or made[1] is not epochs:
            read, name, fill = self._spans(items, epochs), self._namer(items, epochs), self._fill(items, epochs)
            self._readers = made = (items, epochs, read, name, fill)
        return made[2:]

    def _spans(
        self, items: Sequence[Item], epochs: PackedEpochs
    ) -> Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]], Any]:
        """``read(docs, starts, stops)`` over ``items``, as :func:`packed_batch` takes it."""
        first, base, documents = epochs.first_document, epochs.token_start_in_item, self.documents

        def read(docs: npt.NDArray[np.int64], starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> Any:
            """The spans' tokens, one gather per file (in the file's dtype when the batch reads one file)."""
            item = np.searchsorted(first, docs, side="right")  # each span's file, counted from 1
            offset = base[docs]  # where each span's document starts in its file
            lo, hi = offset + starts, offset + stops
            if item.size and item.min() == item.max():
                return documents.read_spans(items[int(item[0]) - 1], lo, hi)
            item -= 1
            sizes = hi - lo
            at = np.cumsum(sizes) - sizes
            out = np.empty(int(sizes.sum()), dtype=np.int64)
            for k in distinct(item).tolist():
                sel = np.flatnonzero(item == k)
                out[ranges(at[sel], at[sel] + sizes[sel])] = documents.read_spans(items[k], lo[sel], hi[sel])
            return out

        return read

    def _fill(
        self, items: Sequence[Item], epochs: PackedEpochs
    ) -> Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]], None]:
        """``fill(docs, starts, stops, out)``: the spans' tokens copied into ``out``, a slice of the
        item's token array each (:meth:`DocumentReader.token_array`), or gathered where it has none."""
        first, base, documents = epochs.first_document, epochs.token_start_in_item, self.documents
        read = self._spans(items, epochs)

        def fill(
            docs: npt.NDArray[np.int64],
            starts: npt.NDArray[np.int64],
            stops: npt.NDArray[np.int64],
            out: npt.NDArray[np.int64],
        ) -> None:
            item = first.searchsorted(docs, side="right")  # counted from 1
            keys = item.tolist()
            # Asked again every stretch, not kept: a store keeps a few maps and drops the rest, so
            # that the shard cache's evicted copies give their disk space back.
            arrays: dict[int, Any] = {}
            for k in set(keys):
                array = documents.token_array(items[k - 1])
                if array is None:  # read by range for now (a remote file not yet copied): gathered
                    got = np.asarray(read(docs, starts, stops))
                    if got.shape != out.shape:
                        raise ValueError(f"the reader returned {got.size} tokens for pieces of {out.size}")
                    out[:] = got
                    return
                arrays[k] = array
            lo = base[docs] + starts
            spans = zip(keys, lo.tolist(), (lo + stops - starts).tolist(), strict=True)
            views = [arrays[k][a:b] for k, a, b in spans]
            np.concatenate(views, out=out, casting="unsafe")  # one call: a slice assignment a span cost more

        return fill

    @staticmethod
    def _namer(items: Sequence[Item], epochs: PackedEpochs) -> Callable[[int], str]:
        def name(doc: int) -> str:
            item, index = epochs.document(doc)
            return f"document {index} of {items[item].key!r}"

        return name
