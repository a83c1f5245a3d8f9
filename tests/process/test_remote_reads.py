"""How a job's first start and first batch read small remote shards, on the S3-protocol server on
loopback behind a proxy that counts requests (and adds latency): each shard indexed with one
request, a batch's shards read at once, each shard's samples with one request. Every added request
costs a store's latency (50 ms and more), and the first batch of a fresh job waits for all of them
(docs/performance.md, the first batch)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import WorkerContext, World
from lightning_sharding.readers import TarReader
from lightning_sharding.readers.storage import cut_ranges, merged_ranges
from lightning_sharding.recipes.synthetic_files import to_regression, write_regression
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import ShardedLoader
from tests.support.fault_proxy import FaultProxy
from tests.support.s3 import S3Server

SIZES = [5, 7, 4, 6, 5, 8, 3, 6]  # eight small shards, 44 samples


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_server.endpoint)
    yield p
    p.close()


def shard_requests(proxy: FaultProxy, since: int = 0) -> Counter[tuple[str, str]]:
    """The requests for the shards themselves (not listings) since ``since`` in the proxy's log."""
    return Counter((m, p) for m, p in proxy.log[since:] if p.endswith(".tar"))


def test_a_first_start_indexes_each_small_shard_with_one_request(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    bucket = s3_server.bucket("first-start")
    write_regression(f"{bucket}/wds", "tar", SIZES, storage_options=s3_server.storage_options)
    reader = TarReader("s3://first-start/wds/*.tar", storage_options=proxy.storage_options(), cache_dir=tmp_path)
    assert [it.num_samples for it in reader.items()] == SIZES
    asked = shard_requests(proxy)
    assert len(asked) == len(SIZES) and set(asked.values()) == {1}, f"not one GET a shard: {asked}"
    assert {m for m, _ in asked} == {"GET"}, "no HEAD before the read: the listing gave the size"


def test_a_batch_reads_its_shards_at_once_each_with_one_request(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    bucket = s3_server.bucket("first-batch")
    write_regression(f"{bucket}/wds", "tar", SIZES, storage_options=s3_server.storage_options)
    reader = TarReader("s3://first-batch/wds/*.tar", storage_options=proxy.storage_options(), cache_dir=tmp_path)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    options = LoaderOptions(batch_size=manifest.total, num_workers=0, shuffle=False, transform=to_regression)
    loader = ShardedLoader.build(reader, manifest, ledger, world=World(), options=options)
    since, delay = len(proxy.log), 0.4
    proxy.delay = delay
    start = time.perf_counter()
    batch = next(iter(loader))
    took = time.perf_counter() - start
    assert batch["id"].tolist() == list(range(manifest.total)), "every sample once, in the plan's order"
    asked = shard_requests(proxy, since)
    assert len(asked) == len(SIZES) and set(asked.values()) == {1}, f"not one request a shard: {asked}"
    # One after the other, the 8 reads would take 8 x 0.4 s; at once, about one delay.
    assert took < len(SIZES) * delay / 2, f"the batch took {took:.2f} s: its shards were not read at once"


def test_ranges_close_together_are_read_as_one_and_cut_back_in_the_order_asked() -> None:
    starts, ends = [5_000_000, 0, 1024, 600_000, 1024], [5_000_512, 512, 2048, 600_100, 1536]
    lo, hi = merged_ranges(starts, ends, gap=256 << 10)
    assert (lo, hi) == ([0, 600_000, 5_000_000], [2048, 600_100, 5_000_512]), "gaps under 256 KiB are read"
    data = np.arange(5_000_512, dtype=np.int64).astype(np.uint8).tobytes()
    spans = [data[a:b] for a, b in zip(lo, hi, strict=True)]
    assert cut_ranges(spans, lo, starts, ends) == [data[a:b] for a, b in zip(starts, ends, strict=True)]
    assert cut_ranges([spans[0][:1000], *spans[1:]], lo, [1024], [2048]) == [b""], "a short read stays short"


@pytest.mark.needs("moto", "boto3", "s3fs")
def test_a_megatron_index_is_read_once_a_job_and_a_batch_reads_each_bin_with_one_request(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    """Token documents in a bucket (issue 55): the listing reads each ``.idx`` once and keeps it, so a
    second start reads none; a batch of packed sequences reads each ``.bin`` with one ranged request."""
    from lightning_sharding.tokens import IndexedTokens, PackedReader, Packing
    from tests.support.data.tokens import upload_corpus, write_corpus

    write_corpus(tmp_path / "corpus", files=2, documents=12)
    url = upload_corpus(tmp_path / "corpus", f"{s3_server.bucket('megatron-reads')}/corpus", s3_server.client())

    def reader() -> PackedReader:
        documents = IndexedTokens(f"{url}/part-*.idx", storage_options=proxy.storage_options(), cache_dir=tmp_path)
        return PackedReader(documents, Packing(16, "concat"))

    manifest = reader().manifest()
    asked = Counter(p.rsplit("/", 1)[-1] for _, p in proxy.log if p.endswith((".idx", ".bin")))
    assert asked == {"part-0.idx": 1, "part-1.idx": 1}, f"the listing read: {asked}"
    since = len(proxy.log)
    again = reader()
    assert again.manifest().items == manifest.items
    order = manifest.order(0, 0)
    batch = again.read_sequences(order, np.arange(manifest.total), manifest.items)
    asked = Counter(p.rsplit("/", 1)[-1] for _, p in proxy.log[since:] if p.endswith((".idx", ".bin")))
    assert asked == {"part-0.bin": 1, "part-1.bin": 1}, f"a second start and a batch of every sequence read: {asked}"
    tokens = batch["input_ids"].numpy()
    assert sorted(tokens[tokens != 0].tolist()) == list(range(1, int(tokens.max()) + 1))


def _epoch(
    reader: TarReader, manifest: Manifest, proxy: FaultProxy
) -> tuple[list[list[int]], Counter[tuple[str, str]]]:
    """One shuffled epoch at 1 rank x 2 spawned DataLoader workers (they wait on their imports, as a
    forkserver's first do, whatever ran before in this process): each batch's sample ids, and the
    shard requests the proxy saw meanwhile."""
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    options = LoaderOptions(
        batch_size=4, num_workers=2, shuffle=True, transform=to_regression, multiprocessing_context="spawn"
    )
    loader = ShardedLoader.build(reader, manifest, ledger, world=World(), options=options)
    since = len(proxy.log)
    try:
        ids = [batch["id"].tolist() for batch in loader]
    finally:
        loader.close()
    return ids, shard_requests(proxy, since)


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_the_workers_first_batches_are_fetched_while_they_start_and_no_worker_asks_for_them_again(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training process fetches each worker's first batch while the workers start (FileReader.first_reads);
    the bytes reach the workers with the reader, which then ask the store for none of them: the epoch makes
    the same requests, shard by shard, as with nothing fetched ahead, and serves the same batches."""
    from lightning_sharding.readers import files

    bucket = s3_server.bucket("first-reads")
    write_regression(f"{bucket}/wds", "tar", SIZES, storage_options=s3_server.storage_options)
    reader = TarReader("s3://first-reads/wds/*.tar", storage_options=proxy.storage_options(), cache_dir=tmp_path)
    manifest = Manifest.from_items(reader.items())
    fetched: list[int] = []
    real = files.FileReader.first_reads

    def counted(self: files.FileReader, reads: Any, workers: int) -> int:
        fetched.append(real(self, reads, workers))
        return fetched[-1]

    monkeypatch.setattr(files.FileReader, "first_reads", counted)
    ahead, asked = _epoch(reader, manifest, proxy)
    assert len(fetched) == 1 and fetched[0] >= 2, f"each worker's first batch is fetched ahead: {fetched}"
    assert reader._first == {}, "the training process keeps none of those bytes once its workers started"
    monkeypatch.setattr(files, "FIRST_READ_BYTES", 0)  # the same epoch, nothing fetched ahead
    plain, asked_plain = _epoch(reader, manifest, proxy)
    assert fetched[1] == 0
    assert ahead == plain, "the same batches, with or without the first reads fetched ahead"
    assert sorted(i for batch in ahead for i in batch) == list(range(manifest.total)), "every sample once"
    assert asked == asked_plain, "a worker asked again for bytes fetched for it (or fewer requests were made)"


def test_a_first_read_that_fails_is_tried_once_and_left_to_the_worker(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    """A store that fails the reads fetched ahead delays no worker by a retry budget: each is tried once
    and dropped, and the worker's own read (with its retries) gets the bytes once the store is back."""
    bucket = s3_server.bucket("first-fails")
    write_regression(f"{bucket}/wds", "tar", SIZES, storage_options=s3_server.storage_options)
    reader = TarReader("s3://first-fails/wds/*.tar", storage_options=proxy.storage_options(), cache_dir=tmp_path)
    items = list(reader.items())
    reads = [(item, np.arange(item.num_samples)) for item in items[:3]]
    proxy.fault_rate, proxy.drop_share = 1.0, 0.0  # every GET answered 503
    assert reader.first_reads(reads, 2) == 0
    assert proxy.counts["503"] == 3 and proxy.counts["retried"] == 0, f"one try each: {dict(proxy.counts)}"
    proxy.fault_rate = 0.0
    since = len(proxy.log)
    samples = reader.read_batch(items[0], np.arange(items[0].num_samples), WorkerContext(0, 1, 0, 0, 0, 0))
    assert len(samples) == SIZES[0] and len(shard_requests(proxy, since)) == 1, "the worker read it itself"
