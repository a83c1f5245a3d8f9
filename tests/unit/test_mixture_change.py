"""A mixture changed on resume (``allow_mixture_change``): through the ledger keeper that restores
checkpoints, the rest of the epoch serves none of the samples consumed before the change, at the new
shares within one sample, the same on every restore; without the opt-in the change is an error
naming the stream. The real-process test is tests/process/test_mixture.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding import CheckpointMismatchError, SyntheticReader
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import World
from lightning_sharding.loading.keeper import LedgerKeeper
from lightning_sharding.mixture import MixtureReader, Stream, change_of, mixture_of
from lightning_sharding.strategies.options import LoaderOptions

SIZES = {"web": [37, 41, 29], "code": [23, 17], "books": [11], "news": [19, 6]}
SEED = 77


def mixture(shares: dict[str, dict[str, Any]], per_epoch: int | None = None, **kw: Any) -> Manifest:
    streams = [Stream(n, SyntheticReader(sizes=SIZES[n]), **share) for n, share in shares.items()]
    return MixtureReader(streams, per_epoch, **kw).manifest()


def samples(manifest: Manifest, epoch: int, positions: np.ndarray) -> list[tuple[str, int]]:
    """The (item key, index) of each position: a sample's name whatever the manifest."""
    items, index = manifest.order(SEED, epoch).locate(positions)
    return [(manifest.items[i].key, j) for i, j in zip(items.tolist(), index.tolist(), strict=True)]


def checkpoint(before: Manifest, consumed: RangeSet) -> dict[str, Any]:
    ledger = Ledger(seed=SEED, total=before.total, manifest=before.summary())
    ledger.merge(consumed)
    keeper = LedgerKeeper(ledger, before, World(), LoaderOptions(8))
    return keeper.state(global_step=5)


def resume(state: dict[str, Any], after: Manifest, batch_size: int = 8, **kw: Any) -> LedgerKeeper:
    fresh = Ledger(seed=SEED, total=after.total, manifest=after.summary())
    keeper = LedgerKeeper(fresh, after, World(), LoaderOptions(batch_size), **kw)
    keeper.restore(state, global_step=5, source="last.ckpt")
    return keeper


def scattered(total: int, rng: np.random.Generator) -> RangeSet:
    """What 3 ranks consumed: a run from the start of each rank's third of the epoch."""
    third = total // 3
    return RangeSet.from_ranges((r * third, r * third + int(rng.integers(1, third))) for r in range(3))


CASES = [  # (before, after, per_epoch before, per_epoch after, composition)
    (
        {"web": {"weight": 3}, "code": {"weight": 1}, "books": {"repeat": 2.0}},
        {"web": {"weight": 1}, "code": {"weight": 3}, "books": {"repeat": 2.0}},
        150,
        150,
        "mixed",
    ),
    (
        {"web": {"weight": 3}, "code": {"weight": 1}, "books": {"repeat": 2.0}},
        {"web": {"weight": 1}, "news": {"weight": 1}},
        150,
        120,
        "mixed",
    ),
    (
        {"web": {"weight": 1}, "code": {"weight": 1}},
        {"code": {"weight": 1}, "web": {"weight": 2}, "books": {"choose": 5}},
        90,
        100,
        "stratified",
    ),
    (
        {"web": {"weight": 2}, "code": {"weight": 1}},
        {"web": {"weight": 1}, "code": {"weight": 1}},
        120,
        100,
        "per_stream",
    ),
]


@pytest.mark.parametrize(("old", "new", "n_old", "n_new", "composition"), CASES)
@pytest.mark.parametrize("draw", [0, 1, 2])
def test_the_rest_of_a_changed_epoch_serves_nothing_consumed_at_the_new_shares(
    old: dict[str, Any], new: dict[str, Any], n_old: int, n_new: int, composition: str, draw: int
) -> None:
    rng = np.random.default_rng(draw)
    before = mixture(old, n_old)
    after = mixture(new, n_new, composition=composition, batch_size=8)
    consumed = scattered(before.total, rng)
    keeper = resume(checkpoint(before, consumed), after, allow_mixture_change=True)
    ledger, change = keeper.ledger, change_of(keeper.manifest)
    assert change is not None and change.epoch == 0
    rest = n_new - len(consumed)
    assert (ledger.total, len(ledger.consumed), change.rest) == (rest + len(consumed), len(consumed), rest)
    # What the plan serves: every position not consumed, i.e. the rest.
    order = keeper.manifest.order(ledger.seed, 0)
    blocks = keeper.manifest.blocks_at(0)
    assert order is change and order.blocks == blocks
    plan = plan_epoch(order, ledger.trained, world_size=2, num_workers=2, batch_size=8)
    served = np.sort(np.concatenate([t.positions[t.num_padding :] for r in range(2) for t in plan.rank(r).tasks()]))
    assert np.array_equal(np.unique(served), np.arange(rest))
    old_samples = set(samples(before, 0, consumed.to_array()))
    rest_samples = samples(keeper.manifest, 0, np.arange(rest))
    per_stream = Counter(key.split("/")[0] for key, _ in rest_samples)
    new = mixture_of(after)
    assert new is not None
    for name, draws in zip(new.names, new.draws, strict=True):
        assert abs(per_stream[name] - rest * draws / n_new) < 1, (name, per_stream, rest)
    # Each stream serves samples it had left; only one asking for more than that repeats any.
    for report in change.report:
        mine = [s for s in rest_samples if s[0].startswith(f"{report.name}/")]
        assert len(mine) == report.planned
        if report.left is None:
            assert not mine, f"removed stream {report.name!r} is served"
        elif report.planned <= report.left:
            assert not old_samples & set(mine), f"{report.name!r}: a sample consumed before the change is served again"
            assert len(set(mine)) == len(mine), f"{report.name!r}: the rest serves a sample twice"
        else:  # all it had left, then fresh passes
            assert len(set(mine[: report.left]) - old_samples) == report.left, report
    # Blocked compositions: every block of the rest is one batch at the new composition.
    if composition != "mixed":
        assert blocks is not None and blocks.size == 8
        for task in (t for r in range(2) for t in plan.rank(r).tasks()):
            assert len(set(blocks.ids(task.positions).tolist())) == 1
    # The checkpoint of the changed epoch restores the same rest, and the next epoch is ordinary.
    again = resume(keeper.state(global_step=5), after)
    assert again.ledger.total == ledger.total and again.ledger.consumed == ledger.consumed
    assert samples(again.manifest, 0, np.arange(rest)) == rest_samples
    again.ledger.start_epoch(1)
    assert (again.ledger.total, again.ledger.change) == (after.total, None)
    assert samples(again.manifest, 1, np.arange(10)) == samples(after, 1, np.arange(10))


def test_a_stream_that_asks_for_more_than_it_has_left_serves_all_it_has_left_first() -> None:
    before = mixture({"books": {"weight": 1}, "code": {"weight": 1}}, 40)  # books 20: each of 11 once, 9 twice
    consumed = RangeSet.interval(0, 20)
    keeper = resume(checkpoint(before, consumed), mixture({"books": {"weight": 3}, "code": {"weight": 1}}, 40),
                    allow_mixture_change=True)  # fmt: skip
    rest = samples(keeper.manifest, 0, np.arange(20))  # books 15 of the rest; it has fewer left
    books_before = {s for s in samples(before, 0, consumed.to_array()) if s[0].startswith("books/")}
    books_rest = [s for s in rest if s[0].startswith("books/")]
    assert len(books_rest) == 15
    left = {(f"books/{it.key.split('/', 1)[1]}", j) for it in before.items[:1] for j in range(11)} - books_before
    assert set(books_rest[: len(left)]) == left, "the samples it had left come first"


def test_without_the_opt_in_a_changed_mixture_names_the_stream_and_the_way_on() -> None:
    before = mixture({"web": {"weight": 3}, "code": {"weight": 1}}, 100)
    state = checkpoint(before, RangeSet.interval(0, 30))
    with pytest.raises(CheckpointMismatchError) as err:
        resume(state, mixture({"web": {"weight": 1}, "code": {"weight": 1}}, 100))
    message = str(err.value)
    assert "stream 'web' share was 'weight=3', now 'weight=1'" in message
    assert "allow_mixture_change=True" in message and "allow_data_change=True" in message


def test_a_kept_stream_with_other_data_or_a_second_change_is_refused_by_name() -> None:
    before = mixture({"web": {"weight": 1}, "code": {"weight": 1}}, 100)
    state = checkpoint(before, RangeSet.interval(0, 30))
    SIZES["code2"] = [23, 18]
    other = [Stream("web", SyntheticReader(sizes=SIZES["web"])), Stream("code", SyntheticReader(sizes=SIZES["code2"]))]
    with pytest.raises(CheckpointMismatchError, match="stream 'code' holds other data than in the checkpoint"):
        resume(state, MixtureReader(other, 100).manifest(), allow_mixture_change=True)
    changed = resume(state, mixture({"web": {"weight": 2}, "code": {"weight": 1}}, 100), allow_mixture_change=True)
    with pytest.raises(CheckpointMismatchError, match="already changed its mixture once"):
        resume(changed.state(global_step=5), mixture({"web": {"weight": 3}, "code": {"weight": 1}}, 100),
               allow_mixture_change=True)  # fmt: skip
    plain = SyntheticReader(sizes=[10, 10])
    with pytest.raises(CheckpointMismatchError, match="the data is no mixture"):
        resume(state, Manifest.from_items(plain.items()), allow_mixture_change=True)


def test_inspect_counts_a_changed_epoch_per_stream_across_both_mixtures() -> None:
    from lightning_sharding.cli.checkpoint import format_inspect

    before = mixture({"web": {"weight": 3}, "code": {"weight": 1}, "books": {"weight": 1}}, 100)
    after = mixture({"web": {"weight": 1}, "code": {"weight": 1}}, 100)
    keeper = resume(checkpoint(before, RangeSet.interval(0, 30)), after, allow_mixture_change=True)
    keeper.ledger.merge(RangeSet.interval(0, 10))  # 10 of the 70 drawn after the change
    text = format_inspect(Path("last.ckpt"), {"lightning_sharding": keeper.state(global_step=5), "global_step": 5})
    assert (
        "changed      epoch 0 resumed under new shares: 30 samples consumed before, 70 drawn at the new shares" in text
    )
    assert "consumed     40 of 100 samples" in text
    lines = [line for line in text.splitlines() if line.startswith("stream")]
    assert [line.split(":")[0].split()[1] for line in lines] == ["'web'", "'code'", "'books'"]
    assert "'books' (removed)" in lines[2]
    consumed = [int(line.split("consumed ")[1].split()[0]) for line in lines]
    draws = [int(line.split(" of ")[1].split()[0]) for line in lines]
    assert sum(consumed) == 40 and sum(draws) == 100, text
    was = Counter(key.split("/")[0] for key, _ in samples(before, 0, np.arange(30)))
    assert consumed[2] == draws[2] == was["books"], text


def test_a_change_that_cannot_go_on_restarts_the_epoch_under_allow_data_change_and_old_checkpoints_say_why() -> None:
    before = mixture({"web": {"weight": 1}, "code": {"weight": 1}}, 100)
    state = checkpoint(before, RangeSet.interval(0, 30))
    other = [Stream("web", SyntheticReader(sizes=SIZES["web"])), Stream("code", SyntheticReader(sizes=[23, 18]))]
    after = MixtureReader(other, 100).manifest()
    with pytest.warns(UserWarning, match="allow_data_change=True restarts the epoch instead"):
        keeper = resume(state, after, allow_mixture_change=True, allow_data_change=True)
    assert (len(keeper.ledger.consumed), keeper.ledger.total, change_of(keeper.manifest)) == (0, 100, None)
    for stream in state["manifest"]["streams"]:  # as an earlier release wrote it
        del stream["data"]
    with pytest.raises(CheckpointMismatchError, match="earlier lightning_sharding that kept no fingerprint of stream"):
        resume(state, mixture({"web": {"weight": 2}, "code": {"weight": 1}}, 100), allow_mixture_change=True)


def test_a_renamed_stream_is_refused_by_both_names_and_the_hidden_data_stream_is_explained() -> None:
    before = mixture({"web": {"weight": 1}, "code": {"weight": 1}}, 100)
    state = checkpoint(before, RangeSet.interval(0, 30))
    renamed = [
        Stream("web", SyntheticReader(sizes=SIZES["web"])),
        Stream("source", SyntheticReader(sizes=SIZES["code"])),
    ]
    with pytest.raises(CheckpointMismatchError) as err:
        resume(state, MixtureReader(renamed, 100).manifest(), allow_mixture_change=True)
    assert "stream 'source' holds the same data as the checkpoint's stream 'code'" in str(err.value)
    assert "Stream('code', ...)" in str(err.value)
    # A reader with samples_per_epoch is one stream named "data"; the same data under streams= is that stream.
    one = MixtureReader([Stream("data", SyntheticReader(sizes=SIZES["web"]))], 80).manifest()
    as_streams = [
        Stream("web", SyntheticReader(sizes=SIZES["web"])),
        Stream("code", SyntheticReader(sizes=SIZES["code"])),
    ]
    with pytest.raises(CheckpointMismatchError, match="the one stream of a `reader=` with `samples_per_epoch`"):
        resume(checkpoint(one, RangeSet.interval(0, 20)), MixtureReader(as_streams, 100).manifest(),
               allow_mixture_change=True)  # fmt: skip
    # Kept under its name, the same change goes on.
    kept = [Stream("data", SyntheticReader(sizes=SIZES["web"])), Stream("code", SyntheticReader(sizes=SIZES["code"]))]
    keeper = resume(checkpoint(one, RangeSet.interval(0, 20)), MixtureReader(kept, 100).manifest(),
                    allow_mixture_change=True)  # fmt: skip
    assert change_of(keeper.manifest) is not None and change_of(keeper.manifest).rest == 80


def test_a_second_change_names_what_differs_and_a_changed_batch_size_names_the_opt_in() -> None:
    before = mixture({"web": {"weight": 1}, "code": {"weight": 1}}, 100)
    changed = resume(
        checkpoint(before, RangeSet.interval(0, 30)),
        mixture({"web": {"weight": 2}, "code": {"weight": 1}}, 100),
        allow_mixture_change=True,
    )
    with pytest.raises(CheckpointMismatchError, match="stream 'web' share was 'weight=2', now 'weight=3'"):
        resume(changed.state(global_step=5), mixture({"web": {"weight": 3}, "code": {"weight": 1}}, 100),
               allow_mixture_change=True)  # fmt: skip
    strat = mixture({"web": {"weight": 1}, "code": {"weight": 1}}, 96, composition="stratified", batch_size=8)
    state = checkpoint(strat, RangeSet.interval(0, 32))
    with pytest.raises(CheckpointMismatchError, match="pass `allow_mixture_change=True` to go on with the rest"):
        resume(state, mixture({"web": {"weight": 1}, "code": {"weight": 1}}, 96, composition="stratified",
                              batch_size=12), batch_size=12)  # fmt: skip
    # With the opt-in, the rest comes in blocks of the new batch size and serves nothing consumed.
    after = mixture({"web": {"weight": 1}, "code": {"weight": 1}}, 96, composition="stratified", batch_size=12)
    keeper = resume(state, after, batch_size=12, allow_mixture_change=True)
    blocks = keeper.manifest.blocks_at(0)
    change = change_of(keeper.manifest)
    assert blocks is not None and blocks.size == 12 and change is not None
    rest = set(samples(keeper.manifest, 0, np.arange(change.rest)))
    assert not rest & set(samples(strat, 0, np.arange(32)))


@pytest.mark.parametrize("consumed_to", [13, 30, 47])
def test_a_repeated_stream_serves_each_sample_within_one_of_the_others_over_a_changed_epoch(consumed_to: int) -> None:
    # books: 11 samples, repeat 3.0 = 33 draws an epoch; the change keeps it at 3.0 and moves the others.
    before = mixture({"books": {"repeat": 3.0}, "code": {"weight": 1}}, 73)
    after = mixture({"books": {"repeat": 3.0}, "web": {"weight": 1}}, 73)
    consumed = RangeSet.interval(0, consumed_to)
    keeper = resume(checkpoint(before, consumed), after, allow_mixture_change=True)
    change = change_of(keeper.manifest)
    assert change is not None
    served = Counter(s for s in samples(before, 0, consumed.to_array()) if s[0].startswith("books/"))
    served.update(s for s in samples(keeper.manifest, 0, np.arange(change.rest)) if s[0].startswith("books/"))
    times = [served[("books/synthetic-00000", j)] for j in range(11)]
    assert max(times) - min(times) <= 1, f"books servings over the epoch: {times}"
    assert sum(times) == sum(served.values())


def test_a_change_at_an_epoch_boundary_warns_of_nothing_and_goes_on_with_the_new_mixture(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = mixture({"web": {"weight": 3}, "code": {"weight": 1}}, 100)
    after = mixture({"web": {"weight": 1}, "code": {"weight": 1}}, 120)
    keeper = resume(checkpoint(before, RangeSet.interval(0, 100)), after, allow_mixture_change=True)
    assert keeper.mixture_from == before.fingerprint
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keeper.start_epoch(1)  # Lightning goes on with the next epoch after an epoch-end checkpoint
    assert (keeper.ledger.epoch, keeper.ledger.total, keeper.ledger.change, len(keeper.ledger.consumed)) == (
        1,
        120,
        None,
        0,
    )
    err = capsys.readouterr().err
    assert "Lightning goes on with epoch 1, so nothing of epoch 0 is drawn under the new mixture" in err, err
    # Cut short mid-epoch instead (max_steps): the samples the old epoch left are warned about.
    keeper = resume(checkpoint(before, RangeSet.interval(0, 40)), after, allow_mixture_change=True)
    with pytest.warns(UserWarning, match="stopped epoch 0 after 40 of its 100 samples"):
        keeper.start_epoch(1)
