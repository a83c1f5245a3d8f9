"""Token documents given as URLs (issue 55 item 1): the document readers list and read them through
the file readers' storage layer. ``file://`` URLs read the local files through it (memory-mapped);
fsspec's ``memory://`` filesystem, which is no local one, takes the path of an object store: the
index read once when listing, ranged reads of the token ranges, the shard cache's copy. The same
tokens as the local readers', batch for batch; the loopback S3 chain is tests/process/test_packing.py."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding.tokens import IndexedTokens, PackedReader, Packing, TokenFiles
from lightning_sharding.tokens.documents import DocumentReader
from tests.support.data.tokens import write_corpus


@pytest.fixture
def memory() -> Iterator[Any]:
    """fsspec's in-memory filesystem, emptied after the test."""
    import fsspec

    fs = fsspec.filesystem("memory")
    yield fs
    fs.rm("/", recursive=True)


def upload(fs: Any, local: Path, where: str) -> None:
    for path in sorted(local.iterdir()):
        fs.pipe(f"{where}/{path.name}", path.read_bytes())


def same_batches(ours: DocumentReader, theirs: DocumentReader, mode: str = "concat") -> None:
    """Both readers' documents and every sequence of an epoch, read in batches of 3, are the same."""
    mine, local = ours.items(), theirs.items()
    assert [it.name for it in mine] == [it.name for it in local]
    np.testing.assert_array_equal(ours.lengths(mine), theirs.lengths(local))
    got = []
    for reader, items in ((ours, mine), (theirs, local)):
        packed = PackedReader(reader, Packing(16, mode))
        manifest = packed.manifest()
        batches = [
            packed.read_sequences(manifest.order(3, 1), np.arange(lo, min(lo + 3, manifest.total)), items)
            for lo in range(0, manifest.total, 3)
        ]
        got.append(np.concatenate([b["input_ids"].numpy() for b in batches]))
    np.testing.assert_array_equal(got[0], got[1])


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_megatron_files_by_url_read_the_same_tokens_as_local_ones(tmp_path: Path, memory: Any, scheme: str) -> None:
    """A glob of ``.idx`` URLs: each ``.idx`` read once when listing and kept in ``cache_dir``, the
    batches' token ranges read by range (``memory://``) or from a memory map (``file://``)."""
    write_corpus(tmp_path / "corpus", files=3, documents=9)
    root = f"file://{tmp_path}/corpus" if scheme == "file" else "memory://bucket/corpus"
    if scheme == "memory":
        upload(memory, tmp_path / "corpus", "memory://bucket/corpus")
    ours = IndexedTokens(f"{root}/part-*.idx", cache_dir=tmp_path / "cache")
    local = IndexedTokens(f"{tmp_path}/corpus/part-*.idx")
    same_batches(ours, local, "best_fit")
    same_batches(ours, local, "concat")
    item = ours.items()[1]
    assert item.key == f"{root}/part-1.bin"
    assert (ours.token_array(item) is None) == (scheme == "memory")
    worker = pickle.loads(pickle.dumps(ours))  # what a DataLoader worker gets
    np.testing.assert_array_equal(worker.read(item, 2, None), local.read(local.items()[1], 2, None))
    assert worker.worker_modules() == ["fsspec"]
    assert PackedReader(worker, Packing(8)).worker_modules() == ["fsspec"]  # what a forkserver preloads


def test_ranged_reads_and_the_shard_cache_serve_token_files_and_megatron_files(tmp_path: Path, memory: Any) -> None:
    """Flat ``.npy`` and ``.bin`` token files in a store split at ``eos_id``; with ``cache_limit`` a
    file is fetched whole once into the shard cache, then read from a memory map of the copy."""
    tokens = np.arange(1, 40, dtype=np.uint16)
    tokens[[4, 11, 12, 30]] = 2
    np.save(tmp_path / "a.npy", tokens.astype(np.int32))
    tokens[::-1].tofile(tmp_path / "b.bin")
    memory.pipe("memory://flat/a.npy", (tmp_path / "a.npy").read_bytes())
    memory.pipe("memory://flat/b.bin", (tmp_path / "b.bin").read_bytes())
    with pytest.raises(ValueError, match=r"\.bin files hold raw tokens: give their dtype="):
        TokenFiles("memory://flat/*.bin", eos_id=2)
    ours = TokenFiles("memory://flat/*", eos_id=2, dtype="uint16", cache_dir=tmp_path / "cache")
    local = TokenFiles([str(tmp_path / "a.npy"), str(tmp_path / "b.bin")], eos_id=2, dtype="uint16")
    same_batches(ours, local)

    write_corpus(tmp_path / "corpus", files=2, documents=6)
    upload(memory, tmp_path / "corpus", "memory://bucket/corpus")
    cached = IndexedTokens("memory://bucket/corpus/part-*.idx", cache_dir=tmp_path / "cache", cache_limit=10**6)
    item = cached.items()[0]
    assert cached.token_array(item) is not None  # fetched whole into the shard cache
    assert cached.take_stats() == {"cache_misses": 1, "fetch_wait_s": pytest.approx(0, abs=5)}
    same_batches(cached, IndexedTokens(f"{tmp_path}/corpus/part-*.idx"))
    assert len([p for p in (tmp_path / "cache" / "shards").iterdir() if not p.name.startswith(".")]) == 2


def test_a_megatron_file_without_its_index_or_of_another_size_is_named(tmp_path: Path, memory: Any) -> None:
    write_corpus(tmp_path / "corpus", files=2, documents=3)
    upload(memory, tmp_path / "corpus", "memory://bad/corpus")
    memory.rm("memory://bad/corpus/part-1.idx")
    with pytest.raises(ValueError, match=r"'memory://bad/corpus/part-1\.idx' does not exist: a Megatron \.bin needs"):
        IndexedTokens("memory://bad/corpus/part-*", cache_dir=tmp_path / "cache").items()
    memory.pipe("memory://bad/corpus/part-1.idx", (tmp_path / "corpus" / "part-1.idx").read_bytes())
    memory.pipe("memory://bad/corpus/part-1.bin", (tmp_path / "corpus" / "part-1.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"part-1\.idx' does not match .*part-1\.bin'.*but the \.bin holds"):
        IndexedTokens(["memory://bad/corpus/part-0", "memory://bad/corpus/part-1"], cache_dir=tmp_path).items()


@pytest.mark.needs("pyarrow")
def test_parquet_token_lists_by_url_are_the_local_documents(tmp_path: Path, memory: Any) -> None:
    """Row groups' list offsets read when listing; a worker reads a row group's token column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_sharding.tokens import ParquetTokens

    rows = [list(range(t, t + n)) for t, n in ((1, 5), (6, 9), (15, 2), (17, 7), (24, 3))]
    pq.write_table(pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32()))}), tmp_path / "t.parquet", 2)
    memory.pipe("memory://pq/t.parquet", (tmp_path / "t.parquet").read_bytes())
    ours = ParquetTokens("memory://pq/*.parquet", cache_dir=tmp_path / "cache")
    same_batches(ours, ParquetTokens(str(tmp_path / "t.parquet")))
    assert ours.read(ours.items()[1], 1, None).tolist() == rows[3]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"column 'text' holds|has no column\(s\) \['text'\]"):
        ParquetTokens("memory://pq/t.parquet", column="text", cache_dir=tmp_path / "cache").items()


def test_local_files_are_known_alike_as_paths_as_file_urls_and_with_options(tmp_path: Path) -> None:
    """A checkpoint of local token files resumes from the same files given as ``file://`` URLs or with
    the file readers' options (which read them through the storage layer): every item's identity,
    what a checkpoint knows it by, is the same, the ``.idx`` and ``eos_id`` included."""
    write_corpus(tmp_path / "corpus", files=2, documents=20)
    tokens = np.arange(1, 60, dtype=np.int32)
    tokens[[9, 30]] = 0
    np.save(tmp_path / "t.npy", tokens)
    makers = {
        "megatron": lambda where, **o: IndexedTokens(f"{where}/corpus/part-*.idx", **o),
        "token files": lambda where, **o: TokenFiles(f"{where}/t.npy", eos_id=0, **o),
    }
    for name, make in makers.items():
        local = [it.identity for it in make(tmp_path).items()]
        assert [it.identity for it in make(f"file://{tmp_path}").items()] == local, name
        assert [it.identity for it in make(tmp_path, cache_dir=tmp_path / f"c-{name}").items()] == local, name
    other = [it.identity for it in TokenFiles(f"file://{tmp_path}/t.npy", eos_id=9).items()]
    assert other != [it.identity for it in TokenFiles(f"{tmp_path}/t.npy", eos_id=0).items()]  # eos_id makes documents


@pytest.mark.needs("fsspec")
def test_packed_stretches_keep_no_more_maps_of_a_store_than_the_store_does(tmp_path: Path) -> None:
    """A store maps a few files and drops the rest, so that copies the shard cache evicted give their
    disk space back: the stretches of packed sequences read through it hold no map of their own."""
    from lightning_sharding.tokens import write_indexed

    rng = np.random.default_rng(0)
    for i in range(12):
        write_indexed(str(tmp_path / f"part{i}"), [rng.integers(0, 100, 50) for _ in range(20)])
    documents = IndexedTokens([f"file://{tmp_path}/part{i}" for i in range(12)])
    reader = PackedReader(documents, Packing(seq_len=64))
    manifest = reader.manifest()
    order = manifest.order(0, 0)
    for start in range(0, order.total - 1, 2):
        batch = reader.read_sequences(order, np.arange(start, start + 2), manifest.items)
        assert batch["input_ids"].shape == (2, 64)
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if str(tmp_path) in line}
    assert 0 < len(mapped) <= 4, sorted(mapped)
