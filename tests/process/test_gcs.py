"""Remote data on a real Google Cloud Storage JSON-API server on loopback (gs:// through gcsfs):
every format reads from a bucket, a missing object is named, and a 2-rank x 2-worker DDP job with
the local shard cache and fetching ahead resumes exactly once on another topology."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sharding.readers import TarReader
from lightning_sharding.recipes.synthetic_files import FORMATS, write_regression
from tests.process.test_s3 import resume_from_a_bucket_exactly_once
from tests.support.gcs import GCSServer
from tests.unit.test_readers import ids_served, make_reader, serve_epoch


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_from_a_gcs_bucket(tmp_path: Path, gcs_server: GCSServer, fmt: str) -> None:
    bucket = gcs_server.bucket(f"formats-{fmt}")
    opts = gcs_server.storage_options
    urls = write_regression(f"{bucket}/train", fmt, [17, 30, 9], row_group_size=16, storage_options=opts)
    assert urls[0] == f"{bucket}/train/part-00000.{fmt}"
    reader = make_reader(
        fmt, f"gcs://{bucket.removeprefix('gs://')}/train/part-*", tmp_path / "cache", storage_options=opts
    )
    items = reader.items()
    assert items[0].key.startswith(f"gcs://formats-{fmt}/train/part-00000.{fmt}"), "the user's spelling is kept"
    assert "tag=None" not in items[0].fingerprint and "size=" in items[0].fingerprint  # the ETag, from the listing
    assert sorted(ids_served(serve_epoch(reader, world_size=2))) == list(range(56))


def test_a_missing_gcs_object_and_one_named_twice_are_named(tmp_path: Path, gcs_server: GCSServer) -> None:
    bucket = gcs_server.bucket("errors")
    opts = gcs_server.storage_options
    with pytest.raises(FileNotFoundError, match="gs://errors/none.tar"):
        TarReader(f"{bucket}/none.tar", storage_options=opts, cache_dir=tmp_path).items()
    with pytest.raises(FileNotFoundError, match="gs://errors/wds/part-"):
        TarReader(f"{bucket}/wds/part-*.tar", storage_options=opts, cache_dir=tmp_path).items()
    write_regression(f"{bucket}/twice", "tar", [3, 4], storage_options=opts)
    twice = (
        r"'gcs://errors/twice/part-00000.tar' is named twice in the URLs \(also as 'gs://errors/twice/part-00000.tar'\)"
    )
    with pytest.raises(ValueError, match=twice):  # two spellings of one object: its samples twice an epoch
        TarReader(
            [f"{bucket}/twice/*.tar", "gcs://errors/twice/*.tar"], storage_options=opts, cache_dir=tmp_path
        ).items()


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_ddp_over_gcs_shards_with_the_shard_cache_resumes_exactly_once_on_another_topology(
    tmp_path: Path, gcs_server: GCSServer
) -> None:
    """2 ranks x 2 workers read tar shards from gs:// through the shared shard cache, fetching 2
    files ahead, are SIGKILLed mid-epoch, and the job resumes on 1 rank x 1 worker: over both
    epochs every sample is trained on exactly once, and the cache holds one complete copy a shard."""
    bucket = gcs_server.bucket("shards")
    sizes = [23, 31, 17, 29, 20]
    write_regression(f"{bucket}/wds", "tar", sizes, storage_options=gcs_server.storage_options)
    data = {
        "format": "tar",
        "urls": f"{bucket}/wds/part-*.tar",
        "storage_options": gcs_server.storage_options,
        "cache_dir": str(tmp_path / "shared-cache"),
        "cache_limit": 10**9,
        "prefetch_files": 2,
    }
    resume_from_a_bucket_exactly_once(tmp_path, data, sizes)
