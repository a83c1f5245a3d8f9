"""Packed token sequences (issue 35): the orders tile every planned token once, whatever the
batches; the batch fields; the readers' indexes; bad input named."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sharding import ShardedDataModule
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.tokens import IndexedTokens, PackedEpochs, PackedReader, Packing, TokenFiles, write_indexed
from tests.support.data.tokens import write_corpus


def coverage(epochs: PackedEpochs, seed: int, epoch: int) -> np.ndarray:
    """How many times each (document, token) is in the epoch's sequences; (documents, longest)."""
    order = epochs.order(epochs.counts, seed, epoch)
    rows, doc, start, stop = order.pieces(np.arange(order.total))
    assert np.all(np.bincount(rows, weights=stop - start) <= epochs.packing.seq_len)
    assert np.all(np.diff(rows) >= 0) and np.unique(rows).size == order.total  # every sequence holds tokens
    seen = np.zeros((epochs.lengths.size, int(epochs.lengths.max())), dtype=np.int64)
    for d, a, b in zip(doc.tolist(), start.tolist(), stop.tolist(), strict=True):
        seen[d, a:b] += 1
    return seen


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=6).filter(lambda c: sum(c) > 0),
    seq_len=st.integers(2, 20),
    mode=st.sampled_from(["concat", "best_fit", "none"]),
    window=st.integers(1, 8),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_every_mode_holds_each_planned_token_once(
    counts: list[int], seq_len: int, mode: str, window: int, seed: int, data: st.DataObject
) -> None:
    lengths = np.array(data.draw(st.lists(st.integers(1, 50), min_size=sum(counts), max_size=sum(counts))))
    epochs = PackedEpochs(lengths, counts, Packing(seq_len, mode, window=window))  # type: ignore[arg-type]
    for epoch in (0, 1):
        seen = coverage(epochs, seed, epoch)
        planned = np.minimum(lengths, seq_len) if mode == "none" else lengths
        want = np.arange(seen.shape[1])[None, :] < planned[:, None]
        np.testing.assert_array_equal(seen, want.astype(np.int64))
        assert epochs.order(epochs.counts, seed, epoch).total == epochs.total
    assert epochs.padding == epochs.total * seq_len - int(want.sum())
    if mode == "concat":
        assert epochs.padding < seq_len  # only the epoch's last sequence is padded


def test_concat_shuffles_per_epoch_and_best_fit_shuffles_its_sequences() -> None:
    lengths = np.arange(1, 61)
    counts = [20, 20, 20]
    for mode in ("concat", "best_fit"):
        epochs = PackedEpochs(lengths, counts, Packing(16, mode))  # type: ignore[arg-type]
        first = [epochs.order(epochs.counts, 1, e).pieces(np.arange(4))[1].tolist() for e in (0, 1)]
        assert first[0] != first[1], mode
        assert (
            epochs.order(epochs.counts, 1, 0).pieces([3])[1].tolist()
            == epochs.order(epochs.counts, 1, 0).pieces([3])[1].tolist()
        )
    unshuffled = PackedEpochs(lengths, counts, Packing(16, "concat")).order(np.array(counts), 1, 0, shuffle=False)
    assert unshuffled.pieces([0])[1].tolist() == [0, 1, 2, 3, 4, 5]  # 1+2+3+4+5 = 15, then 1 token of doc 5


def test_best_fit_packs_whole_documents_and_pads_little() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 2000)
    epochs = PackedEpochs(lengths, [1000, 1000], Packing(256, "best_fit"))
    rows, doc, start, _ = epochs.order(epochs.counts, 0, 0).pieces(np.arange(epochs.total))
    short = lengths[doc] <= 256
    assert np.all(start[short] == 0)  # a document that fits one sequence is never split
    assert epochs.padding / (epochs.total * 256) < 0.05
    assert epochs.order(epochs.counts, 0, 0).total == PackedEpochs(
        lengths, [1000, 1000], Packing(256, "none")
    ).total - (2000 - epochs.total)


def test_a_batch_holds_labels_positions_documents_and_cu_seqlens(tmp_path: Path) -> None:
    # Documents of tokens 1..5, 6..13, 14..16 (one file), seq_len 6, concat, no shuffle.
    write_indexed(str(tmp_path / "a"), [np.arange(1, 6), np.arange(6, 14), np.arange(14, 17)])
    reader = PackedReader(IndexedTokens(str(tmp_path / "a")), Packing(6, "concat"))
    manifest = reader.manifest()
    order = manifest.order(0, 0, shuffle=False)
    batch = reader.read_sequences(order, np.arange(manifest.total), manifest.items)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 0, 0]]
    assert batch["labels"].tolist() == [
        [2, 3, 4, 5, -100, 7],  # 5 ends its document; 6's label (7) is read beyond the sequence
        [8, 9, 10, 11, 12, 13],
        [-100, 15, 16, -100, -100, -100],
    ]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 0, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1], [1, 2, 2, 2, -1, -1]]
    assert batch["cu_seqlens"].tolist() == [0, 5, 6, 12, 13, 16, 18]
    assert batch["cu_seqlens"].dtype.is_floating_point is False and str(batch["cu_seqlens"].dtype) == "torch.int32"
    assert batch["max_seqlen"] == 6
    across = PackedReader(IndexedTokens(str(tmp_path / "a")), Packing(6, "concat", labels_across_documents=True))
    labels = across.read_sequences(order, np.arange(3), manifest.items)["labels"]
    assert labels[0, 4] == 6 and labels[2, 0] == 14  # 5 -> 6 and 13 -> 14 are inside a row: labelled
    assert labels[2, 3] == -100  # the last document ends the row: nothing follows it


def test_token_files_split_at_eos_and_megatron_lengths_come_from_the_index(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.array([5, 6, 2, 7, 2, 8, 9], dtype=np.int32))  # eos 2
    (tmp_path / "b.bin").write_bytes(np.array([3, 2, 4, 4, 2], dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match=r"\.bin files hold raw tokens: give their dtype="):
        TokenFiles(str(tmp_path / "*"), eos_id=2)
    files = TokenFiles([str(tmp_path / "a.npy"), str(tmp_path / "b.bin")], eos_id=2, dtype="uint16")
    items = files.items()
    assert [it.num_samples for it in items] == [3, 2] and [it.name for it in items] == ["a.npy", "b.bin"]
    assert files.lengths(items).tolist() == [3, 2, 2, 2, 3]
    assert files.read(items[0], 2, None).tolist() == [8, 9]  # type: ignore[arg-type]
    total = write_corpus(tmp_path / "m", files=2, documents=5)
    indexed = IndexedTokens(str(tmp_path / "m" / "part-*.idx"))
    assert int(indexed.lengths(indexed.items()).sum()) == total


def write_bad_index(path: Path, what: str) -> None:
    write_indexed(str(path), [np.arange(1, 6), np.arange(6, 9)])
    if what == "truncated bin":
        data = (path.parent / f"{path.name}.bin").read_bytes()
        (path.parent / f"{path.name}.bin").write_bytes(data[:-2])
    elif what == "truncated idx":
        data = (path.parent / f"{path.name}.idx").read_bytes()
        (path.parent / f"{path.name}.idx").write_bytes(data[:-4])
    elif what == "magic":
        data = (path.parent / f"{path.name}.idx").read_bytes()
        (path.parent / f"{path.name}.idx").write_bytes(b"NOTMEGA!!" + data[9:])
    elif what == "version":
        data = bytearray((path.parent / f"{path.name}.idx").read_bytes())
        data[9:17] = struct.pack("<Q", 2)
        (path.parent / f"{path.name}.idx").write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("truncated bin", r"x\.idx' does not match .*x\.bin'.*8 tokens of uint16 \(16 bytes.*holds 14 bytes"),
        ("truncated idx", r"x\.idx' holds \d+ bytes but its header promises 2 sequences .*truncated"),
        ("magic", r"x\.idx' is not a Megatron index"),
        ("version", r"x\.idx' is a Megatron index of version 2"),
    ],
)
def test_a_bad_megatron_index_is_refused_naming_the_file(tmp_path: Path, what: str, message: str) -> None:
    write_bad_index(tmp_path / "x", what)
    with pytest.raises(ValueError, match=message):
        IndexedTokens(str(tmp_path / "x")).items()


def test_bad_packing_input_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Packing\(seq_len=1\) must be a whole number of tokens, 2 or more"):
        Packing(1)
    with pytest.raises(ValueError, match=r"Packing\(pad_id=-1\) must be a token id"):
        Packing(8, pad_id=-1)
    with pytest.raises(ValueError, match=r"Packing\(mode='greedy'\) is not a packing mode"):
        Packing(8, "greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"document 1 of item 0 holds no tokens"):
        PackedEpochs([3, 0, 2], [3], Packing(4))
    write_indexed(str(tmp_path / "e"), [np.arange(1, 6), np.array([], dtype=np.uint16), np.arange(3)])
    with pytest.raises(ValueError, match=r"document 1 of '.*e\.bin' holds no tokens \(1 empty document"):
        PackedReader(IndexedTokens(str(tmp_path / "e")), Packing(8)).manifest()
    write_indexed(str(tmp_path / "v"), [np.arange(1, 6), np.array([1, 70000 % 65536, 3])])
    reader = PackedReader(IndexedTokens(str(tmp_path / "v")), Packing(8, "none", vocab_size=100))
    manifest = reader.manifest()
    with pytest.raises(
        ValueError, match=r"token id 4464 at token 1 of document 1 of '.*v\.bin' is outside the vocabulary \[0, 100\)"
    ):
        reader.read_sequences(manifest.order(0, 0, shuffle=False), np.arange(2), manifest.items)
    with pytest.raises(TypeError, match=r"packing needs a reader of tokenized documents .*got SyntheticReader"):
        from lightning_sharding import SyntheticReader

        ShardedDataModule(SyntheticReader(sizes=[4]), packing=Packing(8))
    docs = IndexedTokens(str(tmp_path / "v"))
    with pytest.raises(
        ValueError,
        match=r"packing=\.\.\.\)`: strategy 'broadcast' does not read packed sequences; use sharding='shard'",
    ):
        ShardedDataModule(docs, packing=Packing(8), sharding="broadcast")
    with pytest.raises(ValueError, match=r"transform= and collate_fn= do not apply; use batch_transform="):
        ShardedDataModule(docs, packing=Packing(8), transform=lambda s, c: s)


def test_a_resume_with_another_packing_or_changed_documents_is_explained(tmp_path: Path) -> None:
    write_corpus(tmp_path, files=2, documents=4)
    docs = IndexedTokens(str(tmp_path / "part-*.idx"))
    saved = PackedReader(docs, Packing(16, "concat")).manifest()
    other = PackedReader(docs, Packing(32, "best_fit")).manifest()
    assert other.fingerprint != saved.fingerprint
    found = other.differences(saved.summary(), saved.table)
    assert "packing.seq_len was 16, now 32" in found and "packing.mode was 'concat', now 'best_fit'" in found
    same = [Packing(16, "concat", vocab_size=60000), Packing(16, "concat", window=7)]
    assert all(PackedReader(docs, p).manifest().fingerprint == saved.fingerprint for p in same)  # checks only
    assert PackedReader(docs, Packing(16, "concat", pad_id=3)).manifest().fingerprint != saved.fingerprint
    write_corpus(tmp_path, files=2, documents=4, seed=1)  # other documents, the same files
    os.utime(tmp_path / "part-0.bin")
    changed = PackedReader(IndexedTokens(str(tmp_path / "part-*.idx")), Packing(16, "concat")).manifest()
    found = changed.differences(saved.summary(), saved.table)
    assert any(f.startswith("'part-0.bin' ") for f in found), found


def test_a_manifest_of_documents_plans_sequences(tmp_path: Path) -> None:
    total = write_corpus(tmp_path, files=3, documents=6)
    manifest = PackedReader(IndexedTokens(str(tmp_path / "part-*.idx")), Packing(8, "concat")).manifest()
    assert isinstance(manifest, Manifest) and manifest.total == -(-total // 8)
    assert manifest.summary()["packing"]["tokens"] == total


@pytest.mark.needs("pyarrow")
def test_parquet_token_lists_are_documents_of_each_row_group(tmp_path: Path) -> None:
    """A tokenized data set as Hugging Face ``datasets`` writes it (an ``input_ids`` list column):
    every row a document, every row group an item; packed, every token is in the epoch once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [list(range(t, t + n)) for t, n in ((1, 5), (6, 9), (15, 2), (17, 7), (24, 3))]
    table = pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32())), "text": ["a", "b", "c", "d", "e"]})
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=2)
    from lightning_sharding.tokens import ParquetTokens

    reader = ParquetTokens(str(tmp_path / "*.parquet"))
    items = reader.items()
    assert [(it.name, it.num_samples) for it in items] == [
        ("train.parquet#rg=0", 2),
        ("train.parquet#rg=1", 2),
        ("train.parquet#rg=2", 1),
    ]
    assert reader.lengths(items).tolist() == [5, 9, 2, 7, 3]
    assert reader.read(items[1], 1, None).tolist() == rows[3]  # type: ignore[arg-type]
    packed = PackedReader(reader, Packing(4, "concat"))
    manifest = packed.manifest()
    batch = packed.read_sequences(manifest.order(3, 0), np.arange(manifest.total), manifest.items)
    tokens = batch["input_ids"][batch["input_ids"] != 0]
    assert sorted(tokens.tolist()) == list(range(1, 27))
    with pytest.raises(
        ValueError, match=r"train\.parquet' has no column 'tokens'; its columns are \['input_ids', 'text'\]"
    ):
        ParquetTokens(str(tmp_path / "train.parquet"), column="tokens").lengths(items[:1])
    with pytest.raises(ValueError, match=r"column 'text' holds string, not lists of integer token ids"):
        ParquetTokens(str(tmp_path / "train.parquet"), column="text").lengths(items[:1])


@pytest.mark.parametrize("mode", ["concat", "best_fit", "none"])
def test_a_mixture_of_packed_streams_holds_each_planned_token_once_whatever_the_batches(
    tmp_path: Path, mode: str
) -> None:
    from lightning_sharding import Stream
    from lightning_sharding.mixture import MixtureReader

    first = write_corpus(tmp_path / "a", files=2, documents=10)
    second = write_corpus(tmp_path / "b", files=1, documents=8, seed=1, first_token=first + 1)

    def mixture(packing: Packing) -> MixtureReader:
        streams = [PackedReader(IndexedTokens(f"{tmp_path / n}/part-*.idx"), packing) for n in "ab"]
        return MixtureReader([Stream("a", streams[0], repeat=1.0), Stream("b", streams[1], repeat=1.0)])

    reader = mixture(Packing(8, mode))  # type: ignore[arg-type]
    manifest = reader.manifest()
    planned = set()
    for name, n in (("a", first), ("b", second)):
        docs = IndexedTokens(f"{tmp_path / name}/part-*.idx")
        items, start = docs.items(), 1 if name == "a" else first + 1
        lengths = docs.lengths(items)
        ends = np.cumsum(lengths)
        for length, end in zip(lengths.tolist(), ends.tolist(), strict=True):
            kept = min(length, 8) if mode == "none" else length
            planned.update(range(start + end - length, start + end - length + kept))
        assert int(lengths.sum()) == n
    for epoch in (0, 1):
        order = manifest.order(7, epoch)
        whole = reader.read_sequences(order, np.arange(manifest.total), manifest.items)
        tokens = whole["input_ids"][whole["input_ids"] != 0].tolist()
        assert len(tokens) == len(set(tokens)) and set(tokens) == planned
        parts = [
            reader.read_sequences(order, np.arange(lo, min(lo + 5, manifest.total)), manifest.items)
            for lo in range(0, manifest.total, 5)
        ]
        for key in ("input_ids", "labels", "position_ids", "document_ids"):
            np.testing.assert_array_equal(whole[key].numpy(), np.concatenate([p[key].numpy() for p in parts]))
        bounds = whole["cu_seqlens"].numpy()
        assert bounds[0] == 0 and bounds[-1] == whole["input_ids"].numel() and np.all(np.diff(bounds) > 0)
    other = mixture(Packing(16, mode)).manifest()  # type: ignore[arg-type]
    assert other.fingerprint != manifest.fingerprint
    found = other.differences(manifest.summary(), manifest.table)
    assert any("stream 'a' packing: seq_len was 8, now 16" in f for f in found), found


def test_a_mixture_packs_every_stream_or_none(tmp_path: Path) -> None:
    from lightning_sharding import Stream, SyntheticReader
    from lightning_sharding.mixture import MixtureReader

    write_corpus(tmp_path, files=1, documents=4)
    packed = PackedReader(IndexedTokens(f"{tmp_path}/part-*.idx"), Packing(8))
    mixture = MixtureReader([Stream("tokens", packed), Stream("rows", SyntheticReader(sizes=[5]))])
    with pytest.raises(ValueError, match=r"streams \['rows'\] are not packed: pack every stream of a mixture, or none"):
        mixture.manifest()


def test_a_share_in_tokens_draws_that_many_tokens_within_one_sequence(tmp_path: Path) -> None:
    from lightning_sharding import Stream

    first = write_corpus(tmp_path / "a", files=2, documents=30)
    write_corpus(tmp_path / "b", files=1, documents=30, seed=1, first_token=first + 1)
    streams = [
        Stream("a", IndexedTokens(f"{tmp_path / 'a'}/part-*.idx"), tokens=700),
        Stream("b", IndexedTokens(f"{tmp_path / 'b'}/part-*.idx"), tokens=1500),  # more than it holds: repeats
    ]
    data = ShardedDataModule(streams=streams, packing=Packing(16, "concat"), batch_size=4, seed=2)
    data.setup("fit")
    reader, manifest = data.make_reader(), data.manifest
    assert manifest is not None
    for epoch in (0, 1):
        batch = reader.read_sequences(manifest.order(2, epoch), np.arange(manifest.total), manifest.items)
        tokens = batch["input_ids"][batch["input_ids"] != 0]
        drawn = {"a": int((tokens <= first).sum()), "b": int((tokens > first).sum())}
        assert abs(drawn["a"] - 700) <= 16 and abs(drawn["b"] - 1500) <= 16, drawn
    with pytest.raises(ValueError, match=r"stream 'a': a share in tokens \(tokens=700\) needs packed token sequences"):
        ShardedDataModule(streams=streams)
    with pytest.raises(ValueError, match=r"stream 'x' sets tokens and weight; give one share"):
        Stream("x", IndexedTokens(f"{tmp_path / 'a'}/part-*.idx"), weight=1, tokens=5)


def test_a_packed_mixture_goes_on_under_other_shares_but_not_under_another_packing(tmp_path: Path) -> None:
    """allow_mixture_change continues packed streams under other shares (tests/unit/test_mixture_change_packed.py);
    a kept stream packed otherwise is refused, naming it and what changed."""
    from lightning_sharding import Stream
    from lightning_sharding.core.ledger import Ledger
    from lightning_sharding.mixture import MixtureChangeError, MixtureReader, change_mixture

    write_corpus(tmp_path, files=2, documents=6)

    def manifest(repeat: float, seq_len: int = 8) -> Manifest:
        reader = PackedReader(IndexedTokens(f"{tmp_path}/part-*.idx"), Packing(seq_len))
        return MixtureReader([Stream("a", reader, repeat=repeat)]).manifest()

    before = manifest(1.0)
    state = Ledger(seed=1, total=before.total, manifest=before.summary()).state_dict()
    change = change_mixture(state, manifest(2.0), shuffle=True)
    assert (change.rest, change.before, change.unit) == (2 * before.total, 0, "sequences")
    with pytest.raises(
        MixtureChangeError, match=r"stream 'a' is packed otherwise than in the checkpoint \(seq_len was 8"
    ):
        change_mixture(state, manifest(2.0, seq_len=16), shuffle=True)
