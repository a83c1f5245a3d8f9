"""Faults: the whole job SIGKILLed at random points, dead helper processes, two runs side by side.

Every kill is a real SIGKILL of real processes (Lightning's ddp_fork ranks, DataLoader workers from
the package's forkserver, dispatch processes); every exactly-once claim is checked by the audit trail over all
segments of a run (``lightning_sharding.loading.audit``) and, independently, by the sample ids the training
steps recorded. Kill points are drawn from a seed that is printed and put in every assertion
message; set ``LSH_FAULT_SEED`` to replay one, and ``LSH_FAULT_KILLS`` for more kills per run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_sharding import SyntheticReader
from lightning_sharding.core.history import StepNotInHistoryError, replay_step
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import World
from lightning_sharding.loading.audit import audit, format_audit
from lightning_sharding.recipes.synthetic_files import write_regression
from lightning_sharding.strategies._helper_deaths import HelperProcessError
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import ShardedLoader
from tests.support.data.sources import make_db
from tests.support.data.windows import write_months
from tests.support.harness import (
    ROOT,
    START_IDS,
    START_METHODS,
    Checks,
    Data,
    Job,
    Loading,
    Segment,
    Topology,
    assert_exactly_once,
    assert_weights_count_once,
    checkpoint_step,
    kept_records,
    run_at_once,
    run_segment,
    served_per_epoch,
    weights_of_run,
)
from tests.support.replay import assert_replay_matches_audit

TOPOLOGIES = [(ranks, workers) for ranks in (1, 2) for workers in (0, 1, 2)]
# Kills per run: 3 in the suite (the topology matrix itself is the in-process contract test's, in
# tests/unit/test_strategy_contract.py); LSH_FAULT_KILLS=5 (the data allows that many) soaks longer.
KILLS = int(os.environ.get("LSH_FAULT_KILLS") or 3)
EVERY = 2  # checkpoint every 2 steps: a kill lands 0 or 1 step after the newest checkpoint
BATCH = 4
MONTHS = (37, 41, 29, 53, 40)  # broadcast: 185 windows of 4 steps
ROWS = 200  # dispatch: rows of the SQLite source


def fault_seed() -> int:
    seed = int(os.environ.get("LSH_FAULT_SEED") or random.SystemRandom().randrange(2**31))
    print(f"LSH_FAULT_SEED={seed}")
    return seed


def strategy_job(strategy: str, data: Path) -> tuple[Job, int]:
    """A 1-epoch job of ``strategy`` with its own small data under ``data``, and its sample count."""
    checks = Checks(count_weights=True)
    if strategy == "broadcast":
        write_months(data, MONTHS)
        job = Job(data=Data(months=str(data)), loading=Loading(sharding="broadcast", batch_size=BATCH), checks=checks)
        return job, sum(n - 3 for n in MONTHS)
    if strategy == "dispatch":
        data.mkdir(parents=True, exist_ok=True)
        source = {"kind": "sqlite", "path": str(make_db(data / "rows.db", ROWS))}
        return Job(
            data=Data(source=source), loading=Loading(sharding="dispatch", batch_size=BATCH), checks=checks
        ), ROWS
    return Job(loading=Loading(batch_size=BATCH), checks=checks), sum(Job().data.sizes)


def consumed_in(checkpoint: Path) -> int:
    """Samples the checkpoint's ledger holds as consumed in its epoch."""
    ranges = torch.load(checkpoint, weights_only=True)["lightning_sharding"]["consumed"]
    return int((ranges[:, 1] - ranges[:, 0]).sum()) if ranges.numel() else 0


def remove_semaphores(out: Path) -> None:
    """Unlink the named semaphores a SIGKILLed job left in /dev/shm (KillGroupAtStep noted them):
    nothing in the job survived to do it, and this machine runs these tests often."""
    names = json.loads((out / "semaphores.json").read_text())
    for name in names:
        Path(name).unlink(missing_ok=True)


@dataclass(frozen=True)
class Kill:
    """Segment topology and where its kill lands (None for the last segment, which finishes)."""

    ranks: int
    workers: int
    resumed_at: int
    step: int | None
    rank: int | None
    moment: str | None


def run_with_kills(out: Path, job: Job, total: int, rng: random.Random, seed: int) -> tuple[list[Segment], list[Kill]]:
    """The first segment on 2 ranks x 2 workers, then one resume per kill on a random topology; each
    but the last is SIGKILLed (its whole process group) at a random step after its first checkpoint."""
    segments: list[Segment] = []
    kills: list[Kill] = []
    resume: Path | None = None
    for i in range(KILLS + 1):
        ranks, workers = (2, 2) if i == 0 else rng.choice(TOPOLOGIES)
        start = checkpoint_step(resume) if resume is not None else 0
        kill = Kill(ranks, workers, start, None, None, None)
        if i < KILLS:
            left = total - (consumed_in(resume) if resume is not None else 0)
            fewest_steps = -(-left // (ranks * job.loading.batch_size))  # no step serves more than ranks x batch
            first_checkpoint = (start // EVERY + 1) * EVERY
            moment = rng.choice(["before", "after"])
            # A kill "after" a checkpoint's step loses that checkpoint. The first segment has no
            # other to resume from, so there its kill lands at least one step later.
            lowest = first_checkpoint + (1 if resume is None and moment == "after" else 0)
            step = min(lowest + rng.randrange(EVERY), start + fewest_steps - 1)
            assert step >= lowest, f"seed {seed}: data too small for {KILLS} kills: {kills}"
            kill = replace(kill, step=step, rank=rng.randrange(ranks), moment=moment)
        kills.append(kill)
        segment_job = job.on(ranks, workers).but(
            checks=dict(audit=True),
            saves=dict(checkpoint_every=EVERY),
            training=dict(resume_from=str(resume) if resume is not None else None),
            faults=dict(
                kill_group=None if kill.step is None else {"step": kill.step, "rank": kill.rank, "moment": kill.moment}
            ),
        )
        segment = run_segment(out, f"seg{i}", segment_job, expect_death=kill.step is not None)
        segments.append(segment)
        if kill.step is not None:
            assert segment.returncode == -signal.SIGKILL, f"seed {seed}: segment {i} {kill} ended {segment.returncode}"
            remove_semaphores(out)
            # Resume from the newest checkpoint there is, as an operator would.
            resume = max((out / "checkpoints").glob("*.ckpt"), key=checkpoint_step)
    return segments, kills


@pytest.mark.processes
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["shard", "broadcast", "dispatch"])
def test_sigkill_of_the_whole_job_at_random_points_then_resume_on_random_topologies(
    tmp_path: Path, strategy: str
) -> None:
    seed = fault_seed()
    rng = random.Random(f"{seed}-{strategy}")
    job, total = strategy_job(strategy, tmp_path / "data")
    out = tmp_path / "run"
    segments, kills = run_with_kills(out, job, total, rng, seed)
    where = f"seed {seed} ({strategy}), segments: {kills}"
    print(where)
    results = audit([out])
    table = format_audit(results)
    print(table)
    assert [r.epoch for r in results] == [0], f"{where}\n{table}"
    (epoch,) = results
    assert epoch.complete and epoch.ok and epoch.consumed == total, f"{where}\n{table}"
    # The same claim from the sample ids themselves: what every segment trained on up to the step
    # the next one resumed from.
    kept: list[dict[str, Any]] = []
    for segment, following in zip(segments, [*kills[1:], None], strict=True):
        kept += kept_records(segment, following.resumed_at if following is not None else None)
    try:
        assert_exactly_once(served_per_epoch(kept), total, epochs=1)
    except AssertionError as err:
        raise AssertionError(f"{where}: {err}") from None
    # And in the weights: the segments a resume kept applied every sample's gradient exactly once.
    try:
        assert_weights_count_once(weights_of_run(out, segments), total, epochs=1)
    except AssertionError as err:
        raise AssertionError(f"{where}: {err}") from None
    # A kill "after" a checkpoint step lands before Lightning's checkpoint callbacks (they run last):
    # that checkpoint is never written and the next segment resumes from the one before.
    assert all(k.resumed_at <= n.resumed_at for k, n in zip(kills, kills[1:], strict=False)), where
    final = segments[-1].report
    assert final is not None and final["epochs"][0]["consumed"] == total, where
    # The newest checkpoint's history names what each step trained on every rank, as the audit recorded
    # it, across the resumes on random topologies (inspect --step); dispatch deals batches as its workers
    # finish them, which no plan replays, and says so.
    newest = max((out / "checkpoints").glob("*.ckpt"), key=checkpoint_step)
    if strategy == "dispatch":
        state = torch.load(newest, weights_only=True)["lightning_sharding"]
        with pytest.raises(StepNotInHistoryError, match="dispatch"):
            replay_step(state, 0)
    else:
        assert_replay_matches_audit(newest, out, range(1))


# -- dead helper processes ----------------------------------------------------------------------------

HELPER_KILLS = {
    # strategy: per failing segment on 2 ranks, (steps after its checkpoint, rank, process killed, workers
    # per rank); then the topology (ranks, workers) that finishes the epoch. A dispatch rank has both
    # kinds of helper. A dead worker is reported the same way under every strategy (one SIGCHLD handler
    # per rank, see processes.py); for time, shard is covered in-process only (the test above). To add
    # it under DDP: "shard": ([(3, 1, "DataLoader worker 1", 2)], (1, 0)) (about 25 s more).
    "dispatch": ([(3, 1, "DataLoader worker 0", 1), (3, 0, "dispatch process", 1)], (1, 0)),
}


@pytest.mark.processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("start", START_METHODS, ids=START_IDS)
def test_a_killed_worker_is_named_with_its_rank_wherever_the_error_surfaces(start: str | None) -> None:
    """In-process, one rank of 2 workers: PyTorch reports the death from a SIGCHLD handler (inside
    whatever runs, here the sleep) or the loader sees it while waiting; either way it is named. Under
    every start method: a forkserver's workers are not this process's children (no SIGCHLD), so
    there the loader sees the death at PyTorch's next status check (every 5 s)."""
    reader = SyntheticReader(num_items=4, samples_per_item=4096)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=3, total=manifest.total, manifest=manifest.summary())
    loader = ShardedLoader.build(
        reader,
        manifest.items,
        ledger,
        world=World(rank=1, world_size=2),
        options=LoaderOptions(batch_size=8, num_workers=2, multiprocessing_context=start),
    )
    batches = iter(loader)
    next(batches)
    victim = loader.helper_processes()["DataLoader worker 1"]
    os.kill(victim.pid, signal.SIGKILL)
    named = rf"rank 1: DataLoader worker 1 \(pid {victim.pid}\) was killed by SIGKILL"
    started = time.time()
    with pytest.raises(HelperProcessError, match=named):
        while time.time() - started < 30:
            next(batches)
            time.sleep(0.01)
    print(f"named after {time.time() - started:.2f} s")
    loader.close()


def _hold_forever(event: Any) -> None:
    """Take the lock of PyTorch's workers-done event and die holding it, as a worker SIGKILLed inside
    ``done_event.is_set()`` does."""
    event._cond.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_worker_killed_holding_the_workers_lock_is_named_not_waited_for_forever() -> None:
    """A worker checks PyTorch's workers-done event at every task; killed while it holds the event's
    lock, it holds it forever. The training process must still name the dead worker (it hung in
    PyTorch's status check, which asks that event, under the default forkserver)."""
    reader = SyntheticReader(num_items=4, samples_per_item=4096)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=3, total=manifest.total, manifest=manifest.summary())
    options = LoaderOptions(batch_size=8, num_workers=2)
    loader = ShardedLoader.build(reader, manifest.items, ledger, world=World(rank=0, world_size=1), options=options)
    batches = iter(loader)
    next(batches)
    event = loader._iterator._workers_done_event  # type: ignore[attr-defined]
    event = getattr(event, "_event", event)  # PyTorch's own, behind the training process's view of it
    holder = multiprocessing.get_context("fork").Process(target=_hold_forever, args=(event,))
    holder.start()
    holder.join(timeout=10)
    assert holder.exitcode == -signal.SIGKILL
    victim = loader.helper_processes()["DataLoader worker 1"]
    os.kill(victim.pid, signal.SIGKILL)
    started = time.time()
    with pytest.raises(
        HelperProcessError, match=rf"rank 0: DataLoader worker 1 \(pid {victim.pid}\) was killed by SIGKILL"
    ):
        while time.time() - started < 30:
            next(batches)
            time.sleep(0.01)
    loader.close()


@pytest.mark.processes
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", list(HELPER_KILLS))
def test_a_killed_worker_or_dispatch_process_fails_fast_naming_it_and_the_resume_is_exactly_once(
    tmp_path: Path, strategy: str
) -> None:
    """2 ranks: one helper process of one rank is SIGKILLed mid-epoch (steps after a checkpoint); the
    job must end within 60 s with an error naming the rank and the process. Each failed run is
    resumed from its newest checkpoint; the audit over all segments is exactly-once."""
    job, total = strategy_job(strategy, tmp_path / "data")
    out = tmp_path / "run"
    kills, (ranks, workers) = HELPER_KILLS[strategy]
    resume: Path | None = None
    for i, (after, rank, process, per_rank) in enumerate(kills):
        start = checkpoint_step(resume) if resume is not None else 0
        failing = job.on(2, per_rank).but(
            checks=dict(audit=True),
            saves=dict(checkpoint_every=EVERY),
            training=dict(resume_from=str(resume) if resume is not None else None),
            faults=dict(kill_helper={"step": start + after, "rank": rank, "process": process}),
        )
        segment = run_segment(out, f"seg{i}", failing, expect_death=True)
        ended = time.time()
        fault = json.loads((out / f"fault-seg{i}.json").read_text())
        named = rf"rank {rank}: (the )?{process} \(pid {fault['pid']}\)[^\n]* was killed by SIGKILL"
        assert re.search(named, segment.output), f"{named!r} missing from:\n{segment.output[-4000:]}"
        print(f"{strategy}: {process} of rank {rank} killed; the job ended {ended - fault['time']:.1f} s later")
        assert ended - fault["time"] < 60, f"the job took {ended - fault['time']:.0f} s to end after the kill"
        resume = max((out / "checkpoints").glob("*.ckpt"), key=checkpoint_step)
    final = job.on(ranks, workers).but(checks=dict(audit=True), training=dict(resume_from=str(resume)))
    run_segment(out, f"seg{len(kills)}", final)
    results = audit([out])
    assert len(results) == 1 and results[0].complete and results[0].ok, format_audit(results)
    assert results[0].consumed == total, format_audit(results)


# -- two runs at once -----------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_two_runs_at_once_share_no_shared_memory_cache_file_or_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two 2-rank x 1-worker jobs on other .npy data at the same time, with one cache directory (the
    default one, $LIGHTNING_SHARDING_CACHE). Each notes, while the other is alive, every /dev/shm name
    and local TCP port its processes hold; none may be the other's, nor may any cache file."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LIGHTNING_SHARDING_CACHE", str(cache))
    sizes = {"a": (30, 41, 29), "b": (37, 33, 25, 12)}
    jobs = {}
    for name, other in (("a", "b"), ("b", "a")):
        write_regression(str(tmp_path / name / "data"), "npy", sizes[name])
        data = {"format": "npy", "urls": str(tmp_path / name / "data" / "*.npy"), "default_cache": True}
        snap = {"step": 3, "other": str(tmp_path / other)}
        jobs[name] = Job(Topology(2, 1), Data(files=data), Loading(batch_size=4), checks=Checks(snapshot=snap))
    results = run_at_once(tmp_path, jobs)
    for name, segment in results.items():
        assert_exactly_once(served_per_epoch(kept_records(segment, None)), sum(sizes[name]), epochs=1)
    held = {name: json.loads((tmp_path / name / "resources.json").read_text()) for name in jobs}
    for name in jobs:
        print(
            f"run {name}: {len(held[name]['pids'])} processes, {len(held[name]['shm'])} /dev/shm names, "
            f"TCP ports {held[name]['ports']}"
        )
        assert held[name]["shm"] and held[name]["master_port"] in held[name]["ports"], held[name]
    assert not set(held["a"]["pids"]) & set(held["b"]["pids"])
    assert not set(held["a"]["shm"]) & set(held["b"]["shm"]), "both runs hold the same /dev/shm names"
    assert not set(held["a"]["ports"]) & set(held["b"]["ports"]), "both runs hold the same TCP ports"
    # Per run: its listing, the directory of its files' indexes and the pointer to the latest listing of
    # its URLs; none shared, no half-written leftovers.
    files = sorted(p.name for p in (cache / "index").iterdir())
    assert len([f for f in files if f.endswith(".d")]) == 2 and len(files) == 6, files
    assert not [f for f in files if f.endswith(".tmp")], files
    indexed = [np.load(d / "counts.npy").tolist() for d in sorted((cache / "index").glob("*.d"))]
    assert sorted(map(sorted, indexed)) == sorted(sorted(sizes[run]) for run in ("a", "b")), indexed


# -- a long run -----------------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_short_long_run_with_persistent_workers_grows_no_memory_descriptors_or_shm(tmp_path: Path) -> None:
    """``benchmarks/long_run.py`` with 4 epochs instead of 20, every strategy, 1 rank x 2 persistent
    workers: from the end of epoch 2 on, no process's RSS grows by 5% and nothing else grows."""
    report = tmp_path / "long_run.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.long_run", "--epochs", "4", "--json", str(report)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    tables = "\n".join(line for line in done.stdout.splitlines() if not line.startswith(("GPU", "TPU", "💡")))
    print(tables)
    results = json.loads(report.read_text())
    assert set(results) == {"shard", "broadcast", "dispatch"}, done.stderr[-3000:]
    for strategy, result in results.items():
        assert result["same_processes"], f"{strategy}: the persistent workers were replaced\n{tables}"
        assert max(result["rss_growth"].values()) < 0.05, f"{strategy}: RSS grew\n{tables}"
        assert max(result["fd_growth"].values()) <= 0, f"{strategy}: file descriptors grew\n{tables}"
        assert result["shm_growth"] <= 0 and result["shm_unlinked_growth"] <= 0, f"{strategy}: /dev/shm grew\n{tables}"
        assert len(result["probes"][0]["rss_kib"]) == (4 if strategy == "dispatch" else 3), result["probes"][0]
    assert done.returncode == 0, done.stderr[-3000:]
