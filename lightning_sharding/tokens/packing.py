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
    :meth:`PackedEpochs.bins`).

    Best-fit decreasing, window by window: the remainders sorted longest first (a stable sort),
    each goes to the open sequence with the least room that holds it, of several with that room
    the one given it last, else to a new sequence; a window's full sequences come before its
    packed ones, each sequence's pieces in the order they came. The windows are packed side by
    side, one piece of every window per step of NumPy operations (:func:`_lockstep`), a chunk of
    windows at a time so that the arrays stay small; the same sequences as the per-document loop
    this replaced (kept in ``tests/unit/test_best_fit.py``)."""
    documents = np.asarray(documents, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    seq_len, window = int(seq_len), int(window)
    per = max(1, _CHUNK_DOCUMENTS // window) * window  # documents in a chunk, whole windows
    pieces = 0  # a first pass counts them, so that the chunks fill the arrays in place
    for a in range(0, documents.size, per):
        n = lengths[documents[a : a + per]]
        if int(n.max()) >= seq_len:
            pieces += int(np.count_nonzero(n % seq_len)) + int((n // seq_len).sum())
        else:
            pieces += int(np.count_nonzero(n))
    out = _Packed(
        first=np.zeros(pieces + 1, dtype=np.int64),  # as many sequences at most, the rest never touched
        doc=np.empty(pieces, dtype=np.int64),
        start=np.zeros(pieces, dtype=np.int64),
        stop=np.empty(pieces, dtype=np.int64),
    )
    for a in range(0, documents.size, per):
        _pack_chunk(out, documents[a : a + per], lengths, seq_len, window)
    return out.first[: out.sequences + 1], out.doc, out.start, out.stop


# Documents packed in one chunk (its arrays are a few MiB, so a chunk reuses the last one's memory),
# windows packed side by side at most (their room tables, windows x (seq_len + 1) entries), and the
# fewest windows worth it (fewer are packed one by one in Python, as fast for so few).
_CHUNK_DOCUMENTS = 1 << 21
_CHUNK_ROOMS = 1 << 23
_LOCKSTEP_WINDOWS = 32


@dataclass
class _Packed:
    """``best_fit``'s output, filled chunk after chunk: ``sequences`` and ``pieces`` so far."""

    first: Int64Array
    doc: Int64Array
    start: Int64Array
    stop: Int64Array
    sequences: int = 0
    pieces: int = 0


def _pack_chunk(out: _Packed, documents: Int64Array, lengths: Int64Array, seq_len: int, window: int) -> None:
    """Pack the windows of ``documents`` (whole windows, the last one maybe short) into ``out``'s
    next sequences and pieces."""
    n = lengths[documents]
    full: Int64Array | None = None
    if int(n.max()) >= seq_len:
        full, rest = np.divmod(n, seq_len)
    else:
        rest = n
    count, rows = n.size, -(-n.size // window)
    # Each window's remainders longest first: a stable sort of seq_len - remainder (a radix sort
    # in 16 bits); a window's documents without one, and the short last window, sort last.
    flat = np.full(rows * window, seq_len, dtype=np.uint16 if seq_len < 1 << 16 else np.int64)
    np.subtract(seq_len, rest, out=flat[:count], casting="unsafe")
    keys: npt.NDArray[Any] = flat.reshape(rows, window)
    order = np.argsort(keys, axis=1, kind="stable")
    keys.sort(axis=1, kind="stable")
    real = np.count_nonzero(keys < seq_len, axis=1)  # each window's remainders
    steps = int(real.max()) if rows else 0
    keys = keys[:, :steps].T.copy()  # (steps, rows): step k packs piece k of every window
    keys[keys == seq_len] = 0  # no piece: one of seq_len tokens, opening a sequence after the window's own
    cb = seq_len.bit_length()  # record: (sequence << cb) | place in it, as _lockstep gives it
    record = np.zeros(
        (steps, rows), dtype=np.int32 if (steps + 1) << max(cb, rows.bit_length()) < 1 << 31 else np.int64
    )
    opened = np.full(rows, steps, dtype=np.int64)
    if steps > 1:
        side = max(1, _CHUNK_ROOMS // (seq_len + 1))
        # A short last window alone: with fewer pieces over half a sequence, it would shorten the
        # start its group places at once.
        lock = rows - 1 if count % window and rows > 1 else rows
        groups = [(g, min(g + side, lock)) for g in range(0, lock, side)] + ([(lock, rows)] if lock < rows else [])
        for g0, g1 in groups:
            pack = _lockstep if g1 - g0 >= _LOCKSTEP_WINDOWS else _one_by_one
            record[:, g0:g1], opened[g0:g1] = pack(keys[:, g0:g1], seq_len, cb)
    del keys
    # Sequence numbers: each window's full sequences, then its packed ones in the order opened.
    bins = opened - (steps - real)
    fulls = np.zeros(rows * window, dtype=np.int64)
    if full is not None:
        fulls[:count] = full
    fulls = fulls.reshape(rows, window).sum(axis=1)
    per_window = fulls + bins
    total = int(per_window.sum())
    bin_first = np.cumsum(per_window) - bins  # each window's first packed sequence, in the chunk
    rec = np.ascontiguousarray(record.T)  # (rows, steps): each window's pieces in packing order
    seq = bin_first[:, None] + (rec >> cb)
    slot = rec & ((1 << cb) - 1)
    order += (np.arange(rows, dtype=np.int64) * window)[:, None]
    at = order[:, :steps]  # each piece's document, in the chunk
    if np.all(real == steps):
        seq, slot, at = seq.reshape(-1), slot.reshape(-1), at.reshape(-1)
    else:
        taken = np.arange(steps) < real[:, None]
        seq, slot, at = seq[taken], slot[taken], at[taken]
    cut_seq = cut_doc = cut_j = None
    if full is not None and fulls.any():
        cut_doc = np.repeat(np.arange(count, dtype=np.int64), full)
        cut_j = np.arange(cut_doc.size, dtype=np.int64) - np.repeat(np.cumsum(full) - full, full)
        cut_seq = np.arange(cut_doc.size, dtype=np.int64) + (np.cumsum(bins) - bins)[cut_doc // window]
        counts = np.bincount(np.concatenate([cut_seq, seq]), minlength=total)
    else:
        counts = np.bincount(seq, minlength=total)
    ends = np.cumsum(counts)
    placed = int(ends[-1]) if total else 0
    np.add(ends, out.pieces, out=out.first[out.sequences + 1 : out.sequences + total + 1])
    ends -= counts  # each sequence's first piece
    src = np.empty(placed, dtype=np.int64)  # each piece's document, in the chunk
    pos = ends[seq]
    pos += slot
    src[pos] = at
    if cut_seq is not None and cut_doc is not None:
        src[ends[cut_seq]] = cut_doc
    into = slice(out.pieces, out.pieces + placed)
    np.take(documents, src, out=out.doc[into])
    np.take(n, src, out=out.stop[into])
    if full is not None:
        np.subtract(out.stop[into], np.take(rest, src), out=out.start[into])
    if cut_seq is not None and cut_j is not None:
        at_cut = ends[cut_seq] + out.pieces
        out.start[at_cut] = cut_j * seq_len
        out.stop[at_cut] = out.start[at_cut] + seq_len
    out.sequences += total
    out.pieces += placed


_ONE = np.uint64(1)
_BIT = _ONE << np.arange(64, dtype=np.uint64)  # _BIT[i]: bit i
_BIT_OR_NONE = np.concatenate([_BIT, np.zeros(1, dtype=np.uint64)])  # and _BIT_OR_NONE[-1]: none
_FROM = np.concatenate([~(_BIT - _ONE), np.zeros(1, dtype=np.uint64)])  # _FROM[i]: bits i..63 (none for 64)
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_SIX = np.uint64(58)
_BIT_AT = np.zeros(64, dtype=np.int64)  # a power of two's bit, by its De Bruijn product's top 6 bits
_BIT_AT[(_BIT * _DEBRUIJN) >> _SIX] = np.arange(64)


def _lowest(words: npt.NDArray[np.uint64]) -> tuple[Int64Array, npt.NDArray[np.uint64]]:
    """The place of each word's lowest set bit (0 for a word of 0), and that bit."""
    low = words & -words
    return _BIT_AT[(low * _DEBRUIJN) >> _SIX], low


def _words(present: npt.NDArray[np.bool_]) -> npt.NDArray[np.uint64]:
    """Bits ``[window, place]`` as 64-bit words ``[window, word]`` (bit ``i`` of word ``w``: place
    ``64 w + i``), with a spare word of 0 after them."""
    rows, places = present.shape
    width = (-(-places // 64) + 1) * 64
    if places != width:
        padded = np.zeros((rows, width), dtype=bool)
        padded[:, :places] = present
        present = padded
    return np.packbits(present, axis=1, bitorder="little").view("<u8").astype(np.uint64, copy=False)


def _lockstep(keys: npt.NDArray[Any], seq_len: int, cb: int) -> tuple[npt.NDArray[Any], Int64Array]:
    """Best-fit decreasing over the windows of ``keys`` side by side, one piece of every window per step.

    ``keys``: ``(steps, windows)``, ``seq_len`` less each piece's size, the pieces of a window in
    packing order (0: a piece of ``seq_len``). Returns ``record``, ``(steps, windows)``, the
    sequence each piece went to, numbered in the order its window opened them, shifted left by
    ``cb`` bits, or'ed with the piece's place in it; and the sequences each window opened.

    A window's open sequences are found by their room (the tokens they have free, 1 to
    ``seq_len``), a room ``x`` being place ``x - 1``: ``last[place, window]`` is the sequence last
    given that room (and its pieces so far, packed as ``record`` is) and ``before[sequence, window]``
    the one given it before that, a stack per room, as the sorted list of the loop this replaced
    gave the last-inserted of equal rooms first. A bitmap per window marks the rooms held, in
    64-bit words, with a word of bits per 64 words above it up to a single word (``summary``), so
    that the least room that holds a piece is a few word operations away. The room ``seq_len`` is
    always held, by a stack of new sequences (the next one the window opens). A sequence left with
    no room goes to place -1: the spare last row of ``last``, and a bit in the spare word of each
    bitmap below ``summary`` (none in ``summary``), where no search looks. The pieces over half a
    sequence that every window starts with each open a sequence, so they are placed at once."""
    steps, rows = keys.shape
    sh = max(0, (rows - 1).bit_length())  # [x, window] is at (x << sh) | window
    stride = 1 << sh
    value = np.dtype(np.int32 if (steps + 1) << max(cb, sh) < 1 << 31 else np.int64)
    win = np.arange(rows, dtype=np.int64)
    last = np.full((seq_len + 1) << sh, -1, dtype=value)
    before = np.empty((steps + 1) << sh, dtype=value)
    before.reshape(steps + 1, stride)[:] = (np.arange(1, steps + 2, dtype=value) << cb)[:, None]  # new ones
    record = np.empty((steps, rows), dtype=value)
    present = np.zeros((rows, (-(-seq_len // 64) + 1) * 64), dtype=bool)  # [window, place]: a room held
    present[:, seq_len - 1] = True
    big = int(np.count_nonzero((keys > 0) & (keys < (seq_len + 1) // 2), axis=0).min())
    if big:  # piece k < big opens sequence k, its room the piece's key, ascending down a window
        place = keys[:big].astype(np.int64) - 1
        j = np.arange(big, dtype=value)[:, None]
        record[:big] = j << cb
        same = np.zeros((big, rows), dtype=bool)
        np.equal(place[1:], place[:-1], out=same[1:])
        before.reshape(steps + 1, stride)[:big, :rows] = np.where(same, ((j - 1) << cb) | 1, -1)
        top = np.ones((big, rows), dtype=bool)
        np.logical_not(same[1:], out=top[:-1])
        last[((place << sh) | win)[top]] = np.broadcast_to((j << cb) | 1, top.shape)[top]
        present[win, place] = True
    last[((seq_len - 1) << sh) | win] = big << cb
    levels: list[npt.NDArray[np.uint64]] = []  # the bitmaps below the summary, finest first
    while True:
        words = _words(present)
        if words.shape[1] <= 2:
            summary = words[:, 0].copy()
            break
        spread = np.zeros((words.shape[1], stride), dtype=np.uint64)
        spread[:, :rows] = words.T
        levels.append(spread.reshape(-1))
        present = words[:, :-1] != 0
    for k in range(big, steps):
        need = seq_len - 1 - keys[k].astype(np.int64)  # the place of a room of the piece's size
        # Up: the first word at or after the place, at each level, masked below it.
        pos, found = need, []
        for bits in levels:
            word = pos >> 6
            found.append((word, bits[(word << sh) | win] & _FROM[pos & 63]))
            pos = word + 1
        at_place, low = _lowest(summary & _FROM[pos])
        # Down: from the finest level that found a bit, its lowest bit's word at the level below.
        for level in range(len(levels) - 1, -1, -1):
            word, masked = found[level]
            here = masked != 0
            at = (np.where(here, word, at_place) << sh) | win
            bit, low = _lowest(np.where(here, masked, levels[level][at]))
            at_place = ((at >> sh) << 6) | bit
        # Take that room's last sequence; its stack may empty, and with it a bit at each level.
        idx = (at_place << sh) | win
        got = np.take(last, idx, out=record[k])
        seq = ((got >> cb) << sh) | win
        below = before[seq]
        last[idx] = below
        gone = below < 0
        if levels:
            left = levels[0][at] ^ (low * gone)
            levels[0][at] = left
            pos = at >> sh
            for bits in levels[1:]:
                gone &= left == 0
                at = ((pos >> 6) << sh) | win
                left = bits[at] ^ (_BIT[pos & 63] * gone)
                bits[at] = left
                pos >>= 6
            summary ^= _BIT[pos] * (gone & (left == 0))
        else:
            summary ^= low * gone
        # Give it its room left, one piece more.
        free = at_place - need - 1
        idx = (free << sh) | win
        before[seq] = last[idx]
        last[idx] = got + 1
        for bits in levels:
            bits[((free >> 6) << sh) | win] |= _BIT[free & 63]
            free >>= 6
        summary |= _BIT_OR_NONE[free]
    return record, (last[((seq_len - 1) << sh) | win] >> cb).astype(np.int64)


def _one_by_one(keys: npt.NDArray[Any], seq_len: int, cb: int) -> tuple[npt.NDArray[Any], Int64Array]:
    """:func:`_lockstep`'s result, a window at a time in Python (for a few windows)."""
    steps, rows = keys.shape
    record = np.empty((steps, rows), dtype=np.int64)
    opened = np.empty(rows, dtype=np.int64)
    for r in range(rows):
        fill: list[int] = []  # each sequence's pieces so far
        room: list[int] = []  # the free tokens of each open sequence, sorted, with ...
        which: list[int] = []  # ... the sequence each belongs to
        column: list[int] = []
        for key in keys[:, r].tolist():
            size = seq_len - key
            at = bisect.bisect_left(room, size)
            if at == len(room):
                b = len(fill)
                fill.append(0)
                free = seq_len - size
            else:
                free, b = room.pop(at) - size, which.pop(at)
            column.append(b << cb | fill[b])
            fill[b] += 1
            if free > 0:
                at = bisect.bisect_left(room, free)
                room.insert(at, free)
                which.insert(at, b)
        record[:, r] = column
        opened[r] = len(fill)
    return record, opened


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
