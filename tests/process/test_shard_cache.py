"""The local shard cache (``cache_limit``) against a real S3-protocol server on loopback, behind the
counting proxy: a cached shard is fetched once across epochs and runs, a budget smaller than the
data holds while the epoch stays exactly-once, and a download killed with SIGKILL leaves nothing a
later run could serve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import World
from lightning_sharding.mixture.order import MixtureOrder
from lightning_sharding.mixture.streams import MixtureReader, Stream
from lightning_sharding.readers import TarReader
from lightning_sharding.readers.cache import ShardCache
from lightning_sharding.recipes.synthetic_files import to_regression, write_regression
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import ShardedLoader
from tests.support.fault_proxy import FaultProxy
from tests.support.s3 import S3Server
from tests.unit.test_readers import ids_served, serve_epoch

SIZES = [23, 17, 29, 19, 31]
TOTAL = sum(SIZES)
ROOT = Path(__file__).resolve().parents[2]


def shards(s3_server: S3Server, bucket: str) -> list[str]:
    """Write the shards into ``bucket`` directly (not through the proxy); returns their object paths."""
    urls = write_regression(f"{s3_server.bucket(bucket)}/wds", "tar", SIZES, storage_options=s3_server.storage_options)
    return [u.removeprefix("s3:/") for u in urls]


def object_gets(proxy: FaultProxy, objects: list[str]) -> dict[str, int]:
    return {o: proxy.requests[("GET", o)] for o in objects}


def copies(cache_dir: Path) -> dict[str, int]:
    """The complete copies of the cache of ``cache_dir`` (partial downloads and locks are hidden)."""
    shard_dir = cache_dir / "shards"
    return copies_in(shard_dir) if shard_dir.exists() else {}


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_cached_shard_is_fetched_once_across_epochs_and_runs(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    objects = shards(s3_server, "cache-once")
    urls = "s3://cache-once/wds/part-*.tar"

    def reader(**kw: object) -> TarReader:
        return TarReader(urls, storage_options=proxy.storage_options(), cache_dir=tmp_path / "cache", **kw)  # type: ignore[arg-type]

    uncached = reader()
    uncached.items()
    proxy.requests.clear()
    for _ in range(2):
        assert sorted(ids_served(serve_epoch(uncached, world_size=2))) == list(range(TOTAL))
    assert all(n >= 2 for n in object_gets(proxy, objects).values()), "without the cache every epoch reads"

    proxy.requests.clear()
    cached = reader(cache_limit=10**9)
    cached.items()
    for epoch in range(2):
        served = serve_epoch(cached, world_size=2, num_workers=2)
        assert sorted(ids_served(served)) == list(range(TOTAL)), f"epoch {epoch}"
        if epoch == 0:
            first = object_gets(proxy, objects)
            assert set(first.values()) == {1}, f"each shard fetched once by the 2 ranks x 2 workers: {first}"
    assert object_gets(proxy, objects) == first, "the second epoch read the local copies"
    second_run = reader(cache_limit=10**9)
    assert sorted(ids_served(serve_epoch(second_run, world_size=1))) == list(range(TOTAL))
    assert object_gets(proxy, objects) == first, "a second run read the local copies"
    assert sorted(copies(tmp_path / "cache").values()) == sorted(
        s3_server.client().head_object(Bucket="cache-once", Key=o.split("/", 2)[2])["ContentLength"] for o in objects
    )


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_budget_smaller_than_the_data_holds_and_the_epoch_stays_exactly_once(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    objects = shards(s3_server, "cache-budget")
    sizes = [
        s3_server.client().head_object(Bucket="cache-budget", Key=o.split("/", 2)[2])["ContentLength"] for o in objects
    ]
    limit = int(max(sizes) * 2.5)
    assert limit < sum(sizes)
    options = proxy.storage_options()
    reader = TarReader(
        "s3://cache-budget/wds/part-*.tar", storage_options=options, cache_dir=tmp_path / "c", cache_limit=limit
    )
    for epoch in range(2):
        served = serve_epoch(reader, world_size=2, num_workers=2)
        assert sorted(ids_served(served)) == list(range(TOTAL)), f"epoch {epoch}"
        held = copies(tmp_path / "c")
        assert 0 < sum(held.values()) <= limit, held
    # Evicted shards were fetched again: the budget costs requests, never samples.
    assert sum(object_gets(proxy, objects).values()) > len(objects)


KILLED_READER = """
import sys
from lightning_sharding.readers import TarReader
from lightning_sharding.core.world import WorkerContext
import numpy as np
options = eval(sys.argv[2])
reader = TarReader(sys.argv[1], storage_options=options, cache_dir=sys.argv[3], cache_limit=10**9)
item = reader.items()[0]
print("reading", flush=True)
reader.read_batch(item, np.arange(3), None)
"""


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_download_killed_by_sigkill_leaves_no_file_a_later_run_serves(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    shards(s3_server, "cache-kill")
    urls = "s3://cache-kill/wds/part-*.tar"
    cache = tmp_path / "cache"
    proxy.trickle = 0.02  # 1 KiB every 20 ms: a download of the first shard takes seconds
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", KILLED_READER, urls, repr(proxy.storage_options()), str(cache)]
    child = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        partial: list[Path] = []
        while not partial:
            assert child.poll() is None and time.monotonic() < deadline, "the download never started"
            time.sleep(0.05)
            partial = (
                [p for p in (cache / "shards").glob(".*.part-*") if p.stat().st_size > 0]
                if (cache / "shards").exists()
                else []
            )
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert partial[0].exists() and not copies(cache), "SIGKILL left a partial download, and no complete copy"
    proxy.trickle = 0.0
    reader = TarReader(urls, storage_options=proxy.storage_options(), cache_dir=cache, cache_limit=10**9)
    served = serve_epoch(reader, world_size=2)
    assert sorted(ids_served(served)) == list(range(TOTAL))
    assert not partial[0].exists(), "the dead writer's partial download was swept"
    assert len(copies(cache)) == len(SIZES)


def test_a_copy_in_use_is_never_evicted_and_a_bad_limit_is_named(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 100)

    def writer(n: int):  # type: ignore[no-untyped-def]
        return lambda part: Path(part).write_bytes(b"x" * n)

    with cache.open("s3://b/a.tar", "size=60;tag=1", 60, writer(60)) as held:
        assert held is not None
        with cache.open("s3://b/b.tar", "size=60;tag=1", 60, writer(60)) as other:
            assert other is not None and Path(held).exists(), "the copy being read stayed"
        assert Path(held).read_bytes() == b"x" * 60
    assert sum(copies_in(tmp_path).values()) <= 100
    with cache.open("s3://b/big.tar", "size=500;tag=1", 500, writer(500)) as big:
        assert big is None  # larger than the whole budget: read from storage
    assert (cache.fetches, cache.hits) == (2, 0)
    for bad in (0, -5, 1.5, "10GB", True):
        with pytest.raises(ValueError, match=f"cache_limit={bad!r}"):
            ShardCache(tmp_path, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_limit=0"):
        TarReader("s3://b/*.tar", cache_limit=0)


def copies_in(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir() if not p.name.startswith(".")}


@pytest.mark.processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["epoch-start", "resumed-mid-epoch", "byte-cap"])
def test_a_worker_prefetches_its_next_files_in_plan_order(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy, mode: str
) -> None:
    """While training holds the first batch, the worker's prefetch threads fetch the file it reads
    and the next ``prefetch_files`` of its plan, and no further; over the epoch every file is
    fetched once, in the order the plan reads them (give or take the files fetched at once).
    Resumed mid-epoch, it starts at the resumed position's file, not at the epoch's first. With
    ``prefetch_bytes`` the size of the plan's second file, only that one file is fetched ahead."""
    resumed = mode == "resumed-mid-epoch"
    objects = shards(s3_server, f"cache-ahead-{mode}")
    urls = f"s3://cache-ahead-{mode}/wds/part-*.tar"
    options = proxy.storage_options()
    cap: dict[str, int] = {}
    ahead = 2
    if mode == "byte-cap":
        items = TarReader(urls, storage_options=options, cache_dir=tmp_path / "cache").items()
        second = int(Manifest.from_items(items).order(3, 0, shuffle=True).item_order[1])
        cap, ahead = {"prefetch_bytes": int(items[second].fingerprint.split(";")[0].removeprefix("size="))}, 1
    reader = TarReader(
        urls, storage_options=options, cache_dir=tmp_path / "cache", cache_limit=10**9, prefetch_files=2, **cap
    )
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=3, total=manifest.total, manifest=manifest.summary())
    if resumed:
        ledger.record(np.arange(40))
        ledger.commit()
    proxy.delay, proxy.log[:] = 0.05, []
    loader = ShardedLoader.build(
        reader,
        manifest.items,
        ledger,
        world=World(0, 1),
        track=True,
        options=LoaderOptions(batch_size=4, transform=to_regression, num_workers=1),
    )
    batches = iter(loader)
    first = next(batches)
    time.sleep(4)  # a long training step
    while_held = fetched(proxy, objects)
    ids = [i for b in [first, *batches] for i in b["id"][~b["is_padding"]].tolist()]
    files = np.searchsorted(np.cumsum(SIZES), ids, side="right")
    plan = [objects[f] for f in dict.fromkeys(files.tolist())]
    assert sorted(while_held) == sorted(plan[: 1 + ahead]), (
        f"the file read and the next {ahead} of the plan, no more: {while_held} vs {plan}"
    )
    order = fetched(proxy, objects)
    assert sorted(order) == sorted(plan), "every file the epoch reads fetched, once"
    late = [(k, plan.index(o)) for k, o in enumerate(order) if abs(plan.index(o) - k) > 2]
    assert not late, f"fetched in plan order, within the 2 fetched at once: {order} vs {plan}"
    order = manifest.order(3, 0, shuffle=True)
    items, index = order.locate(np.arange(40 if resumed else 0))
    consumed = set((np.concatenate(([0], np.cumsum(SIZES)))[items] + index).tolist())
    assert sorted(ids) == sorted(set(range(TOTAL)) - consumed), "each sample not consumed, once"
    if resumed:  # the epoch's first file is wholly before position 40 (no file holds 40 samples)
        skipped = objects[int(order.item_order[0])]
        assert skipped not in fetched(proxy, objects), "prefetch started at the resumed position"


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_each_stream_of_a_mixture_prefetches_its_own_next_files(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    """In a mixture of two streams from two buckets, each stream's reader fetches the files of the
    worker's batch and its own next file (``prefetch_files=1``) while training holds the first
    batch: the next file of each stream from its next draw on, which the batch does not read."""
    objects = {name: shards(s3_server, f"mix-ahead-{name}") for name in ("a", "b")}
    options = proxy.storage_options()

    def stream(name: str) -> Stream:
        urls = f"s3://mix-ahead-{name}/wds/part-*.tar"
        reader = TarReader(
            urls, storage_options=options, cache_dir=tmp_path / "cache", cache_limit=10**9, prefetch_files=1
        )
        return Stream(name, reader)

    mixture = MixtureReader([stream("a"), stream("b")])
    manifest = mixture.manifest()
    ledger = Ledger(seed=3, total=manifest.total, manifest=manifest.summary())
    order = manifest.order(3, 0, shuffle=True)
    assert isinstance(order, MixtureOrder)
    every = np.arange(manifest.total)
    streams, _ = order.streams(every)
    items, _ = order.locate(every)
    object_of = [f"/{it.key.split('/s3://', 1)[1]}" for it in manifest.items]
    batch = 4
    expected = {object_of[i] for i in items[:batch].tolist()}  # the first batch's files...
    for s in range(2):  # ... and each stream's next file after them, in the order its draws read them
        later = [object_of[i] for i in items[batch - 1 :][streams[batch - 1 :] == s].tolist()]
        expected.add(next(o for o in later if o not in {object_of[i] for i in items[:batch].tolist()}))
    proxy.delay, proxy.log[:] = 0.05, []
    options_ = LoaderOptions(batch_size=batch, transform=to_regression, num_workers=1)
    loader = ShardedLoader.build(mixture, manifest, ledger, world=World(0, 1), track=True, options=options_)
    batches = iter(loader)
    next(batches)
    time.sleep(4)  # a long training step
    every_object = objects["a"] + objects["b"]
    assert sorted(fetched(proxy, every_object)) == sorted(expected), "the batch's files and one more of each stream"
    served = 1 + sum(1 for _ in batches)
    assert served == -(-manifest.total // batch)
    gets = Counter(path for method, path in proxy.log if method == "GET" and path in every_object)
    assert set(gets.values()) == {1}, f"each file fetched once: {gets}"


def fetched(proxy: FaultProxy, objects: list[str]) -> list[str]:
    """The objects read by GET, in the order of their first GET."""
    return list(dict.fromkeys(path for method, path in proxy.log if method == "GET" and path in objects))


def test_a_partial_file_is_swept_only_once_its_writer_holds_no_fetch_lock(tmp_path: Path) -> None:
    """A writer on another host or in another PID namespace (its PID means nothing here) keeps its
    partial download as long as it holds the copy's fetch lock; once the lock is free it is swept.
    A file whose own name contains ".part-" is no exception, and no lock file is ever swept."""
    import fcntl

    ShardCache(tmp_path, 10**6)
    for name in ("0123abcd-part-00000.tar", "4567cdef-train.part-0001.tar"):
        partial = tmp_path / f".{name}.part-elsewhere-1-abcdef"
        lock = tmp_path / f".{name}.lock"
        with open(lock, "a+b") as writer:
            fcntl.flock(writer, fcntl.LOCK_EX)
            partial.write_bytes(b"half a shard")
            ShardCache(tmp_path, 10**6)  # another run starting now
            assert partial.exists(), f"a live writer's partial download of {name} was removed"
        ShardCache(tmp_path, 10**6)
        assert not partial.exists(), f"a partial download of {name} with no writer was left"
        assert lock.exists(), f"the fetch lock of {name} was swept"


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_the_logger_gets_cache_hits_and_prefetch_wait(tmp_path: Path, s3_server: S3Server) -> None:
    """A real Trainer, 2 spawned workers, shards in the bucket: the first epoch's logged reads miss
    the cache at first and wait for files; the second epoch's all hit it and wait for nothing."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_sharding import ShardedDataModule, ShardingCallback
    from tests.jobs.parts import RecordingModel
    from tests.support.harness import cpu_trainer

    shards(s3_server, "cache-metrics")
    reader = TarReader(
        "s3://cache-metrics/wds/part-*.tar",
        storage_options=s3_server.storage_options,
        cache_dir=tmp_path / "cache",
        cache_limit=10**9,
        prefetch_files=1,
    )
    dm = ShardedDataModule(reader, transform=to_regression, batch_size=8, num_workers=2, seed=5)
    logger = CSVLogger(str(tmp_path), name="logs")
    trainer = cpu_trainer(
        max_epochs=2, logger=logger, log_every_n_steps=1, callbacks=[ShardingCallback(log_every_n_steps=1)]
    )
    trainer.fit(RecordingModel(str(tmp_path / "seen")), datamodule=dm)
    rows = [r for r in csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")) if r.get("data/cache_hit")]
    by_epoch = {e: [r for r in rows if int(r["epoch"]) == e] for e in (0, 1)}
    assert by_epoch[0] and by_epoch[1], f"cache figures logged in both epochs: {rows[:3]}"
    first = by_epoch[0][0]
    assert float(first["data/cache_hit"]) < 1 and float(first["data/prefetch_wait"]) > 0, first
    assert {float(r["data/cache_hit"]) for r in by_epoch[1]} == {1.0}, "every read of epoch 2 hit the cache"
    assert {float(r["data/prefetch_wait"]) for r in by_epoch[1]} == {0.0}
