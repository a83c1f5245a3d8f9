"""Online control of a mixture, without processes: a decision leaves every earlier position's sample
where it was, draws from its position at its shares, carries into the next epoch, and is kept by
the ledger; bad shares are named with the step that made them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_sharding import SyntheticReader
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.lightning.controller import ExcessLossWeights, MixtureController, StreamStats
from lightning_sharding.mixture import ControlledMixture, Decision, MixtureReader, Stream, check_shares
from lightning_sharding.strategies.shard import delivered_positions


def manifest(total: int = 120):
    streams = [Stream("a", SyntheticReader(sizes=[50, 50])), Stream("b", SyntheticReader(sizes=[30]))]
    return MixtureReader(streams, total).manifest()


def located(m, controlled: ControlledMixture, epoch: int = 0) -> list[tuple[int, int]]:
    items, index = controlled.order(m.counts, 7, epoch).locate(np.arange(m.total))
    return list(zip(items.tolist(), index.tolist(), strict=True))


def test_a_decision_keeps_every_earlier_position_and_draws_the_rest_at_its_shares() -> None:
    m = manifest()
    none = ControlledMixture(m.epochs)
    first = none.decided(Decision(0, 40, {"a": 1, "b": 9}))
    second = first.decided(Decision(0, 80, {"a": 1}))
    base, one, two = located(m, none), located(m, first), located(m, second)
    assert base[:40] == one[:40] and one[:80] == two[:80] and one[40:] != base[40:]
    streams, _ = first.order(m.counts, 7, 0).streams(np.arange(40, 120))
    assert np.bincount(streams, minlength=2).tolist() == [8, 72]
    assert second.order(m.counts, 7, 0).draws == (64, 56)
    # b has 30 samples: 56 draws are one pass and 26 of a second; never a sample twice before its pass ends.
    b = [key for key in two if key[0] == 2]
    assert len(b) == 56 and len(set(b[:30])) == 30
    assert second.shares_at(0, 10) == {"a": 0.5, "b": 0.5} and second.shares_at(0, 100) == {"a": 1.0, "b": 0.0}


def test_the_last_decision_holds_from_the_next_epochs_start_and_a_deferred_one_changes_only_those() -> None:
    m = manifest()
    deferred = ControlledMixture(m.epochs).decided(Decision(0, 120, {"b": 1}))
    assert located(m, deferred, 0) == located(m, ControlledMixture(m.epochs), 0)
    assert deferred.order(m.counts, 7, 1).draws == (0, 120)
    assert deferred.shares_at(1, 0) == {"a": 0.0, "b": 1.0}


def test_a_controlled_epoch_is_planned_in_time_order_and_the_delivered_windows_are_a_prefix() -> None:
    m = manifest()
    order = ControlledMixture(m.epochs).order(m.counts, 7, 0)
    assert order.in_time_order
    plan = plan_epoch(order, RangeSet.interval(0, 16), world_size=2, num_workers=2, batch_size=4)
    delivered, position = delivered_positions(plan, 3)
    assert delivered == RangeSet.interval(16, 40) and position == 40
    assert delivered_positions(plan, 13)[1] == 120  # into the last, partial window: from the next epoch
    gaps = plan_epoch(order, RangeSet.interval(100, 104), world_size=2, num_workers=2, batch_size=4)
    assert delivered_positions(gaps, 1)[1] == 120  # consumed positions after it: it cannot start there


def test_the_ledger_keeps_the_decisions_and_an_earlier_release_refuses_them() -> None:
    ledger = Ledger(seed=1, total=120, manifest={"fingerprint": "f"})
    ledger.decisions = [Decision(0, 40, {"a": 1.0}, 4).state()]
    state = ledger.state_dict()
    assert state["version"] == 3
    again = Ledger.from_state_dict(state)
    again.start_epoch(1)
    assert again.decisions == ledger.decisions and Decision.from_state(again.decisions[0]).position == 40


@pytest.mark.parametrize(
    ("shares", "said"),
    [
        ({"a": math.nan}, "share of stream 'a' is nan"),
        ({"a": -1.0, "b": 2.0}, "share of stream 'a' is -1.0"),
        ({"c": 1.0}, "['c'] are not streams"),
        ({"a": 0, "b": 0}, "sum to nothing"),
        ([0.5, 0.5], "must map stream names"),
    ],
)
def test_bad_shares_are_named_with_where_they_came_from(shares: object, said: str) -> None:
    with pytest.raises(ValueError, match="at step 12") as err:
        check_shares(shares, ("a", "b"), "MixtureController: the policy's shares at step 12")
    assert said in str(err.value)


def test_the_doremi_style_policy_upweights_the_stream_with_the_most_excess_loss() -> None:
    policy = ExcessLossWeights({"a": 1.0, "b": 1.0}, lr=1.0, smoothing=0.0)
    stats = StreamStats(step=4, epoch=0, shares={"a": 0.5, "b": 0.5}, loss={"a": 3.0, "b": math.nan}, samples={})
    shares = policy(stats)
    assert shares["a"] == pytest.approx(math.e**2 / (math.e**2 + 1)) and sum(shares.values()) == pytest.approx(1)


def test_a_controller_refuses_a_bad_interval_or_policy() -> None:
    with pytest.raises(ValueError, match="every_n_steps=0"):
        MixtureController(lambda s: {}, every_n_steps=0)
    with pytest.raises(TypeError, match="policy=3"):
        MixtureController(3)  # type: ignore[arg-type]


def test_a_mixture_with_a_schedule_or_blocks_is_not_put_under_control() -> None:
    streams = [Stream("a", SyntheticReader(sizes=[50])), Stream("b", SyntheticReader(sizes=[30]))]
    blocked = MixtureReader(streams, 40, composition="stratified", batch_size=8).manifest()
    with pytest.raises(ValueError, match="batch_composition='stratified'"):
        ControlledMixture(blocked.epochs)


def test_a_schedule_over_training_cuts_the_epochs_where_its_samples_fall() -> None:
    """Phases from samples of training: a phase at sample 180 of epochs of 120 starts at position 60
    of epoch 1; epoch 0 is the first phase's, epoch 2 the last's; the ramp's 16 steps move between."""
    from lightning_sharding.mixture import Phase

    streams = [Stream("a", SyntheticReader(sizes=[50, 50])), Stream("b", SyntheticReader(sizes=[30]))]
    schedule = [Phase(shares={"a": 1}), Phase(shares={"b": 1}, samples=180, ramp=32)]
    m = MixtureReader(streams, 120, schedule=schedule).manifest()
    assert isinstance(m.epochs, ControlledMixture) and m.summary()["training_schedule"][0] == {
        "samples": 0,
        "shares": {"a": 1},
    }
    orders = [m.order(7, e) for e in (0, 1, 2)]
    assert [o.draws for o in orders] == [(120, 0), (76, 44), (0, 120)]
    streams_1, _ = orders[1].streams(np.arange(120))
    assert set(streams_1[:60].tolist()) == {0} and set(streams_1[92:].tolist()) == {1}
    ramp = streams_1[60:92]
    assert 0 < int(ramp.sum()) < 32 and ramp[:8].sum() < ramp[-8:].sum()  # more b as the ramp goes
    # The audit and inspect lay the epochs out from the summary alone, as the order does.
    from lightning_sharding.mixture import layout_of_summary

    summary = m.summary()
    for e, order in enumerate(orders):
        again, _ = layout_of_summary(summary["streams"], summary, e).streams(np.arange(120))
        assert np.array_equal(again, order.streams(np.arange(120))[0])
    # Another schedule is another mixture: a checkpoint of one refuses the other, naming it.
    other = MixtureReader(streams, 120, schedule=[Phase(shares={"a": 1}), Phase(shares={"b": 1}, samples=240)])
    changed = other.manifest()
    assert changed.fingerprint != m.fingerprint
    assert "schedule over training was from sample 0" in changed.explain_mismatch(summary)


def test_a_ramp_in_a_schedule_of_the_epoch_moves_the_shares_in_steps() -> None:
    from lightning_sharding.mixture import Phase

    streams = [Stream("a", SyntheticReader(sizes=[50, 50])), Stream("b", SyntheticReader(sizes=[30]))]
    m = MixtureReader(streams, 160, schedule=[Phase(0, {"a": 1}), Phase(0.5, {"b": 1}, ramp=0.2)]).manifest()
    schedule = m.summary()["schedule"]
    assert len(schedule) == 2 + 16 and schedule[1]["note"] == "ramp 1/16 to phase 1"
    assert [p["draws"][1] for p in schedule[1:17]] == sorted(p["draws"][1] for p in schedule[1:17])
    assert schedule[-1]["start"] == pytest.approx(0.7) and schedule[-1]["draws"] == [0, 48]


def _fit(policy, tmp_path, epochs: int = 1, decisions=(), checkpoint_every: int | None = None):  # type: ignore[no-untyped-def]
    """An in-process fit of a small mixture under a MixtureController: (datamodule, controller)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_sharding import ShardedDataModule, log_stream_loss

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            per_sample = (self.w - batch["y"].float()) ** 2
            log_stream_loss(self, per_sample, batch)
            return per_sample.mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    streams = [Stream("a", SyntheticReader(sizes=[50, 50])), Stream("b", SyntheticReader(sizes=[30]))]
    data = ShardedDataModule(streams=streams, samples_per_epoch=120, batch_size=10, seed=3)
    controller = MixtureController(policy, every_n_steps=2, decisions=decisions)
    saves = [ModelCheckpoint(tmp_path, every_n_train_steps=checkpoint_every, save_top_k=-1)] if checkpoint_every else []
    pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        callbacks=[controller, *saves],
        logger=False,
        enable_checkpointing=bool(saves),
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(Model(), datamodule=data)
    return data, controller


def test_a_policy_that_raises_or_returns_a_tensor_share_is_handled_naming_the_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    def broken(stats: StreamStats) -> dict[str, float]:
        raise KeyError("missing")

    with pytest.raises(ValueError, match=r"the policy raised at step 2: KeyError: 'missing'") as err:
        _fit(broken, tmp_path)
    assert isinstance(err.value.__cause__, KeyError)  # the policy's own traceback is kept
    # A 0-d tensor is a number; the shares the policy is handed are the ones it gave, exactly.
    handed: list[dict[str, float]] = []

    def tensors(stats: StreamStats) -> dict[str, object]:
        handed.append(stats.shares)
        return {"a": torch.tensor(0.01), "b": torch.tensor(0.99)}

    data, controller = _fit(tensors, tmp_path, epochs=2)
    assert handed[0] == {"a": 0.5, "b": 0.5} and all(h == pytest.approx({"a": 0.01, "b": 0.99}) for h in handed[1:])
    # The datamodule's manifest is the one the ledger plans by: it knows the decisions.
    from lightning_sharding.mixture import mixture_of

    manifest = data.manifest
    assert manifest is not None
    again = ControlledMixture(mixture_of(manifest), tuple(controller.decisions))  # type: ignore[arg-type]
    draws = manifest.order(3, 1).draws
    assert draws == again.order(manifest.counts, 3, 1).draws and draws[0] < 10 and draws != (60, 60)
    assert len(controller.decisions) == 12


def test_decisions_replay_only_into_epochs_of_their_size_and_a_run_without_the_controller_is_warned(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    made = [Decision(0, 40, {"b": 1.0}, 4, total=100).state()]
    with pytest.raises(ValueError, match=r"made in epochs of 100 samples, and these have 120"):
        _fit(None, tmp_path, decisions=made)
    _fit(lambda stats: {"a": 1.0, "b": 3.0}, tmp_path / "run", checkpoint_every=3)
    checkpoint = sorted((tmp_path / "run").glob("*step=6.ckpt"))[0]
    held = MixtureController.decisions_in(checkpoint)
    assert [d["step"] for d in held] == [2, 4, 6] and held[0]["total"] == 120
    import lightning.pytorch as pl
    import torch

    from lightning_sharding import ShardedDataModule, ShardingCallback

    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return ((self.w - batch["y"].float()) ** 2).mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    streams = [Stream("a", SyntheticReader(sizes=[50, 50])), Stream("b", SyntheticReader(sizes=[30]))]
    data = ShardedDataModule(streams=streams, samples_per_epoch=120, batch_size=10, seed=3)
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", callbacks=[ShardingCallback()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"holds 3 decision\(s\) of a MixtureController and this run has none"):
        trainer.fit(Plain(), datamodule=data, ckpt_path=str(checkpoint))
    from lightning_sharding.mixture import mixture_of

    manifest = data.manifest
    assert manifest is not None
    again = ControlledMixture(mixture_of(manifest), tuple(Decision.from_state(d) for d in held))  # type: ignore[arg-type]
    assert manifest.order(3, 0).draws == again.order(manifest.counts, 3, 0).draws != (60, 60)
