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
from lightning_sharding.readers.tar import member_samples, table_samples
from lightning_sharding.readers.tar_headers import (
    TarHeaderError,
    file_members,
    local_members,
    members,
    plain_members,
)


def by_tarfile(path: Path) -> list[tuple[str, int, int, int]]:
    with tarfile.open(path, "r:") as tar:
        return [(m.name, m.offset, m.offset_data, m.size) for m in tar if m.isfile()]


def assert_walks_agree(path: Path, plain: bool | None = None) -> int:
    """Every walk gives tarfile's members: the array walk (when the shard is ``plain``: it must take
    it), the header-by-header one over bytes and over a file object; and the index arrays built from
    the member table equal those built member by member, values and dtypes."""
    expected = by_tarfile(path)
    data = path.read_bytes()
    assert [tuple(m) for m in local_members(str(path))] == expected, path.name
    assert [tuple(m) for m in members(lambda pos, n: data[pos : pos + n], len(data), path.name)] == expected
    with open(path, "rb") as f:
        assert [tuple(m) for m in file_members(f, path.stat().st_size, path.name)] == expected, path.name
    table = plain_members(data)
    if plain is not None:
        assert (table is not None) == plain, f"{path.name}: the array walk {'was not' if plain else 'was'} taken"
    if table is not None:
        assert [tuple(m) for m in table.members()] == expected
        fast, slow = table_samples(table)[0], member_samples(table.members())
        if expected and all(ord(c) < 128 for m in expected for c in m[0]):
            assert fast is not None
        if fast is not None:
            assert fast.keys() == slow.keys()
            for name in slow:
                assert fast[name].dtype == slow[name].dtype, name
                assert fast[name].tolist() == slow[name].tolist(), name
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
    assert assert_walks_agree(path, plain=False) == 120  # long names: the walk header by header
    short = tmp_path / "short.tar"  # the same writer with names of at most 100 bytes: the array walk
    with tarfile.open(short, "w", format=fmt) as tar:
        folder = tarfile.TarInfo("folder/")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for i in range(60):
            for ext in ("cls", "seg.png", ""):
                data = os.urandom(i * 37 % 1500)
                info = tarfile.TarInfo(f"{'folder/' * (i % 2)}{'.' if i == 3 else ''}s{i:04d}{'.' if ext else ''}{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    assert assert_walks_agree(short, plain=True) == 180


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
    from tests.support.extras import require

    require("webdataset")
    import webdataset as wds

    with wds.ShardWriter(str(tmp_path / "shard-%d.tar"), maxcount=1000, verbose=0) as sink:
        for i in range(100):
            sink.write({"__key__": f"s{i:05d}", "cls": i, "json": {"a": i}, "txt": "x" * i})
    assert assert_walks_agree(tmp_path / "shard-0.tar", plain=True) == 300
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


def test_a_batch_of_shards_is_indexed_as_each_alone(tmp_path: Path) -> None:
    """``TarReader.scan_batch`` (one buffer, one array walk) gives each shard the index and content id
    its own scan gives: plain shards, PAX records, long and non-ASCII names, an empty sample key; it
    leaves to the shard's own scan one with a repeated key, one changed since it was listed, and a
    large one."""
    import webdataset as wds

    from lightning_sharding.readers import tar_headers
    from lightning_sharding.readers.storage import content_digest, list_files

    def write(name: str, names: list[str], fmt: int = tarfile.GNU_FORMAT) -> None:
        with tarfile.open(tmp_path / name, "w", format=fmt) as tar:
            for i, member in enumerate(names):
                data = os.urandom(i * 91 % 2000)
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    for k in range(5):
        write(f"a{k}-plain.tar", [f"s{k}{i:03d}.{ext}" for i in range(20) for ext in ("jpg", "cls")])
    write("b-long.tar", [f"{'d' * 120}/s{i}.txt" for i in range(6)])
    write("c-utf8.tar", [f"é{i}.txt" for i in range(6)], tarfile.PAX_FORMAT)
    write("d-again.tar", ["x.txt", "y.txt", "x.json"])
    write("e-nokey.tar", [".txt", "a.txt"])
    write("e-utf8-gnu.tar", [f"é{i}.txt" for i in range(4)])  # raw UTF-8 in the name field: left to the walk
    with wds.ShardWriter(str(tmp_path / "f-wds-%d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(30):
            sink.write({"__key__": f"w{i:03d}", "cls": i, "txt": "t" * i})
    files = list_files(str(tmp_path / "*.tar"))
    changed = next(f for f in files if f.url.endswith("a4-plain.tar"))
    with open(changed.url, "ab") as f:
        f.write(bytes(1024))  # grown since it was listed
    reader = TarReader(str(tmp_path / "*.tar"), cache_dir=tmp_path / "cache")
    got = dict(zip((f.url for f in files), reader.scan_batch(files), strict=False))
    for info in files:
        name = Path(info.url).name
        if name in ("d-again.tar", "a4-plain.tar"):
            assert got[info.url] is None, name
            continue
        idx, content = got[info.url]  # type: ignore[misc]
        alone, _ = reader.scan_content(info)
        assert content == content_digest(info.url, info.size), name
        assert idx.counts == alone.counts and idx.suffixes == alone.suffixes, name
        for key, array in alone.arrays[0].items():
            assert idx.arrays[0][key].tolist() == array.tolist(), (name, key)
    with pytest.raises(ValueError, match=r"key 'x' appears again at member 'x.json'"):
        reader.scan(next(f for f in files if f.url.endswith("d-again.tar")))
    big = files[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lightning_sharding.readers.tar.READ_WHOLE", big.size - 1)
        assert reader.scan_batch([big]) == [None]  # a large shard: walked alone, through a map
    assert tar_headers.plain_members((tmp_path / "b-long.tar").read_bytes()) is None


def test_only_a_pax_record_that_renames_or_resizes_a_member_turns_the_array_walk_away(tmp_path: Path) -> None:
    """The array walk looks for ``path=`` and ``size=`` in the PAX records alone: a member whose bytes
    say them (a text about tar) keeps its shard on the fast walk, a PAX path does not."""
    text = tmp_path / "text.tar"
    with tarfile.open(text, "w", format=tarfile.PAX_FORMAT) as tar:
        for i, body in enumerate([b"a 20 path=x/y\n record", b"12 size=99\n GNU.sparse"]):
            info = tarfile.TarInfo(f"s{i}.txt")
            info.size, info.mtime = len(body), 1.5  # a float time: a PAX record, as webdataset writes
            tar.addfile(info, io.BytesIO(body))
    assert assert_walks_agree(text, plain=True) == 2
    renamed = tmp_path / "renamed.tar"
    with tarfile.open(renamed, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("s0.txt")
        info.size, info.pax_headers = 2, {"path": "s0.txt"}
        tar.addfile(info, io.BytesIO(b"ok"))
    assert assert_walks_agree(renamed, plain=False) == 1
