"""The bad-input matrix: every reader and strategy, every kind of bad input, one parametrised test.

Readers: the four file formats and the synthetic reader under ``shard``, climate months
(``NpyWindows``) under ``broadcast``, a SQLite table under ``dispatch``. Cases: a missing file,
truncated or corrupt content, an empty item (or sample), the wrong dtype or shape, a checkpoint of
other data, an unknown or unsuitable strategy, a zero or negative size, and more ranks than items
under ``broadcast``. Each must fail with an error naming what is at fault. Where the fault is in
single samples (shard only), ``on_error="skip"`` must skip exactly those, count and report them,
and serve every other sample once; the other strategies refuse ``on_error="skip"`` by name.

Everything runs a real Trainer in this process; the corrupt tar shard is read by spawned workers.
"""

from __future__ import annotations

import io
import itertools
import json
import re
import sqlite3
import tarfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding import CheckpointMismatchError, SampleError, ShardedDataModule, ShardingCallback
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import World
from lightning_sharding.readers import FILE_READERS, NpyReader, SyntheticReader, TarReader
from lightning_sharding.readers.sources import SqliteSource
from lightning_sharding.readers.storage import RetryPolicy
from lightning_sharding.recipes.synthetic_files import FORMATS, to_regression, write_regression
from lightning_sharding.strategies.broadcast import BroadcastLoader, BroadcastStrategy
from lightning_sharding.strategies.options import LoaderOptions
from tests.jobs.parts import RecordingModel
from tests.support.data.sources import ROTATING_QUERY, make_db, row_to_sample
from tests.support.data.windows import MonthWindows, write_months
from tests.support.harness import cpu_trainer

SIZES = (12, 10, 14)  # samples per file (file readers, synthetic)
MONTHS = (9, 11, 10)  # steps per month (broadcast, window 4)
ROWS = 41  # rows of the SQLite table (dispatch)
STRATEGY = {"windows": "broadcast", "sqlite": "dispatch"}  # every other reader: "shard"
_runs = itertools.count()


def total_of(reader: str) -> int:
    return {"windows": sum(m - 3 for m in MONTHS), "sqlite": ROWS}.get(reader, sum(SIZES))


def good(reader: str, d: Path, sizes: tuple[int, ...] = SIZES, months: tuple[int, ...] = MONTHS) -> dict[str, Any]:
    """Write a good data set for ``reader`` into ``d``; returns the ShardedDataModule arguments."""
    d.mkdir(parents=True, exist_ok=True)
    if reader in FORMATS:
        write_regression(str(d), reader, sizes, row_group_size=8)
        return {"reader": FILE_READERS[reader](f"{d}/part-*", cache_dir=d / "cache"), "transform": to_regression}
    if reader == "synthetic":
        return {"reader": SyntheticReader(sizes=sizes)}
    if reader == "windows":
        return {"reader": MonthWindows(write_months(d, months), window=4), "sharding": "broadcast"}
    db = d / "samples.db"
    if not db.exists():
        make_db(db, ROWS)
    return {"source": SqliteSource(db, ROTATING_QUERY), "sharding": "dispatch", "transform": row_to_sample}


@dataclass
class Result:
    """What a fit trained on: per-step records, the epoch reports and the logged metrics."""

    records: list[dict[str, Any]]
    reports: list[dict[str, Any]]
    metrics: dict[str, float]


def fit(
    d: Path,
    data: dict[str, Any],
    *,
    on_error: str = "raise",
    num_workers: int = 0,
    max_steps: int = -1,
    ckpt_path: Path | None = None,
    save_to: Path | None = None,
    **options: Any,
) -> Result:
    """Train one epoch on ``data`` with a real Trainer in this process."""
    defaults = {"batch_size": 4, "seed": 3}
    dm = ShardedDataModule(**data, on_error=on_error, num_workers=num_workers, **{**defaults, **options})  # type: ignore[arg-type]
    log = d / f"seen-{next(_runs)}"
    trainer = cpu_trainer(max_steps=max_steps)
    trainer.fit(RecordingModel(str(log)), datamodule=dm, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    path = Path(f"{log}-rank0.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    sharding = next(cb for cb in trainer.callbacks if isinstance(cb, ShardingCallback))  # type: ignore[attr-defined]
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return Result(records, sharding.summary(), metrics)


# -- ways to break the data -----------------------------------------------------------------------


def rewrite_tar_member(url: str, name: str, data: bytes) -> None:
    """Rebuild the tar shard ``url`` with member ``name`` holding ``data`` (a valid tar, bad content)."""
    with tarfile.open(url) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(url, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, content in members:
            content = data if member.name == name else content
            member.size = len(content)
            tar.addfile(member, io.BytesIO(content))


def npy_bytes(array: np.ndarray[Any, Any]) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def replace_jsonl_line(url: Path, sample: int, text: str) -> None:
    lines = url.read_text().splitlines()
    lines[sample] = text
    url.write_text("\n".join(lines) + "\n")


def parquet_with_a_short_row(url: Path, row: int) -> None:
    """Rewrite ``url`` with ``x`` as a variable-length list column whose row ``row`` has 7 values, not 8."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(url)
    xs = table.column("x").to_pylist()
    xs[row] = xs[row][:7]
    table = table.set_column(table.schema.get_field_index("x"), "x", pa.array(xs, type=pa.list_(pa.float32())))
    pq.write_table(table, url, row_group_size=8)


def sqlite_table(path: Path, ids: list[Any]) -> Path:
    """A ``samples`` table with these ids (no type constraint, so a bad value can get in)."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE samples (id, payload TEXT)")
    con.executemany("INSERT INTO samples VALUES (?, ?)", [(i, f"row-{i}") for i in ids])
    con.commit()
    con.close()
    return path


def missing(reader: str, d: Path, on_error: str) -> Result:
    data = good(reader, d)
    if reader in FORMATS:
        data["reader"] = FILE_READERS[reader]([f"{d}/part-00000.{reader}", f"{d}/part-00009.{reader}"], cache_dir=d)
    elif reader == "windows":
        data["reader"] = MonthWindows([*data["reader"].paths, str(d / "month-09.npy")], window=4)
    else:
        data["source"] = SqliteSource(d / "missing.db", ROTATING_QUERY)
    return fit(d, data, on_error=on_error)


def nothing_matches(reader: str, d: Path, on_error: str) -> Result:
    data = good(reader, d)
    data["reader"] = FILE_READERS[reader](f"{d}/train-*.{reader}", cache_dir=d)
    return fit(d, data, on_error=on_error)


def corrupt(reader: str, d: Path, on_error: str) -> Result:
    data = good(reader, d)
    workers = 0
    if reader == "tar":  # the headers stay valid, sample 11's array is garbage
        rewrite_tar_member(f"{d}/part-00000.tar", "sample00000011.x.npy", b"\x93NUMPY garbage")
        workers = 2 if on_error == "skip" else 1  # the error crosses the worker boundary intact
    elif reader == "jsonl":
        replace_jsonl_line(d / "part-00000.jsonl", 5, '{"id": 5, "x": [0.1, 0.2')
    elif reader in ("parquet", "npy"):
        (d / f"part-00001.{reader}").write_bytes((d / f"part-00001.{reader}").read_bytes()[:-50])
    elif reader == "windows":
        (d / "month-01.npy").write_bytes((d / "month-01.npy").read_bytes()[:-20])
    else:
        (d / "samples.db").write_bytes(b"this is not a SQLite database" * 100)
    return fit(d, data, on_error=on_error, num_workers=workers)


def empty(reader: str, d: Path, on_error: str) -> Result:
    data = good(reader, d)
    if reader in ("tar", "parquet", "npy"):  # a zero-byte file among good ones
        (d / f"part-00001.{reader}").write_bytes(b"")
    elif reader == "jsonl":  # an empty sample: a line holding {}
        replace_jsonl_line(d / "part-00000.jsonl", 7, "{}")
    elif reader == "synthetic":
        data = good(reader, d, sizes=(0, 0))
    elif reader == "windows":
        data = good(reader, d, months=(9, 0, 10))
    else:
        data["source"] = SqliteSource(sqlite_table(d / "empty.db", []), ROTATING_QUERY)
    return fit(d, data, on_error=on_error)


def wrong_shape(reader: str, d: Path, on_error: str) -> Result:
    data = good(reader, d)
    workers = 0
    if reader == "tar":  # sample 11's x has 7 values, the others 8
        x = np.zeros(7, dtype=np.float32)
        rewrite_tar_member(f"{d}/part-00000.tar", "sample00000011.x.npy", npy_bytes(x))
    elif reader == "jsonl":
        replace_jsonl_line(d / "part-00000.jsonl", 7, json.dumps({"id": 7, "x": [0.0] * 7, "y": 0.0}))
    elif reader == "parquet":
        parquet_with_a_short_row(d / "part-00000.parquet", 7)
    elif reader == "npy":  # a file of float64 rows among float32 ones
        np.save(d / "part-00001.npy", np.load(d / "part-00001.npy").astype(np.float64))
    elif reader == "windows":
        np.save(d / "month-02.npy", np.load(d / "month-02.npy").astype(np.float64))
    else:  # a text id where the transform expects an integer
        data["source"] = SqliteSource(sqlite_table(d / "odd.db", [*range(7), "abc", *range(8, 20)]), ROTATING_QUERY)
    return fit(d, data, on_error=on_error, num_workers=workers)


def other_data(reader: str, d: Path, on_error: str) -> Result:
    """Checkpoint two steps on the data, then grow the data and resume from the checkpoint."""
    ckpt = d / "two-steps.ckpt"
    fit(d, good(reader, d), max_steps=2, save_to=ckpt)
    if reader == "sqlite":
        con = sqlite3.connect(d / "samples.db")
        con.execute("INSERT INTO samples VALUES (?, ?)", (ROWS, "late row"))
        con.commit()
        con.close()
    grown = good(reader, d, sizes=(*SIZES, 5) if reader != "synthetic" else (12, 10, 16), months=(*MONTHS, 7))
    return fit(d, grown, ckpt_path=ckpt, on_error=on_error)


def bad_strategy(reader: str, d: Path, on_error: str) -> Result:
    data = good(reader, d)
    if reader == "synthetic":
        data["sharding"] = "webdataset"
    elif reader == "tar":  # broadcast needs a windowed reader
        data["sharding"] = "broadcast"
    else:  # a source without sharding="dispatch"
        data["sharding"] = "shard"
    return fit(d, data, on_error=on_error)


def size(arguments: dict[str, Any]) -> Callable[[str, Path, str], Result]:
    """A case that passes a zero or negative size: to the datamodule, the reader or the retry policy."""

    def run(reader: str, d: Path, on_error: str) -> Result:
        data = good(reader, d)
        if "reader" in arguments:
            data["reader"] = arguments["reader"](d)
        options = {k: v for k, v in arguments.items() if k != "reader"}
        if "sharding" in options:  # a strategy built with a bad setting of its own
            data["sharding"] = options.pop("sharding")()
        return fit(d, data, on_error=on_error, **options)

    return run


def more_ranks_than_items(reader: str, d: Path, on_error: str) -> Result:
    windows = MonthWindows(write_months(d, (9, 11)), window=4)
    manifest = Manifest.from_items(windows.items())
    ledger = Ledger(seed=3, total=manifest.total, manifest=manifest.summary())
    BroadcastLoader.build(
        windows, manifest.items, ledger, world=World(0, 3), options=LoaderOptions(batch_size=4, on_error=on_error)
    )
    raise AssertionError("unreachable: three ranks cannot share two months")


def skip_refused(reader: str, d: Path, on_error: str) -> Result:
    return fit(d, good(reader, d), on_error="skip")


# -- the matrix -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """``provoke(reader, dir, on_error)`` must raise ``error`` with a message matching ``message``
    (``{d}`` is the data directory); ``skipped`` are the sample ids ``on_error="skip"`` skips."""

    reader: str
    fault: str
    provoke: Callable[[str, Path, str], Result]
    error: type[BaseException]
    message: str
    skipped: tuple[int, ...] | None = None

    @property
    def id(self) -> str:
        return f"{self.reader}-{STRATEGY.get(self.reader, 'shard')}-{self.fault}"


SKIP_HINT = r".*pass on_error='skip'"
CASES = [
    # a missing file
    *(
        Case(fmt, "missing", missing, FileNotFoundError, rf"data file '{{d}}/part-00009\.{fmt}' does not exist")
        for fmt in FORMATS
    ),
    Case("parquet", "missing-glob", nothing_matches, FileNotFoundError, r"no file matches '{d}/train-\*\.parquet'"),
    Case("windows", "missing", missing, ValueError, r"item '{d}/month-09\.npy' is not a readable \.npy array"),
    Case("sqlite", "missing", missing, FileNotFoundError, r"SqliteSource: no database file at '{d}/missing\.db'"),
    # truncated or corrupt content
    Case(
        "tar",
        "corrupt",
        corrupt,
        SampleError,
        r"cannot read sample 11 of item '{d}/part-00000\.tar'.*sample 11 \(key 'sample00000011'\) is corrupt"
        + SKIP_HINT,
        skipped=(11,),
    ),
    Case("parquet", "truncated", corrupt, ValueError, r"{d}/part-00001\.parquet: cannot index this parquet file"),
    Case(
        "npy",
        "truncated",
        corrupt,
        ValueError,
        r"{d}/part-00001\.npy: cannot index this npy file: is truncated: the header promises shape \(10, 10\) "
        r"of float32 \(\d+ bytes\), the file has \d+",
    ),
    Case(
        "jsonl",
        "corrupt",
        corrupt,
        SampleError,
        r"cannot read sample 5 of item '{d}/part-00000\.jsonl'.*line 6 \(sample 5\) is not valid JSON" + SKIP_HINT,
        skipped=(5,),
    ),
    Case("windows", "truncated", corrupt, ValueError, r"item '{d}/month-01\.npy' is not a readable \.npy array"),
    Case(
        "sqlite",
        "corrupt",
        corrupt,
        ValueError,
        r"SqliteSource\('{d}/samples\.db'\): cannot run the query on this database: file is not a database",
    ),
    # an empty item (a zero-byte file, an item of no samples) or an empty sample
    *(
        Case(fmt, "empty", empty, ValueError, rf"{{d}}/part-00001\.{fmt}: cannot index this {fmt} file")
        for fmt in ("tar", "parquet", "npy")
    ),
    Case(
        "jsonl",
        "empty-sample",
        empty,
        SampleError,
        r"the transform failed on sample 7 of item '{d}/part-00000\.jsonl' .*KeyError: 'x'",
        skipped=(7,),
    ),
    Case(
        "synthetic",
        "empty",
        empty,
        ValueError,
        r"the dataset is empty: all 2 items hold 0 samples \(first item: 'synthetic-00000'\)",
    ),
    Case("windows", "empty", empty, ValueError, r"item '{d}/month-01\.npy' has 0 steps, fewer than the window of 4"),
    Case(
        "sqlite",
        "empty",
        empty,
        ValueError,
        r"SqliteSource\({d}/empty\.db\)\.length\(\) returned 0; a source must hold at least one element",
    ),
    # the wrong dtype or shape
    *(
        Case(
            fmt,
            "shape",
            wrong_shape,
            SampleError,
            rf"sample {i} of item '{{d}}/{key}' .*does not fit in a batch with the others: field 'x' is shape "
            r"\(7,\) float32, the other samples' is shape \(8,\) float32" + SKIP_HINT,
            skipped=(i,),
        )
        for fmt, key, i in (
            ("tar", r"part-00000\.tar", 11),
            ("jsonl", r"part-00000\.jsonl", 7),
            ("parquet", r"part-00000\.parquet#rg=0", 7),
        )
    ),
    Case(
        "npy",
        "dtype",
        wrong_shape,
        ValueError,
        r"{d}/part-00001\.npy: holds rows of shape \(10,\) and dtype float64, but the first file "
        r"{d}/part-00000\.npy holds rows of shape \(10,\) and dtype float32",
    ),
    Case(
        "windows",
        "dtype",
        wrong_shape,
        ValueError,
        r"item '{d}/month-02\.npy' holds steps of shape \(2,\) and dtype float64, but the first item "
        r"'{d}/month-00\.npy' holds \(2,\) and float32",
    ),
    Case(
        "sqlite",
        "dtype",
        wrong_shape,
        SampleError,
        r"rank 0, worker 0: the transform failed on the element at position \d+ of epoch 0: "
        r"ValueError: invalid literal for int\(\) with base 10: 'abc'",
    ),
    # a checkpoint of other data
    *(
        Case(
            reader,
            "other-data",
            other_data,
            CheckpointMismatchError,
            r"the checkpoint .*two-steps\.ckpt was written for other data: " + change,
        )
        for reader, change in (
            # Each changed item named (by its name under the data's root), then the totals.
            (
                "tar",
                r"'part-00003\.tar' is new \(not in the checkpoint's data\); num_items was 3, now 4; total was 36",
            ),
            ("parquet", r"'part-00003\.parquet#rg=0' is new .*; num_items was 6, now 7; total was 36, now 41"),
            (
                "npy",
                r"'part-00003\.npy' is new \(not in the checkpoint's data\); num_items was 3, now 4; total was 36",
            ),
            ("jsonl", r"'part-00003\.jsonl' is new .*; num_items was 3, now 4; total was 36, now 41"),
            ("synthetic", r"'synthetic-00002' holds 16 samples, the checkpoint 14; total was 36, now 38"),
            # Months known by name and bytes: the three rewritten with the same bytes are the same.
            (
                "windows",
                r"'month-03\.npy' is new \(not in the checkpoint's data\); num_items was 3, now 4; total was 21",
            ),
            (
                "sqlite",
                r"'source:SqliteSource\(.*samples\.db\)' holds 42 samples, the checkpoint 41; total was 41, now 42",
            ),
        )
    ),
    # an unknown strategy, or one that does not fit the data
    Case(
        "synthetic",
        "unknown-strategy",
        bad_strategy,
        ValueError,
        r"`ShardedDataModule\(sharding='webdataset'\)` is not a strategy; choose one of "
        r"\['shard', 'broadcast', 'dispatch', 'dali'\]",
    ),
    Case(
        "tar",
        "unsuitable-strategy",
        bad_strategy,
        TypeError,
        r"strategy 'broadcast' needs a WindowedReader \(such as NpyWindows\), got TarReader",
    ),
    Case(
        "sqlite",
        "unsuitable-strategy",
        bad_strategy,
        ValueError,
        r"`ShardedDataModule\(sharding='shard'\)`: `source=` goes with sharding='dispatch' and only with it",
    ),
    # a zero or negative size
    *(
        Case(reader, f"size-{name}", size({name: value}), ValueError, rf"`ShardedDataModule\({name}={value}\)`")
        for reader in ("synthetic", "windows", "sqlite")
        for name, value in (("batch_size", 0), ("batch_size", -3), ("num_workers", -1))
    ),
    Case(
        "windows",
        "size-prefetch_items",
        size({"sharding": lambda: BroadcastStrategy(prefetch_items=-1)}),
        ValueError,
        r"`BroadcastStrategy\(prefetch_items=-1\)` must be an integer >= 0",
    ),
    Case(
        "windows",
        "size-window",
        size({"reader": lambda d: MonthWindows([str(d / "month-00.npy")], window=0)}),
        ValueError,
        r"`MonthWindows\(window=0\)` must be a positive number of steps",
    ),
    Case(
        "windows",
        "size-stride",
        size({"reader": lambda d: MonthWindows([str(d / "month-00.npy")], window=3, stride=-1)}),
        ValueError,
        r"`MonthWindows\(stride=-1\)` must be a positive number of steps",
    ),
    Case(
        "npy",
        "size-sample_length",
        size({"reader": lambda d: NpyReader(f"{d}/part-*", sample_length=0)}),
        ValueError,
        r"`NpyReader\(sample_length=0\)` must be positive",
    ),
    Case(
        "tar",
        "size-scan_threads",
        size({"reader": lambda d: TarReader(f"{d}/part-*", scan_threads=0)}),
        ValueError,
        r"`TarReader\(scan_threads=0\)` must be at least 1",
    ),
    Case(
        "jsonl",
        "size-retry",
        size({"reader": lambda d: FILE_READERS["jsonl"](f"{d}/part-*", retry=RetryPolicy(attempts=0))}),
        ValueError,
        r"RetryPolicy\(attempts=0, backoff=0.2\): need attempts >= 1",
    ),
    Case(
        "synthetic",
        "size-items",
        size({"reader": lambda d: SyntheticReader(num_items=0)}),
        ValueError,
        r"SyntheticReader\(num_items=0, samples_per_item=128\): need at least one item",
    ),
    # more ranks than items under broadcast
    Case(
        "windows",
        "more-ranks-than-items",
        more_ranks_than_items,
        ValueError,
        r"strategy 'broadcast' has 3 ranks but only 2 items with windows \('{d}/month-00\.npy', '{d}/month-01\.npy'\)"
        r": every rank needs an item of its own",
    ),
    # on_error="skip" outside strategy "shard" is refused, naming the strategy
    *(
        Case(
            reader,
            "skip-refused",
            skip_refused,
            ValueError,
            rf"`ShardedDataModule\(on_error='skip'\)`: strategy '{STRATEGY[reader]}' cannot skip a sample: " + after,
        )
        # A window reader is a reader, which 'shard' reads; no reader's strategy reads a source.
        for reader, after in (("windows", r".*; use sharding='shard'$"), ("sqlite", r"[^;]*$"))
    ),
]


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_named_and_skipping_it_serves_the_rest_exactly_once(tmp_path: Path, case: Case) -> None:
    d = tmp_path / "raise"
    with pytest.raises(case.error) as err:
        case.provoke(case.reader, d, "raise")
    pattern = case.message.replace("{d}", re.escape(str(d)))
    assert re.search(pattern, str(err.value), flags=re.DOTALL), f"{pattern!r} not in:\n{err.value}"
    if case.skipped is None:
        return
    # on_error="skip": exactly the bad samples are skipped, counted and reported; the rest once.
    result = case.provoke(case.reader, tmp_path / "skip", "skip")
    served = Counter(i for record in result.records for i in record["ids"])
    assert max(served.values()) == 1, f"served twice: {[i for i, n in served.items() if n > 1]}"
    assert sorted(served) == sorted(set(range(total_of(case.reader))) - set(case.skipped))
    (report,) = result.reports
    assert report["skipped"] == len(case.skipped) and report["consumed"] == total_of(case.reader)
    assert result.metrics["data/skipped"] == len(case.skipped)
