"""``best_fit`` packs the windows side by side with NumPy operations (issue 55 item 6): the same
four arrays as the per-document loop it replaced, kept below verbatim as the reference, on random
lengths (documents longer than several sequences, of exactly ``seq_len``, empty), ``seq_len``
(one, two and three levels of room bitmaps) and windows (of 1 too), with the windows packed side
by side or one by one, in one chunk or several."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_sharding.tokens.packing as packing
from lightning_sharding.tokens import PackedEpochs, Packing
from lightning_sharding.tokens.packing import best_fit

Int64Array = npt.NDArray[np.int64]


# -- the reference: best_fit in lightning_sharding/tokens/packing.py before issue 55, verbatim -------


def reference_best_fit(
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


# -------------------------------------------------------------------------------------------------


@contextmanager
def sizes(lockstep_windows: int, chunk_documents: int, chunk_rooms: int) -> Iterator[None]:
    """``best_fit`` with other thresholds: windows side by side from ``lockstep_windows`` of them,
    ``chunk_documents`` documents per chunk, ``chunk_rooms`` room-table entries at once."""
    kept = packing._LOCKSTEP_WINDOWS, packing._CHUNK_DOCUMENTS, packing._CHUNK_ROOMS
    packing._LOCKSTEP_WINDOWS, packing._CHUNK_DOCUMENTS, packing._CHUNK_ROOMS = (
        lockstep_windows,
        chunk_documents,
        chunk_rooms,
    )
    try:
        yield
    finally:
        packing._LOCKSTEP_WINDOWS, packing._CHUNK_DOCUMENTS, packing._CHUNK_ROOMS = kept


def assert_same(lengths: Int64Array, documents: Int64Array, seq_len: int, window: int) -> None:
    want = reference_best_fit(lengths, documents, seq_len, window)
    got = best_fit(lengths, documents, seq_len, window)
    for name, a, b in zip(("first", "doc", "start", "stop"), want, got, strict=True):
        assert b.dtype == np.int64 and b.shape == a.shape, (name, a.shape, b.shape)
        assert np.array_equal(a, b), (name, a.tolist()[:40], b.tolist()[:40])


@settings(max_examples=400, deadline=None)
@given(
    seq_len=st.one_of(st.integers(1, 70), st.sampled_from([127, 128, 129, 4095, 4096, 4097, 5000, 70_000])),
    window=st.one_of(st.integers(1, 12), st.sampled_from([40, 64, 1000])),
    kind=st.sampled_from(["short", "long", "edges", "small"]),
    count=st.integers(0, 300),
    shuffled=st.booleans(),
    lockstep_windows=st.sampled_from([1, 2, 32, 10**9]),
    chunk_documents=st.sampled_from([1, 5, 64, 1 << 21]),
    chunk_rooms=st.sampled_from([1, 300, 1 << 23]),
    seed=st.integers(0, 2**32 - 1),
)
def test_best_fit_packs_the_sequences_of_the_loop_it_replaced(
    seq_len: int,
    window: int,
    kind: str,
    count: int,
    shuffled: bool,
    lockstep_windows: int,
    chunk_documents: int,
    chunk_rooms: int,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    if kind == "short":  # at most one sequence
        lengths = rng.integers(0, seq_len + 1, count)
    elif kind == "long":  # up to several sequences, cut into full ones and a remainder
        lengths = rng.integers(0, 5 * seq_len + 1, count)
    elif kind == "edges":  # exactly seq_len, its multiples, one short of it, halves: ties everywhere
        edges = [0, 1, seq_len - 1, seq_len, seq_len + 1, 2 * seq_len, 3 * seq_len, seq_len // 2, seq_len // 2 + 1]
        lengths = rng.choice(np.asarray(edges, dtype=np.int64), count)
    else:  # many small pieces to a sequence, equal rooms in plenty
        lengths = rng.integers(1, max(2, seq_len // 3), count)
    lengths = lengths.astype(np.int64)
    documents = rng.permutation(count) if shuffled else np.arange(count, dtype=np.int64)
    if shuffled and count:  # ids into the lengths, some repeated or left out
        documents = rng.integers(0, count, count)
    with sizes(lockstep_windows, chunk_documents, chunk_rooms):
        assert_same(lengths, documents.astype(np.int64), seq_len, window)


@pytest.mark.parametrize(
    ("lengths", "seq_len", "window"),
    [
        (np.random.default_rng(3).integers(1, 2000, 30_000), 2048, 1024),  # the benchmark's, smaller
        (np.random.default_rng(4).integers(1, 9000, 20_000), 4096, 1024),  # cut, and three levels of bitmaps
        (np.random.default_rng(5).integers(1, 300, 20_000), 256, 128),  # several per sequence
        (np.random.default_rng(6).integers(1, 2000, 5_000), 2048, 1),  # windows of one
        (np.full(5_000, 2048), 2048, 1024),  # every document exactly a sequence
        (np.random.default_rng(7).integers(1, 2000, 200), 2048, 10**6),  # one window, packed in Python
    ],
)
def test_best_fit_at_scale_packs_the_same_sequences(lengths: Int64Array, seq_len: int, window: int) -> None:
    lengths = np.asarray(lengths, dtype=np.int64)
    assert_same(lengths, np.arange(lengths.size, dtype=np.int64), seq_len, window)


def test_packed_epochs_bins_are_best_fits() -> None:
    lengths = np.random.default_rng(8).integers(1, 700, 3000)
    epochs = PackedEpochs(lengths, [1000, 2000], Packing(512, "best_fit", window=256))
    want = reference_best_fit(lengths, np.arange(3000, dtype=np.int64), 512, 256)
    for a, b in zip(want, epochs.bins, strict=True):
        assert np.array_equal(a, b)
    assert epochs.total == want[0].size - 1
