"""``skip=``: what it takes (and refuses, by name), the ledger's skipped positions across epochs and
checkpoints, and the replay of steps past a checkpoint that names them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from lightning_sharding import ShardedDataModule, SyntheticReader
from lightning_sharding.config.schemas import CONF_DIR
from lightning_sharding.core.history import replay_steps, segment_entry
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.skip import Skip, SkipError
from lightning_sharding.train import build_datamodule


def test_skip_takes_step_ranges_lists_and_mappings_and_says_them_back() -> None:
    assert Skip.of(None) is None
    assert Skip.of("81200-81400,81500").steps == ((81200, 81400), (81500, 81500))  # type: ignore[union-attr]
    assert Skip.of([4, 9]).steps == ((4, 4), (9, 9))  # type: ignore[union-attr]
    skip = Skip.of({"samples": "10-19", "epoch": 2})
    assert skip is not None and (skip.samples, skip.epoch, skip.describe()) == (
        ((10, 19),),
        2,
        "samples 10-19 of epoch 2",
    )
    assert Skip.of({"steps": "4-5", "checkpoint": "late.ckpt"}).describe() == "steps 4-5, as late.ckpt trained them"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("4..5", "'4..5' is not a number or a range 'first-last'"),
        ("9-4", "the range '9-4' ends before it starts"),
        ({"step": "4"}, "skip= has no key 'step'"),
        ({"epoch": 1}, "names no steps, samples or documents"),
        ({"checkpoint": "x.ckpt", "samples": [3]}, "checkpoint: replays steps="),
        ([True], "True is not a non-negative integer"),
        (3.5, "3.5 is neither ranges"),
    ],
)
def test_a_bad_skip_is_refused_naming_the_value(value: object, says: str) -> None:
    with pytest.raises(SkipError, match=None) as err:
        Skip.of(value)
    assert says in str(err.value)
    with pytest.raises(ValueError, match=r"ShardedDataModule\(skip="):
        ShardedDataModule(SyntheticReader(sizes=[8]), skip=value)  # type: ignore[arg-type]


def test_the_ledger_keeps_skipped_positions_apart_from_consumed_and_moves_later_epochs_in() -> None:
    ledger = Ledger(seed=1, total=20, manifest={"fingerprint": "f"})
    ledger.consumed = RangeSet.interval(0, 4)
    ledger.skip({0: RangeSet.interval(6, 8), 1: RangeSet.interval(0, 2)})
    assert (len(ledger.consumed), len(ledger.skipped), ledger.settled.ranges()) == (4, 2, [(0, 4), (6, 8)])
    restored = Ledger.from_state_dict(ledger.state_dict())  # a checkpoint keeps both
    assert restored.skipped.ranges() == [(6, 8)] and restored.skip_ahead[1].ranges() == [(0, 2)]
    plan = plan_epoch(20, restored.settled, epoch=0, world_size=1, num_workers=0, batch_size=4)
    served = np.concatenate([t.positions for t in plan.rank(0).tasks()])
    assert sorted(served.tolist()) == [4, 5, *range(8, 20)]  # neither consumed nor skipped
    restored.start_epoch(1)
    assert restored.skipped.ranges() == [(0, 2)] and not restored.skip_ahead and not restored.consumed
    restored.start_epoch(2)
    assert not restored.skipped


def test_steps_past_the_checkpoint_replay_as_its_run_went_on_into_the_next_epoch() -> None:
    """Steps past the checkpoint's are replayed on its last run's topology, also across an epoch's end,
    the next epoch planned without what a skip left out of it ahead."""
    ledger = Ledger(seed=1, total=30, manifest={"fingerprint": "f"})
    entry = dict(world_size=2, num_workers=1, batch_size=4, accumulate=1, even_batches="pad")
    ledger.history.append(segment_entry(step=0, epoch=0, consumed=RangeSet(), **entry))  # type: ignore[arg-type]
    state = {**ledger.state_dict(), "global_step": 2}
    with pytest.raises(ValueError, match="covers steps 0 to 1"):
        replay_steps(state, [5])
    steps = replay_steps(state, [3, 4, 5], beyond=True)  # the epoch: 4 steps of 2 ranks x 4 (30 -> 32, padded)
    assert [steps[s][0].epoch for s in (3, 4, 5)] == [0, 1, 1]
    assert [len(r.positions) for r in steps[3]] == [3, 3]  # the epoch's last, padding left out
    later = {**state, "history": {"version": 1, "segments": [{**state["history"]["segments"][0]}]}}
    later["history"]["segments"][0]["ahead"] = [[1, 0, 8]]  # epoch 1's first 8 left out by a skip
    first_of_epoch_1 = replay_steps(later, [4], beyond=True)[4]
    assert min(int(r.positions.min()) for r in first_of_epoch_1) == 8


def test_hydra_takes_skip_from_the_command_line(tmp_path: Path) -> None:
    base = [f"out_dir={tmp_path}", f"data.cache_dir={tmp_path}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        steps = compose("train", overrides=[*base, "data.skip=81200-81400"])
        samples = compose("train", overrides=[*base, "data.skip={samples:'10-19',epoch:1}"])
    assert build_datamodule(steps).skip == Skip(steps=((81200, 81400),))
    assert build_datamodule(samples).skip == Skip(samples=((10, 19),), epoch=1)


def _keeper(skip: object) -> object:
    """A keeper of 40 synthetic samples on one rank, taking ``skip=``."""
    from lightning_sharding.core.world import World
    from lightning_sharding.loading.engine import LoadingEngine

    reader = SyntheticReader(sizes=[40])
    engine = LoadingEngine.from_arguments("ShardedDataModule", reader, batch_size=4, seed=3, skip=skip)
    return engine.setup(reader, World())


def _checkpoint_state(global_step: int) -> dict[str, object]:
    """A checkpoint's ledger entry of the keeper's data after ``global_step`` steps of batches of 4."""
    keeper = _keeper(None)
    ledger = keeper.ledger  # type: ignore[attr-defined]
    entry = dict(world_size=1, num_workers=0, batch_size=4, accumulate=1, even_batches="pad")
    ledger.history.append(segment_entry(step=0, epoch=0, consumed=RangeSet(), **entry))  # type: ignore[arg-type]
    ledger.consumed = RangeSet.interval(0, 4 * global_step)
    return {**ledger.state_dict(), "global_step": global_step}


def test_a_resume_applies_a_skip_once_and_refuses_steps_its_weights_hold(capsys: pytest.CaptureFixture[str]) -> None:
    state = _checkpoint_state(3)
    keeper = _keeper("3-4")
    keeper.restore(state, 3, "ckpt-3")  # type: ignore[attr-defined]
    assert keeper.ledger.skipped.ranges() == [(12, 20)]  # type: ignore[attr-defined]
    assert "skip= steps 3-4: 8 sample(s) of epoch 0 left out" in capsys.readouterr().err
    # A requeue with the same skip= from a later checkpoint of that run: applied already, nothing more.
    later = keeper.ledger  # type: ignore[attr-defined]
    later.consumed = later.consumed | RangeSet.interval(20, 28)
    again = _keeper("3-4")
    again.restore({**later.state_dict(), "global_step": 5}, 5, "ckpt-5")  # type: ignore[attr-defined]
    assert again.ledger.skipped.ranges() == [(12, 20)] and len(again.ledger.skips) == 1  # type: ignore[attr-defined]
    assert "was applied at the resume from step 3 already" in capsys.readouterr().err
    with pytest.raises(SkipError, match="step 2 is in this checkpoint's weights already"):
        _keeper("2-4").restore(state, 3, "ckpt-3")  # type: ignore[attr-defined]
    with pytest.raises(SkipError, match="position 40 is outside an epoch of 40 samples"):
        _keeper({"samples": "38-40"}).restore(state, 3, "ckpt-3")  # type: ignore[attr-defined]
    with pytest.raises(SkipError, match="are in the checkpoint's weights already"):
        _keeper({"samples": "0-5"}).restore(state, 3, "ckpt-3")  # type: ignore[attr-defined]
    with pytest.raises(SkipError, match="names documents of packed token sequences .* give samples="):
        _keeper({"documents": "2"}).restore(state, 3, "ckpt-3")  # type: ignore[attr-defined]


def test_steps_trained_after_another_resume_are_replayed_from_the_later_checkpoint_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The spike's steps were trained by a resume on 2 ranks, which the step-3 checkpoint (1 rank) does not
    know: ``checkpoint=`` names a later one whose history holds them, and its positions are left out."""
    import torch

    from lightning_sharding.core.history import replay_step

    state = _checkpoint_state(3)
    later = Ledger.from_state_dict(state)
    entry = dict(num_workers=0, batch_size=4, accumulate=1, even_batches="pad")
    later.history.append(segment_entry(step=3, epoch=0, consumed=later.consumed, world_size=2, **entry))  # type: ignore[arg-type]
    later.consumed = later.consumed | RangeSet.interval(12, 36)
    path = tmp_path / "late.ckpt"
    saved = {**later.state_dict(), "global_step": 6}
    saved["consumed"] = torch.from_numpy(saved["consumed"])  # as a checkpoint holds it (weights_only)
    torch.save({"lightning_sharding": saved, "global_step": 6}, path)
    keeper = _keeper({"steps": "4-5", "checkpoint": str(path)})
    keeper.restore(state, 3, "ckpt-3")  # type: ignore[attr-defined]
    on_two_ranks = np.concatenate([r.positions for s in (4, 5) for r in replay_step(later.state_dict(), s, 6)])
    assert keeper.ledger.skipped == RangeSet.from_positions(on_two_ranks)  # type: ignore[attr-defined]
    assert len(on_two_ranks) == 16  # 2 steps x 2 ranks x 4, where the step-3 checkpoint's run would give 8
    assert f"as {path}'s history replays them" in capsys.readouterr().err


def test_documents_follow_the_loaders_order_also_unshuffled(tmp_path: Path) -> None:
    """``documents=`` leaves out the sequences that hold the document in the order the loader serves,
    which ``shuffle=False`` changes: the keeper plans with the loader's own setting."""
    from lightning_sharding.core.world import World
    from lightning_sharding.loading.engine import LoadingEngine
    from lightning_sharding.tokens import IndexedTokens, Packing
    from tests.support.data.tokens import write_corpus

    write_corpus(tmp_path, files=2, documents=12)
    for shuffle in (False, True):
        reader = IndexedTokens(f"{tmp_path}/part-*.idx")
        arguments = dict(batch_size=2, seed=3, shuffle=shuffle, packing=Packing(seq_len=16, mode="best_fit"))
        plain = LoadingEngine.from_arguments("ShardedDataModule", reader, **arguments)  # type: ignore[arg-type]
        keeper = plain.setup(plain.reader, World())  # type: ignore[arg-type]
        entry = dict(world_size=1, num_workers=0, batch_size=2, accumulate=1, even_batches="pad")
        keeper.ledger.history.append(segment_entry(step=0, epoch=0, consumed=RangeSet(), **entry))  # type: ignore[arg-type]
        state = {**keeper.ledger.state_dict(), "global_step": 0}
        order = keeper.manifest.order(3, 0, shuffle=shuffle)
        rows, docs, _, _ = order.pieces(np.arange(order.total))
        engine = LoadingEngine.from_arguments("ShardedDataModule", reader, **arguments, skip={"documents": 5})  # type: ignore[arg-type]
        skipping = engine.setup(engine.reader, World())  # type: ignore[arg-type]
        skipping.restore(state, 0, "ckpt-0")
        assert skipping.ledger.skipped == RangeSet.from_positions(rows[docs == 5]), shuffle


def test_a_ledger_with_skipped_samples_is_one_an_earlier_release_refuses_and_this_one_reads() -> None:
    from lightning_sharding.core.ledger import LEDGER_VERSION, SKIPPED_VERSION

    ledger = Ledger(seed=1, total=20, manifest={"fingerprint": "f"})
    assert ledger.state_dict()["version"] == LEDGER_VERSION
    ledger.skip({0: RangeSet.interval(2, 4)})
    state = ledger.state_dict()
    assert state["version"] == SKIPPED_VERSION != LEDGER_VERSION  # a release before skip= refuses it by version
    assert Ledger.from_state_dict(state).skipped.ranges() == [(2, 4)]


def _run(
    directory: Path, run: str, started: float, start: int, lines: list[dict[str, object]], **header: object
) -> None:
    from lightning_sharding.loading.audit import AuditWriter

    base = {"started": started, "world_size": 1, "seed": 5, "total": 12, "fingerprint": "f", "start_step": start}
    writer = AuditWriter(directory, run, 0, {**base, **header})
    for line in lines:
        writer._write(line)
    writer.close()


def test_the_audit_cuts_every_run_at_a_rollback_and_takes_the_skips_of_the_line_that_trained() -> None:
    """Run a trains steps 0-5 (2 positions a step), run b resumes at step 4 and trains 4-5 again, then
    the loss spiked: run c resumes from step 2 with skip= leaving steps 2-3's positions [4, 8) out, and
    trains the rest. Exactly-once holds with 4 skipped; a run d rolled back to step 2 again without
    skip= trains them, and the skips of the line it replaced no longer count."""
    import tempfile

    from lightning_sharding.loading.audit import audit

    def steps(first: int, positions: list[tuple[int, int]], end: bool = False) -> list[dict[str, object]]:
        lines: list[dict[str, object]] = [
            {"kind": "step", "epoch": 0, "gs": first + k + 1, "pos": [list(p)], "pad": 0}
            for k, p in enumerate(positions)
        ]
        gs = first + len(positions)
        return lines + ([{"kind": "epoch_end", "epoch": 0, "gs": gs, "dropped": 0}] if end else [])

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        _run(root, "a", 1.0, 0, steps(0, [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]))
        _run(root, "b", 2.0, 4, steps(4, [(8, 10), (10, 12)]))
        _run(root, "c", 3.0, 2, steps(2, [(8, 10), (10, 12)], end=True), skipped=[[0, 4, 8]])
        (row,) = audit([root])
        assert (row.consumed, row.duplicates, row.missing, row.skipped, row.skipped_trained, row.ok) == (
            8,
            0,
            0,
            4,
            0,
            True,
        )
        _run(root, "d", 4.0, 2, steps(2, [(4, 6), (6, 8), (8, 10), (10, 12)], end=True))
        (row,) = audit([root])
        assert (row.consumed, row.duplicates, row.missing, row.skipped, row.ok) == (12, 0, 0, 0, True)


def test_a_mixture_changed_at_a_resume_is_refused_while_its_epoch_holds_skipped_samples() -> None:
    """A changed mixture draws the rest of the epoch anew: the skipped samples would be drawn again."""
    from lightning_sharding.core.ledger import CheckpointMismatchError
    from lightning_sharding.core.world import World
    from lightning_sharding.loading.engine import LoadingEngine
    from lightning_sharding.mixture import Stream

    def keeper(web: int, **more: object) -> object:
        streams = [Stream("web", SyntheticReader(sizes=[30]), weight=web), Stream("code", SyntheticReader(sizes=[20]))]
        engine = LoadingEngine.from_arguments("ShardedDataModule", batch_size=4, seed=3, streams=streams, **more)  # type: ignore[arg-type]
        return engine.setup(engine.reader, World())  # type: ignore[arg-type]

    before = keeper(1, skip={"samples": "8-11"})
    ledger = before.ledger  # type: ignore[attr-defined]
    ledger.consumed = RangeSet.interval(0, 8)
    before.restore({**ledger.state_dict(), "global_step": 2}, 2, "ckpt-2")  # type: ignore[attr-defined]
    state = {**before.ledger.state_dict(), "global_step": 4}  # type: ignore[attr-defined]
    assert state["skipped"] == [8, 12]
    with pytest.raises(CheckpointMismatchError, match="left samples of epoch 0 out at a resume with skip="):
        keeper(3, allow_mixture_change=True).restore(state, 4, "ckpt-4")  # type: ignore[attr-defined]


@pytest.mark.needs("nvidia.dali")  # a DaliStrategy is made only where DALI is installed
def test_steps_are_refused_by_a_strategy_whose_batches_the_history_does_not_replay() -> None:
    with pytest.raises(ValueError, match=r"strategy 'dali' merges a run of each of its 2 sources .* name samples"):
        ShardedDataModule(SyntheticReader(sizes=[8]), sharding="dali", num_workers=2, skip="3-4")
    ShardedDataModule(SyntheticReader(sizes=[8]), sharding="dali", num_workers=2, skip={"samples": "3-4"})
    ShardedDataModule(SyntheticReader(sizes=[8]), sharding="dali", num_workers=1, skip="3-4")
