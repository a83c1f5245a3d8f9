"""What a batch of packed sequences holds, built with array operations over the whole batch.

For ``B`` sequences of ``L`` tokens (:func:`packed_batch`), the fields of
:attr:`Packing.fields <lightning_sharding.tokens.packing.Packing>` (all by default):

- ``input_ids`` ``(B, L)`` int64, ``pad_id`` at padding (always built);
- ``labels`` ``(B, L)`` int64: the next token of the same document; -100 at padding and where the
  document ends (unless ``labels_across_documents``: then the next document's first token in the
  sequence). A piece cut at a sequence's end is labelled with the document's next token, read
  beyond the piece, so no token of a document but its first goes unpredicted;
- ``position_ids`` ``(B, L)`` int64, counting from 0 at the start of each piece (a document, or the
  part of one this sequence holds: attention cannot see the rest), 0 at padding;
- ``document_ids`` ``(B, L)`` int64: the document each token belongs to (manifest numbering:
  documents item after item), -1 at padding;
- ``cu_seqlens`` ``(segments + 1,)`` int32 over the flattened batch (each piece a segment, and the
  padding at the end of a row one more), and ``max_seqlen``, for variable-length attention kernels.

How: the pieces' tokens are read with one gather per file, in piece order, followed by the next
token of each piece its document goes on after. In piece order a row's tokens follow the row
before's, so when no row is padded (``concat`` but for an epoch's last batch) every field is built
in its final layout: ``labels`` is the tokens shifted by one with one fix per piece, ``position_ids``
a count minus each piece's start, ``document_ids`` each piece's document repeated. Padded rows get
the same arrays spread over their rows by one mask. No step loops in Python over sequences,
pieces or tokens.

Consecutive full sequences of ``concat`` (a batch's usual case: a worker reads a run of positions)
are one stretch of the epoch's token stream. :class:`ConcatRun` builds every field of such a stretch
of several batches at once, in the same layout, and hands each batch its slice: the calls a batch
costs (about forty, of a microsecond or so each) are paid once for the stretch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from lightning_sharding.tokens.packing import Packing, counting

Int64Array = npt.NDArray[np.int64]
IGNORE_INDEX = -100


def packed_batch(
    rows: int,
    pieces: tuple[Int64Array, Int64Array, Int64Array, Int64Array],
    lengths: Int64Array,
    read: Callable[[Int64Array, Int64Array, Int64Array], npt.NDArray[Any]],
    packing: Packing,
    name: Callable[[int], str] = "document {}".format,
) -> dict[str, Any]:
    """The batch of ``rows`` sequences made of ``pieces`` (``(row, doc, start, stop)``, as
    :meth:`~lightning_sharding.tokens.packing.PackedOrder.pieces` gives them: row after row, each
    row's pieces in their order), holding the fields of ``packing.fields``.

    ``lengths`` holds every document's token count; ``read(docs, starts, stops)`` returns the
    tokens ``[starts[k], stops[k])`` of document ``docs[k]`` for every span ``k``, one after
    another, of any integer dtype; ``name(doc)`` says which document a bad token is in.
    """
    row, doc, start, stop = pieces
    seq_len, fields = packing.seq_len, packing.fields
    size = rows * seq_len
    n = stop - start
    if n.size and not n.all():  # an empty piece holds nothing to lay out
        keep = n > 0
        row, doc, start, stop, n = row[keep], doc[keep], start[keep], stop[keep], n[keep]
    ends = np.cumsum(n)  # where each piece ends among the batch's tokens, in piece order
    befores = ends - n
    total = int(ends[-1]) if ends.size else 0
    goes = stop < lengths[doc]  # the piece's document goes on after it: read its next token for the label
    after = stop[goes]
    spans = (np.concatenate((doc, doc[goes])), np.concatenate((start, after)), np.concatenate((stop, after + 1)))
    flat = np.asarray(read(*spans))
    if flat.shape != (total + after.size,):
        raise ValueError(f"the reader returned {flat.size} tokens for pieces of {total + after.size}")
    if packing.vocab_size is not None and flat.size and (int(flat.min()) < 0 or int(flat.max()) >= packing.vocab_size):
        _refuse_token(flat, packing.vocab_size, ends, n, start, stop, np.flatnonzero(goes), doc, name)
    tokens = on_page(total)  # in piece order; a copy (a reader may hand back its own memory)
    tokens[:] = flat[:total]
    full = total == size  # no padding: piece order is the batch's layout
    if not full:
        used = np.bincount(row, weights=n, minlength=rows).astype(np.int64)
        inside = counting(seq_len)[None, :] < used[:, None]  # (rows, L): the tokens' places

    def laid(values: Int64Array, fill: int) -> torch.Tensor:
        """``values`` (piece order) in the batch's ``(rows, L)`` layout, ``fill`` at padding."""
        if full:
            return torch.from_numpy(values.reshape(rows, seq_len))
        out = np.full((rows, seq_len), fill, dtype=np.int64)
        out[inside] = values
        return torch.from_numpy(out)

    batch: dict[str, Any] = {"input_ids": laid(tokens, packing.pad_id)}
    if "labels" in fields:
        labels = on_page(total)  # as the tokens: never 8 bytes past them in a page (see Buffers)
        labels[:-1] = tokens[1:]  # the next token, right inside a piece
        lasts = ends - 1  # each piece's last token
        labels[lasts[goes]] = flat[total:]
        ended = ~goes
        if packing.labels_across_documents:  # the next piece of the same row keeps its first token as label
            ended[:-1] &= row[1:] != row[:-1]
        labels[lasts[ended]] = IGNORE_INDEX
        batch["labels"] = laid(labels, IGNORE_INDEX)
    if "position_ids" in fields:
        positions = np.repeat(befores, n)
        np.subtract(counting(total), positions, out=positions)  # the count since the piece's start
        batch["position_ids"] = laid(positions, 0)
    if "document_ids" in fields:
        batch["document_ids"] = laid(np.repeat(doc, n), -1)
    if "cu_seqlens" in fields:
        if full:  # every piece is a segment; no padding
            bounds = np.empty(n.size + 1, dtype=np.int32)
            bounds[:-1] = befores
            bounds[-1] = size
            batch["max_seqlen"] = int(n.max()) if size else 0
        else:  # a piece starts at its row's start plus the row's tokens before it; padding follows a row's last
            row_start = counting(rows) * seq_len
            shift = row_start - (np.cumsum(used) - used)  # from piece order to the row's place
            pads = np.flatnonzero(used < seq_len)
            cut = np.concatenate((befores + shift[row], row_start[pads] + used[pads], [size]))
            cut.sort()
            bounds = cut.astype(np.int32)
            batch["max_seqlen"] = int(np.diff(cut).max()) if size else 0
        batch["cu_seqlens"] = torch.from_numpy(bounds)
    return batch


def on_page(size: int) -> Int64Array:
    """An ``int64`` array of ``size`` elements (of undefined values) starting on a page (:data:`Buffers.ALIGN`)."""
    owner, at = _page_owner(size)
    return owner[at : at + size]


def _page_owner(size: int) -> tuple[Int64Array, int]:
    """An array owning its memory, with room for ``size`` elements from element ``at`` on, which starts a page."""
    owner = np.empty(size + Buffers.ALIGN // 8, dtype=np.int64)
    return owner, (-owner.ctypes.data % Buffers.ALIGN) // 8  # malloc aligns to 16 bytes: whole elements


def _refuse_token(
    flat: npt.NDArray[Any],
    vocab_size: int,
    ends: Int64Array,
    n: Int64Array,
    start: Int64Array,
    stop: Int64Array,
    goes_on: Int64Array,
    doc: Int64Array,
    name: Callable[[int], str],
) -> None:
    """Raise naming the first token outside ``[0, vocab_size)``, in the order the pieces' tokens
    come (each piece, then the next token its document goes on with)."""
    total = int(ends[-1])
    bad = np.flatnonzero((flat < 0) | (flat >= vocab_size))
    inner, outer = bad[bad < total], bad[bad >= total] - total
    piece = np.searchsorted(ends, inner, side="right")
    at = start[piece] + inner - (ends - n)[piece]
    order = inner + np.searchsorted(goes_on, piece)  # counting the next tokens before each piece
    piece = np.concatenate((piece, goes_on[outer]))
    at = np.concatenate((at, stop[goes_on[outer]]))
    order = np.concatenate((order, ends[goes_on[outer]] + outer))
    k = int(np.argmin(order))
    raise ValueError(
        f"token id {int(flat[bad[k]])} at token {int(at[k])} of {name(int(doc[piece[k]]))} is outside the vocabulary "
        f"[0, {vocab_size}): the data was tokenized for another vocabulary, or the vocabulary size "
        "given (Packing(vocab_size=...), Hydra data.vocab_size) is not the tokenizer's"
    )


def join_packed(parts: list[tuple[Int64Array, dict[str, Any], int]], rows: int) -> dict[str, Any]:
    """One batch of ``rows`` sequences from batches of some of them (a mixture's streams):
    ``(where, batch, first_document)`` each, its rows going to rows ``where`` of the result and its
    ``document_ids`` counted from ``first_document`` (documents numbered stream after stream). The
    parts hold the same fields (one packing); ``cu_seqlens`` and ``max_seqlen`` are those of the joined
    batch: each part's segment bounds moved with their rows."""
    first_batch = parts[0][1]
    seq_len = int(first_batch["input_ids"].shape[1])
    keys = [k for k in ("input_ids", "labels", "position_ids", "document_ids") if k in first_batch]
    joined: dict[str, Any] = {key: torch.empty((rows, seq_len), dtype=torch.int64) for key in keys}
    for where, batch, first in parts:
        at = torch.from_numpy(where)
        for key in keys:
            value = batch[key]
            if key == "document_ids":
                value = torch.where(value >= 0, value + first, value)
            joined[key][at] = value
    if "cu_seqlens" in first_batch:
        size = rows * seq_len
        moved = [np.array([size], dtype=np.int64)]
        for where, batch, _ in parts:
            bounds = batch["cu_seqlens"].numpy()[:-1].astype(np.int64)  # every segment's start in the part
            row = bounds // seq_len
            moved.append(bounds + (where[row] - row) * seq_len)
        cu = np.concatenate(moved)
        cu.sort()
        joined["cu_seqlens"] = torch.from_numpy(cu.astype(np.int32))
        joined["max_seqlen"] = int(np.diff(cu).max()) if size else 0
    return joined


class Buffers:
    """``int64`` arrays for :class:`ConcatRun`, each used again once nothing else holds it (every
    batch sliced from it is gone): fresh memory for every stretch costs page faults, several times
    the time of writing the fields on this project's machine. At most :attr:`LIMIT` are kept; a
    batch held on to for long only makes another array be allocated. The free array used last goes
    out first: on this project's machine a 512 KiB copy ran at 14 us among arrays that stay in cache
    and at 155-185 us once they pass about 4 MiB, and handing out the oldest free array (the previous
    stretch's set but one) made a packed batch at 0 workers 135 us, the newest 116 (A/B, 6 rounds).

    Every array starts on a page (:data:`ALIGN` bytes): ``labels`` is the tokens copied one place
    on, and where ``labels`` started 16 bytes past the tokens in its page (two arrays one after the
    other from ``malloc``) the copy's target ran 8 bytes ahead of its source, modulo a page, which
    ``memcpy`` on this project's machine (AMD EPYC) copies 14x slower: 200 us for 512 KiB against 14
    (docs/performance.md, packed token sequences).

    Whether an array is free is read from its reference count, compared with the count of an array
    nothing else holds, measured the same way when the pool is made: how many references the
    interpreter counts while looking (the list's, the loop's name, the call's argument) differs
    between Python versions, so no number is assumed. Every array sliced from one (a batch's
    tensor holds one) adds a reference. One thread per pool: a reader is used by one thread.
    """

    LIMIT = 16
    ALIGN = 4096

    def __init__(self) -> None:
        self._held: list[tuple[Int64Array, int]] = []  # an array that owns its memory, where its page starts
        self._free = self._count([(np.empty(1, dtype=np.int64), 0)], 0)

    @staticmethod
    def _count(held: list[tuple[Int64Array, int]], k: int) -> int:
        """The reference count of the array of ``held[k]``, as :meth:`take` reads it."""
        return sys.getrefcount(held[k][0])

    def take(self, size: int) -> Int64Array:
        """An array of ``size`` elements (of undefined values), starting on a page, that nothing else uses."""
        held, count, free = self._held, self._count, self._free
        for k in range(len(held) - 1, -1, -1):  # the array used last first: its memory is likeliest in cache
            if count(held, k) == free:
                owner, at = held[k]
                if owner.size - at >= size:
                    held.append(held.pop(k))
                    return owner[at : at + size]
        owner, at = _page_owner(size)
        if len(held) < self.LIMIT:
            held.append((owner, at))
        return owner[at : at + size]


class ConcatRun:
    """Every field of the full ``concat`` sequences ``[first, stop)`` of ``order`` (a packed order),
    built at once over their stretch of the epoch's token stream; :meth:`batch` hands out a run of
    them, as :func:`packed_batch` builds it (the same values, as views of the stretch's arrays).

    ``read`` as :func:`packed_batch` takes it; ``name(doc)`` names a document in an error;
    ``fill(docs, starts, stops, out)``, where the reader has it, writes the spans' tokens into
    ``out`` (int64) instead of ``read``; ``buffers`` gives the arrays (:class:`Buffers`).
    """

    def __init__(
        self,
        order: Any,
        first: int,
        stop: int,
        read: Callable[[Int64Array, Int64Array, Int64Array], npt.NDArray[Any]],
        packing: Packing,
        name: Callable[[int], str] = "document {}".format,
        fill: Callable[[Int64Array, Int64Array, Int64Array, Int64Array], None] | None = None,
        buffers: Buffers | None = None,
    ) -> None:
        seq_len = packing.seq_len
        take = (buffers or Buffers()).take
        self.order, self.first, self.stop, self.packing = order, first, stop, packing
        self.served = first  # the sequences before this one were handed out (see holds)
        lo, hi = first * seq_len, stop * seq_len  # the stretch of the stream; whole sequences, so hi <= its end
        size = hi - lo
        ends = order._ends
        d0 = int(ends.searchsorted(lo, side="right"))
        d1 = int(ends.searchsorted(hi, side="left")) + 1
        docs = order.documents[d0:d1]
        doc_end = ends[d0:d1]
        length = order.epochs.lengths[docs]
        doc_start = doc_end - length
        start = np.maximum(lo - doc_start, 0)
        stop_at = np.minimum(hi - doc_start, length)
        goes = int(doc_end[-1]) > hi  # the last document goes on: read its next token for the last label
        n = stop_at - start
        if goes:
            stop_at = stop_at.copy()
            stop_at[-1] += 1
        if fill is not None:  # straight into the array the batches slice: no gather, no second copy
            flat = take(size + goes)
            fill(docs, start, stop_at, flat)
            tokens = flat[:size]
        else:
            flat = np.asarray(read(docs, start, stop_at))
            if flat.shape != (size + goes,):
                raise ValueError(f"the reader returned {flat.size} tokens for pieces of {size + goes}")
            tokens = take(size)
            tokens[:] = flat[:size]
        vocab = packing.vocab_size
        if vocab is not None and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
            positions = np.arange(first, stop, dtype=np.int64)  # the general path names the token at fault
            packed_batch(stop - first, order.pieces(positions), order.epochs.lengths, read, packing, name)
        fields = packing.fields
        self.tokens = tokens
        if "labels" in fields:
            labels = take(size)
            labels[:-1] = tokens[1:]
            labels[-1] = flat[size] if goes else IGNORE_INDEX
            last = doc_end[: d1 - d0 - goes] - (lo + 1)  # the last token of each document that ends here
            if packing.labels_across_documents:  # only where a sequence ends too
                last = last[(last + 1) % seq_len == 0]
            labels[last] = IGNORE_INDEX
            self.labels = labels
        # np.repeat's arrays are the fields themselves: a copy into a pooled array cost more than it saved.
        if "document_ids" in fields:
            self.documents = np.repeat(docs, n)
        if "position_ids" not in fields and "cu_seqlens" not in fields:
            return
        # Pieces start where a sequence starts or a document starts inside one (each sorted: merged by a sort).
        inner = doc_start[1:] - lo
        cuts = np.concatenate((inner[inner % seq_len != 0], counting(size)[::seq_len]))
        cuts.sort()
        pieces = np.empty_like(cuts)
        np.subtract(cuts[1:], cuts[:-1], out=pieces[:-1])
        pieces[-1] = size - cuts[-1]
        if "cu_seqlens" in fields:  # the cuts and the stretch's end, int32, and where each sequence's cuts begin
            self.bounds = np.empty(cuts.size + 1, dtype=np.int32)
            self.bounds[:-1] = cuts
            self.bounds[-1] = size
            self.sequence_cut = cuts.searchsorted(counting(size + 1)[::seq_len]).tolist()
            self.piece_lengths = pieces.tolist()  # a batch's longest: max() of a short list beats an array's
        if "position_ids" in fields:  # the count since the piece's start
            self.positions = np.repeat(cuts, pieces)
            np.subtract(counting(size), self.positions, out=self.positions)

    def holds(self, order: Any, first: int, rows: int) -> bool:
        """Whether the sequences ``[first, first + rows)`` of ``order`` are built here and not
        handed out yet: a batch is served from a stretch once (its holder may change it in place),
        so reading sequences again (a second pass, a validation run) builds them afresh."""
        return order is self.order and self.served <= first and first + rows <= self.stop

    def batch(self, first: int, rows: int) -> dict[str, Any]:
        """The batch of the sequences ``[first, first + rows)`` (:meth:`holds` them)."""
        seq_len, fields = self.packing.seq_len, self.packing.fields
        self.served = first + rows
        a = (first - self.first) * seq_len
        b = a + rows * seq_len
        batch: dict[str, Any] = {"input_ids": torch.from_numpy(self.tokens[a:b].reshape(rows, seq_len))}
        if "labels" in fields:
            batch["labels"] = torch.from_numpy(self.labels[a:b].reshape(rows, seq_len))
        if "position_ids" in fields:
            batch["position_ids"] = torch.from_numpy(self.positions[a:b].reshape(rows, seq_len))
        if "document_ids" in fields:
            batch["document_ids"] = torch.from_numpy(self.documents[a:b].reshape(rows, seq_len))
        if "cu_seqlens" in fields:
            i, j = self.sequence_cut[first - self.first], self.sequence_cut[first - self.first + rows]
            batch["cu_seqlens"] = torch.from_numpy(self.bounds[i : j + 1] - a)  # the next sequence's start ends it
            batch["max_seqlen"] = max(self.piece_lengths[i:j])
        return batch
