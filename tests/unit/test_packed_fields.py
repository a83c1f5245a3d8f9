"""The fields of a packed batch, built with array operations over the whole batch (issue 54), are
those of the per-token scatter they replaced, value for value: the earlier code is kept below,
verbatim, as the reference, and both run on random documents (split across sequences, several
files, tokens of several dtypes) in the three packing modes, with and without labels across
documents, padded or not; ``Packing(fields=...)`` builds only the fields asked for."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_sharding.tokens as tokens_module
from lightning_sharding.core.manifest import Item
from lightning_sharding.mixture import MixtureReader, Stream
from lightning_sharding.tokens import FIELDS, DocumentReader, PackedReader, Packing
from lightning_sharding.tokens.batch import Buffers, join_packed, packed_batch
from lightning_sharding.tokens.packing import distinct

Int64Array = npt.NDArray[np.int64]
IGNORE_INDEX = -100


# -- the reference: lightning_sharding/tokens/batch.py before issue 54, verbatim ----------------------


def _ranges(lo: Int64Array, hi: Int64Array) -> Int64Array:
    """``concatenate([arange(l, h) for l, h in zip(lo, hi)])`` without a Python loop."""
    sizes = hi - lo
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(lo - np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes)
    return starts + np.arange(total, dtype=np.int64)


def reference_batch(
    rows: int,
    pieces: tuple[Int64Array, Int64Array, Int64Array, Int64Array],
    lengths: Int64Array,
    read: Callable[[Int64Array, Int64Array, Int64Array], npt.NDArray[Any]],
    packing: Packing,
    name: Callable[[int], str] = "document {}".format,
) -> dict[str, Any]:
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
    src = _ranges(read_at, read_at + n)
    dest = _ranges(dest_at, dest_at + n)
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


def reference_join(parts: list[tuple[Int64Array, dict[str, Any], int]], rows: int) -> dict[str, Any]:
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


# -- documents in memory ------------------------------------------------------------------------------


class MemoryDocuments(DocumentReader):
    """Files of documents held in memory, tokens of ``dtype``; ``gather``: read spans with one gather."""

    def __init__(
        self, files: Sequence[Sequence[npt.NDArray[Any]]], dtype: Any, gather: bool = True, arrays: bool = False
    ) -> None:
        self.files = [np.concatenate(docs).astype(dtype) for docs in files]
        self.lengths_of = [np.array([len(d) for d in docs], dtype=np.int64) for docs in files]
        self.gather, self.arrays = gather, arrays

    def token_array(self, item: Item) -> npt.NDArray[Any] | None:
        return self.files[int(item.key[4:])] if self.arrays else None  # arrays: read by slices, as a map is

    def items(self) -> Sequence[Item]:
        return [Item(f"mem-{k}", len(lengths)) for k, lengths in enumerate(self.lengths_of)]

    def document_lengths(self, item: Item) -> Int64Array:
        return self.lengths_of[int(item.key[4:])]

    def read_tokens(self, item: Item, start: int, stop: int) -> npt.NDArray[Any]:
        return self.files[int(item.key[4:])][start:stop]

    def read_spans(self, item: Item, starts: Int64Array, stops: Int64Array) -> npt.NDArray[Any]:
        if not self.gather:  # one read per span (DocumentReader's own)
            return super().read_spans(item, starts, stops)
        return self.files[int(item.key[4:])][_ranges(starts, stops)]


def corpus(data: st.DataObject, files: int, longest: int) -> list[list[npt.NDArray[np.int64]]]:
    """``files`` files of 1 to 5 documents of 1 to ``longest`` tokens (ids 1..999)."""
    out = []
    for _ in range(files):
        lengths = data.draw(st.lists(st.integers(1, longest), min_size=1, max_size=5))
        out.append([np.asarray(data.draw(st.lists(st.integers(1, 999), min_size=n, max_size=n))) for n in lengths])
    return out


def assert_same(batch: dict[str, Any], want: dict[str, Any], fields: Sequence[str] = FIELDS) -> None:
    expected = {"input_ids", *fields, *(["max_seqlen"] if "cu_seqlens" in fields else [])}
    assert set(batch) == expected
    for key in expected:
        if key == "max_seqlen":
            assert batch[key] == want[key]
            continue
        assert batch[key].dtype == want[key].dtype, key
        assert batch[key].shape == want[key].shape, key
        assert torch.equal(batch[key], want[key]), (key, batch[key], want[key])


@settings(max_examples=150, deadline=None)
@given(
    files=st.integers(1, 3),
    seq_len=st.integers(2, 24),
    mode=st.sampled_from(["concat", "best_fit", "none"]),
    window=st.integers(1, 6),
    across=st.booleans(),
    pad_id=st.integers(0, 3),
    dtype=st.sampled_from([np.uint16, np.int32, np.int64]),
    gather=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_the_fields_are_the_per_token_scatters_value_for_value(
    files: int,
    seq_len: int,
    mode: str,
    window: int,
    across: bool,
    pad_id: int,
    dtype: Any,
    gather: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    docs = corpus(data, files, longest=3 * seq_len)  # documents longer than a sequence are split across sequences
    packing = Packing(seq_len, mode, window=window, pad_id=pad_id, labels_across_documents=across)  # type: ignore[arg-type]
    reader = PackedReader(MemoryDocuments(docs, dtype, gather), packing)
    manifest = reader.manifest()
    order = manifest.order(seed, data.draw(st.integers(0, 2)))
    # A batch of any positions of the epoch (the last sequence is padded in concat), a repeated one at
    # the end as the plan's padding is.
    positions = np.asarray(
        data.draw(st.lists(st.integers(0, order.total - 1), min_size=1, max_size=order.total + 2)), dtype=np.int64
    )
    tokens = np.concatenate([np.concatenate(f) for f in docs]).astype(np.int64)
    at = np.concatenate(([0], np.cumsum(order.epochs.lengths)))

    def read(doc: Int64Array, start: Int64Array, stop: Int64Array) -> Int64Array:
        return tokens[_ranges(at[doc] + start, at[doc] + stop)]

    pieces = order.pieces(positions)
    want = reference_batch(len(positions), pieces, order.epochs.lengths, read, packing)
    assert_same(reader.read_sequences(order, positions, manifest.items), want)
    assert_same(packed_batch(len(positions), pieces, order.epochs.lengths, read, packing), want)
    fields = ["input_ids", *data.draw(st.lists(st.sampled_from(FIELDS[1:]), unique=True))]
    fewer = PackedReader(reader.documents, dataclasses.replace(packing, fields=tuple(fields)))
    assert_same(fewer.read_sequences(order, positions, manifest.items), want, fields)


@settings(max_examples=100, deadline=None)
@given(
    files=st.integers(1, 3),
    seq_len=st.integers(2, 12),
    rows=st.integers(1, 4),
    across=st.booleans(),
    dtype=st.sampled_from([np.uint16, np.int64]),
    arrays=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_consecutive_batches_of_concat_from_one_stretch_are_the_per_token_ones(
    files: int, seq_len: int, rows: int, across: bool, dtype: Any, arrays: bool, seed: int, data: st.DataObject
) -> None:
    """A worker reads runs of consecutive sequences: ``concat`` builds a stretch of several batches
    at once (``ConcatRun``) and hands out slices. Batch after batch, then back to an earlier one (a
    resume) and on into the next epoch, each is the reference's, with every field and with fewer,
    though each batch is changed in place once read (a step that masks its labels, say)."""
    docs = corpus(data, files, longest=3 * seq_len)
    fields = ("input_ids", *data.draw(st.lists(st.sampled_from(FIELDS[1:]), unique=True)))
    packing = Packing(seq_len, "concat", labels_across_documents=across, fields=fields)
    reader = PackedReader(MemoryDocuments(docs, dtype, arrays=arrays), packing)
    manifest = reader.manifest()
    tokens = np.concatenate([np.concatenate(f) for f in docs]).astype(np.int64)
    at = np.concatenate(([0], np.cumsum(manifest.epochs.lengths)))  # type: ignore[attr-defined]

    def read(doc: Int64Array, start: Int64Array, stop: Int64Array) -> Int64Array:
        return tokens[_ranges(at[doc] + start, at[doc] + stop)]

    for epoch in (0, 1):
        order = manifest.order(seed, epoch)
        starts = list(range(0, order.total, rows))
        back = data.draw(st.sampled_from(starts))
        for start in [*starts, back, *starts[starts.index(back) + 1 :]]:
            positions = np.arange(start, min(start + rows, order.total), dtype=np.int64)
            want = reference_batch(len(positions), order.pieces(positions), order.epochs.lengths, read, packing)
            batch = reader.read_sequences(order, positions, manifest.items)
            assert_same(batch, want, fields)
            for value in batch.values():
                if isinstance(value, torch.Tensor):
                    value.fill_(7)


@settings(max_examples=60, deadline=None)
@given(
    seq_len=st.integers(2, 16),
    mode=st.sampled_from(["concat", "best_fit", "none"]),
    rows=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_a_mixtures_joined_batch_is_the_per_token_one(
    seq_len: int, mode: str, rows: int, seed: int, data: st.DataObject
) -> None:
    packing = Packing(seq_len, mode)  # type: ignore[arg-type]
    readers = [PackedReader(MemoryDocuments(corpus(data, 2, 3 * seq_len), np.uint16), packing) for _ in range(2)]
    reader = MixtureReader([Stream(f"s{k}", r, repeat=1.0) for k, r in enumerate(readers)])
    manifest = reader.manifest()
    order = manifest.order(seed, 0)
    positions = np.asarray(data.draw(st.lists(st.integers(0, order.total - 1), min_size=rows, max_size=rows)))
    captured: list[Any] = []

    def capture(parts: list[Any], n: int) -> dict[str, Any]:
        captured.append((parts, n))
        return join_packed(parts, n)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokens_module, "join_packed", capture)
        batch = reader.read_sequences(order, positions, manifest.items)
    ((parts, n),) = captured
    assert_same(batch, reference_join(parts, n))
    for key in ("input_ids", "labels", "position_ids", "document_ids"):  # fewer fields: the same rows
        parts_of = [(w, {k: v for k, v in b.items() if k in ("input_ids", key)}, f) for w, b, f in parts]
        assert torch.equal(join_packed(parts_of, n)[key], batch[key])


def test_a_stretchs_array_is_used_again_only_once_no_batch_holds_it() -> None:
    buffers = Buffers()
    first = buffers.take(100)
    first[:] = 7
    batch = torch.from_numpy(first[10:20].reshape(2, 5))  # what a batch holds: a view of the array
    del first
    second = buffers.take(100)
    assert not np.shares_memory(second, batch.numpy())  # the batch still holds the first: a new one
    second[:] = 8
    assert batch.unique().tolist() == [7]
    del batch
    again = buffers.take(50)
    assert again.size == 50 and not np.shares_memory(again, second)  # the first again, now free
    del second, again
    assert len(buffers._held) == 2


def test_every_array_starts_on_a_page() -> None:
    """So ``labels`` (the tokens one place on) is never copied to 8 bytes past its source, modulo a
    page, which ``memcpy`` copies many times slower on AMD EPYC (``Buffers``)."""
    buffers = Buffers()
    taken = [buffers.take(size) for size in (1, 100, 65_537, 100)]
    assert [a.ctypes.data % Buffers.ALIGN for a in taken] == [0, 0, 0, 0]
    assert [a.size for a in taken] == [1, 100, 65_537, 100]
    assert len({a.ctypes.data for a in taken}) == 4
    del taken
    again = buffers.take(65_537)  # a free one used again: still on its page
    assert again.ctypes.data % Buffers.ALIGN == 0


def test_the_free_array_used_last_goes_out_first() -> None:
    """Its memory is the likeliest in cache: a stretch's fields are written into warm arrays."""
    buffers = Buffers()
    a, b = buffers.take(100), buffers.take(100)
    a_at, b_at = a.ctypes.data, b.ctypes.data
    del a, b
    first = buffers.take(100)
    assert first.ctypes.data == b_at, "b was taken last"
    second = buffers.take(100)
    assert second.ctypes.data == a_at
    del second
    assert buffers.take(100).ctypes.data == a_at, "a, freed last, before b still held"


def test_a_bad_token_is_named_where_the_reference_named_it() -> None:
    docs = [[np.array([1, 2, 3, 4, 5]), np.array([6, 7, 8])], [np.array([9, 10, 11, 12])]]
    for bad in range(12):  # token `bad` (in file order) out of the vocabulary, and every one after it
        files, seen = [[d.copy() for d in f] for f in docs], 0
        for d in (d for f in files for d in f):
            for i in range(len(d)):
                d[i] += 100 if seen >= bad else 0
                seen += 1
        for mode in ("concat", "best_fit", "none"):
            got, want = bad_token_messages(files, Packing(3, mode, vocab_size=50))  # type: ignore[arg-type]
            assert got == want, (bad, mode)
        if bad < 9:  # in concat's full sequences, read as one stretch: the same message
            got, want = bad_token_messages(files, Packing(3, "concat", vocab_size=50), full=True)
            assert got == want, bad


def bad_token_messages(files: list[list[npt.NDArray[Any]]], packing: Packing, full: bool = False) -> tuple[str, str]:
    """What the reader and the reference say of a whole unshuffled epoch of ``files`` (``full``: of
    its full sequences, all but the padded last)."""
    reader = PackedReader(MemoryDocuments(files, np.int64), packing)
    manifest = reader.manifest()
    order = manifest.order(0, 0, shuffle=False)
    positions = np.arange(order.total - full)
    tokens = np.concatenate([np.concatenate(f) for f in files])
    at = np.concatenate(([0], np.cumsum(order.epochs.lengths)))

    def name(doc: int) -> str:
        item, index = order.epochs.document(doc)
        return f"document {index} of {manifest.items[item].key!r}"

    def read(d: Int64Array, a: Int64Array, b: Int64Array) -> Int64Array:
        return tokens[_ranges(at[d] + a, at[d] + b)]

    with pytest.raises(ValueError) as got:
        reader.read_sequences(order, positions, manifest.items)
    with pytest.raises(ValueError) as want:
        reference_batch(len(positions), order.pieces(positions), order.epochs.lengths, read, packing, name)
    return str(got.value), str(want.value)


def test_fields_are_checked_and_keep_one_spelling() -> None:
    assert Packing(8).fields == FIELDS
    assert Packing(8, fields=["labels", "input_ids"]).fields == ("input_ids", "labels")  # FIELDS' order
    assert Packing(8, fields=("input_ids",)).identity() == Packing(8).identity()  # a resume under other fields
    assert Packing(8, fields=("input_ids",)).record()["fields"] == ["input_ids"]
    with pytest.raises(ValueError, match=r"\['attention_mask'\] not a batch field; choose from \['input_ids'"):
        Packing(8, fields=("input_ids", "attention_mask"))
    with pytest.raises(ValueError, match=r"must hold 'input_ids'"):
        Packing(8, fields=("labels",))
    with pytest.raises(ValueError, match=r"must be a list of field names"):
        Packing(8, fields="input_ids")  # type: ignore[arg-type]


@given(st.lists(st.integers(-5, 5), max_size=30))
def test_distinct_values_are_np_uniques(values: list[int]) -> None:
    array = np.asarray(values, dtype=np.int64)
    np.testing.assert_array_equal(distinct(array), np.unique(array))
