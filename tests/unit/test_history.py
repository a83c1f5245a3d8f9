"""The training history in the ledger and its replay: the positions of any global step, on every rank,
against a planner-driven simulation of a chain of resumes on other topologies."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_sharding.core.history import StepNotInHistoryError, replay_step, segment_entry
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet

Topology = tuple[int, int, int, int]  # ranks, workers, batch size, accumulation


def simulate(total: int, chain: list[tuple[Topology, int]], epochs: int = 2) -> tuple[Ledger, dict[int, list[Any]]]:
    """Train ``chain`` (each topology for a number of optimizer steps, then a checkpoint and a resume)
    as the loader and Lightning do: every rank's tasks in DataLoader order; an optimizer step where the
    epoch's batch count (Lightning's, kept across a resume) is a multiple of ``accumulate``, and at the
    epoch's last batch. Returns the last ledger and, per global step, what each rank trained."""
    ledger = Ledger(seed=1, total=total, manifest={"fingerprint": "f"})
    trained: dict[int, list[Any]] = {}
    step = before = 0  # before: the epoch's batches so far, as Lightning counts them
    for (ranks, workers, batch, accumulate), steps in chain:
        state = ledger.state_dict()
        ledger = Ledger.from_state_dict(state)  # the resume
        ledger.history.append(
            segment_entry(
                step=step,
                epoch=ledger.epoch,
                consumed=ledger.consumed,
                world_size=ranks,
                num_workers=workers,
                batch_size=batch,
                accumulate=accumulate,
                even_batches="pad",
                batches_before=before,
            )
        )
        stop = step + steps
        while step < stop and ledger.epoch < epochs:
            plan = plan_epoch(
                total, ledger.consumed, epoch=ledger.epoch, world_size=ranks, num_workers=workers, batch_size=batch
            )
            delivered = [list(plan.rank(r).tasks()) for r in range(ranks)]
            window: list[list[Any]] = [[] for _ in range(ranks)]
            for j in range(plan.num_batches):
                for r in range(ranks):
                    task = delivered[r][j]
                    window[r].append(task.positions[: task.positions.size - task.num_padding])
                    ledger.record(window[r][-1])
                before += 1
                if before % accumulate == 0 or j == plan.num_batches - 1:
                    ledger.commit()
                    trained[step] = [(ledger.epoch, w) for w in window]
                    window = [[] for _ in range(ranks)]
                    step += 1
                    if step >= stop:
                        break
            if before == 0 or j == plan.num_batches - 1:  # the epoch is over: Lightning starts the next
                ledger.start_epoch(ledger.epoch + 1)
                before = 0
    return ledger, trained


@pytest.mark.parametrize(
    "chain",
    [
        [((2, 2, 4, 1), 5), ((1, 3, 4, 1), 7), ((2, 1, 4, 1), 100)],
        [((2, 2, 3, 2), 3), ((3, 1, 2, 3), 4), ((1, 2, 5, 1), 100)],
        [((1, 0, 4, 1), 2), ((4, 2, 1, 2), 40), ((2, 3, 2, 1), 100)],
        [((2, 2, 3, 2), 3), ((1, 3, 2, 4), 2), ((2, 1, 4, 3), 100)],  # windows part-filled at each resume
    ],
)
def test_replay_names_every_step_of_a_chain_of_rescales(chain: list[tuple[Topology, int]]) -> None:
    ledger, trained = simulate(61, chain)
    state = ledger.state_dict()
    last = max(trained) + 1
    assert state["history"]["version"] == 1 and len(state["history"]["segments"]) == len(chain)
    restored = Ledger.from_state_dict(state).state_dict()  # the history survives a save and a load
    for step, ranks in trained.items():
        replayed = replay_step(restored, step, global_step=last)
        assert len(replayed) == len(ranks), step
        for got, (epoch, batches) in zip(replayed, ranks, strict=True):
            assert got.epoch == epoch, step
            assert [b.tolist() for b in got.batches] == [b.tolist() for b in batches], (step, got.rank)


def test_a_step_outside_the_history_names_the_range_it_covers() -> None:
    ledger, trained = simulate(40, [((2, 1, 4, 1), 3), ((1, 1, 4, 1), 2)])
    state = ledger.state_dict()
    with pytest.raises(StepNotInHistoryError, match="covers steps 0 to 4"):
        replay_step(state, 5, global_step=5)
    state["history"]["segments"] = state["history"]["segments"][1:]  # as if the first run predates histories
    with pytest.raises(StepNotInHistoryError, match="starts at the resume at step 3"):
        replay_step(state, 1, global_step=5)
    assert replay_step(state, 3, global_step=5)[0].positions.size == 4


def test_a_ledger_without_history_loads_and_replays_nothing() -> None:
    state = Ledger(seed=1, total=10, manifest={"fingerprint": "f"}).state_dict()
    assert "history" not in state
    assert Ledger.from_state_dict(state).history == []
    with pytest.raises(StepNotInHistoryError, match="records no training history"):
        replay_step(state, 0, global_step=1)


def test_inspect_step_names_each_sample_by_its_file_and_index() -> None:
    """With the data's manifest (``inspect --step N --data ...``), each position of the step is named by
    its item's key and the sample's index in it, as the epoch's order locates it."""
    from lightning_sharding.cli.checkpoint import format_step
    from lightning_sharding.core.manifest import Item, Manifest

    manifest = Manifest.from_items(
        [Item(f"/data/part-{i}.npy", n, fingerprint=str(i)) for i, n in enumerate((9, 7, 8))]
    )
    ledger, trained = simulate(manifest.total, [((2, 1, 3, 1), 2), ((1, 2, 3, 2), 100)], epochs=1)
    ledger.manifest = manifest.summary()
    state = ledger.state_dict()
    order = manifest.order(ledger.seed, 0)
    text = format_step(state, 2, global_step=max(trained) + 1, manifest=manifest)
    positions = [p for batch in trained[2][0][1] for p in batch.tolist()]
    items, index = order.locate(positions)
    for p, i, j in zip(positions, items.tolist(), index.tolist(), strict=True):
        assert f"  position {p}: /data/part-{i}.npy [{j}]" in text, text
    assert "rank 0 micro-batch 1: positions" in text, text


@pytest.mark.parametrize("layout", ["runs", "interleaved"])
@pytest.mark.parametrize(("total", "workers", "batch"), [(61, 3, 4), (10, 4, 3), (7, 0, 2), (100, 2, 7), (5, 6, 1)])
def test_the_dealt_batch_is_found_without_listing_the_tasks(total: int, workers: int, batch: int, layout: str) -> None:
    from lightning_sharding.core.history import _delivered

    plan = plan_epoch(total, RangeSet(), world_size=2, num_workers=workers, batch_size=batch, worker_layout=layout)
    for rank in range(2):
        rank_plan = plan.rank(rank)
        dealt = [t.index for t in rank_plan.tasks()]
        assert [_delivered(rank_plan, d) for d in range(len(dealt))] == dealt


def test_steps_no_plan_replays_are_refused_by_name() -> None:
    ledger, _ = simulate(40, [((2, 1, 4, 1), 3), ((1, 1, 4, 1), 2)])
    state = ledger.state_dict()
    first, second = state["history"]["segments"]
    first["fingerprint"] = "another mixture"
    with pytest.raises(StepNotInHistoryError, match="other data or another mixture"):
        replay_step(state, 1, global_step=5)
    assert replay_step(state, 3, global_step=5)[0].positions.size == 4  # the run after the change replays
    with pytest.raises(ValueError, match="need orders="):
        replay_step({**state, "manifest": {**state["manifest"], "streams": [{"name": "web"}]}}, 3, global_step=5)
    second["limited"] = True
    with pytest.raises(StepNotInHistoryError, match="limit_train_batches"):
        replay_step(state, 3, global_step=5)
    with pytest.raises(StepNotInHistoryError, match="online control"):
        replay_step({**state, "decisions": [{"step": 1}]}, 3, global_step=5)
    second["limited"], second["worker_layout"] = False, ""
    with pytest.raises(StepNotInHistoryError, match="dispatch"):
        replay_step(state, 3, global_step=5)
