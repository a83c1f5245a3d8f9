"""A first start over many small local shards does each piece of its work once: the listing's
files' JSON once, the listing index's place once (workers find it where the listing wrote it), a
suffix glob without a regular expression per name (docs/performance.md, the first batch)."""

from __future__ import annotations

import fnmatch
import gc
import os
from pathlib import Path

import fsspec
import pytest

from lightning_sharding.loading.engine import older_objects_frozen
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


class _RecordingReader(TarReader):
    """A TarReader that records what its listing sees: the collector's frozen objects in ``items``,
    and the threads it indexes with."""

    frozen: list[int] = []
    threads: list[int] = []

    def items(self):  # type: ignore[no-untyped-def]
        _RecordingReader.frozen.append(gc.get_freeze_count())
        return super().items()

    def indexing_threads(self, files, ranks_here=1):  # type: ignore[no-untyped-def]
        _RecordingReader.threads.append(super().indexing_threads(files, ranks_here))
        return _RecordingReader.threads[-1]


def test_setup_freezes_the_objects_made_before_it_and_leaves_the_collector_as_it_was(tmp_path: Path) -> None:
    """A setup's collections skip the objects that were there before it (gc.freeze, undone after):
    seen from inside a real setup's listing. A collector that is off, or objects the user froze, are
    left as they are."""
    from lightning_sharding import ShardedDataModule

    write_regression(str(tmp_path / "data"), "tar", [5, 3, 7])
    _RecordingReader.frozen = []
    reader = _RecordingReader(str(tmp_path / "data" / "*.tar"), cache_dir=tmp_path / "cache")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    ShardedDataModule(reader, batch_size=2, num_workers=0, seed=0).setup("fit")
    assert _RecordingReader.frozen[0] > 10_000, "the objects made before the setup were not frozen in it"
    assert gc.isenabled() and gc.get_freeze_count() == 0, "the setup left objects frozen"

    with older_objects_frozen():
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the user's, before the setup
    try:
        theirs = gc.get_freeze_count()
        with older_objects_frozen():
            assert gc.get_freeze_count() == theirs
        assert gc.get_freeze_count() == theirs, "the user's frozen objects were unfrozen"
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with older_objects_frozen():
            assert gc.get_freeze_count() == 0 and not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_indexing_leaves_a_core_to_the_forkservers_imports_until_it_has_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While this process's forkserver imports (it started none of the workers yet), a setup indexes
    local files with one thread fewer than the rank's cores (at least one); once it has served, and
    without one, with a thread per core. Real setups; only the server's pid is given."""
    from multiprocessing import forkserver

    from lightning_sharding import ShardedDataModule
    from lightning_sharding.strategies import _start

    write_regression(str(tmp_path / "data"), "tar", [5, 3, 7])
    cores = len(os.sched_getaffinity(0))

    def threads_of_a_first_start(name: str) -> int:
        _RecordingReader.threads = []
        reader = _RecordingReader(str(tmp_path / "data" / "*.tar"), cache_dir=tmp_path / name)
        ShardedDataModule(reader, batch_size=2, num_workers=0, seed=0).setup("fit")
        assert len(_RecordingReader.threads) == 1, _RecordingReader.threads
        return _RecordingReader.threads[0]

    monkeypatch.setattr(_start, "_served", None)
    monkeypatch.setattr(_start, "_importing", None)
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", 4242)
    assert threads_of_a_first_start("none") == min(cores, 3), "no server started by this process: a core each"
    monkeypatch.setattr(_start, "_importing", 4242)  # as _start_forkserver notes a server it started
    assert _start.forkserver_importing()
    assert threads_of_a_first_start("importing") == min(max(1, cores - 1), 3)
    _start.note_started("forkserver")
    assert not _start.forkserver_importing()
    assert threads_of_a_first_start("served") == min(cores, 3)


def test_a_forkservers_preload_list_keeps_what_was_asked_between_the_collectors_pause_and_resume() -> None:
    from lightning_sharding.strategies._start import framed_preload

    first = framed_preload(["mine"], ["torch", "mine", "lightning_sharding.strategies._worker"])
    assert first == [
        "lightning_sharding.preload.pause",
        "mine",
        "torch",
        "lightning_sharding.strategies._worker",
        "lightning_sharding.preload.resume",
    ]
    # A new server of the same process is asked the previous list again, with a module more.
    assert framed_preload(first, ["torch", "s3fs"]) == [*first[:-1], "s3fs", first[-1]]


def test_only_a_forkserver_this_process_started_counts_as_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that ran before the loader asked for one (the user's, or a previous loader's in a
    forked rank) imported before: nothing waits for it. One that the loader started imports until it
    serves a helper process. Only ensure_running's effect on the server's pid is given here."""
    from multiprocessing import forkserver

    from lightning_sharding.strategies import _start

    server = forkserver._forkserver
    monkeypatch.setattr(server, "_preload_modules", [])
    monkeypatch.setattr(server, "_forkserver_pid", 4242)
    monkeypatch.setattr(_start, "_started_by", None)
    monkeypatch.setattr(_start, "_served", None)
    monkeypatch.setattr(_start, "_importing", None)
    monkeypatch.setattr(forkserver, "ensure_running", lambda: None)  # running already: nothing to start
    _start._start_forkserver(["json"])
    assert not _start.forkserver_importing()
    monkeypatch.setattr(_start, "_started_by", None)
    monkeypatch.setattr(forkserver, "ensure_running", lambda: setattr(server, "_forkserver_pid", 4343))
    _start._start_forkserver(["json"])
    assert _start.forkserver_importing()
    _start.note_started("forkserver")
    assert not _start.forkserver_importing()
