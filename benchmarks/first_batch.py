"""Time to the first batch of a fresh job over many small shards, local and on loopback S3:
``python -m benchmarks.first_batch [--shards 10000] [--s3-shards 1000] [--latency-ms 50]
[--per-shard 4] [--repeats 3]``.

WebDataset tar shards (``webdataset.ShardWriter``) of 4 small JPEGs and labels each: ``--shards``
in a local directory, and the first ``--s3-shards`` of them in a bucket of a real S3-protocol
server (moto) on loopback, behind a proxy that adds ``--latency-ms`` to every request, both in a
process of their own, as a real store is (in the benchmark's process, until 2026-11-27, they
answered every request under the GIL of the process whose loader is timed). Each system
starts from where the data is, as a new job does, and the clock runs to the first batch of 64
decoded images at 1 rank x 2 workers, their start counted:

- ours runs what ``trainer.fit`` runs for data (``ShardedDataModule.setup("fit")``, then
  ``train_dataloader()``), without a Trainer, with the default start method: on Linux a forkserver,
  which ``setup`` starts before it lists so that its imports overlap the listing and the indexing
  (``--ours-start spawn`` starts ours as the peers). Each round starts a new server, as a new job does;
- ours, first start: ``TarReader`` on the glob lists the shards and reads each one's tar headers
  (local: in batches with array operations, a thread per core; S3: each small shard in one request,
  16 threads), then the manifest, the plan and the workers. The file indexes go to ``cache_dir``;
- ours, from the data's index: the same with an empty cache, where ``lightning-sharding index``
  wrote an index beside the shards (once, timed apart): one listing and the index's few files;
- ours, started again: the first start's job again: the indexes come from its cache (a shard's size
  and modification time or ETag say it is unchanged), so only the listing remains;
- webdataset: lists the shards (``glob`` locally; ``s3fs`` on S3, what a user does since
  ``WebDataset`` takes a list), then ``WebDataset`` + ``WebLoader`` with its own splitters and
  ``shuffle``. On S3 each shard is read over HTTP by ``curl`` (webdataset's ``http`` handler) from a
  presigned URL (made by boto3 in the timed listing): webdataset reads no index, it streams each
  shard from its start;
- LitData: the same samples as chunks of 4 written by its ``optimize`` (its format: the index is
  ``index.json``, written once by ``optimize``); ``StreamingDataset`` + ``StreamingDataLoader``
  with an empty chunk cache;
- MosaicML Streaming: the same samples as MDS shards written by its ``MDSWriter`` (its index is
  ``index.json``); ``StreamingDataset`` (``remote=`` on S3, into an empty local directory) and a
  DataLoader.

The peers' workers are spawned, as a CUDA job's must be (``fork`` copies the training process, its
CUDA context too, into each worker). Figures are seconds, the median of R rounds run alternately,
and how many times longer each takes than webdataset; ours is also split into its setup (listing,
indexing, planning) and what follows (the workers' start, the first reads). Printed last: the
targets (issue 54) with the ratios of ours to the peers, round by round, and whether each is met.
The one-off conversions (our index, LitData's ``optimize``, Streaming's MDS) are printed apart.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
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

from lightning_sharding import TarReader  # noqa: E402
from lightning_sharding.readers.data_index import write_data_index  # noqa: E402

# What the timed systems need and the benchmark's own machinery (the S3 server, the peers' modules)
# is imported in the functions that use them: every worker runs this module's top level again (as
# ``__mp_main__``), and an import here (pytest, through the tests' S3 helper, took a second) would be
# in every system's worker start.

BATCH, SIDE = 64, 32
WORKERS = 2  # --workers
OURS_START: str | None = None  # --ours-start: ours' start method (None: the default, a forkserver on Linux)
BUCKET = "first-batch"
# What each system's run gives: its first batch's images, and what stops its workers (untimed).
First = tuple[Any, Callable[[], None]]
# Ours' last run, split: seconds of setup (listing, indexing, planning) and of what follows to the
# first batch (the workers' start, the first reads).
SPLIT: dict[str, float] = {}


@dataclass
class Where:
    """One place the data lives: the tars' glob, their URLs as webdataset reads them, LitData's dir."""

    name: str
    tars: str
    wds_urls: Callable[[], list[str]]
    litdata: str | None
    streaming: str | None = None
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


def upload(s3: Any, local_root: Path, prefix: str) -> None:
    """Every file under ``local_root`` to ``s3://BUCKET/prefix/`` (16 threads: moto is slow one at a time)."""
    client = s3.client()
    files = [p for p in local_root.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(local_root)}"), files))


# -- the systems, each from the data's location to its first batch -------------------------------


def ours(where: Where, cache: Path, data_index: bool = False) -> First:
    from lightning_sharding.lightning.datamodule import ShardedDataModule

    start = time.perf_counter()
    reader = TarReader(
        where.tars,
        decode="torchrgb8",
        fields=["jpg", "cls"],
        cache_dir=cache,
        storage_options=where.storage_options,
        data_index=None if data_index else False,
    )
    start_method = OURS_START if WORKERS else None
    dm = ShardedDataModule(reader, batch_size=BATCH, num_workers=WORKERS, seed=0, multiprocessing_context=start_method)
    dm.setup("fit")  # as trainer.fit: the forkserver starts, then the listing, the indexes, the plan
    SPLIT["setup"] = time.perf_counter() - start
    batch = next(iter(dm.train_dataloader()))
    SPLIT["first batch"] = time.perf_counter() - start - SPLIT["setup"]
    return batch["jpg"], lambda: dm.teardown("fit")


# The S3 server (moto) and the proxy that adds latency, in a process of their own, as a real store
# is: in the benchmark's process their threads would answer every request under the GIL of the
# process whose loader is timed. The process prints their endpoints, then serves until its stdin closes.
_SERVE_S3 = """
import json, logging, sys
sys.path.insert(0, sys.argv[2])
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
from tests.support.fault_proxy import FaultProxy
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
proxy = FaultProxy(f"http://{host}:{port}", delay=float(sys.argv[1]))
print(json.dumps({"server": f"http://{host}:{port}", "proxy": proxy.endpoint}), flush=True)
sys.stdin.read()
proxy.close()
server.stop()
"""


def serve_s3(latency: float) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """Start the process that serves the bucket (:data:`_SERVE_S3`): it and the endpoints of the
    server and of the proxy that adds ``latency`` seconds to every request."""
    repo = str(Path(__file__).resolve().parents[1])
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE_S3, str(latency), repo], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"the S3 server's process exited ({process.wait()}) before serving")
    return process, json.loads(line)


def new_job() -> None:
    """Forget the forkserver a round of ours started (untimed): each round starts as a new job."""
    from multiprocessing import forkserver

    from lightning_sharding.strategies import _start

    server: Any = getattr(forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", None) is not None:
        server._stop()
    _start._started_by = None


def wds_first(where: Where, cache: Path) -> First:
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
    return batch[0], lambda: _shut(it)


class Decode:
    """LitData's per-sample work: the stored JPEG bytes to a ``uint8`` CHW tensor (picklable)."""

    def __call__(self, sample: dict[str, Any]) -> torch.Tensor:
        from PIL import Image

        pixels = np.asarray(Image.open(io.BytesIO(sample["jpg"])).convert("RGB"))
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def litdata_first(where: Where, cache: Path) -> First:
    from benchmarks import peers

    module, reason = peers.load("LitData")
    assert module is not None and where.litdata is not None, reason
    options = dict(where.litdata_options)
    if where.litdata.startswith("s3://"):  # a fresh job's empty chunk cache
        options["cache_dir"] = str(cache / "litdata")
    loader = module.loader(where.litdata, WORKERS, Decode(), BATCH, field=None, **options)
    it = iter(loader)
    batch = next(it)
    return batch, lambda: _shut(it)


def ours_indexed(where: Where, cache: Path) -> First:
    return ours(where, cache, data_index=True)


def streaming_first(where: Where, cache: Path) -> First:
    from benchmarks import peers

    module, reason = peers.load("MosaicML Streaming")
    assert module is not None and where.streaming is not None, reason
    local = str(cache / "mds") if where.streaming.startswith("s3://") else None
    loader = module.loader(where.streaming, WORKERS, Decode(), BATCH, field=None, local=local)
    it = iter(loader)
    batch = next(it)
    return batch, lambda: _shut(it)


def _shut(iterator: Any) -> None:
    """Stop a peer's loader iterator's workers now, not when it is collected: PyTorch's iterator
    directly; a generator over one (LitData's loader) by closing it, which drops that iterator."""
    stop = getattr(iterator, "_shutdown_workers", None) or getattr(iterator, "close", None)
    if stop is not None:
        stop()


def set_workers(workers: int, ours_start: str | None = None) -> None:
    global WORKERS, OURS_START
    WORKERS, OURS_START = workers, ours_start


def time_first(first: Callable[[Where, Path], First], where: Where, cache: Path) -> float:
    """Seconds from the data's location to ``first``'s first batch, as in a fresh process: fsspec's
    cached filesystems (and the listings they hold) are dropped first. The clock stops when the batch
    is in hand; the system's workers are stopped after, untimed (a stop waits for the batch a worker
    is making, up to a quarter of a second here, which is no part of the time to the first one)."""
    import fsspec

    for cls in list(fsspec.registry.values()) + [fsspec.get_filesystem_class("file")]:
        if hasattr(cls, "clear_instance_cache"):
            cls.clear_instance_cache()
    start = time.perf_counter()
    images, stop = first(where, cache)
    seconds = time.perf_counter() - start
    stop()
    assert tuple(images.shape) == (BATCH, 3, SIDE, SIDE), images.shape
    return seconds


def prepare(tars: list[str], out: Path, per_shard: int) -> dict[str, float]:
    """The peers' own formats of ``tars`` under ``out`` (``litdata/``, ``mds/``): seconds each took."""
    from benchmarks import peers

    took: dict[str, float] = {}
    for name, write in (
        ("LitData", lambda m: m.prepare_tars(tars, out / "litdata", chunk_bytes=None, chunk_size=per_shard)),
        ("MosaicML Streaming", lambda m: m.prepare_tars(tars, out / "mds")),
    ):
        module, _ = peers.load(name)
        if module is not None:
            start = time.perf_counter()
            write(module)
            took[name] = time.perf_counter() - start
    return took


# The targets: on each kind of place, (ours, the peer ours must take at most the time of).
TARGETS = {
    "local": [
        ("lightning_sharding, first start", "MosaicML Streaming"),
        ("lightning_sharding, started again", "MosaicML Streaming"),
    ],
    "S3": [
        ("lightning_sharding, from the data's index", "LitData"),
        ("lightning_sharding, from the data's index", "MosaicML Streaming"),
    ],
}


def _target(place: str, times: dict[str, list[float]], ours_name: str, peer: str) -> str:
    """One target's line: ours / the peer, the median of the rounds' ratios, and met or missed."""
    if not times[peer]:
        return f"- {place}: {ours_name} <= {peer}: not measured ({_unavailable(peer)})"
    ratios = [a / b for a, b in zip(times[ours_name], times[peer], strict=True)]
    ratio = statistics.median(ratios)
    return (
        f"- {place}: {ours_name} {statistics.median(times[ours_name]):.2f} s, {peer} "
        f"{statistics.median(times[peer]):.2f} s: {ratio:.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); "
        f"target <= 1x: {'met' if ratio <= 1 else 'MISSED'}"
    )


def _unavailable(name: str) -> str:
    from benchmarks import peers

    return (peers.load(name)[1] if name in peers.PEERS else None) or "not prepared"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000, help="local shards")
    parser.add_argument(
        "--s3-shards", type=int, default=1_000, help="shards in the bucket (the first of the local ones)"
    )
    parser.add_argument("--latency-ms", type=float, default=50.0, help="added to every request to the S3 server")
    parser.add_argument("--per-shard", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=WORKERS, help="DataLoader workers (0: a smoke run)")
    parser.add_argument("--local-only", action="store_true", help="no S3 rows")
    parser.add_argument("--s3-only", action="store_true", help="no local rows")
    parser.add_argument(
        "--data", help="write the shards and the peers' formats into this directory once, and reuse them after"
    )
    parser.add_argument(
        "--ours-start", choices=("forkserver", "spawn", "fork"), help="ours' start method (default: the package's)"
    )
    args = parser.parse_args()
    set_workers(args.workers, args.ours_start)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    import lightning_sharding.lightning.datamodule  # noqa: F401 - ours' import (Lightning), not timed
    from tests.support.s3 import S3Server

    root = Path(tempfile.mkdtemp(prefix="first-batch-"))
    server = None
    one_off: list[str] = []
    try:
        data = Path(args.data) if args.data else root
        if (data / "data" / "tar").is_dir():  # written by an earlier run with --data: the same sizes
            tars = sorted(glob.glob(str(data / "data" / "tar" / "*.tar")))
            took = {
                n: 0.0
                for n, d in (("LitData", "litdata"), ("MosaicML Streaming", "mds"))
                if (data / "data" / d).is_dir()
            }
        else:
            tars = write_tars(data / "data", args.shards, args.per_shard)
            took = prepare(tars, data / "data", args.per_shard)
            one_off += [f"{name} ({args.shards} local shards): {t:.1f} s" for name, t in took.items()]
            start = time.perf_counter()
            write_data_index(TarReader(str(data / "data" / "tar" / "*.tar"), cache_dir=root / "index-cache"))
            one_off.append(
                f"lightning-sharding index ({args.shards} local shards): {time.perf_counter() - start:.1f} s"
            )
        places = (
            []
            if args.s3_only
            else [
                Where(
                    "local",
                    str(data / "data" / "tar" / "*.tar"),
                    lambda: sorted(glob.glob(str(data / "data" / "tar" / "*.tar"))),
                    str(data / "data" / "litdata") if "LitData" in took else None,
                    str(data / "data" / "mds") if "MosaicML Streaming" in took else None,
                )
            ]
        )
        if not args.local_only:
            remote = data / "s3data"
            if (remote / "tar").is_dir():
                took = {
                    n: 0.0 for n, d in (("LitData", "litdata"), ("MosaicML Streaming", "mds")) if (remote / d).is_dir()
                }
            else:
                (remote / "tar").mkdir(parents=True)
                for tar in tars[: args.s3_shards]:
                    shutil.copy(tar, remote / "tar")
                took = prepare(sorted(glob.glob(str(remote / "tar" / "*.tar"))), remote, args.per_shard)
            server, endpoints = serve_s3(args.latency_ms / 1000)
            s3 = S3Server(endpoints["server"])  # the server itself: the untimed upload and index
            s3.bucket(BUCKET)
            start = time.perf_counter()
            upload(s3, remote, "data")
            print(f"(uploaded to the loopback S3 server in {time.perf_counter() - start:.0f} s)")
            via = S3Server(endpoints["proxy"])  # every system reaches the bucket through the proxy
            start = time.perf_counter()
            s3_tars = f"s3://{BUCKET}/data/tar/*.tar"
            write_data_index(TarReader(s3_tars, storage_options=s3.storage_options, cache_dir=root / "index-cache"))
            one_off.append(
                f"lightning-sharding index ({args.s3_shards} S3 shards): {time.perf_counter() - start:.1f} s"
            )
            os.environ.update(  # MosaicML Streaming's S3 client reads these
                S3_ENDPOINT_URL=via.endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing"
            )

            def listed() -> list[str]:
                import s3fs

                fs = s3fs.S3FileSystem(**via.storage_options)
                client = via.client()
                return [
                    client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key.split("/", 1)[1]})
                    for key in sorted(fs.glob(f"{BUCKET}/data/tar/*.tar"))
                ]

            places.append(
                Where(
                    f"S3 (loopback, +{args.latency_ms:.0f} ms)",
                    s3_tars,
                    listed,
                    f"s3://{BUCKET}/data/litdata" if "LitData" in took else None,
                    f"s3://{BUCKET}/data/mds" if "MosaicML Streaming" in took else None,
                    via.storage_options,
                    {
                        "storage_options": {
                            "endpoint_url": via.endpoint,
                            "aws_access_key_id": "testing",
                            "aws_secret_access_key": "testing",
                            "region_name": "us-east-1",
                        }
                    },
                )
            )
        systems: dict[str, Callable[[Where, Path], First]] = {
            "lightning_sharding, first start": ours,
            "lightning_sharding, from the data's index": ours_indexed,
            "lightning_sharding, started again": ours,
            "webdataset.WebLoader": wds_first,
            "LitData": litdata_first,
            "MosaicML Streaming": streaming_first,
        }
        started = f"ours: {OURS_START or 'the default start method (a forkserver on Linux)'}, the peers: spawned"
        print(
            f"tar shards of {args.per_shard} JPEGs ({args.shards} local, {args.s3_shards} on S3), 1 rank x {WORKERS} "
            f"workers ({started}), batch {BATCH}: seconds from the data's location to the first batch (median of "
            f"{args.repeats}, systems alternated round by round); ours split into setup (listing, indexes, plan) "
            "+ the rest (workers' start, first reads)\n"
        )
        print("| data | system | seconds | it / webdataset | ours: setup + the rest |")
        print("|---|---|---:|---:|---|")
        verdicts, status = [], []
        for where in places:
            times: dict[str, list[float]] = {name: [] for name in systems}
            splits: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
            for r in range(args.repeats):
                cache = root / f"cache-{where.name[:5]}-{r}"
                for name, first in systems.items():
                    if (name == "LitData" and where.litdata is None) or (
                        name == "MosaicML Streaming" and not where.streaming
                    ):
                        continue
                    if name != "lightning_sharding, started again":  # it reuses the first start's cache
                        shutil.rmtree(cache, ignore_errors=True)
                    if first in (ours, ours_indexed):
                        new_job()
                    times[name].append(time_first(first, where, cache))
                    if first in (ours, ours_indexed):
                        splits[name].append((SPLIT["setup"], SPLIT["first batch"]))
                    print(f"  {where.name}, round {r + 1}: {name}: {times[name][-1]:.2f} s", flush=True)
            wds = times["webdataset.WebLoader"]
            for name, values in times.items():
                if not values:
                    print(f"| {where.name} | {name} | {_unavailable(name)} | | |")
                    continue
                ratio = statistics.median(v / w for v, w in zip(values, wds, strict=True))
                split = ""
                if splits[name]:
                    setup = statistics.median(a for a, _ in splits[name])
                    split = f"{setup:.2f} + {statistics.median(b for _, b in splits[name]):.2f}"
                print(f"| {where.name} | {name} | {statistics.median(values):.2f} | {ratio:.2f} | {split} |")
            ratio = statistics.median(
                v / w for v, w in zip(times["lightning_sharding, from the data's index"], wds, strict=False)
            )
            verdicts.append(
                f"{where.name}: a start from the data's index takes {ratio:.2f}x webdataset's time to its first batch; "
                f"target <= 2x: {'met' if ratio <= 2 else 'NOT MET'}"
            )
            targets = TARGETS["local" if where.name == "local" else "S3"]
            status += [_target(where.name, times, ours_name, peer) for ours_name, peer in targets]
        print("\n" + "\n".join(verdicts))
        print(
            "\ntargets (issue 54): ours at most the peer's time to the first batch (ours / peer <= 1, round by round)"
        )
        print("\n".join(status))
        print("\none-off conversions: " + "; ".join(one_off))
    finally:
        if server is not None:
            server.stdin.close()  # the serving process stops its proxy and server, and exits
            server.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
