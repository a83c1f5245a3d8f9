"""An index written with the data (``lightning-sharding index``): a later start on any machine takes
every unchanged file's index from it and reads no file; data copied or touched still uses it; a
file changed since, or added, is indexed now and named in a warning; an index for other options is
not used, and a missing one that was named is an error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from lightning_sharding.cli.main import main
from lightning_sharding.readers import NpyReader, TarReader
from lightning_sharding.readers.data_index import INDEX_DIR
from lightning_sharding.recipes.synthetic_files import write_regression

SIZES = [7, 5, 9, 6]


def shards(root: Path) -> str:
    write_regression(str(root), "tar", SIZES)
    return str(root / "*.tar")


def start(pattern: str, cache: Path, **options: object) -> tuple[TarReader, list[object], list[str]]:
    """A fresh reader's first start (an empty cache): the reader, its items, the warnings it gave."""
    reader = TarReader(pattern, cache_dir=cache, **options)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = list(reader.items())
    return reader, items, [str(w.message) for w in caught]


def test_a_start_takes_every_files_index_from_the_data_and_reads_the_same_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pattern = shards(tmp_path / "data")
    walked, walked_items, _ = start(pattern, tmp_path / "walked", data_index=False)
    assert walked.last_scan["scanned"] == len(SIZES)
    assert main(["index", pattern]) == 0
    out = capsys.readouterr().out
    assert f"wrote the index of 4 tar file(s), {sum(SIZES)} samples, to {tmp_path / 'data' / INDEX_DIR}" in out
    reader, items, said = start(pattern, tmp_path / "fresh")
    assert reader.last_scan == {"files": 4, "scanned": 0, "cached": 4} and not said
    assert items == walked_items  # keys, counts, fingerprints, names and content ids
    for item in items:  # the offsets it gave read every sample as the walk's do
        for i in range(item.num_samples):  # type: ignore[attr-defined]
            ours, theirs = reader.read(item, i, None), walked.read(item, i, None)  # type: ignore[arg-type]
            assert ours["__key__"] == theirs["__key__"] and np.array_equal(ours["x.npy"], theirs["x.npy"])


def test_data_copied_elsewhere_or_touched_keeps_its_index_and_a_change_is_named(tmp_path: Path) -> None:
    pattern = shards(tmp_path / "data")
    assert main(["index", pattern]) == 0
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "data", moved, copy_function=shutil.copy)  # new modification times
    os.utime(moved / "part-00001.tar", (1, 1))
    reader, items, said = start(str(moved / "*.tar"), tmp_path / "c1")
    assert reader.last_scan["scanned"] == 0 and not said
    assert [it.num_samples for it in items] == SIZES  # type: ignore[attr-defined]

    write_regression(str(tmp_path / "other"), "tar", [3, 3, 3, 3, 3])  # other shards of the same names
    shutil.copy(tmp_path / "other" / "part-00002.tar", moved / "part-00002.tar")
    shutil.copy(tmp_path / "other" / "part-00004.tar", moved / "part-00004.tar")  # a shard it does not hold
    reader, items, said = start(str(moved / "*.tar"), tmp_path / "c2")
    assert reader.last_scan["scanned"] == 2
    assert [it.num_samples for it in items] == [7, 5, 3, 6, 3]  # type: ignore[attr-defined]
    (warning,) = said
    assert f"the data index {moved / INDEX_DIR} is stale: 1 file(s) changed since it was written: " in warning
    assert f"{moved / 'part-00002.tar'} (size=" in warning
    assert f"1 file(s) are not in it: {moved / 'part-00004.tar'}" in warning
    assert "lightning-sharding index" in warning

    assert main(["index", str(moved / "*.tar")]) == 0  # written again: the changed ones alone are walked
    reader, items, said = start(str(moved / "*.tar"), tmp_path / "c3")
    assert reader.last_scan["scanned"] == 0 and not said


def test_an_index_for_other_options_is_not_used_and_a_named_one_must_exist(tmp_path: Path) -> None:
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "a.npy", np.arange(12))
    np.save(tmp_path / "npy" / "b.npy", np.arange(8))
    assert main(["index", str(tmp_path / "npy" / "*.npy"), "--option", "sample_length=4"]) == 0
    reader = NpyReader(str(tmp_path / "npy" / "*.npy"), sample_length=2, cache_dir=tmp_path / "c")
    with pytest.warns(
        UserWarning, match=r"was written for npy files with options 'sample_length=4'.*indexed without it"
    ):
        assert [it.num_samples for it in reader.items()] == [6, 4]
    pattern = shards(tmp_path / "data")
    with pytest.raises(
        FileNotFoundError, match=rf"data_index='{tmp_path}/nowhere': there is no data index at .*nowhere/{INDEX_DIR}"
    ):
        TarReader(pattern, cache_dir=tmp_path / "c", data_index=str(tmp_path / "nowhere")).items()
    assert main(["index", pattern, "--output", str(tmp_path / "elsewhere")]) == 0
    for named in (tmp_path / "elsewhere", tmp_path / "elsewhere" / INDEX_DIR):  # what --output named, or the index
        reader, _, said = start(pattern, tmp_path / f"c-{named.name}", data_index=str(named))
        assert reader.last_scan["scanned"] == 0 and not said
    with pytest.raises(ValueError, match="must be None .*False .*or the URL"):
        TarReader(pattern, data_index=True)  # type: ignore[arg-type]


def test_the_command_names_what_it_cannot_do(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x")
    run = [sys.executable, "-m", "lightning_sharding.cli", "index"]
    done = subprocess.run([*run, str(tmp_path / "*.bin")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "cannot tell the format of" in done.stderr and "give --format" in done.stderr
    pattern = shards(tmp_path / "data")
    signed = "https://example.com/data/shard-0001?sig=SECRETSECRETSECRET42"
    done = subprocess.run([*run, signed], capture_output=True, text=True)
    assert done.returncode == 2 and "SECRETSECRET" not in done.stderr and "give --format" in done.stderr
    done = subprocess.run([*run, pattern, "--storage-options", "{nope"], capture_output=True, text=True)
    assert done.returncode == 2 and "--storage-options is not JSON" in done.stderr
    done = subprocess.run([*run, pattern, "--option", "colour=red"], capture_output=True, text=True)
    assert done.returncode == 2 and "TarReader takes no such option" in done.stderr
    assert not (tmp_path / "data" / INDEX_DIR).exists()
    assert subprocess.run([*run, pattern], capture_output=True).returncode == 0
    assert (tmp_path / "data" / INDEX_DIR / "meta.json").is_file()
    reader, items, _ = start(str(tmp_path / "data" / "*"), tmp_path / "c")  # the index is no data file
    assert len(items) == len(SIZES)


def test_a_large_shard_with_a_new_time_is_indexed_again(tmp_path: Path) -> None:
    """A local file over 4 MiB has a content id of sampled blocks, which cannot vouch for its headers:
    touched, it is walked again (and the warning says why); one kept with its time is not."""
    import io
    import tarfile

    (tmp_path / "data").mkdir()
    with tarfile.open(tmp_path / "data" / "big.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(5):
            for ext, data in (("bin", os.urandom(1 << 20)), ("json", b'{"label": 1}')):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    pattern = str(tmp_path / "data" / "*.tar")
    assert main(["index", pattern]) == 0
    reader, _, said = start(pattern, tmp_path / "c1")
    assert reader.last_scan["scanned"] == 0 and not said
    os.utime(tmp_path / "data" / "big.tar", (1, 1))
    reader, items, said = start(pattern, tmp_path / "c2")
    assert reader.last_scan["scanned"] == 1 and [it.num_samples for it in items] == [5]  # type: ignore[attr-defined]
    (warning,) = said
    assert "1 file(s) over 4 MiB have a new modification time" in warning and "big.tar" in warning


def test_an_index_that_cannot_be_read_is_not_used_and_a_named_one_is_an_error(tmp_path: Path) -> None:
    pattern = shards(tmp_path / "data")
    (tmp_path / "data" / INDEX_DIR).write_text("not a directory")  # looking inside it fails, not as "missing"
    reader, items, said = start(pattern, tmp_path / "c1")
    assert len(items) == len(SIZES) and reader.last_scan["scanned"] == len(SIZES)
    (warning,) = said
    assert f"the data index {tmp_path / 'data' / INDEX_DIR} cannot be used (NotADirectoryError" in warning
    assert "pass data_index=False" in warning
    (tmp_path / "data" / INDEX_DIR).unlink()
    assert main(["index", pattern]) == 0
    (arrays,) = (tmp_path / "data" / INDEX_DIR).glob("arrays-*")
    (arrays / "key.npy").write_bytes((arrays / "key.npy").read_bytes()[:100])  # truncated
    reader, items, said = start(pattern, tmp_path / "c2")
    assert reader.last_scan["scanned"] == len(SIZES) and "cannot be used" in said[0]
    with pytest.raises(ValueError, match=r"cannot be used .*write it again with `lightning-sharding index`"):
        TarReader(pattern, cache_dir=tmp_path / "c3", data_index=str(tmp_path / "data")).items()
    assert main(["index", pattern]) == 0  # the command repairs it
    assert [p.name for p in (tmp_path / "data" / INDEX_DIR).glob("arrays-*")] != [arrays.name]
    reader, _, said = start(pattern, tmp_path / "c4")
    assert reader.last_scan["scanned"] == 0 and not said


def test_no_index_after_a_transient_error_is_no_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that fails once and then answers "no such object" has no index: nothing to warn about."""
    from lightning_sharding.readers import data_index

    def flaky_then_missing(call: object, what: str, policy: object) -> object:
        raise OSError(f"{what} failed after 2 attempts") from FileNotFoundError("meta.json")

    monkeypatch.setattr(data_index, "with_retries", flaky_then_missing)
    reader, items, said = start(shards(tmp_path / "data"), tmp_path / "c")
    assert len(items) == len(SIZES) and not said


@pytest.mark.needs("pyarrow")
@pytest.mark.parametrize("where", ["local", "s3"])
def test_parquet_files_of_several_row_groups_share_one_data_index(
    tmp_path: Path, where: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files of 3, 2 and 1 row groups (an item each) under one index: a first start reads no file."""
    from lightning_sharding.readers import ParquetReader

    monkeypatch.setenv("LIGHTNING_SHARDING_CACHE", str(tmp_path / "cli-cache"))  # the command walks every file

    sizes, options, args = [150, 70, 40], {}, []
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        root, options = f"{server.bucket('row-groups')}/data", server.storage_options
        args = ["--storage-options", json.dumps(options)]
    else:
        root = str(tmp_path / "data")
    write_regression(root, "parquet", sizes, row_group_size=64, storage_options=options or None)
    pattern = f"{root}/*.parquet"
    walked = ParquetReader(pattern, cache_dir=tmp_path / "walked", data_index=False, storage_options=options)
    walked_items = list(walked.items())
    assert [item.num_samples for item in walked_items] == [64, 64, 22, 64, 6, 40]
    assert main(["index", pattern, *args]) == 0
    reader = ParquetReader(pattern, cache_dir=tmp_path / "fresh", storage_options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no file is stale, none is walked
        items = list(reader.items())
    assert reader.last_scan == {"files": 3, "scanned": 0, "cached": 3} and items == walked_items
    for item in items:  # every row group reads from the footer the index kept
        ours = reader.read_batch(item, np.arange(item.num_samples), None)  # type: ignore[arg-type]
        theirs = walked.read_batch(item, np.arange(item.num_samples), None)  # type: ignore[arg-type]
        assert [r["id"] for r in ours] == [r["id"] for r in theirs]
