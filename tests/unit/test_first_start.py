"""A first start over many small local shards does each piece of its work once: the listing's
files' JSON once, the listing index's place once (workers find it where the listing wrote it), a
suffix glob without a regular expression per name (docs/performance.md, the first batch)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import fsspec
import pytest

from lightning_sharding.readers import TarReader
from lightning_sharding.readers.storage import _local_glob
from lightning_sharding.recipes.synthetic_files import write_regression


def test_workers_find_the_listing_index_where_the_listing_wrote_it(tmp_path: Path) -> None:
    write_regression(str(tmp_path / "data"), "tar", [5, 3, 7])
    urls = str(tmp_path / "data" / "*.tar")
    for start in ("first", "again"):  # indexed now, then from the cached listing
        reader = TarReader(urls, cache_dir=tmp_path / "cache")
        items = reader.items()
        kept = reader._listing_index
        assert kept is not None and Path(kept[0]).is_dir(), start
        reader._attach_listing(items)  # as from another rank's items: computed from the items alone
        assert reader._listing_index == kept, start
        assert [reader.file_index(it).counts for it in items] == [[5], [3], [7]]


@pytest.mark.parametrize("pattern", ["*.tar", "*", "part-*.tar", "*.t?r", "*[0-9].tar"])
def test_a_local_glob_matches_what_fnmatch_matches(tmp_path: Path, pattern: str) -> None:
    names = ["part-1.tar", ".hidden.tar", "part-2.tar.bak", "x.tgz", "tar", "a.tar"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    found = _local_glob(fsspec.filesystem("file"), f"{tmp_path}/{pattern}")
    assert found is not None
    assert sorted(Path(p).name for p in found) == sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))


def test_workers_wait_on_imports_when_spawned_or_a_forkserver_has_not_served_yet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loader fetches the workers' first batches ahead only for workers that wait on imports
    (FileReader.first_reads): spawned ones always, a forkserver's until it started workers for this
    process, forked ones never. Only the server's pid is given here; the bookkeeping is the code's."""
    from multiprocessing import forkserver

    from lightning_sharding.strategies import _start

    server = forkserver._forkserver
    monkeypatch.setattr(_start, "_served", None)
    monkeypatch.setattr(server, "_forkserver_pid", 4242)
    assert _start.slow_to_start("spawn") and not _start.slow_to_start("fork")
    assert _start.slow_to_start("forkserver"), "a server that started nothing yet is importing"
    _start.note_started("forkserver")
    assert not _start.slow_to_start("forkserver"), "its preload is done once it started workers"
    assert _start.slow_to_start("spawn")
    monkeypatch.setattr(server, "_forkserver_pid", 4343)  # a new server (a new job in this process)
    assert _start.slow_to_start("forkserver")
    monkeypatch.setattr(server, "_forkserver_pid", None)  # none started yet
    assert _start.slow_to_start("forkserver")
