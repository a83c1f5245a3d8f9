"""The dispatch strategy: a non-replicable source read by one process per rank, dealt to workers.

Real sources (a SQLite file through one cursor, a TCP stream on 127.0.0.1), real Lightning
Trainer, DDP over gloo, spawned DataLoader workers and dispatch processes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_sharding import ShardedDataModule
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import WorkerContext, World
from lightning_sharding.readers.sources import SqliteSource, source_manifest
from lightning_sharding.strategies._dispatch_process import Chunk, SourceError, Spec, deal
from lightning_sharding.strategies.dispatch import DispatchLoader
from lightning_sharding.strategies.options import LoaderOptions
from tests.support.data.sources import (
    ROTATING_QUERY,
    FailingSqlite,
    LogServer,
    ProgressSqlite,
    TcpStream,
    make_db,
    row_to_sample,
    slow_transform,
)
from tests.support.harness import (
    START_IDS,
    START_METHODS,
    Data,
    Job,
    Loading,
    Topology,
    Training,
    assert_exactly_once,
    check_resume,
    kept_records,
    run_segment,
    served_per_epoch,
)

N = 101  # rows: 2 ranks get 51 and 50, so padding/splitting is exercised


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return make_db(tmp_path / "samples.db", N)


def rotated_id(position: int, epoch: int, n: int = N) -> int:
    """The id at ``position`` of ROTATING_QUERY's order in ``epoch``."""
    return (position - epoch * 17) % n


# -- the dealing scheme, in-process ----------------------------------------------------------------


def _dealt(source: SqliteSource, ctx: WorkerContext, spec_plan: bool, consumed: RangeSet) -> list[Chunk]:
    plan = None
    if spec_plan:
        epoch_plan = plan_epoch(N, consumed, epoch=0, world_size=ctx.data_size, num_workers=2, batch_size=8)
        plan = epoch_plan.rank(ctx.data_rank)
    return [m for m in deal(source, Spec(1, ctx, 8, plan, consumed)) if isinstance(m, Chunk)]


@pytest.mark.parametrize("planned", [True, False], ids=["known-length", "sync"])
def test_ranks_deal_disjoint_shares_that_cover_what_the_ledger_left(db: Path, planned: bool) -> None:
    source = SqliteSource(db, ROTATING_QUERY)
    consumed = RangeSet.from_ranges([(0, 20), (33, 40), (70, 71)])
    served: list[int] = []
    for rank in range(3):
        ctx = WorkerContext(rank, 3, 0, 2, 0, 7)
        for chunk in _dealt(source, ctx, planned, consumed):
            real = chunk.positions[: len(chunk.positions) - chunk.num_padding]
            assert [row["id"] for row in chunk.elements[: len(real)]] == real.tolist()  # epoch 0: id == position
            served += real.tolist()
    assert sorted(served) == list(consumed.complement(N))


def test_a_source_without_length_needs_the_sync_policy(tmp_path: Path) -> None:
    ledger = Ledger(seed=0, total=10, manifest={"fingerprint": "x"})
    with pytest.raises(ValueError, match="no known length.*even_batches='sync'"):
        DispatchLoader(TcpStream(1), ledger, world=World(), options=LoaderOptions(batch_size=4, even_batches="pad"))


def test_a_query_without_order_by_is_refused(db: Path) -> None:
    with pytest.raises(ValueError, match="needs an ORDER BY"):
        SqliteSource(db, "SELECT id FROM samples")


@pytest.mark.parametrize("start", START_METHODS, ids=START_IDS)
def test_a_failing_source_in_process_names_the_rank_the_dispatcher_and_the_error(db: Path, start: str | None) -> None:
    """The dispatch process, started by every start method, reports its source's failure."""
    source = FailingSqlite(str(db), ROTATING_QUERY, fail_at=20)
    ledger = Ledger(seed=0, total=N, manifest=source_manifest(source).summary())
    options = LoaderOptions(batch_size=8, transform=row_to_sample, multiprocessing_context=start)
    loader = DispatchLoader(source, ledger, world=World(), options=options)
    with pytest.raises(SourceError, match=r"rank 0: the dispatcher reading SqliteSource.*ValueError: corrupt row at"):
        list(loader)


# -- in the training process and with workers, without DDP ------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_zero_workers_runs_the_same_pipeline_in_process(db: Path) -> None:
    from tests.jobs.parts import RecordingModel
    from tests.support.harness import cpu_trainer

    dm = ShardedDataModule(
        source=SqliteSource(db, ROTATING_QUERY), sharding="dispatch", transform=row_to_sample, batch_size=8
    )
    log = db.parent / "seen"
    cpu_trainer(max_epochs=2).fit(RecordingModel(str(log)), datamodule=dm)
    records = [json.loads(line) for line in Path(f"{log}-rank0.jsonl").read_text().splitlines()]
    assert_exactly_once(served_per_epoch(records), N, epochs=2)


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_queues_are_bounded_when_workers_are_slower_than_the_source(db: Path) -> None:
    progress = db.parent / "progress"
    source = ProgressSqlite(db, progress)
    ledger = Ledger(seed=0, total=N, manifest=source_manifest(source).summary())
    loader = DispatchLoader(
        source,
        ledger,
        world=World(),
        queue_size=2,
        options=LoaderOptions(batch_size=4, num_workers=2, transform=slow_transform, prefetch_factor=1),
    )
    try:
        batches = iter(loader)
        next(batches)
        time.sleep(2.0)  # the source could be read to its end many times over in this time
        ahead = int(progress.read_text())
    finally:
        loader.close()
    # Batches of 4: 3 taken by the workers (one per prefetched task and the delivered one), 2 queues
    # x 2 waiting, 1 read by the dispatcher and blocked on a full queue. Unbounded, it reads all 101.
    bound = (3 + 2 * 2 + 1) * 4
    print(f"dispatcher read up to position {ahead} of {N} (bound {bound})")
    assert ahead < bound


# -- DDP: exactly-once resume, epoch boundaries, faults, the stream ----------------------------------


def dispatch_job(db: Path, topology: Topology, source: dict[str, Any] | None = None, **loading: Any) -> Job:
    """A job of strategy dispatch over the SQLite table ``db`` (or the given ``source``)."""
    data = Data(source=source or {"kind": "sqlite", "path": str(db)})
    return Job(topology, data, Loading(sharding="dispatch", **loading))


@pytest.mark.processes
@pytest.mark.chain
@pytest.mark.timeout(240)
def test_sqlite_resumes_exactly_once_after_sigkill_on_another_topology(tmp_path: Path, db: Path) -> None:
    """Spawned dispatch processes and workers: the dispatch strategy's exactly-once chain under spawn."""
    first = dispatch_job(db, Topology(2, 2), start_method="spawn").but(training=Training(epochs=2))
    then = first.on(1, 2)
    seen, segments = check_resume(tmp_path / "run", first, [then], checkpoint_every=3)
    assert_exactly_once(seen, N, epochs=2)
    final = segments[-1].report
    assert final is not None and [e["consumed"] for e in final["epochs"]] == [N, N]


@pytest.mark.processes
@pytest.mark.timeout(180)
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh-workers"])
def test_an_epoch_stopped_early_leaks_nothing_into_the_next(tmp_path: Path, db: Path, persistent: bool) -> None:
    """limit_train_batches=3 leaves prefetched batches of every epoch behind; the order rotates each
    epoch, so a leaked batch would show up as wrong ids."""
    # Fresh workers are restarted every epoch: one rank keeps the test short.
    world = 2 if persistent else 1
    job = dispatch_job(db, Topology(world_size=world), persistent_workers=persistent)
    job = job.but(training=Training(epochs=2, limit_train_batches=3))
    segment = run_segment(tmp_path, "run", job)
    plan = plan_epoch(N, RangeSet(), epoch=0, world_size=world, num_workers=2, batch_size=8)
    for rank, records in segment.records.items():
        expected_positions = [plan.rank(rank).batch(i).positions.tolist() for i in range(3)]
        for epoch in range(2):
            got = [r["ids"] for r in records if r["epoch"] == epoch]
            assert got == [[rotated_id(p, epoch) for p in b] for b in expected_positions], (rank, epoch)


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("world", "fault", "expected"),
    [
        (2, {"fail_at": 60}, ["rank 1", "dispatcher reading SqliteSource", "ValueError: corrupt row at position 60"]),
        (1, {"die_at": 60}, ["rank 0: the dispatch process", "died", "was killed by SIGKILL"]),
    ],
    ids=["source-raises", "dispatcher-killed"],
)
def test_a_fault_fails_fast_naming_rank_dispatcher_and_cause(
    tmp_path: Path, db: Path, world: int, fault: dict[str, int], expected: list[str]
) -> None:
    """On 2 ranks, rank 1's source fails (rank 0 must not hang); on 1 rank, its dispatcher is killed."""
    source = {"kind": "sqlite", "path": str(db), **fault}
    job = dispatch_job(db, Topology(world, 1), source=source)
    segment = run_segment(tmp_path, "run", job, expect_death=True)
    ended = time.time()
    for text in expected:
        assert text in segment.output, f"{text!r} missing from:\n{segment.output[-4000:]}"
    elapsed = ended - float(db.with_suffix(".fault").read_text())
    print(f"the job ended {elapsed:.1f} s after the fault")
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end after the fault"


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_tcp_stream_resumes_at_least_once_from_its_commits(tmp_path: Path) -> None:
    """97 elements, 2 ranks x batch 8, even_batches='sync': the stream's length is unknown."""
    server = LogServer(97)
    try:
        source = {"kind": "tcp", "port": server.port}
        job = Job(Topology(num_workers=1), Data(source=source), Loading(sharding="dispatch", even_batches="sync"))
        seen, segments = check_resume(tmp_path, job, [job], checkpoint_every=3)
    finally:
        server.stop()
    # The killed segment's checkpoint at step 3 held positions [0, 48) of the interleaved shares;
    # the stream was told so once that checkpoint was written, and resumed there.
    assert (0, 48) in server.commits, server.commits
    everything = served_per_epoch([r for s in segments for recs in s.records.values() for r in recs])
    assert set(everything[0]) >= set(range(96)), "at-least-once: every element but the unserved one was trained on"
    assert_exactly_once(seen, 97, epochs=1, missing_ok=1)
    # 49 left after the resume: rank 0 has a 4th batch of 1 that rank 1 cannot match; it is reported.
    final = segments[-1].report
    assert final is not None and final["epochs"][0]["dropped"] == 1
    assert "samples fetched but not served per rank: [1, 0]" in segments[-1].output
    assert not any(96 in r["ids"] for r in kept_records(segments[-1], None))
    assert torch.tensor(server.commits).max().item() >= 48 and np.all(np.diff([c[1] for c in server.commits]) >= 0)
