"""Share schedules (lightning_sharding.mixture.schedule): each phase draws at its own shares, from
what the epoch's earlier phases did not serve, as a pure function of the streams, schedule, seed
and epoch; bad schedules are named."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from lightning_sharding import Phase, ShardedDataModule, ShardingCallback
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.mixture import MixtureReader, layout_of_summary
from lightning_sharding.mixture.schedule import Phased
from tests.support.data.streams import make_streams

STREAMS = [
    {"name": "web", "sizes": [37, 41, 29], "weight": 3},  # 107 samples
    {"name": "code", "sizes": [23, 17], "weight": 1},  # 40 samples
    {"name": "books", "sizes": [11], "repeat": 2.0},  # 11 samples
]
SCHEDULE = [
    Phase(0, {"web": 1, "code": 1}),
    Phase(0.5, {"web": 3, "code": 1, "books": 1}),
    Phase(0.8, {"books": 1, "code": 1}),  # an annealing tail: web draws nothing here
]


def scheduled(schedule=SCHEDULE, per_epoch: int = 150):  # type: ignore[no-untyped-def]
    return MixtureReader(make_streams(STREAMS), per_epoch, schedule=schedule).manifest()


@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_each_phase_draws_at_its_shares_and_each_stream_draws_its_epoch_order_once(epoch: int) -> None:
    manifest = scheduled()
    order = manifest.order(7, epoch)
    assert order.total == 150
    stream, draw = order.streams(np.arange(150))
    # The phases cut the epoch at floor(start * 150): 0, 75, 120; each splits its part at its shares.
    assert [Counter(stream[lo:hi].tolist()) for lo, hi in ((0, 75), (75, 120), (120, 150))] == [
        {0: 38, 1: 37},
        {0: 27, 1: 9, 2: 9},
        {1: 15, 2: 15},
    ]
    mixture = manifest.epochs
    assert mixture.draws == (65, 61, 24)  # each stream's draws over the phases
    for s, total in enumerate(mixture.draws):  # a stream's draws go on from phase to phase, each once
        assert sorted(draw[stream == s].tolist()) == list(range(total))
    for p in (0, 1, 74, 75, 76, 119, 120, 149, 150):  # prefixes agree with the positions
        assert order.prefix(p) == [int((stream[:p] == s).sum()) for s in range(3)]


def test_a_stream_serves_each_sample_once_in_an_epoch_until_the_phases_ask_for_more_than_it_holds() -> None:
    manifest = scheduled()
    order = manifest.order(3, 0)
    stream, _ = order.streams(np.arange(150))
    items, index = order.locate(np.arange(150))
    starts = np.concatenate(([0], np.cumsum(manifest.counts)))
    ids = starts[items] + index
    served = {s: Counter(ids[stream == s].tolist()) for s in range(3)}
    assert max(served[0].values()) == 1 and len(served[0]) == 65  # web: 65 of its 107, each once
    assert sorted(Counter(served[1].values()).items()) == [(1, 19), (2, 21)]  # code: 61 draws of 40
    assert sorted(Counter(served[2].values()).items()) == [(2, 9), (3, 2)]  # books: 24 of 11


def test_the_order_is_the_same_whoever_builds_it_and_changes_with_the_seed_and_epoch() -> None:
    a, b = scheduled().order(11, 2), scheduled().order(11, 2)
    positions = np.arange(150)
    assert all(np.array_equal(x, y) for x, y in zip(a.locate(positions), b.locate(positions), strict=True))
    other = scheduled().order(11, 3).locate(positions)
    assert not np.array_equal(a.locate(positions)[0], other[0])


def test_the_saved_summary_rebuilds_the_layout_and_a_changed_schedule_is_explained() -> None:
    manifest = scheduled()
    summary = manifest.summary()
    saved = layout_of_summary(summary["streams"], summary)
    assert isinstance(saved, Phased)
    positions = np.arange(150)
    assert all(
        np.array_equal(x, y)
        for x, y in zip(saved.streams(positions), manifest.order(0, 0).streams(positions), strict=True)
    )
    other = scheduled([SCHEDULE[0], Phase(0.6, {"books": 1})])
    changes = manifest.epochs.explain(manifest.summary(), other.summary())
    assert any("schedule phase 1 was from 0.5" in c and "now from 0.6" in c for c in changes), changes
    assert any("schedule phase 2 was from 0.8" in c and "absent" in c for c in changes), changes
    assert manifest.fingerprint != other.fingerprint  # a checkpoint of one schedule is refused under the other


def test_a_fixed_mixture_is_unchanged_by_the_schedule_code() -> None:
    fixed = MixtureReader(make_streams(STREAMS), 150).manifest()
    assert fixed.epochs.draws == (96, 32, 22) and not fixed.epochs.schedule
    assert "schedule" not in fixed.summary()


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([], r"schedule=\[\] has no phase"),
        ([Phase(0.2, {"web": 1})], r"first phase starts at 0.2 of the epoch; it must start at 0"),
        ([Phase(0, {"web": 1, "code": 1})], r"streams \['books'\] are named by no phase of the schedule"),
        (
            [Phase(shares={"web": 1}, samples=0), Phase(0.5, {"books": 1, "code": 1})],
            r"mixes phases from a fraction of the epoch \(start=\) and of training \(samples= or tokens=\)",
        ),
        (
            [Phase(0, {"web": 1}), Phase(0.5, {"code": 1}, ramp=0.3), Phase(0.7, {"books": 1})],
            r"phase 1's ramp ends at 0.8 of the epoch, after phase 2 starts \(0.7\)",
        ),
        ([Phase(0, {"web": 1, "code": 1, "books": 1}, ramp=0.1)], r"first phase has a ramp"),
        ([{"samples": -5, "shares": {"web": 1}}], r"Phase\(samples=-5\): samples is a number of samples"),
        ([Phase(0, {"web": 1}), Phase(0.5, {"code": 1}), Phase(0.4, {"web": 1})], r"phase 2 starts at 0.4, not after"),
        ([Phase(0, {"web": 1, "news": 2})], r"phase 0 names \['news'\], which are not streams"),
        ([{"start": 0, "shares": {"web": 1}, "weight": 2}], r"schedule phase 0: .* not \['weight'\]"),
        (["web"], r"schedule phase 0 is 'web'"),
        (Phase(0, {"web": 1}), r"must be a list of phases"),
        ({"start": 0, "shares": {"web": 1}}, r"must be a list of phases"),
        (
            [{"start": 0, "shares": ["web", "code"]}],
            r"schedule phase 0: shares=\['web', 'code'\] must map stream names",
        ),
        ([{"start": "70%", "shares": {"web": 1}}], r"schedule phase 0: start='70%' must be a fraction"),
        (
            [Phase(0, {"web": 1, "books": 1}), Phase(0.001, {"code": 1})],  # phase 1 starts at position 0 too
            r"phase 0 \(from 0\) gets no position of an epoch of 150",
        ),
    ],
)
def test_a_bad_schedule_is_named(schedule, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):  # at construction, or (epoch sizes) at the manifest
        MixtureReader(make_streams(STREAMS), 150, schedule=schedule).manifest()


@pytest.mark.parametrize(
    ("start", "shares", "message"),
    [
        (1.0, {"web": 1}, r"start is a fraction of the epoch"),
        (0, {"web": 0, "code": 0}, r"sum to nothing"),
        (0, {"web": -1}, r"the share of stream 'web' is -1"),
        (0, {"web": float("nan")}, r"the share of stream 'web' is nan"),
        (0, {}, r"shares must map stream names"),
    ],
)
def test_a_bad_phase_is_named(start, shares, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        Phase(start, shares)


def test_the_datamodule_takes_a_schedule_only_for_a_mixed_mixture_of_streams() -> None:
    reader = make_streams(STREAMS)[0].reader
    with pytest.raises(ValueError, match=r"schedule=\.\.\.\)` changes the shares of a mixture's streams"):
        ShardedDataModule(reader, schedule=SCHEDULE)
    with pytest.raises(ValueError, match="a share schedule needs batch_composition='mixed', not 'stratified'"):
        ShardedDataModule(
            streams=make_streams(STREAMS), batch_size=8, batch_composition="stratified", schedule=SCHEDULE
        )
    data = ShardedDataModule(streams=make_streams(STREAMS), samples_per_epoch=150, schedule=SCHEDULE)
    assert data.engine.reader.manifest().epochs.draws == (65, 61, 24)  # type: ignore[union-attr]


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (1, 2), (2, 2), (3, 1), (4, 3)])
@pytest.mark.parametrize("consumed", [0, 37])
def test_a_scheduled_epoch_is_trained_phase_after_phase_on_every_rank_at_once(
    world: int, workers: int, consumed: int
) -> None:
    """The plan serves a scheduled epoch in time order: in the DataLoader's delivery order, batch i
    of every rank holds the positions trained at step i, so all ranks cross a phase boundary at the
    same step, and nothing is served twice or left out (also when resumed after ``consumed``)."""
    manifest = scheduled()
    order = manifest.order(9, 0)
    done = RangeSet.interval(0, consumed)
    plan = plan_epoch(order, done, world_size=world, num_workers=workers, batch_size=8)
    phase_of = order.interleave.phase_of
    steps: list[list[int]] = []
    served: list[int] = []
    for rank in range(world):
        tasks = list(plan.rank(rank).tasks())
        assert [t.index for t in tasks] == list(range(len(tasks)))  # delivered in batch order
        for step, task in enumerate(tasks):
            real = task.positions[: task.positions.size - task.num_padding]
            if step < 2 and consumed == 0:  # a batch is a stretch of the order: mixed, never one stream
                assert set(order.streams(real)[0].tolist()) == {0, 1}, (rank, step)
            served += real.tolist()
            while len(steps) <= step:
                steps.append([])
            steps[step] += phase_of(real).tolist()
    assert sorted(served) == list(range(consumed, 150))
    for step, phases in enumerate(steps):  # a step holds at most the two phases it crosses between
        assert max(phases) - min(phases) <= 1, (step, phases)
    firsts = [min(p) for p in steps]
    assert firsts == sorted(firsts) and steps[-1][-1] == 2


def test_inspect_shows_each_phase_and_how_far_it_is_consumed() -> None:
    from lightning_sharding.cli.checkpoint import _stream_lines
    from lightning_sharding.core.ledger import Ledger

    manifest = scheduled()
    summary = manifest.summary()
    ledger = Ledger(seed=1, total=manifest.total, manifest=summary)
    ledger.merge(RangeSet.interval(0, 80))  # all of phase 0 (75) and 5 of phase 1
    lines = _stream_lines(summary["streams"], ledger, summary)
    assert "phase 0      from 0 of the epoch (positions 0..74: web 38, code 37): consumed 75 of 75" in lines
    assert "phase 1      from 0.5 of the epoch (positions 75..119: web 27, code 9, books 9): consumed 5 of 45" in lines
    assert "phase 2      from 0.8 of the epoch (positions 120..149: code 15, books 15): consumed 0 of 30" in lines


def test_the_logger_gets_the_shares_of_the_phase_being_trained(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``data/share/<stream>`` each step: the phase's draws over its positions (web 0 in the tail)."""
    import csv

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return (self.w - batch["y"].float().mean()) ** 2

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = ShardedDataModule(streams=make_streams(STREAMS), samples_per_epoch=150, schedule=SCHEDULE, batch_size=10)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        callbacks=[ShardingCallback(log_every_n_steps=1)],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), datamodule=data)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f) if r.get("data/share/web")}
    shares = [
        (float(r["data/progress"]), float(r["data/share/web"]), float(r["data/share/books"])) for r in rows.values()
    ]
    assert len(shares) == 15  # one a step, 15 steps of 10
    for progress, web, books in shares:  # progress: after the step; the phase of the next position
        position = round(progress * 150)
        expected = (38 / 75, 0.0) if position < 75 else (27 / 45, 9 / 45) if position < 120 else (0.0, 0.5)
        assert (web, books) == pytest.approx(expected), (position, web, books)


def test_a_checkpoint_of_one_schedule_refuses_another_naming_the_phase_unless_allowed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Resumed under another schedule, a checkpoint is refused, naming the phase that differs; with
    ``allow_mixture_change=True`` the rest of its epoch is served once, nothing consumed again."""
    from lightning_sharding import CheckpointMismatchError
    from tests.support.harness import cpu_trainer
    from tests.unit.test_streams import Counting

    def data(schedule, **options):  # type: ignore[no-untyped-def]
        return ShardedDataModule(
            streams=make_streams(STREAMS), samples_per_epoch=150, schedule=schedule, batch_size=10, seed=2, **options
        )

    from lightning.pytorch.callbacks import ModelCheckpoint

    first = Counting()
    every_5 = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=5)
    cpu_trainer(max_steps=5, callbacks=[every_5], enable_checkpointing=True).fit(first, datamodule=data(SCHEDULE))
    later = [SCHEDULE[0], Phase(0.6, {"web": 1, "books": 1})]
    with pytest.raises(CheckpointMismatchError, match=r"schedule phase 1 was from 0.5: .*, now from 0.6"):
        cpu_trainer(max_steps=8).fit(Counting(), datamodule=data(later), ckpt_path=tmp_path / "mid.ckpt")
    rest = Counting()
    cpu_trainer(max_epochs=1).fit(
        rest, datamodule=data(later, allow_mixture_change=True), ckpt_path=tmp_path / "mid.ckpt"
    )
    before, after = first.seen[0], rest.seen[0]
    assert sum(before.values()) == 50 and sum(after.values()) == 100  # 5 steps of 10, then the rest of 150
    web_before = {i for (stream, i) in before if stream == 0}
    assert not web_before & {i for (stream, i) in after if stream == 0}  # web: nothing consumed served again
