"""Index once per job (``index_once_per``) against a real S3-protocol server on loopback, behind the
counting proxy: a 2-rank DDP job's first start lists the bucket once and makes one index pass per
object, where every rank indexing for itself lists it twice; nodes that share no disk each index
into their own cache and still train exactly once; a failure of the indexing rank stops every
rank with its message instead of leaving one waiting."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from lightning_sharding.readers import TarReader
from lightning_sharding.recipes.synthetic_files import write_regression
from tests.support.fault_proxy import FaultProxy
from tests.support.harness import (
    Data,
    Job,
    Loading,
    Topology,
    Training,
    assert_exactly_once,
    run_segment,
    served_per_epoch,
)
from tests.support.s3 import S3Server

SIZES = (23, 17, 29, 19, 31)


def bucket_with_shards(s3_server: S3Server, name: str) -> tuple[str, list[str]]:
    """Shards written directly (not through the proxy): the glob and the object paths."""
    urls = write_regression(
        f"{s3_server.bucket(name)}/wds", "tar", list(SIZES), storage_options=s3_server.storage_options
    )
    return f"s3://{name}/wds/part-*.tar", [u.removeprefix("s3:/") for u in urls]


def split(requests: Counter[tuple[str, str]], objects: list[str]) -> tuple[dict[str, int], int]:
    """GETs per object (the index pass), and the listings: GETs of the bucket itself. HEADs are left
    out: with index_once_per='rank' whether a second rank asks for an object's size depends on
    whether the first rank's index is already in the shared cache, which is timing."""
    per_object = {o: requests[("GET", o)] for o in objects}
    buckets = {"/" + o.strip("/").split("/", 1)[0] for o in objects}
    return per_object, sum(requests[("GET", b)] + requests[("GET", b + "/")] for b in buckets)


def job_counts(
    tmp_path: Path, proxy: FaultProxy, urls: str, objects: list[str], per: str
) -> tuple[dict[str, int], int]:
    """What a 2-rank x 2-worker DDP job's setup asks of the store (no training step: only the index)."""
    proxy.requests.clear()
    data = {
        "format": "tar",
        "urls": urls,
        "storage_options": proxy.storage_options(),
        "cache_dir": str(tmp_path / f"cache-{per}"),
        "index_once_per": per,
    }
    job = Job(Topology(2, 2), Data(files=data), Loading(batch_size=6), Training(limit_train_batches=0))
    run_segment(tmp_path / f"job-{per}", "first", job)
    return split(proxy.requests, objects)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_two_rank_job_lists_once_and_indexes_each_object_once(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    urls, objects = bucket_with_shards(s3_server, "index-once")
    TarReader(urls, storage_options=proxy.storage_options(), cache_dir=tmp_path / "one-process").items()
    one_pass, one_listing = split(proxy.requests, objects)
    assert one_listing >= 1 and all(n >= 1 for n in one_pass.values()), (one_listing, one_pass)

    heads = sum(n for (method, _), n in proxy.requests.items() if method == "HEAD")
    per_object, listing = job_counts(tmp_path, proxy, urls, objects, "job")
    job_heads = sum(n for (method, _), n in proxy.requests.items() if method == "HEAD")
    assert job_heads == heads, f"the job asked for object sizes {job_heads} time(s), one process {heads}"
    assert listing == one_listing, f"the job listed the bucket {listing} request(s), one process {one_listing}"
    assert per_object == one_pass, f"one index pass per object: {per_object} vs one process {one_pass}"

    per_object, listing = job_counts(tmp_path, proxy, urls, objects, "rank")
    assert listing == 2 * one_listing, "with index_once_per='rank' each of the 2 ranks lists the bucket"
    assert all(n >= one_pass[o] for o, n in per_object.items())


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_nodes_sharing_no_disk_each_index_their_own_cache_and_train_exactly_once(
    tmp_path: Path, s3_server: S3Server
) -> None:
    urls, _ = bucket_with_shards(s3_server, "index-per-node")
    cache = tmp_path / "caches"
    data = {"format": "tar", "urls": urls, "storage_options": s3_server.storage_options, "cache_dir": str(cache)}
    data.update(index_once_per="node", cache_per_node=True)
    job = Job(Topology(2, 2, launcher="torchrun", num_nodes=2), Data(files=data), Loading(batch_size=6))
    segment = run_segment(tmp_path / "job", "first", job)
    assert_exactly_once(
        served_per_epoch([r for rs in segment.records.values() for r in rs]), total=sum(SIZES), epochs=1
    )
    for node in ("node0", "node1"):
        indexes = sorted((cache / node / "index").glob("tar-*.npz"))
        assert len(indexes) == len(SIZES), f"{node} indexed every shard into its own disk: {indexes}"


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_failure_of_the_indexing_rank_stops_every_rank_with_its_message(tmp_path: Path, s3_server: S3Server) -> None:
    s3_server.bucket("index-fails")
    data = {"format": "tar", "urls": "s3://index-fails/none.tar", "storage_options": s3_server.storage_options}
    job = Job(Topology(2, 1, launcher="torchrun"), Data(files=data), Loading(batch_size=6))
    segment = run_segment(tmp_path / "job", "first", job, expect_death=True)
    assert "FileNotFoundError" in segment.output and "s3://index-fails/none.tar" in segment.output
    assert "rank 0 lists and indexes tar files ['s3://index-fails/none.tar'] for this job" in segment.output


def index_job(tmp_path: Path, shards: Path) -> tuple[int, str]:
    """A 2-rank torchrun job that builds its manifest of ``shards/*.tar`` and stops (tests/jobs/index_job.py)."""
    import subprocess
    import sys

    from tests.support.harness import ROOT, job_env

    env = job_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    cmd += [f"--master_port={env['MASTER_PORT']}", str(ROOT / "tests" / "jobs" / "index_job.py")]
    proc = subprocess.run(
        [*cmd, str(tmp_path), str(shards / "*.tar")], env=env, capture_output=True, text=True, timeout=240
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_the_ranks_of_a_job_share_the_indexing_and_each_shard_is_walked_once(tmp_path: Path) -> None:
    import json

    shards = tmp_path / "shards"
    write_regression(str(shards), "tar", [7 + i % 5 for i in range(9)])
    code, output = index_job(tmp_path, shards)
    assert code == 0, output[-4000:]
    scans = {rank: (tmp_path / f"scans-rank{rank}.txt").read_text().split() for rank in (0, 1)}
    walked = Counter(url for urls in scans.values() for url in urls)
    assert sorted(walked) == sorted(str(p) for p in shards.glob("*.tar")) and set(walked.values()) == {1}, walked
    assert len(scans[0]) == 5 and len(scans[1]) == 4, "rank r walks every other shard"
    manifests = [json.loads((tmp_path / f"manifest-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert manifests[0]["fingerprint"] == manifests[1]["fingerprint"]
    assert manifests[0]["total"] == sum(7 + i % 5 for i in range(9))

    for rank in (0, 1):
        (tmp_path / f"scans-rank{rank}.txt").unlink()
    code, output = index_job(tmp_path, shards)  # the next start: every index and the listing are cached
    assert code == 0, output[-4000:]
    assert not any((tmp_path / f"scans-rank{rank}.txt").exists() for rank in (0, 1)), "a cached start walks nothing"

    bad = sorted(shards.glob("*.tar"))[1]  # rank 1's first shard
    bad.write_bytes(b"not a tar file" * 100)
    (tmp_path / "again").mkdir()
    code, output = index_job(tmp_path / "again", shards)
    assert code != 0
    assert "rank 1 indexes its share of tar files" in output and f"{bad}: cannot index this tar file" in output, output[
        -3000:
    ]
