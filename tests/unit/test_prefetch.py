"""What a worker fetches ahead (``files_ahead``): the files of its batch, then the next files of its
plan, at most ``prefetch_files`` of them and, with ``prefetch_bytes``, only while they fit; and the
errors for bad prefetch arguments, each naming the argument; and what asking for a file already
cached costs. Fetching ahead from a real bucket is in tests/process/test_shard_cache.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding.core.manifest import Item
from lightning_sharding.readers import NpyReader, TarReader
from lightning_sharding.readers.cache import ShardCache
from lightning_sharding.readers.prefetch import check_prefetch, files_ahead
from lightning_sharding.recipes.synthetic_files import write_regression

SIZES = {"a": 100, "b": 300, "c": 200, "d": 50, "e": 400}


def item(file: str, group: int = 0) -> Item:
    return Item(f"{file}#rg={group}", 10, f"size={SIZES[file]};tag=x")


def file_of(i: Item) -> str:
    return i.key.split("#")[0]


def size_of(i: Item) -> int:
    return SIZES[file_of(i)]


def keys(items: list[Item]) -> list[str]:
    return [i.key for i in items]


def test_the_batch_files_come_first_then_the_next_files_of_the_plan_one_item_each() -> None:
    now = [item("a", 0), item("a", 1), item("b", 0)]
    upcoming = [item("b", 1), item("c", 0), item("c", 1), item("d", 0), item("e", 0)]
    assert keys(files_ahead(now, upcoming, file_of, size_of, files=2)) == ["a#rg=1", "b#rg=0", "c#rg=0", "d#rg=0"]
    assert keys(files_ahead(now, upcoming, file_of, size_of, files=9)) == [
        "a#rg=1",
        "b#rg=0",
        "c#rg=0",
        "d#rg=0",
        "e#rg=0",
    ]
    assert keys(files_ahead([], upcoming, file_of, size_of, files=1)) == ["b#rg=1"]


@pytest.mark.parametrize(
    ("max_bytes", "ahead"),
    [(None, ["c", "d", "e"]), (650, ["c", "d", "e"]), (649, ["c", "d"]), (250, ["c", "d"]), (249, ["c"]), (199, [])],
)
def test_prefetch_bytes_stops_at_the_first_next_file_that_does_not_fit(max_bytes: int | None, ahead: list[str]) -> None:
    """The batch's files are read now whatever their size; the cap is on the files ahead, in plan
    order, and a file that does not fit ends the list (a later, smaller one is not taken before it)."""
    now, upcoming = [item("b")], [item("c"), item("d"), item("e"), item("a")]
    wanted = files_ahead(now, upcoming, file_of, size_of, files=3, max_bytes=max_bytes)
    assert [file_of(i) for i in wanted] == ["b", *ahead]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefetch_files": -1}, r"NpyReader\(prefetch_files=-1\)` must be an int >= 0"),
        ({"prefetch_files": 1.5}, r"NpyReader\(prefetch_files=1.5\)` must be an int >= 0"),
        (
            {"prefetch_files": 2, "cache_limit": None},
            r"prefetch_files=2\)` fetches into the local shard cache: set cache_limit=",
        ),
        ({"prefetch_files": 2, "prefetch_bytes": 0}, r"NpyReader\(prefetch_bytes=0\)` must be a number of bytes >= 1"),
        ({"prefetch_files": 2, "prefetch_bytes": 1e9}, r"prefetch_bytes=1000000000.0\)` must be a number of bytes"),
        (
            {"prefetch_bytes": 2**30},
            r"prefetch_bytes=1073741824\)` caps what prefetch_files= fetches ahead: set prefetch_files=",
        ),
    ],
)
def test_bad_prefetch_arguments_are_named(kwargs: dict[str, object], message: str) -> None:
    options = {"cache_limit": 10**9, **kwargs}
    with pytest.raises(ValueError, match=message):
        NpyReader("data/*.npy", **options)  # type: ignore[arg-type]


def test_numpy_integers_are_taken() -> None:
    assert check_prefetch("R", 10**9, np.int64(2), np.int64(2**20)) == (2, 2**20)
    assert check_prefetch("R", None, 0, None) == (0, None)


def test_asking_ahead_for_a_file_already_cached_costs_a_touch_not_a_locked_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker asks at every batch for its current and next files, most of them cached by then.
    write_regression("memory://prefetch-touch/d", "tar", [10, 10])
    reader = TarReader("memory://prefetch-touch/d/*.tar", cache_dir=tmp_path, cache_limit=10**9, prefetch_files=1)
    first, second = reader.items()
    reader.read_batch(first, np.arange(3), None)  # the worker's read fetches the first file
    (copy,) = [p for p in (tmp_path / "shards").iterdir() if not p.name.startswith(".")]
    os.utime(copy, (1, 1))
    opened: list[str] = []
    real_open = ShardCache.open

    def counting_open(cache: ShardCache, url: str, *args: Any) -> Any:
        opened.append(url)
        return real_open(cache, url, *args)

    monkeypatch.setattr(ShardCache, "open", counting_open)
    reader._have_copy(first)
    assert opened == [], "a cached copy was opened and read-locked to learn that it is there"
    assert copy.stat().st_mtime > 1, "the copy asked for stays the most recently used"
    reader._have_copy(second)  # not there yet: fetched under the cache's lock
    assert opened == [reader.split_key(second)[0]]
    assert len([p for p in (tmp_path / "shards").iterdir() if not p.name.startswith(".")]) == 2
