"""Time to the first batch of a fresh job over many small shards, local and on loopback S3:
``python -m benchmarks.first_batch [--shards 10000] [--per-shard 4] [--repeats 3]``.

10,000 WebDataset tar shards (``webdataset.ShardWriter``) of 4 small JPEGs and labels each, in a
local directory and in a bucket of a real S3-protocol server (moto) on loopback. Each system starts
from where the data is, as a new job does, and the clock runs to the first batch of 64 decoded
images at 1 rank x 2 spawned workers (their start is the same for every system, and counted):

- ours, cold: ``TarReader`` on the glob lists the shards and reads each one's tar headers (16
  threads), then the manifest, the plan and the workers. The file indexes go to ``cache_dir``;
- ours, warm: the same job started again: the indexes come from the cache (a shard's size and
  modification time say it is unchanged), so only the listing remains;
- webdataset: lists the shards (``glob`` locally; ``s3fs`` on S3, what a user does since
  ``WebDataset`` takes a list), then ``WebDataset`` + ``WebLoader`` with its own splitters and
  ``shuffle``. On S3 each shard is read over HTTP by ``curl`` (webdataset's ``http`` handler) from a
  presigned URL (made by boto3 in the timed listing): webdataset reads no index, it streams each
  shard from its start;
- LitData: the same samples as 10,000 chunks of 4 written by its ``optimize`` (its format: the index
  is ``index.json``, written once by ``optimize``); ``StreamingDataset`` + ``StreamingDataLoader``
  with an empty chunk cache.

Figures are seconds, the median of R rounds run alternately, and how many times longer each takes
than ours (cold and warm). The one-off conversion LitData needs (``optimize``) is printed apart.
"""

from __future__ import annotations

import argparse
import glob
import io
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
# LitData reads chunks through obstore, which refuses an http endpoint unless told (benchmarks.peer_litdata)
os.environ.setdefault("AWS_ALLOW_HTTP", "true")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import peers  # noqa: E402
from lightning_sharding import Ledger, Manifest, TarReader, World  # noqa: E402
from lightning_sharding.strategies.options import LoaderOptions  # noqa: E402
from lightning_sharding.strategies.shard import ShardedLoader  # noqa: E402
from tests.s3 import S3Server  # noqa: E402

BATCH, SIDE = 64, 32
WORKERS = 2  # --workers
BUCKET = "first-batch"


@dataclass
class Where:
    """One place the data lives: the tars' glob, their URLs as webdataset reads them, LitData's dir."""

    name: str
    tars: str
    wds_urls: Callable[[], list[str]]
    litdata: str | None
    storage_options: dict[str, Any] = field(default_factory=dict)
    litdata_options: dict[str, Any] = field(default_factory=dict)


def jpegs(count: int) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(buf, "JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def write_tars(root: Path, shards: int, per_shard: int) -> list[str]:
    import webdataset

    images = jpegs(64)
    (root / "tar").mkdir(parents=True)
    with webdataset.ShardWriter(str(root / "tar" / "part-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(shards * per_shard):
            sink.write({"__key__": f"s{i:08d}", "jpg": images[i % len(images)], "cls": i % 10})
    return sorted(glob.glob(str(root / "tar" / "*.tar")))


def upload(s3: S3Server, local_root: Path, prefix: str) -> None:
    """Every file under ``local_root`` to ``s3://BUCKET/prefix/`` (16 threads: moto is slow one at a time)."""
    client = s3.client()
    files = [p for p in local_root.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(local_root)}"), files))


# -- the systems, each from the data's location to its first batch -------------------------------


def ours(where: Where, cache: Path) -> Any:
    reader = TarReader(
        where.tars, decode="torchrgb8", fields=["jpg", "cls"], cache_dir=cache, storage_options=where.storage_options
    )
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    options = LoaderOptions(batch_size=BATCH, num_workers=WORKERS, multiprocessing_context="spawn" if WORKERS else None)
    loader = ShardedLoader.build(reader, manifest.items, ledger, world=World(), options=options)
    batch = next(iter(loader))
    loader.close()
    return batch["jpg"]


def wds_first(where: Where, cache: Path) -> Any:
    import webdataset as wds

    urls = where.wds_urls()
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker)
        .shuffle(1000)
        .decode("torchrgb8")
        .to_tuple("jpg", "cls")
        .batched(BATCH, partial=True)
    )
    context = "spawn" if WORKERS else None
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=WORKERS, multiprocessing_context=context)
    it = iter(loader)
    batch = next(it)
    del it
    return batch[0]


class Decode:
    """LitData's per-sample work: the stored JPEG bytes to a ``uint8`` CHW tensor (picklable)."""

    def __call__(self, sample: dict[str, Any]) -> torch.Tensor:
        from PIL import Image

        pixels = np.asarray(Image.open(io.BytesIO(sample["jpg"])).convert("RGB"))
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def litdata_first(where: Where, cache: Path) -> Any:
    module, reason = peers.load("LitData")
    assert module is not None and where.litdata is not None, reason
    options = dict(where.litdata_options)
    if where.litdata.startswith("s3://"):  # a fresh job's empty chunk cache
        options["cache_dir"] = str(cache / "litdata")
    loader = module.loader(where.litdata, WORKERS, Decode(), BATCH, field=None, **options)
    it = iter(loader)
    batch = next(it)
    del it
    return batch


def set_workers(workers: int) -> None:
    global WORKERS
    WORKERS = workers


def time_first(first: Callable[[Where, Path], Any], where: Where, cache: Path) -> float:
    """Seconds from the data's location to ``first``'s first batch, as in a fresh process: fsspec's
    cached filesystems (and the listings they hold) are dropped first."""
    import fsspec

    for cls in list(fsspec.registry.values()) + [fsspec.get_filesystem_class("file")]:
        if hasattr(cls, "clear_instance_cache"):
            cls.clear_instance_cache()
    start = time.perf_counter()
    images = first(where, cache)
    seconds = time.perf_counter() - start
    assert tuple(images.shape) == (BATCH, 3, SIDE, SIDE), images.shape
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--per-shard", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=WORKERS, help="DataLoader workers (0: a smoke run)")
    parser.add_argument("--local-only", action="store_true", help="no S3 rows")
    args = parser.parse_args()
    set_workers(args.workers)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    root = Path(tempfile.mkdtemp(prefix="first-batch-"))
    server = None
    try:
        tars = write_tars(root / "data", args.shards, args.per_shard)
        litdata, why_not = peers.load("LitData")
        optimize_s = None
        if litdata is not None:
            start = time.perf_counter()
            litdata.prepare_tars(tars, root / "data" / "litdata", chunk_bytes=None, chunk_size=args.per_shard)
            optimize_s = time.perf_counter() - start
        places = [
            Where(
                "local",
                str(root / "data" / "tar" / "*.tar"),
                lambda: sorted(glob.glob(str(root / "data" / "tar" / "*.tar"))),
                str(root / "data" / "litdata") if litdata is not None else None,
            )
        ]
        if not args.local_only:
            from moto.server import ThreadedMotoServer

            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            s3 = S3Server(f"http://{host}:{port}")
            s3.bucket(BUCKET)
            start = time.perf_counter()
            upload(s3, root / "data", "data")
            print(f"(uploaded to the loopback S3 server in {time.perf_counter() - start:.0f} s)")

            def listed() -> list[str]:
                import s3fs

                fs = s3fs.S3FileSystem(**s3.storage_options)
                client = s3.client()
                return [
                    client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key.split("/", 1)[1]})
                    for key in sorted(fs.glob(f"{BUCKET}/data/tar/*.tar"))
                ]

            places.append(
                Where(
                    "S3 (loopback)",
                    f"s3://{BUCKET}/data/tar/*.tar",
                    listed,
                    f"s3://{BUCKET}/data/litdata" if litdata is not None else None,
                    s3.storage_options,
                    {
                        "storage_options": {
                            "endpoint_url": s3.endpoint,
                            "aws_access_key_id": "testing",
                            "aws_secret_access_key": "testing",
                            "region_name": "us-east-1",
                        }
                    },
                )
            )
        systems: dict[str, Callable[[Where, Path], Any]] = {
            "lightning_sharding, cold": ours,
            "lightning_sharding, warm": ours,
            "webdataset.WebLoader": wds_first,
            "LitData": litdata_first,
        }
        n = args.shards * args.per_shard
        print(
            f"{args.shards} tar shards of {args.per_shard} JPEGs ({n} samples), 1 rank x {WORKERS} spawned workers, "
            f"batch {BATCH}: seconds from the data's location to the first batch (median of {args.repeats})\n"
        )
        print("| data | system | seconds | it / ours cold | it / ours warm |")
        print("|---|---|---:|---:|---:|")
        for where in places:
            times: dict[str, list[float]] = {name: [] for name in systems}
            for r in range(args.repeats):
                cache = root / f"cache-{where.name[:5]}-{r}"
                for name, first in systems.items():
                    if name == "LitData" and litdata is None:
                        continue
                    if name != "lightning_sharding, warm":  # warm reuses the cold run's cache
                        shutil.rmtree(cache, ignore_errors=True)
                    times[name].append(time_first(first, where, cache))
            cold, warm = times["lightning_sharding, cold"], times["lightning_sharding, warm"]
            for name, values in times.items():
                if not values:
                    print(f"| {where.name} | {name} | {why_not} | | |")
                    continue
                ratios = [
                    f"{statistics.median(v / o for v, o in zip(values, b, strict=True)):.2f}" for b in (cold, warm)
                ]
                print(f"| {where.name} | {name} | {statistics.median(values):.2f} | {ratios[0]} | {ratios[1]} |")
        if optimize_s is not None:
            print(f"\nLitData's one-off conversion (optimize into {args.shards} chunks): {optimize_s:.1f} s")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
