"""The fast tar header walk gives what Python's ``tarfile`` gives, on shards of every writer.

Shards written by Python's ``tarfile`` (GNU, PAX and ustar formats: long names, PAX records, the
ustar prefix, a directory), by GNU ``tar`` (gnu and posix formats) and by ``webdataset.ShardWriter``
are walked both ways, from a local file and through a file object (as a remote shard is); a
corrupt header is named with its byte offset.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from lightning_sharding import TarReader
from lightning_sharding.readers.tar_headers import TarHeaderError, file_members, local_members


def by_tarfile(path: Path) -> list[tuple[str, int, int, int]]:
    with tarfile.open(path, "r:") as tar:
        return [(m.name, m.offset, m.offset_data, m.size) for m in tar if m.isfile()]


def assert_walks_agree(path: Path) -> int:
    expected = by_tarfile(path)
    assert [tuple(m) for m in local_members(str(path))] == expected, path.name
    with open(path, "rb") as f:
        assert [tuple(m) for m in file_members(f, path.stat().st_size, path.name)] == expected, path.name
    return len(expected)


@pytest.mark.parametrize(
    "fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT], ids=["gnu", "pax", "ustar"]
)
def test_shards_of_pythons_tarfile(tmp_path: Path, fmt: int) -> None:
    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w", format=fmt) as tar:
        folder = tarfile.TarInfo("folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for i in range(60):
            for ext, data in (("cls", str(i).encode()), ("jpg", os.urandom(i * 37 % 1500))):
                name = f"{'sub/' * (i % 3)}sample{i:04d}.{ext}"
                if i % 7 == 0:  # past 100 bytes: a GNU long name, a PAX path, or the ustar prefix
                    name = ("p" * 90 + "/" if fmt == tarfile.USTAR_FORMAT else "long/" + "x" * 120 + "/") + name
                info = tarfile.TarInfo(name)
                info.size = len(data)
                if fmt == tarfile.PAX_FORMAT and i % 5 == 0:
                    info.pax_headers = {"comment": "héllo wörld"}
                tar.addfile(info, io.BytesIO(data))
    assert assert_walks_agree(path) == 120


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar is not installed")
@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_shards_of_gnu_tar(tmp_path: Path, fmt: str) -> None:
    (tmp_path / "data" / "sub").mkdir(parents=True)
    for i in range(40):
        (tmp_path / "data" / "sub" / f"k{i:03d}.txt").write_bytes(os.urandom(i * 13))
    (tmp_path / "data" / ("y" * 150 + ".bin")).write_bytes(b"z" * 1000)
    subprocess.run(["tar", f"--format={fmt}", "-cf", "shard.tar", "data"], cwd=tmp_path, check=True)
    assert assert_walks_agree(tmp_path / "shard.tar") == 41


def test_shards_of_webdataset(tmp_path: Path) -> None:
    from tests.extras import require

    require("webdataset")
    import webdataset as wds

    with wds.ShardWriter(str(tmp_path / "shard-%d.tar"), maxcount=1000, verbose=0) as sink:
        for i in range(100):
            sink.write({"__key__": f"s{i:05d}", "cls": i, "json": {"a": i}, "txt": "x" * i})
    assert assert_walks_agree(tmp_path / "shard-0.tar") == 300
    reader = TarReader(str(tmp_path / "shard-0.tar"), cache_dir=tmp_path / "cache")
    (item,) = reader.items()
    assert item.num_samples == 100
    sample = reader.read(item, 42, None)  # type: ignore[arg-type]
    assert sample["__key__"] == "s00042" and sample["cls"] == 42 and sample["json"] == {"a": 42}


def test_a_corrupt_header_is_named_with_its_offset(tmp_path: Path) -> None:
    """A bad first header is an error; a bad later one ends the shard there, as tarfile reads it, warned."""
    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(3):
            info = tarfile.TarInfo(f"s{i}.txt")
            info.size = 700
            tar.addfile(info, io.BytesIO(b"a" * 700))
    data = bytearray(path.read_bytes())
    data[1536 + 10] ^= 0xFF  # the second member's header (after 512 + 1024 bytes)
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"shard\.tar: the header at byte 1536 is not a valid tar header"):
        assert [m.name for m in local_members(str(path))] == ["s0.txt"]  # as tarfile reads it
    with pytest.raises(TarHeaderError, match=r"not a tar header|bad checksum"):
        local_members(str(Path(__file__)))  # not a tar file at all


def test_the_walk_ends_and_fails_where_tarfile_does(tmp_path: Path) -> None:
    def shard(name: str, *, link_with_size: bool = False) -> Path:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(2):
                info = tarfile.TarInfo(f"s{i}.txt")
                info.size = 700
                tar.addfile(info, io.BytesIO(b"a" * 700))
                if link_with_size and i == 0:
                    link = tarfile.TarInfo("link")
                    link.type, link.linkname = tarfile.SYMTYPE, "s0.txt"
                    tar.addfile(link)
        data = bytearray(buf.getvalue())
        if link_with_size:  # a link header whose size field is not 0: tarfile skips no data after it
            header = data[1536:2048]
            header[124:136], header[148:156] = b"%011o\0" % 700, b" " * 8
            header[148:156] = b"%06o\0 " % sum(header)
            data[1536:2048] = header
        path = tmp_path / name
        path.write_bytes(bytes(data))
        return path

    assert assert_walks_agree(shard("link.tar", link_with_size=True)) == 2
    junk = shard("junk.tar")
    junk.write_bytes(junk.read_bytes()[:3072] + b"J" * 512)  # a bad header after the members: the end
    with pytest.warns(UserWarning, match=r"junk\.tar: the header at byte 3072 is not a valid tar header"):
        assert assert_walks_agree(junk) == 2
    truncated = shard("truncated.tar")
    truncated.write_bytes(truncated.read_bytes()[:1200])
    with pytest.raises(tarfile.ReadError):
        by_tarfile(truncated)
    with pytest.raises(TarHeaderError, match=r"is truncated: member 's0.txt' needs 1212 bytes, the file has 1200"):
        local_members(str(truncated))
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(TarHeaderError, match=r"empty\.tar: is empty, not a tar file"):
        local_members(str(tmp_path / "empty.tar"))
