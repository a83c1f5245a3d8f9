"""What the package writes on a shared node is its owner's only, whatever the umask.

Under a permissive umask (0000), a strict one (0077) and one that would leave files unwritable
(0277), every file the package creates is 0600 and every directory it creates 0700: the shared
arrays of ``broadcast`` and the batch slots of the pool (``shard``) in ``/dev/shm`` (seen while real DataLoader
workers serve batches), the index and listing cache, the shard cache with its lock files, and the
audit trail. A cache shared on purpose gets the mode it asks for. The sweeps of dead runs' files
leave another user's files alone.
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_sharding import ShardedData, SyntheticReader, TarReader
from lightning_sharding.core.private import make_dirs
from lightning_sharding.loading.audit import AuditWriter
from lightning_sharding.readers import NpyWindows
from lightning_sharding.readers.cache import ShardCache
from lightning_sharding.strategies import _shared_memory as shared_memory
from lightning_sharding.strategies import get_strategy
from tests.support.data.windows import write_months

OTHER_UID = 65534  # nobody


@pytest.fixture(params=[0o000, 0o077, 0o277], ids=["umask0000", "umask0077", "umask0277"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def modes_under(root: Path) -> dict[str, int]:
    """Every file and directory below ``root`` (itself excluded), with its permission bits."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in sorted(root.rglob("*"))}


def assert_private(modes: dict[str, int], root: Path) -> None:
    assert modes, "nothing was written"
    wrong = {
        name: oct(mode)
        for name, mode in modes.items()
        if mode != (0o700 if (root / name).is_dir() else 0o600) and not name.startswith("/dev/shm")
    }
    assert not wrong, f"not owner-only under {root}: {wrong}"


def own_shm_files() -> dict[str, int]:
    """This process's (and its workers') files in /dev/shm, with their modes: those named with its
    token (a pool's slots carry their owner's, the process that made the pool). Another test's run at
    the same time has its own token: its files are not this test's."""
    token = shared_memory.process_token()
    found = {}
    for path in shared_memory.SHM_DIR.glob(f"{shared_memory.PREFIX}*"):
        try:
            if path.stat().st_uid == os.getuid() and token is not None and token in path.name:
                found[path.name] = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            continue
    return found


def test_make_dirs_gives_the_directories_it_makes_the_mode_and_leaves_the_others(umask: int, tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    make_dirs(tmp_path / "a" / "b" / "c")
    assert modes_under(tmp_path) == {"a": 0o700, "a/b": 0o700, "a/b/c": 0o700}
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755, "a directory the user gave keeps its mode"


def test_broadcast_shared_arrays_and_pool_slots_are_the_owners_only_while_workers_serve(
    umask: int, tmp_path: Path
) -> None:
    months = write_months(tmp_path / "months", [12, 12])
    for strategy, reader in (
        ("broadcast", NpyWindows(months, window=4)),
        ("shard", SyntheticReader(sizes=[20, 20])),
    ):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        data = ShardedData(
            reader,
            optimizer=optimizer,
            sharding=get_strategy(strategy, transport="pool"),
            batch_size=4,
            num_workers=1,
            seed=0,
        )
        seen: dict[str, int] = {}
        for _ in data.train_loader(0):
            seen.update(own_shm_files())
        data.close()
        kinds = {"-s" if "-w" in name else "array" for name in seen}
        assert kinds == ({"array"} if strategy == "broadcast" else {"-s"}), f"{strategy}: {sorted(seen)}"
        wrong = {name: oct(mode) for name, mode in seen.items() if mode != 0o600}
        assert not wrong, f"{strategy}: /dev/shm files readable by others under umask {oct(umask)}: {wrong}"


def test_the_index_listing_and_shard_caches_and_the_audit_trail_are_the_owners_only(umask: int, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with tarfile.open(data / "shard-0.tar", "w") as tar:
        for i in range(3):
            info = tarfile.TarInfo(f"s{i}.txt")
            info.size = 1
            tar.addfile(info, fileobj=__import__("io").BytesIO(b"x"))
    cache = tmp_path / "cache"
    reader = TarReader(str(data / "*.tar"), cache_dir=cache)
    assert sum(item.num_samples for item in reader.items()) == 3
    shards = ShardCache(cache / "shards", limit=4)  # 4 bytes: the second copy puts it over budget

    def fetch(part: str) -> None:
        with open(part, "wb") as f:  # as fsspec's get_file writes: into the file we made
            f.write(b"abc")

    for url in ("s3://bucket/one", "s3://bucket/two"):
        with shards.open(url, "v1", 3, fetch) as local:
            assert local is not None and Path(local).read_bytes() == b"abc"
    audit = AuditWriter(tmp_path / "audit" / "runs", "run-1", 0, {"started": 0.0})
    audit.close()
    modes = modes_under(cache)
    assert any(name.startswith("index/") for name in modes) and any(".lock" in name for name in modes), modes
    assert_private(modes, cache)
    assert_private(modes_under(tmp_path / "audit"), tmp_path / "audit")


def test_a_cache_shared_on_purpose_gets_the_mode_it_asks_for(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        reader = TarReader(str(tmp_path / "none-*.tar"), cache_dir=tmp_path / "cache", cache_mode=0o660)
        with pytest.raises(FileNotFoundError):
            reader.items()
        shards = ShardCache(tmp_path / "cache" / "shards", limit=100, mode=0o660)
        with shards.open("s3://b/k", "v", 1, lambda part: Path(part).write_bytes(b"x")):
            pass
    finally:
        os.umask(old)
    modes = modes_under(tmp_path / "cache")
    assert modes["shards"] == 0o2770 and all(m == 0o660 for n, m in modes.items() if n != "shards"), modes
    for bad in (0o644 & ~0o200, 0o1600, "0o640", True):
        with pytest.raises(ValueError, match=r"cache_mode=.*must be a file mode from 0o600"):
            TarReader(str(tmp_path / "x.tar"), cache_mode=bad)  # type: ignore[arg-type]


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root (CI runs as root)")
def test_the_sweeps_of_dead_runs_leave_another_users_files_alone(tmp_path: Path) -> None:
    dead = f"{shared_memory.PREFIX}test-999999.1-r0-g0"  # a pid that is not running: a dead run
    theirs, mine = shared_memory.SHM_DIR / f"{dead}-theirs", shared_memory.SHM_DIR / f"{dead}-mine"
    try:
        for path in (theirs, mine):
            path.write_bytes(b"x")
        os.chown(theirs, OTHER_UID, OTHER_UID)
        removed = shared_memory.sweep_dead()
        # Swept by this sweep, or by one a concurrent test process ran first (every fit sweeps dead runs).
        assert not mine.exists(), "this user's dead file is swept"
        assert theirs.exists() and theirs.name not in removed, "another user's file is left alone"
    finally:
        theirs.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)
    shards = ShardCache(tmp_path / "shards", limit=100)
    part = tmp_path / "shards" / ".abc-k.part-otherhost-1234-abcdef"
    part.write_bytes(b"partial")
    os.chown(part, OTHER_UID, OTHER_UID)
    own = tmp_path / "shards" / ".abd-k.part-otherhost-1234-abcdef"
    own.write_bytes(b"partial")
    shards.sweep()
    assert part.exists(), "another user's partial download in a shared cache is left alone"
    assert not own.exists(), "this user's dead partial download is swept"
    np.testing.assert_equal(sorted(p.name for p in (tmp_path / "shards").iterdir() if ".part-" in p.name), [part.name])


def test_urls_are_shown_without_their_credentials_and_errors_are_scrubbed() -> None:
    from lightning_sharding.core.private import hide_credentials, redact_url, scrub

    assert redact_url("https://alice:pw-4711@host/x.tar?sig=abc%2Bdef&v=2") == (
        "https://alice:REDACTED@host/x.tar?sig=REDACTED&v=2"
    )
    assert redact_url("https://h/x?id=7&X-Amz-Credential=AKIA%2F2026&t=" + "z" * 16) == (
        "https://h/x?id=7&X-Amz-Credential=REDACTED&t=REDACTED"
    ), "a credential's name, or a long value"
    for plain in ("s3://bucket/train/*.tar", "/data/x.npy", "abfss://container@account.dfs.core.windows.net/a.tar"):
        assert redact_url(plain) == plain, "nothing to hide: the user's spelling is kept"
    assert redact_url("simplecache::https://h/x.tar?token=t0ken123") == "simplecache::https://h/x.tar?token=REDACTED"
    shown, hidden = hide_credentials(["https://h/a.tar?X-Amz-Signature=s3cr3tvalue", "s3://b/c.tar"])
    assert shown == ["https://h/a.tar?X-Amz-Signature=REDACTED", "s3://b/c.tar"]
    assert hidden == {shown[0]: "https://h/a.tar?X-Amz-Signature=s3cr3tvalue"}
    message = "404 for url='https://h/a.tar?X-Amz-Signature=s3cr3tvalue' (signature s3cr3tvalue)"
    assert scrub(message, hidden) == f"404 for url='{shown[0]}' (signature REDACTED)"
    sas = "https://h/a.tar?sv=2022&sig=Zm9v%2Fb2FyYmF6cXV4%2Bc3Q%3D"  # yarl prints %2F back as "/"
    assert scrub(f"403, url='{sas.replace('%2F', '/')}'", hide_credentials([sas])[1]) == (
        "403, url='https://h/a.tar?sv=2022&sig=REDACTED'"
    )
    with pytest.raises(ValueError, match=r"two data URLs differ only in their credentials"):
        hide_credentials(["https://h/get?id=1&sig=AAAA", "https://h/get?id=1&sig=BBBB"])
    with pytest.raises(ValueError, match=r"a glob cannot carry credentials"):
        TarReader("ftp://user:pw123@host/d/*.tar")
    reader = TarReader(["https://h/a.tar?X-Amz-Signature=s3cr3tvalue"])
    assert reader.urls == [shown[0]] and "s3cr3tvalue" not in repr(reader.urls)
    try:
        try:
            raise FileNotFoundError(message)
        except FileNotFoundError as inner:
            raise OSError("reading failed") from inner
    except OSError as outer:
        raised, clean = outer, reader.scrubbed(outer)
    assert clean is not raised and clean.__cause__ is None and "s3cr3tvalue" not in str(clean)
    harmless = ValueError("no secret here")
    assert reader.scrubbed(harmless) is harmless


def test_a_mixture_or_packing_of_a_reader_with_credentials_scrubs_its_errors_too() -> None:
    from lightning_sharding.mixture import MixtureReader, Stream

    real = "https://h/a.tar?X-Amz-Signature=s3cr3tvalue"
    mixture = MixtureReader([Stream("signed", TarReader([real]), weight=1.0)], samples_per_epoch=10)
    err = OSError(2, "No such file", real)  # the URL in the str only, not the repr
    clean = mixture.scrubbed(err)
    assert clean is not err and "s3cr3tvalue" not in f"{clean} {clean!r}"
