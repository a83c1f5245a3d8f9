"""WindowedReader: window counts with and without a halo against the continuous series; bad items."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_sharding.strategies._shared_memory as shared_memory
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.readers.windows import NpyWindows, WindowedReader
from tests.support.data.windows import write_months

CTX = WorkerContext(data_rank=0, data_size=1, worker_id=0, num_workers=0, epoch=0, seed=0)


class InMemory(WindowedReader):
    """Months held in memory; step t of the continuous series holds t."""

    def __init__(self, lengths: list[int], window: int, stride: int, halo: bool) -> None:
        super().__init__(window, stride, halo)
        self.lengths = lengths
        self.first = np.concatenate(([0], np.cumsum(lengths)))

    def keys(self) -> list[str]:
        return [f"m{i}" for i in range(len(self.lengths))]

    def length(self, key: str) -> int:
        return self.lengths[int(key[1:])]

    def load(self, key: str, start: int, stop: int) -> np.ndarray:
        t0 = self.first[int(key[1:])]
        return np.arange(t0 + start, t0 + stop, dtype=np.int64)[:, None]


def windows_of(reader: WindowedReader) -> list[int]:
    """First steps of every window the reader serves, in manifest order, read for real."""
    starts = []
    for item in reader.items():
        got = reader.read_batch(item, np.arange(item.num_samples), CTX)
        for sample in got:
            window = sample["x"][:, 0]
            assert window.tolist() == list(range(sample["start"], sample["start"] + reader.window))
            starts.append(sample["start"])
    return starts


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    window=st.integers(1, 9),
    stride=st.integers(1, 4),
)
def test_with_a_halo_the_windows_are_exactly_those_of_the_continuous_series(lengths, window, stride) -> None:
    total = sum(lengths)
    if total < window:
        return
    reader = InMemory(lengths, window, stride, halo=True)
    starts = windows_of(reader)
    assert starts == list(range(0, total - window + 1, stride))
    assert sum(it.num_samples for it in reader.items()) == (total - window) // stride + 1
    ids = np.concatenate([reader.first_ids()[k] + np.arange(n) for k, n in enumerate(reader.window_counts())])
    assert ids.tolist() == list(range(len(starts)))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(9, 20), min_size=1, max_size=5), window=st.integers(1, 9), stride=st.integers(1, 4))
def test_without_a_halo_each_item_keeps_its_own_windows(lengths, window, stride) -> None:
    reader = InMemory(lengths, window, stride, halo=False)
    assert [it.num_samples for it in reader.items()] == [(n - window) // stride + 1 for n in lengths]
    starts = windows_of(reader)
    first = np.concatenate(([0], np.cumsum(lengths)))
    expected = [int(first[k]) + s for k, n in enumerate(lengths) for s in range(0, n - window + 1, stride)]
    assert starts == expected


def test_climate_months_lose_windows_at_boundaries_only_without_a_halo(tmp_path: Path) -> None:
    days = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    paths = write_months(tmp_path, [24 * d for d in days])  # hourly steps
    series = sum(days) * 24
    plain = sum(it.num_samples for it in NpyWindows(paths, window=48, stride=6).items())
    halo = sum(it.num_samples for it in NpyWindows(paths, window=48, stride=6, halo=True).items())
    assert halo == (series - 48) // 6 + 1 == 1453
    assert plain < halo


def test_a_window_longer_than_an_item_names_the_item(tmp_path: Path) -> None:
    paths = write_months(tmp_path, [10, 3, 10])
    with pytest.raises(ValueError, match=r"month-01\.npy.* 3 steps, fewer than the window of 4.*halo=True"):
        NpyWindows(paths, window=4).items()
    assert sum(it.num_samples for it in NpyWindows(paths, window=4, halo=True).items()) == 20


@pytest.mark.parametrize("change", ["shape"])  # dtype: tests/process/test_bad_input.py
def test_an_item_of_another_shape_or_dtype_names_the_item(tmp_path: Path, change: str) -> None:
    paths = write_months(tmp_path, [10, 10, 10])
    odd = np.zeros((10, 3), np.float32) if change == "shape" else np.zeros((10, 2), np.float64)
    np.save(paths[2], odd)
    with pytest.raises(ValueError, match=r"item '.*month-02\.npy' holds steps of shape .* first item '.*month-00"):
        NpyWindows(paths, window=4).items()


def test_an_unreadable_file_names_the_item(tmp_path: Path) -> None:
    paths = write_months(tmp_path, [10])
    Path(paths[0]).write_text("not an array")
    with pytest.raises(ValueError, match=r"month-00\.npy' is not a readable \.npy"):
        NpyWindows(paths, window=4).items()


def test_the_interleaved_layout_deals_batch_i_to_worker_i_mod_w() -> None:
    plan = plan_epoch(100, RangeSet(), epoch=0, world_size=2, num_workers=3, batch_size=7, worker_layout="interleaved")
    rank = plan.rank(1)
    assert [rank.worker_batches(w) for w in range(3)] == [range(0, 8, 3), range(1, 8, 3), range(2, 8, 3)]
    tasks = list(rank.tasks())
    assert [t.index for t in tasks] == list(range(8))
    assert [t.worker for t in tasks] == [i % 3 for i in range(8)]
    with pytest.raises(ValueError, match="worker_layout='diagonal'"):
        plan_epoch(10, RangeSet(), epoch=0, world_size=1, num_workers=1, batch_size=2, worker_layout="diagonal")  # type: ignore[arg-type]


def test_the_sweep_removes_shared_memory_files_of_dead_owners_only(tmp_path: Path) -> None:
    dead = shared_memory.SHM_DIR / f"{shared_memory.PREFIX}test-999999999.1-r0-g0-n0-i0"
    live = shared_memory.SHM_DIR / f"{shared_memory.PREFIX}test-{shared_memory.process_token()}-r0-g0-n0-i0"
    reused = shared_memory.SHM_DIR / f"{shared_memory.PREFIX}test-{os.getpid()}.1-r0-g0-n0-i0"  # same pid, other start
    for path in (dead, live, reused):
        path.write_bytes(b"x")
    try:
        removed = shared_memory.sweep_dead()
        assert dead.name in removed and reused.name in removed
        assert live.exists() and not dead.exists() and not reused.exists()
    finally:
        for path in (dead, live, reused):
            path.unlink(missing_ok=True)


def test_a_shared_array_is_a_read_only_zero_copy_view() -> None:
    name = f"{shared_memory.PREFIX}test-{shared_memory.process_token()}-r0-g0-n0-i7"
    data = np.arange(24, dtype=np.float32).reshape(6, 4)
    info = shared_memory.write_shared_array(name, [data[:4], data[4:]], data.shape, data.dtype)
    try:
        view = shared_memory.open_shared_array(info)
        assert np.array_equal(view, data) and not view.flags.writeable and not view.flags.owndata
        with pytest.raises(ValueError):
            view[0, 0] = 1
    finally:
        shared_memory.unlink(name)
    assert not info.path.exists()


def test_months_are_known_by_name_and_bytes_so_a_copy_or_touch_is_the_same_data(tmp_path: Path) -> None:
    """NpyWindows names each month under the folder the months share and ids its bytes: a copy
    elsewhere with new times has the same fingerprint; a rewritten month is named by the table."""
    from lightning_sharding.core.identity import item_changes, item_table
    from lightning_sharding.core.manifest import Manifest

    paths = write_months(tmp_path / "a", [12, 9, 11])
    items = NpyWindows(paths, window=4, halo=True).items()
    assert [it.name for it in items] == ["month-00.npy", "month-01.npy", "month-02.npy"]
    assert all(it.content.startswith(f"size={os.path.getsize(p)};digest=") for it, p in zip(items, paths, strict=True))
    copied = write_months(tmp_path / "b" / "c", [12, 9, 11])
    os.utime(copied[1], (2_000_000_000, 2_000_000_000))
    moved = NpyWindows(copied, window=4, halo=True).items()
    assert Manifest(moved).fingerprint == Manifest(items).fingerprint
    assert Manifest(moved).root == f"{tmp_path}/b/c/" and Manifest(items).root == f"{tmp_path}/a/"
    assert Manifest(NpyWindows(copied, window=4).items()).fingerprint != Manifest(items).fingerprint  # no halo
    array = np.load(copied[2])
    array[3, 0] += 1.0
    np.save(copied[2], array)
    changed = NpyWindows(copied, window=4, halo=True).items()
    assert item_changes(item_table(items), changed) == [
        "'month-02.npy' changed: same size, other content (its digest differs)"
    ]
