"""Packed sequences: an epoch order of fixed-length token sequences cut from shuffled documents.

A manifest of documents (items are files, samples are documents, each of a known token length)
gets :class:`PackedEpochs`, so its epochs are orders of *sequences* of ``seq_len`` tokens: the
ledger counts sequences, and everything that plans, resumes or rescales by positions works on
them unchanged. A sequence is a list of *pieces*, runs of tokens of one document
(:meth:`PackedOrder.pieces`). Three modes:

- ``concat``: the epoch's documents (the plain order: items shuffled, documents shuffled in each)
  joined end to end and cut every ``seq_len`` tokens; a document may span sequences; only the
  epoch's last sequence is padded. Every token is in exactly one sequence of every epoch.
- ``best_fit``: documents longer than ``seq_len`` are cut into full sequences and a remainder;
  the remainders are packed, whole, by best-fit decreasing over windows of ``window`` documents
  of the manifest (documents of one file together). The packing is the same in every epoch and
  every epoch shuffles the sequences, so an epoch holds the same number of sequences every time.
  Every token is in exactly one sequence; the padding is counted (:attr:`PackedEpochs.padding`).
- ``none``: one document per sequence, cut at ``seq_len`` tokens (the rest is not trained) and padded.

The sequences are a pure function of (the documents' lengths, seed, epoch, ``seq_len``, mode,
window), never of ranks, workers or batch size.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.blocks import Blocks
from lightning_sharding.core.order import EpochOrder, _rng

Int64Array = npt.NDArray[np.int64]
Mode = Literal["concat", "best_fit", "none"]
MODES: tuple[str, ...] = ("concat", "best_fit", "none")
# What a batch can hold (:mod:`~lightning_sharding.tokens.batch`); ``cu_seqlens`` comes with ``max_seqlen``.
FIELDS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "document_ids", "cu_seqlens")

_SEQUENCE_STREAM = 0x5E9A


@dataclass(frozen=True)
class Packing:
    """How documents become sequences: ``seq_len`` tokens each, by ``mode`` (``concat``,
    ``best_fit`` or ``none``); ``window``: documents ``best_fit`` packs together at most.

    ``pad_id`` fills padding (its labels are -100); ``labels_across_documents``: whether a
    document's last token is trained to predict the next document's first (default: it is not, its
    label is -100); ``vocab_size``: when given, a token at or above it is refused naming where it is.

    ``fields``: what a batch holds, of :data:`FIELDS` (``input_ids``, ``labels``, ``position_ids``,
    ``document_ids``, ``cu_seqlens`` with ``max_seqlen``); by default all of them, and ``input_ids``
    always among them. A field left out is not computed at all (a model that masks attention by
    ``cu_seqlens`` needs no ``document_ids``, one with plain causal attention needs neither). It
    changes no sequence, so a checkpoint resumes under other fields.
    """

    seq_len: int
    mode: Mode = "concat"
    window: int = 1024
    pad_id: int = 0
    labels_across_documents: bool = False
    vocab_size: int | None = None
    fields: tuple[str, ...] = FIELDS

    def __post_init__(self) -> None:
        where = "Packing"
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"{where}(seq_len={self.seq_len!r}) must be a whole number of tokens, 2 or more")
        if self.mode not in MODES:
            raise ValueError(f"{where}(mode={self.mode!r}) is not a packing mode; choose one of {list(MODES)}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"{where}(window={self.window!r}) must be a positive number of documents")
        if isinstance(self.pad_id, bool) or not isinstance(self.pad_id, int) or self.pad_id < 0:
            raise ValueError(f"{where}(pad_id={self.pad_id!r}) must be a token id (an integer >= 0)")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or self.vocab_size < 1):
            raise ValueError(f"{where}(vocab_size={self.vocab_size!r}) must be a positive number of token ids")
        if self.vocab_size is not None and not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"{where}(pad_id={self.pad_id}) must be a token id below vocab_size={self.vocab_size}")
        given = self.fields
        if isinstance(given, str) or not all(isinstance(f, str) for f in given):
            raise ValueError(f"{where}(fields={given!r}) must be a list of field names out of {list(FIELDS)}")
        unknown = [f for f in given if f not in FIELDS]
        if unknown:
            raise ValueError(
                f"{where}(fields={list(given)!r}): {unknown} not a batch field; choose from {list(FIELDS)}"
            )
        if "input_ids" not in given:
            raise ValueError(f"{where}(fields={list(given)!r}) must hold 'input_ids' (every batch has its tokens)")
        object.__setattr__(self, "fields", tuple(f for f in FIELDS if f in given))  # one spelling, in FIELDS' order

    def record(self) -> dict[str, Any]:
        """What a checkpoint keeps of the packing (every field)."""
        return {**asdict(self), "fields": list(self.fields)}

    def identity(self) -> dict[str, Any]:
        """The fields that decide the sequences and what a batch holds: a resume with another of
        them is refused (``vocab_size`` only checks tokens, ``fields`` only chooses what is built,
        ``window`` matters to ``best_fit`` only)."""
        kept = {k: v for k, v in asdict(self).items() if k not in ("vocab_size", "fields")}
        if self.mode != "best_fit":
            kept.pop("window")
        return kept


class PackedEpochs:
    """The epochs of a manifest of documents as orders of packed sequences (the core's ``Epochs``).

    ``lengths``: every document's token count, item after item in manifest order, shape
    ``(num_documents,)``; ``counts``: documents per item, shape ``(num_items,)``.
    """

    def __init__(self, lengths: npt.ArrayLike, counts: npt.ArrayLike, packing: Packing) -> None:
        self.lengths: Int64Array = np.asarray(lengths, dtype=np.int64)
        self.counts: Int64Array = np.asarray(counts, dtype=np.int64)
        self.packing = packing
        if self.lengths.ndim != 1 or int(self.counts.sum()) != self.lengths.size:
            raise ValueError(
                f"{self.lengths.size} document lengths for {int(self.counts.sum())} documents in the items"
            )
        # Each item's first document, and where each document's tokens start in its item.
        self.first_document: Int64Array = np.concatenate(([0], np.cumsum(self.counts)))
        empty = np.flatnonzero(self.lengths <= 0)
        if empty.size:
            item, index = self.document(int(empty[0]))
            raise ValueError(
                f"document {index} of item {item} holds no tokens ({empty.size} empty document(s) in all): "
                "remove empty documents from the data"
            )
        starts = np.concatenate(([0], np.cumsum(self.lengths)))
        self.token_start_in_item: Int64Array = starts[:-1] - np.repeat(starts[self.first_document[:-1]], self.counts)
        self.tokens = int(starts[-1])

    def document(self, doc: int) -> tuple[int, int]:
        """``(item, index in the item)`` of document ``doc``."""
        item = int(np.searchsorted(self.first_document, doc, side="right")) - 1
        return item, doc - int(self.first_document[item])

    # -- the Epochs protocol ---------------------------------------------------------------------

    @cached_property
    def total(self) -> int:
        """Sequences in an epoch (the same in every epoch)."""
        mode, seq_len = self.packing.mode, self.packing.seq_len
        if mode == "concat":
            return -(-self.tokens // seq_len)
        if mode == "none":
            return int(self.lengths.size)
        return len(self.bins[0]) - 1

    def order(self, counts: npt.NDArray[np.int64], seed: int, epoch: int, *, shuffle: bool = True) -> PackedOrder:
        """The sequences of ``epoch``."""
        return PackedOrder(self, seed, epoch, shuffle=shuffle)

    def blocks_at(self, epoch: int) -> Blocks | None:
        """Sequences are cut into batches anywhere."""
        return None

    @cached_property
    def _digest(self) -> str:
        return hashlib.blake2b(self.lengths.astype("<i8").tobytes(), digest_size=16).hexdigest()

    def identity(self, counts: npt.NDArray[np.int64]) -> list[Any]:
        """The packing and the documents' lengths: another of either is other data to a checkpoint."""
        return [["packing", self.packing.identity(), self._digest]]

    def summary(self, items: Sequence[Any], counts: npt.NDArray[np.int64]) -> dict[str, Any]:
        """The packing, and the documents, tokens and padding of an epoch."""
        return {
            "packing": {
                **self.packing.record(),
                "documents": int(self.lengths.size),
                "tokens": self.planned_tokens,
                "padding": self.padding,
                "lengths_digest": self._digest,
            }
        }

    def identity_summary(self) -> dict[str, Any]:
        """The packing fields that decide the sequences, and the documents and tokens they hold
        (what a mixture's stream keeps of its packing, in its identity)."""
        return {
            **self.packing.identity(),
            "documents": int(self.lengths.size),
            "tokens": self.planned_tokens,
            "lengths_digest": self._digest,
        }

    def explain(self, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
        """The packing's fields that changed, then the documents' lengths."""
        old, new = before.get("packing"), after.get("packing")
        if old is None or new is None:
            return [] if old == new else [f"packing was {old!r}, now {new!r}"]
        found = [
            f"packing.{key} was {old.get(key)!r}, now {new.get(key)!r}"
            for key in (*self.packing.identity(), "documents", "tokens")
            if old.get(key) != new.get(key)
        ]
        if not found and old.get("lengths_digest") != new.get("lengths_digest"):
            found.append("the documents' token counts changed (the same number of documents and tokens)")
        return found

    # -- tokens ----------------------------------------------------------------------------------

    @cached_property
    def planned_tokens(self) -> int:
        """Tokens an epoch trains on (all of them, but what ``none`` cuts off)."""
        if self.packing.mode == "none":
            return int(np.minimum(self.lengths, self.packing.seq_len).sum())
        return self.tokens

    @cached_property
    def padding(self) -> int:
        """Padding tokens in an epoch's sequences."""
        return self.total * self.packing.seq_len - self.planned_tokens

    @cached_property
    def bins(self) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array]:
        """``best_fit``'s sequences: ``(first, doc, start, stop)``, the pieces of sequence ``s``
        being ``first[s]:first[s + 1]``, each tokens ``[start, stop)`` of ``doc``. Packed over the
        documents in manifest order (documents of one file together), so the same for every seed
        and epoch: an epoch shuffles the sequences, and the ledger's total never changes."""
        documents = np.arange(self.lengths.size, dtype=np.int64)
        return best_fit(self.lengths, documents, self.packing.seq_len, self.packing.window)


def best_fit(
    lengths: Int64Array, documents: Int64Array, seq_len: int, window: int
) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array]:
    """Pack ``documents`` (ids into ``lengths``, in this order) into sequences of ``seq_len``
    tokens: full sequences cut from long documents first, then the rest of each window of
    ``window`` documents by best-fit decreasing. Returns ``(first, doc, start, stop)`` (see
    :meth:`PackedEpochs.bins`)."""
    first, doc, start, stop = [0], [], [], []
    for lo in range(0, len(documents), window):
        ids = documents[lo : lo + window]
        n = lengths[ids]
        full = n // seq_len
        for d, k in zip(ids[full > 0].tolist(), full[full > 0].tolist(), strict=True):
            for j in range(k):
                doc.append(d)
                start.append(j * seq_len)
                stop.append((j + 1) * seq_len)
                first.append(len(doc))
        rest = n - full * seq_len
        keep = rest > 0
        ids, rest, cut = ids[keep], rest[keep], (full * seq_len)[keep]
        by_size = np.argsort(-rest, kind="stable")
        bins: list[list[int]] = []  # the pieces (indices into ids) of each open sequence
        room: list[int] = []  # the free tokens of each open sequence, sorted, with ...
        which: list[int] = []  # ... the sequence each belongs to
        for i in by_size.tolist():
            size = int(rest[i])
            at = bisect.bisect_left(room, size)
            if at == len(room):
                bins.append([i])
                free, b = seq_len - size, len(bins) - 1
            else:
                free, b = room.pop(at) - size, which.pop(at)
                bins[b].append(i)
            if free > 0:
                at = bisect.bisect_left(room, free)
                room.insert(at, free)
                which.insert(at, b)
        for pieces in bins:
            for i in pieces:
                doc.append(int(ids[i]))
                start.append(int(cut[i]))
                stop.append(int(cut[i] + rest[i]))
            first.append(len(doc))
    as_array = np.asarray
    return (
        as_array(first, dtype=np.int64),
        as_array(doc, dtype=np.int64),
        as_array(start, dtype=np.int64),
        as_array(stop, dtype=np.int64),
    )


class PackedOrder:
    """The sequences of one ``(seed, epoch)`` of :class:`PackedEpochs`: an ``Order`` whose positions
    are sequences; :meth:`pieces` says which tokens each holds."""

    blocks: Blocks | None = None

    def __init__(self, epochs: PackedEpochs, seed: int, epoch: int, *, shuffle: bool = True) -> None:
        self.epochs = epochs
        self.seed, self.epoch, self.shuffle = int(seed), int(epoch), bool(shuffle)
        self.total = epochs.total
        self.seq_len = epochs.packing.seq_len
        self.mode = epochs.packing.mode

    @cached_property
    def documents(self) -> Int64Array:
        """The epoch's documents in order (``concat`` and ``none``), shape ``(num_documents,)``."""
        return EpochOrder(self.epochs.counts, self.seed, self.epoch, shuffle=self.shuffle).sample_order()

    @cached_property
    def _ends(self) -> Int64Array:
        """``concat``: where each of :attr:`documents` ends in the epoch's tokens, laid end to end."""
        return np.cumsum(self.epochs.lengths[self.documents])

    @cached_property
    def _sequences(self) -> Int64Array:
        """``best_fit``: the packed sequence at each position (the epoch's shuffle of them)."""
        if not self.shuffle:
            return np.arange(self.total, dtype=np.int64)
        return _rng(_SEQUENCE_STREAM, self.seed, self.epoch).permutation(self.total).astype(np.int64)

    def record(self) -> dict[str, Any]:
        """Nothing beyond the manifest (which holds the packing), the seed and the epoch."""
        return {}

    def _check(self, positions: npt.ArrayLike) -> Int64Array:
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.total):
            bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
            raise ValueError(f"sequence {bad} is outside the epoch's [0, {self.total})")
        return pos

    def pieces(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array]:
        """The pieces of the sequences at ``positions`` (shape ``(n,)``), sequence after sequence:
        ``(row, doc, start, stop)``, each of shape ``(pieces,)``: piece ``k`` is tokens
        ``[start[k], stop[k])`` of document ``doc[k]`` (manifest numbering), in row ``row[k]``
        (an index into ``positions``)."""
        pos = self._check(positions)
        seq_len = self.seq_len
        if self.mode == "none":
            doc = self.documents[pos]
            rows = np.arange(pos.size, dtype=np.int64)
            return rows, doc, np.zeros_like(doc), np.minimum(self.epochs.lengths[doc], seq_len)
        if self.mode == "best_fit":
            first, docs, starts, stops = self.epochs.bins
            seqs = self._sequences[pos]
            lo, hi = first[seqs], first[seqs + 1]
            rows = np.repeat(np.arange(pos.size, dtype=np.int64), hi - lo)
            at = ranges(lo, hi)
            return rows, docs[at], starts[at], stops[at]
        # concat: sequence s is tokens [s L, (s + 1) L) of the stream; documents d0..d1 cover it.
        ends = self._ends
        lo_tok = pos * seq_len
        hi_tok = np.minimum(lo_tok + seq_len, int(ends[-1]))
        d0 = np.searchsorted(ends, lo_tok, side="right")
        d1 = np.searchsorted(ends, hi_tok, side="left")
        d1 += 1
        rows = np.repeat(counting(pos.size), d1 - d0)
        slot = ranges(d0, d1)
        doc = self.documents[slot]
        length = self.epochs.lengths[doc]
        doc_start = ends[slot] - length  # where each document starts in the stream
        start = lo_tok[rows] - doc_start
        np.maximum(start, 0, out=start)
        stop = hi_tok[rows] - doc_start
        np.minimum(stop, length, out=stop)
        return rows, doc, start, stop

    def tokens(self, positions: npt.ArrayLike) -> int:
        """The tokens (not padding) the sequences at ``positions`` hold."""
        _, _, start, stop = self.pieces(positions)
        return int((stop - start).sum())

    def locate(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """The item and document index of each sequence's first piece."""
        pos = self._check(positions)
        rows, doc, _, _ = self.pieces(pos)
        first = np.flatnonzero(np.concatenate(([True], np.diff(rows) != 0)))
        docs = doc[first]
        items = np.searchsorted(self.epochs.first_document, docs, side="right") - 1
        return items.astype(np.int64), docs - self.epochs.first_document[items]

    def items_from(self, position: int, count: int) -> Int64Array:
        """The items of the documents from sequence ``position`` on, each once, in order."""
        last = min(self.total, position + max(8, count))
        _, doc, _, _ = self.pieces(np.arange(position, last))
        items = np.searchsorted(self.epochs.first_document, doc, side="right") - 1
        return np.asarray(list(dict.fromkeys(items.tolist()))[:count], dtype=np.int64)


def ranges(lo: Int64Array, hi: Int64Array) -> Int64Array:
    """``concatenate([arange(l, h) for l, h in zip(lo, hi)])`` without a Python loop."""
    sizes = hi - lo
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if ends.size else 0
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out = np.repeat(lo - (ends - sizes), sizes)
    out += counting(total)
    return out


def distinct(values: Int64Array) -> Int64Array:
    """The sorted distinct values of ``values``. Not ``np.unique``: NumPy 2's imports ``numpy.ma``
    the first time it runs, about 0.1-0.3 s in every fresh worker process, in its first batch."""
    ordered = np.sort(values)
    keep = np.ones(ordered.size, dtype=bool)
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


_COUNTING: Int64Array = np.arange(1 << 16, dtype=np.int64)
_COUNTING.flags.writeable = False


def counting(n: int) -> Int64Array:
    """``arange(n)`` (int64, read-only), sliced from one kept array grown as needed: a batch's index
    arithmetic asks for one of its token count every time."""
    global _COUNTING
    if n > _COUNTING.size:
        grown = np.arange(max(n, 2 * _COUNTING.size), dtype=np.int64)
        grown.flags.writeable = False
        _COUNTING = grown
    return _COUNTING[:n]
