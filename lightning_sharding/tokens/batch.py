"""What a batch of packed sequences holds, built with array operations from the pieces' tokens.

For ``B`` sequences of ``L`` tokens (:func:`packed_batch`):

- ``input_ids`` ``(B, L)`` int64, ``pad_id`` at padding;
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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from lightning_sharding.tokens.packing import Packing, ranges

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
    :meth:`~lightning_sharding.tokens.packing.PackedOrder.pieces` gives them).

    ``lengths`` holds every document's token count; ``read(docs, starts, stops)`` returns the
    tokens ``[starts[k], stops[k])`` of document ``docs[k]`` for every piece ``k``, one after another
    (one token more than the piece when the document goes on after it); ``name(doc)`` says which
    document a bad token is in.
    """
    row, doc, start, stop = pieces
    seq_len = packing.seq_len
    n = stop - start
    extra = (stop < lengths[doc]).astype(np.int64)  # the document goes on: read its next token for the label
    flat = np.asarray(read(doc, start, stop + extra)).astype(np.int64, copy=False)
    if flat.size != int((n + extra).sum()):
        raise ValueError(f"the reader returned {flat.size} tokens for pieces of {int((n + extra).sum())}")
    if packing.vocab_size is not None and flat.size and (flat.min() < 0 or flat.max() >= packing.vocab_size):
        k = int(np.flatnonzero((flat < 0) | (flat >= packing.vocab_size))[0])
        piece = int(np.searchsorted(np.cumsum(n + extra), k, side="right"))
        at = int(start[piece]) + k - int(np.concatenate(([0], np.cumsum(n + extra)))[piece])
        raise ValueError(
            f"token id {int(flat[k])} at token {at} of {name(int(doc[piece]))} is outside the vocabulary "
            f"[0, {packing.vocab_size}): the data was tokenized for another vocabulary, or the vocabulary size "
            "given (Packing(vocab_size=...), Hydra data.vocab_size) is not the tokenizer's"
        )
    # Where each piece starts in the read tokens, and in its row.
    read_at = np.concatenate(([0], np.cumsum(n + extra)[:-1])).astype(np.int64)
    first_of_row = np.concatenate(([True], row[1:] != row[:-1])) if row.size else np.zeros(0, dtype=bool)
    before = np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.int64)
    row_base = np.maximum.accumulate(np.where(first_of_row, before, 0)) if row.size else before
    col = before - row_base
    dest_at = row * seq_len + col
    src = ranges(read_at, read_at + n)
    dest = ranges(dest_at, dest_at + n)
    size = rows * seq_len
    input_ids = np.full(size, packing.pad_id, dtype=np.int64)
    input_ids[dest] = flat[src]
    labels = np.full(size, IGNORE_INDEX, dtype=np.int64)
    # The label of a token is the token after it in the read tokens, except after a piece's last
    # token when the document ended there.
    last = np.zeros(src.size, dtype=bool)
    ends = np.cumsum(n) - 1
    last[ends[n > 0]] = True
    ended = np.repeat(extra == 0, n)
    has_next = ~(last & ended)
    labels[dest[has_next]] = flat[src[has_next] + 1]
    if packing.labels_across_documents and row.size > 1:
        follows = np.flatnonzero((extra[:-1] == 0) & (row[1:] == row[:-1]) & (n[:-1] > 0))
        labels[dest_at[follows] + n[follows] - 1] = flat[read_at[follows + 1]]
    position_ids = np.zeros(size, dtype=np.int64)
    position_ids[dest] = dest - np.repeat(dest_at, n)
    document_ids = np.full(size, -1, dtype=np.int64)
    document_ids[dest] = np.repeat(doc, n)
    used = np.bincount(row, weights=n, minlength=rows).astype(np.int64)
    pads = np.flatnonzero(used < seq_len)
    bounds = np.unique(np.concatenate(([0], dest_at[n > 0], pads * seq_len + used[pads], [size]))).astype(np.int32)
    shape = (rows, seq_len)
    return {
        "input_ids": torch.from_numpy(input_ids.reshape(shape)),
        "labels": torch.from_numpy(labels.reshape(shape)),
        "position_ids": torch.from_numpy(position_ids.reshape(shape)),
        "document_ids": torch.from_numpy(document_ids.reshape(shape)),
        "cu_seqlens": torch.from_numpy(bounds),
        "max_seqlen": int(np.diff(bounds).max()) if size else 0,
    }


def join_packed(parts: list[tuple[Int64Array, dict[str, Any], int]], rows: int) -> dict[str, Any]:
    """One batch of ``rows`` sequences from batches of some of them (a mixture's streams):
    ``(where, batch, first_document)`` each, its rows going to rows ``where`` of the result and its
    ``document_ids`` counted from ``first_document`` (documents numbered stream after stream).
    ``cu_seqlens`` and ``max_seqlen`` are those of the joined batch."""
    seq_len = int(parts[0][1]["input_ids"].shape[1])
    fields = {key: torch.empty((rows, seq_len), dtype=torch.int64) for key in ("input_ids", "labels", "position_ids")}
    document_ids = torch.empty((rows, seq_len), dtype=torch.int64)
    for where, batch, first in parts:
        at = torch.from_numpy(where)
        for key, out in fields.items():
            out[at] = batch[key]
        docs = batch["document_ids"]
        document_ids[at] = torch.where(docs >= 0, docs + first, docs)
    flat_docs = document_ids.reshape(-1).numpy()
    flat_positions = fields["position_ids"].reshape(-1).numpy()
    size = rows * seq_len
    starts = np.zeros(size, dtype=bool)
    starts[::seq_len] = True  # every row starts a segment
    starts[1:] |= flat_docs[1:] != flat_docs[:-1]  # a document (or the padding) begins
    starts[1:] |= (flat_positions[1:] == 0) & (flat_docs[1:] >= 0)  # a piece begins
    bounds = np.concatenate((np.flatnonzero(starts), [size])).astype(np.int32)
    return {
        **fields,
        "document_ids": document_ids,
        "cu_seqlens": torch.from_numpy(bounds),
        "max_seqlen": int(np.diff(bounds).max()) if size else 0,
    }
