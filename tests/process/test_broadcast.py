"""Strategy broadcast: one shared-memory copy per rank, workers crop disjoint windows of the same item.

The loader tests run real spawned DataLoader workers; the process tests run the real training job
(Lightning, DDP over gloo, spawned workers) through the shared harness.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import World
from lightning_sharding.strategies._shared_memory import SHM_DIR
from lightning_sharding.strategies.broadcast import BroadcastLoader
from lightning_sharding.strategies.options import LoaderOptions
from tests.support.data.windows import MonthWindows, write_months
from tests.support.harness import (
    START_IDS,
    START_METHODS,
    Data,
    Faults,
    Job,
    Loading,
    Segment,
    Topology,
    Training,
    assert_exactly_once,
    check_resume,
    kept_records,
    run_at_once,
    run_segment,
    served_per_epoch,
)

MONTHS = (37, 41, 29, 53, 40)


def shm_files(*owners: int) -> set[str]:
    """Broadcast segments in /dev/shm (not the batch slots a pooled loader may hold); with ``owners``,
    only the segments those pids made (``lsh-<run>-<pid>.<start>-...``): a broadcast test in the
    other test process may hold segments of its own at the same time."""
    names = {p.name for p in SHM_DIR.glob("lsh-*") if not re.search(r"-w\d+\.\d+-s\d+-g\d+$", p.name)}
    return {n for n in names if any(f"-{pid}." in n for pid in owners)} if owners else names


def mine() -> set[str]:
    """The segments this test process made (its in-process loaders own them)."""
    return shm_files(os.getpid())


def owner_pids(segment: Segment) -> set[int]:
    """The pids of a segment's ranks, as their records name them."""
    return {r["pid"] for recs in segment.records.values() for r in recs}


def build(
    paths: list[str], *, window: int = 4, halo: bool = False, rank: int = 0, world_size: int = 1, **options: Any
) -> BroadcastLoader:
    reader = MonthWindows(paths, window=window, halo=halo)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=11, total=manifest.total, manifest=manifest.summary())
    options.setdefault("batch_size", 6)
    options.setdefault("num_workers", 2)
    prefetch_items = options.pop("prefetch_items", 1)  # the strategy's setting
    return BroadcastLoader.build(
        reader,
        manifest.items,
        ledger,
        world=World(rank=rank, world_size=world_size),
        prefetch_items=prefetch_items,
        options=LoaderOptions(**options),
    )


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_workers_crop_disjoint_windows_of_the_same_item_from_one_copy(tmp_path: Path) -> None:
    paths = write_months(tmp_path, [60, 60, 60])
    loader = build(paths, num_workers=2, prefetch_items=1)
    counts = [it.num_samples for it in Manifest.from_items(MonthWindows(paths, window=4).items()).items]
    first_ids = np.concatenate(([0], np.cumsum(counts)))
    by_item: dict[int, dict[int, set[int]]] = {}
    live_max = 0
    batches = list[dict[str, Any]]()
    for batch in loader:
        assert loader.sampler.pool is not None
        live_max = max(live_max, len(mine()))
        batches.append(batch)
    for i, batch in enumerate(batches):
        workers = set(batch["worker"].tolist())
        assert workers == {i % 2}, f"batch {i} came from workers {workers}, expected {i % 2}"
        # The window's content is the series itself: step t holds t.
        assert np.array_equal(batch["first"].numpy(), batch["start"].numpy()[:, None] + np.arange(4))
        ids = batch["id"][~batch["is_padding"]].numpy()
        items = np.searchsorted(first_ids, ids, side="right") - 1
        for item, wid in zip(items.tolist(), ids.tolist(), strict=True):
            by_item.setdefault(item, {}).setdefault(i % 2, set()).add(wid)
    for item, per_worker in by_item.items():
        assert set(per_worker) == {0, 1}, f"item {item} was cropped by workers {set(per_worker)} only"
        assert not per_worker[0] & per_worker[1], f"item {item}: both workers cropped the same windows"
        assert per_worker[0] | per_worker[1] == set(range(first_ids[item], first_ids[item + 1]))
    # One segment per item in use plus one prefetched; none once the epoch is over.
    assert 1 <= live_max <= 2
    assert mine() == set()


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", START_METHODS, ids=START_IDS)
def test_an_abandoned_or_failed_epoch_unlinks_its_segments(tmp_path: Path, start: str | None) -> None:
    paths = write_months(tmp_path, list(MONTHS))
    loader = build(paths, num_workers=1, prefetch_items=2, multiprocessing_context=start)
    it = iter(loader)
    next(it)
    assert len(mine()) >= 1
    loader.close()  # what teardown does
    assert mine() == set()
    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            raise ZeroDivisionError("a failing training step")  # closes the loader's generator
    assert mine() == set()


def test_a_transform_runs_per_window_with_its_sample_context(tmp_path: Path) -> None:
    paths = write_months(tmp_path, [20, 20])
    loader = build(paths, num_workers=0, transform=add_position, batch_size=5)
    seen = Counter[int]()
    for batch in loader:
        assert (batch["position"] >= 0).all()
        seen.update(batch["id"][~batch["is_padding"]].tolist())
    assert sorted(seen) == list(range(34)) and set(seen.values()) == {1}


def add_position(sample: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {**sample, "position": ctx.position}


# -- real training jobs -------------------------------------------------------------------------


def broadcast_job(months: Path, topology: Topology, *, halo: bool = False, **loading: Any) -> Job:
    """A job of strategy broadcast over the month files in ``months`` (window 4, batch 8)."""
    return Job(topology, Data(months=str(months), halo=halo), Loading(sharding="broadcast", batch_size=8, **loading))


@pytest.mark.processes
@pytest.mark.chain
@pytest.mark.timeout(300)
def test_resume_and_rescale_with_a_halo_is_exactly_once_and_sigkill_leaves_nothing(tmp_path: Path) -> None:
    """2 ranks x 2 workers, SIGKILLed mid-epoch, resumed on 1 rank x 1 worker. The halo makes the
    epoch exactly the windows of the continuous series; the next run sweeps the killed run's segments.
    Spawned workers: the broadcast strategy's exactly-once chain under spawn."""
    write_months(tmp_path / "months", MONTHS)
    total = sum(MONTHS) - 4 + 1  # every window of the continuous series, stride 1
    before = shm_files()
    left: list[set[str]] = []

    def look(segment: Segment) -> None:
        left.append(shm_files() - before)

    first = broadcast_job(tmp_path / "months", Topology(2, 2), halo=True, start_method="spawn")
    then = first.on(1, 1)
    seen, segments = check_resume(tmp_path / "run", first, [then], checkpoint_every=3, after_segment=look)
    assert_exactly_once(seen, total, epochs=1)
    assert segments[-1].report is not None and segments[-1].report["epochs"][0]["consumed"] == total
    # What each rank held in /dev/shm as it was killed (another test's fit may sweep it at once).
    killed = set().union(*(json.loads(p.read_text()) for p in (tmp_path / "run").glob("killed-holding-rank*.json")))
    assert killed, "the SIGKILLed run held no segment: this test would not test the sweep"
    assert all("-r0-" in n or "-r1-" in n for n in killed), sorted(killed)
    assert not killed & shm_files(), f"segments of the killed run survived the next run: {sorted(killed & shm_files())}"
    resumed = {n for n in left[1] if any(f"-{pid}." in n for pid in owner_pids(segments[1]))}
    assert resumed == set(), f"segments survived the next run: {sorted(resumed)}"


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_an_exception_in_training_leaves_no_segment(tmp_path: Path) -> None:
    write_months(tmp_path / "months", MONTHS)
    before = shm_files()
    job = broadcast_job(tmp_path / "months", Topology(1, 2)).but(faults=Faults(raise_at_step=4))
    segment = run_segment(tmp_path, "fail", job, expect_death=True)
    assert "RaiseAtStep: deliberate failure after step 4" in segment.output
    held = set(json.loads((tmp_path / "held-rank0.json").read_text()))
    assert held, "the run held no segment when it failed: this test would not test the cleanup"
    pids = {int(m.group(1)) for n in held if (m := re.search(r"^lsh-[^-]+-(\d+)\.", n))}
    assert pids, sorted(held)
    assert not held & shm_files() and shm_files(*pids) - before == set()


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_two_runs_at_once_do_not_collide(tmp_path: Path) -> None:
    """Two jobs on this machine at the same time, two epochs each (one with persistent workers)."""
    write_months(tmp_path / "months", MONTHS)
    before = shm_files()
    two_epochs = Training(epochs=2)
    jobs = {
        "a": broadcast_job(tmp_path / "months", Topology(1, 2)).but(training=two_epochs),
        "b": broadcast_job(tmp_path / "months", Topology(1, 2), persistent_workers=True, seed=99).but(
            training=two_epochs
        ),
    }
    results = run_at_once(tmp_path, jobs)
    total = sum(n - 3 for n in MONTHS)
    for segment in results.values():
        assert_exactly_once(served_per_epoch(kept_records(segment, None)), total, epochs=2)
    # Only the files these two runs' ranks own: a broadcast test in the other test process may hold its own now.
    owners = set().union(*(owner_pids(segment) for segment in results.values()))
    assert len(owners) == 2, owners
    assert shm_files(*owners) - before == set()


@pytest.mark.processes
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("lengths", "world_size", "message"),
    [
        ((40,), 2, r"2 ranks but only 1 items with windows \('.*month-00\.npy'\)"),
        ((40, 3, 40), 1, r"item '.*month-01\.npy' has 3 steps, fewer than the window of 4"),
    ],
    ids=["more-ranks-than-items", "window-longer-than-item"],
)
def test_bad_configuration_fails_on_every_rank_with_the_item_named(
    tmp_path: Path, lengths: tuple[int, ...], world_size: int, message: str
) -> None:
    """Two DDP ranks that both raise (no rank is left waiting in a collective), and one rank."""
    write_months(tmp_path / "months", lengths)
    job = broadcast_job(tmp_path / "months", Topology(world_size, 1))
    segment = run_segment(tmp_path, "bad", job, expect_death=True)
    # Ranks share one log, so two tracebacks can interleave: any one intact line will do.
    found = re.search(message, segment.output) or re.search(message, segment.output.replace("\n", ""))
    assert found, segment.output[-3000:]
