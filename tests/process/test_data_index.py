"""An index written with the data in a bucket of a real S3-protocol server on loopback, behind the
counting proxy: ``lightning-sharding index`` (a real process) writes it there, and a 2-rank x
2-worker DDP job's first start, with an empty cache, reads it and not one shard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sharding.readers.data_index import INDEX_DIR
from lightning_sharding.recipes.synthetic_files import write_regression
from tests.support.fault_proxy import FaultProxy
from tests.support.harness import Data, Job, Loading, Topology, Training, run_segment
from tests.support.s3 import S3Server

SIZES = (23, 17, 29, 19, 31)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_job_reads_the_index_written_with_the_data_and_no_shard(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    bucket = s3_server.bucket("data-index")
    shards = write_regression(f"{bucket}/wds", "tar", list(SIZES), storage_options=s3_server.storage_options)
    urls = "s3://data-index/wds/part-*.tar"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_sharding.cli",
            "index",
            urls,
            "--storage-options",
            json.dumps(proxy.storage_options()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"LIGHTNING_SHARDING_CACHE": str(tmp_path / "cli-cache"), **dict(__import__("os").environ)},
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote the index of 5 tar file(s), {sum(SIZES)} samples, to s3://data-index/wds/{INDEX_DIR}" in done.stdout
    objects = [u.removeprefix("s3:/") for u in shards]
    assert all(proxy.requests[("GET", o)] >= 1 for o in objects), "writing the index walks every shard"

    proxy.requests.clear()
    data = {
        "format": "tar",
        "urls": urls,
        "storage_options": proxy.storage_options(),
        "cache_dir": str(tmp_path / "job"),
    }
    job = Job(Topology(2, 2), Data(files=data), Loading(batch_size=6), Training(limit_train_batches=0))
    segment = run_segment(tmp_path / "run", "first", job)
    assert {o: proxy.requests[("GET", o)] for o in objects} == dict.fromkeys(objects, 0), segment.output[-2000:]
    assert proxy.requests[("GET", f"/data-index/wds/{INDEX_DIR}/meta.json")] >= 1
    assert "stale" not in segment.output and "indexing" not in segment.output
