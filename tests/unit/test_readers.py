"""File readers on local files: every format serves every sample once, indexes are cached, a
resume inside an item reads only what it needs, and bad input is named."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

import lightning_sharding.readers.files as files_module
import lightning_sharding.readers.storage as storage_module
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import World
from lightning_sharding.readers import FILE_READERS, JsonlReader, NpyReader, ParquetReader, TarReader
from lightning_sharding.readers.storage import RetryPolicy, with_retries
from lightning_sharding.recipes.synthetic_files import FORMATS, to_regression, write_regression
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import ShardedLoader


def make_reader(fmt: str, urls: Any, cache: Path, **kw: Any) -> Any:
    return FILE_READERS[fmt](urls, cache_dir=cache, **kw)


def serve_epoch(reader: Any, world_size: int = 1, batch_size: int = 8, consumed: Any = None, **kw: Any) -> list[Any]:
    """Every rank's provenance and batches for one in-process epoch."""
    manifest = Manifest.from_items(reader.items())
    out = []
    for rank in range(world_size):
        ledger = Ledger(seed=3, total=manifest.total, manifest=manifest.summary())
        if consumed is not None:
            ledger.record(consumed)
            ledger.commit()
        loader = ShardedLoader.build(
            reader,
            manifest.items,
            ledger,
            world=World(rank, world_size),
            track=True,
            options=LoaderOptions(batch_size=batch_size, transform=to_regression, **kw),
        )
        for batch in loader:
            out.append((batch, loader.pop_delivered()))
    return out


def ids_served(delivered: list[Any]) -> list[int]:
    return [i for batch, _ in delivered for i in batch["id"][~batch["is_padding"]].tolist()]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_serves_every_sample_once_across_ranks(tmp_path: Path, fmt: str) -> None:
    sizes = [13, 40, 7, 21]
    write_regression(str(tmp_path / "data"), fmt, sizes, row_group_size=16)
    reader = make_reader(fmt, str(tmp_path / "data" / "part-*"), tmp_path / "cache")
    delivered = serve_epoch(reader, world_size=2)
    ids = ids_served(delivered)
    assert sorted(ids) == list(range(sum(sizes)))
    # The values are those of the synthetic reader, whatever the format.
    batch = delivered[0][0]
    x = batch["x"].numpy()
    phase = batch["id"].numpy()[:, None] * 0.618 + np.arange(8)[None, :]
    np.testing.assert_allclose(x, np.sin(phase), atol=1e-6)


@pytest.mark.needs("pyarrow")
def test_parquet_items_are_row_groups_and_columns_can_be_selected(tmp_path: Path) -> None:
    write_regression(str(tmp_path), "parquet", [50, 20], row_group_size=16)
    reader = ParquetReader(str(tmp_path / "*.parquet"), columns=["id", "x"], cache_dir=tmp_path / "cache")
    items = reader.items()
    assert [it.num_samples for it in items] == [16, 16, 16, 2, 16, 4]
    assert items[1].key.endswith("part-00000.parquet#rg=1")
    sample = reader.read(items[1], 3, None)
    assert set(sample) == {"id", "x"} and sample["id"] == 19 and sample["x"].shape == (8,)
    with pytest.raises(ValueError, match=r"has no column\(s\) \['z'\]; it has \['id', 'x', 'y'\]"):
        ParquetReader(str(tmp_path / "*.parquet"), columns=["z"], cache_dir=tmp_path / "other").items()


def test_npy_token_stream_is_cut_into_sequences(tmp_path: Path) -> None:
    np.save(tmp_path / "tokens.npy", np.arange(1000, dtype=np.int32))
    reader = NpyReader(str(tmp_path / "tokens.npy"), sample_length=64, key="tokens", cache_dir=tmp_path / "cache")
    (item,) = reader.items()
    assert item.num_samples == 15  # the 40-token tail is not served
    np.testing.assert_array_equal(reader.read(item, 2, None)["tokens"], np.arange(128, 192))


def test_jsonl_skips_blank_lines_and_handles_a_missing_final_newline(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"id": 0}\n\n  \n{"id": 1}\r\n{"id": 2}')
    reader = JsonlReader(str(tmp_path / "a.jsonl"), cache_dir=tmp_path / "cache")
    (item,) = reader.items()
    assert item.num_samples == 3
    assert [reader.read(item, i, None)["id"] for i in range(3)] == [0, 1, 2]


def test_the_index_is_cached_and_rebuilt_only_for_changed_files(tmp_path: Path) -> None:
    urls = write_regression(str(tmp_path / "d"), "tar", [10, 10, 10])
    reader = TarReader(str(tmp_path / "d" / "*.tar"), cache_dir=tmp_path / "cache")
    first = Manifest.from_items(reader.items())
    assert reader.last_scan == {"files": 3, "scanned": 3, "cached": 0}
    again = TarReader(str(tmp_path / "d" / "*.tar"), cache_dir=tmp_path / "cache")
    assert Manifest.from_items(again.items()).fingerprint == first.fingerprint
    assert again.last_scan == {"files": 3, "scanned": 0, "cached": 3}
    write_regression(str(tmp_path / "other"), "tar", [12])
    os.replace(tmp_path / "other" / "part-00000.tar", urls[1])
    changed = Manifest.from_items(again.items())
    assert again.last_scan == {"files": 3, "scanned": 1, "cached": 2}
    assert changed.fingerprint != first.fingerprint and changed.counts.tolist() == [10, 12, 10]


def test_workers_rebuild_an_index_whose_cache_was_cleared(tmp_path: Path) -> None:
    write_regression(str(tmp_path / "d"), "jsonl", [9])
    reader = JsonlReader(str(tmp_path / "d" / "*"), cache_dir=tmp_path / "cache")
    manifest = Manifest.from_items(reader.items())
    for f in [*(tmp_path / "cache").rglob("*.npz"), *(tmp_path / "cache").rglob("*.npy")]:
        f.unlink()
    assert sorted(ids_served(serve_epoch(reader))) == list(range(manifest.total))


def test_a_read_without_the_shard_cache_resolves_its_filesystem_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_regression(str(tmp_path / "d"), "tar", [9])
    reader = TarReader(str(tmp_path / "d" / "*.tar"), cache_dir=tmp_path / "cache")
    (item,) = reader.items()
    resolved: list[str] = []
    for module in (files_module, storage_module):
        real = module.filesystem
        monkeypatch.setattr(module, "filesystem", lambda url, *a, real=real: resolved.append(url) or real(url, *a))
    reader.read_batch(item, np.arange(3), None)
    assert resolved == [reader.split_key(item)[0]], "only the ranged read itself resolves the file's filesystem"


# -- resuming inside an item reads from the nearest offset -------------------------------------


class CountingFileSystem(LocalFileSystem):
    """Local files under ``counting://``, counting every byte read through fsspec."""

    protocol = "counting"
    bytes_read = 0

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        return LocalFileSystem._strip_protocol(path.removeprefix("counting://"))

    def unstrip_protocol(self, name: str) -> str:
        return "counting://" + self._strip_protocol(name)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        return _CountingFile(super()._open(path, mode, **kwargs))


class _CountingFile(io.RawIOBase):
    def __init__(self, f: Any) -> None:
        self._f = f

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        CountingFileSystem.bytes_read += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()
        super().close()


@pytest.fixture
def counting() -> Any:
    fsspec.register_implementation("counting", CountingFileSystem, clobber=True)
    CountingFileSystem.bytes_read = 0
    yield CountingFileSystem


@pytest.mark.parametrize("fmt", FORMATS)
def test_resuming_inside_an_item_reads_only_what_is_left(tmp_path: Path, fmt: str, counting: Any) -> None:
    (url,) = write_regression(str(tmp_path), fmt, [256], row_group_size=64)
    size = os.path.getsize(url)
    reader = make_reader(fmt, f"counting://{url}", tmp_path / "cache")
    manifest = Manifest.from_items(reader.items())
    counting.bytes_read = 0
    # Unshuffled, epoch positions are the file's samples in order: 192 of 256 are done.
    delivered = serve_epoch(reader, consumed=np.arange(192), shuffle=False, batch_size=16)
    assert sorted(ids_served(delivered)) == list(range(192, 256))
    # A quarter of the samples is left; reading them costs about a quarter of the file (plus the
    # Parquet footer), never the file from its start.
    assert counting.bytes_read < 0.45 * size, f"{fmt}: read {counting.bytes_read} of {size} bytes"
    assert manifest.total == 256


# -- bad samples under on_error='skip' (every bad-input case: tests/process/test_bad_input.py) -------------


def corrupt_tar_member(url: str, key: str) -> None:
    """Overwrite the data of ``key``'s .npy member with garbage (headers stay valid)."""
    with tarfile.open(url) as tar:
        member = tar.getmember(f"{key}.x.npy")
    with open(url, "r+b") as f:
        f.seek(member.offset_data)
        f.write(b"\xff" * member.size)


def test_on_error_skip_counts_bad_samples_keeps_batches_full_and_serves_the_rest_once(tmp_path: Path) -> None:
    urls = write_regression(str(tmp_path), "tar", [30, 30])
    for key in ("sample00000004", "sample00000005", "sample00000047"):
        corrupt_tar_member(urls[int(key[-2:]) // 30], key)
    with pytest.warns(UserWarning, match="skipped a bad sample"):  # each named: the test below
        delivered = serve_epoch(TarReader(urls, cache_dir=tmp_path / "c"), world_size=2, on_error="skip")
    assert sorted(ids_served(delivered)) == sorted(set(range(60)) - {4, 5, 47})
    skipped = np.concatenate([p.skipped for _, p in delivered])
    consumed = np.concatenate([p.consumed_positions for _, p in delivered])
    assert len(skipped) == 3
    assert sorted(consumed.tolist()) == list(range(60))  # every position accounted once
    for batch, provenance in delivered:
        assert len(batch["id"]) == len(provenance.positions)
        assert int(batch["is_padding"].sum()) == provenance.num_padding
    sizes = [len(b["id"]) for b, _ in delivered]
    assert sizes.count(8) >= len(sizes) - 2  # only each rank's last batch may be short


def test_on_error_skip_names_each_skipped_sample_in_a_warning_then_counts_them(tmp_path: Path) -> None:
    """Every sample but the first of each batch of 8 is corrupt: 105 skipped. The first 10 get a
    warning each naming the file, the sample and the error; then one warning counts 100."""
    urls = write_regression(str(tmp_path), "tar", [120])
    bad = [i for i in range(120) if i % 8]
    for i in bad:
        corrupt_tar_member(urls[0], f"sample{i:08d}")
    with pytest.warns(UserWarning) as caught:
        delivered = serve_epoch(TarReader(urls, cache_dir=tmp_path / "c"), shuffle=False, on_error="skip")
    assert sum(len(p.skipped) for _, p in delivered) == len(bad)
    messages = [str(w.message) for w in caught if "skipped" in str(w.message)]
    assert len(messages) == 11, messages
    for i, message in zip(bad, messages[:10], strict=False):
        assert message.startswith(f"skipped a bad sample (on_error='skip'): cannot read sample {i} of item {urls[0]!r}")
        assert f"(key 'sample{i:08d}')" in message and "ValueError" in message and "Fix or remove" not in message
    assert "rank 0, worker 0 names its first 10 skipped samples" in messages[9]
    assert messages[10].startswith("rank 0, worker 0 has skipped 100 bad samples (on_error='skip'")


def test_transient_errors_are_retried_and_permanent_ones_are_not() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    assert with_retries(flaky, "reading x", RetryPolicy(attempts=5, backoff=0.001)) == "ok" and len(calls) == 3
    denied = []

    def forbidden() -> None:
        denied.append(1)
        raise PermissionError("Forbidden")

    with pytest.raises(PermissionError):
        with_retries(forbidden, "reading y", RetryPolicy(attempts=5, backoff=0.001))
    assert len(denied) == 1
    with pytest.raises(OSError, match="reading z failed after 2 attempts"):
        with_retries(lambda: (_ for _ in ()).throw(TimeoutError("slow")), "reading z", RetryPolicy(2, 0.001))


def test_a_first_start_writes_one_index_for_the_listing_not_one_file_per_shard(tmp_path: Path) -> None:
    write_regression(str(tmp_path / "d"), "tar", [5] * 60)
    reader = TarReader(str(tmp_path / "d" / "*.tar"), cache_dir=tmp_path / "cache")
    manifest = Manifest.from_items(reader.items())
    written = [p for p in (tmp_path / "cache" / "index").rglob("*") if p.is_file()]
    assert len(written) < 20 and not list((tmp_path / "cache" / "index").glob("tar-*.npz")), written
    assert sorted(ids_served(serve_epoch(reader))) == list(range(manifest.total)), "workers read the listing's index"
