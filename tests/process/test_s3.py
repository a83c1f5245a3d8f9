"""Remote data on a real S3-protocol server on loopback: every format, errors, and an exactly-once
mid-epoch resume of a 2-rank x 2-worker DDP job reading WebDataset shards from a bucket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding.readers import TarReader
from lightning_sharding.recipes.synthetic_files import FORMATS, write_regression
from tests.support.harness import Data, Job, Loading, Topology, Training, assert_exactly_once, check_resume
from tests.support.s3 import S3Server
from tests.unit.test_readers import ids_served, make_reader, serve_epoch


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_from_a_bucket(tmp_path: Path, s3_server: S3Server, fmt: str) -> None:
    bucket = s3_server.bucket(f"formats-{fmt}")
    opts = s3_server.storage_options
    urls = write_regression(f"{bucket}/train", fmt, [17, 30, 9], row_group_size=16, storage_options=opts)
    assert urls[0] == f"{bucket}/train/part-00000.{fmt}"
    reader = make_reader(fmt, f"{bucket}/train/part-*", tmp_path / "cache", storage_options=opts)
    items = reader.items()
    assert items[0].key.startswith(f"{bucket}/train/part-00000.{fmt}")
    assert "tag=" in items[0].fingerprint and "size=" in items[0].fingerprint  # the ETag, from the listing
    assert sorted(ids_served(serve_epoch(reader, world_size=2))) == list(range(56))


def test_a_missing_object_and_a_forbidden_one_are_named(tmp_path: Path, s3_server: S3Server) -> None:
    bucket = s3_server.bucket("errors")
    opts = s3_server.storage_options
    with pytest.raises(FileNotFoundError, match="s3://errors/none.tar"):
        TarReader(f"{bucket}/none.tar", storage_options=opts, cache_dir=tmp_path).items()
    write_regression(f"{bucket}/secret", "tar", [4], storage_options=opts)
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Deny", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::errors/secret/*"}
        ],
    }
    s3_server.client().put_bucket_policy(Bucket="errors", Policy=json.dumps(policy))
    with pytest.raises(PermissionError, match="s3://errors/secret/part-00000.tar: no permission"):
        TarReader(f"{bucket}/secret/*.tar", storage_options=opts, cache_dir=tmp_path).items()


@pytest.mark.processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cached", [False, True], ids=["ranged-reads", "local-shard-cache"])
def test_ddp_over_s3_shards_resumes_exactly_once_on_another_topology(
    tmp_path: Path, s3_server: S3Server, cached: bool
) -> None:
    """2 ranks x 2 workers read tar shards from the bucket, are SIGKILLed mid-epoch, and the job
    resumes on 1 rank x 1 worker; over both epochs every sample is trained on exactly once. With the
    local shard cache, all ranks, workers and both runs share one cache directory."""
    bucket = s3_server.bucket(f"shards-{int(cached)}")
    sizes = [23, 31, 17, 29, 20]
    write_regression(f"{bucket}/wds", "tar", sizes, storage_options=s3_server.storage_options)
    data: dict[str, Any] = {
        "format": "tar",
        "urls": f"{bucket}/wds/part-*.tar",
        "storage_options": s3_server.storage_options,
    }
    if cached:
        data.update(cache_dir=str(tmp_path / "shared-cache"), cache_limit=10**9)
    resume_from_a_bucket_exactly_once(tmp_path, data, sizes)


def resume_from_a_bucket_exactly_once(tmp_path: Path, data: dict[str, Any], sizes: list[int]) -> None:
    """A 2-rank x 2-worker job over ``data`` (shards of ``sizes`` samples in a bucket), SIGKILLed
    mid-epoch, resumed on 1 rank x 1 worker: over both epochs every sample is trained on exactly
    once, nothing skipped; with a shard cache, it holds one complete copy a shard, nothing partial."""
    first = Job(Topology(2, 2), Data(files=data), Loading(batch_size=6), Training(epochs=2))
    seen, segments = check_resume(tmp_path, first, [first.on(1, 1)], checkpoint_every=4)
    assert_exactly_once(seen, total=sum(sizes), epochs=2)
    report = segments[-1].report
    assert report is not None and [e["consumed"] for e in report["epochs"]] == [sum(sizes)] * 2
    assert np.all(np.array([e["skipped"] for e in report["epochs"]]) == 0)
    if data.get("cache_limit") is not None:
        held = sorted((Path(data["cache_dir"]) / "shards").iterdir())
        assert len([p for p in held if not p.name.startswith(".")]) == len(sizes)
        assert not [p for p in held if ".part-" in p.name]
