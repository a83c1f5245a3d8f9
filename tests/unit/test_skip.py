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
