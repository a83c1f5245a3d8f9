"""Batch composition of mixtures (``lightning_sharding.mixture.composition``) and the plans that follow it.

Properties over random mixtures, batch sizes and ledgers: every (stream, draw) sits at one position;
``prefix`` counts what ``streams`` lays out; under ``stratified`` every full batch holds each stream
at floor or ceil of its share, under ``per_stream`` a single stream; the plan of any remaining set
on any topology serves each remaining position at most once, in batches that never cross a block,
with the same batch count on every rank; and what a fresh epoch's batches hold is the same on every
topology.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sharding.core.blocks import Blocks
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.mixture.composition import Stratified, layout
from lightning_sharding.mixture.streams import MixtureReader, Stream
from lightning_sharding.readers.synthetic import SyntheticReader

blocked = st.sampled_from(["stratified", "per_stream"])
draw_lists = st.lists(st.integers(0, 80), min_size=1, max_size=4).filter(lambda d: sum(d) > 0)


class Span(NamedTuple):
    """What the planner reads of an order (its total and blocks), for a layout without items."""

    total: int
    blocks: Blocks | None
    epoch: int = 0


@settings(max_examples=80, deadline=None)
@given(draw_lists, st.integers(1, 24), blocked)
def test_every_draw_has_one_position_and_prefixes_count_the_layout(draws, batch_size, composition) -> None:
    order = layout(draws, composition, batch_size)
    stream, draw = order.streams(np.arange(order.total))
    for s, d in enumerate(draws):
        assert sorted(draw[stream == s].tolist()) == list(range(d))
    for p in range(order.total + 1):
        assert order.prefix(p) == [int((stream[:p] == s).sum()) for s in range(len(draws))]


@settings(max_examples=80, deadline=None)
@given(draw_lists, st.integers(1, 24))
def test_stratified_batches_hold_every_stream_at_its_share_within_one_sample(draws, batch_size) -> None:
    order = layout(draws, "stratified", batch_size)
    assert isinstance(order, Stratified)
    stream, _ = order.streams(np.arange(order.total))
    full = order.total // batch_size
    for b in range(full):
        held = np.bincount(stream[b * batch_size : (b + 1) * batch_size], minlength=len(draws))
        for s, d in enumerate(draws):
            share = (d - order.last[s]) / full  # the stream's share of the full batches
            assert math.floor(share) <= held[s] <= math.ceil(share), (b, s, held, share)
            assert abs(held[s] - batch_size * d / order.total) < 1 + 1 / full  # and of the epoch


@settings(max_examples=80, deadline=None)
@given(draw_lists, st.integers(1, 24))
def test_per_stream_batches_come_from_one_stream_at_the_stream_shares(draws, batch_size) -> None:
    order = layout(draws, "per_stream", batch_size)
    stream, _ = order.streams(np.arange(order.total))
    ids = order.blocks.ids(np.arange(order.total))
    starts, ends = order.blocks.bounds(np.arange(order.blocks.count))
    for b, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        assert (ids[lo:hi] == b).all() and len(set(stream[lo:hi].tolist())) == 1
        assert hi - lo == batch_size or lo >= order.blocks.aligned, "short blocks only at the end"
    # full blocks are spread at the streams' shares: any prefix within 2 blocks of its share
    firsts = stream[: order.blocks.aligned : batch_size]
    full = [d // batch_size for d in draws]
    for n in range(1, firsts.size + 1):
        for s, f in enumerate(full):
            assert abs(int((firsts[:n] == s).sum()) - n * f / firsts.size) <= 2


@settings(max_examples=120, deadline=None)
@given(
    draw_lists,
    st.integers(1, 12),
    blocked,
    st.integers(1, 4),
    st.integers(0, 3),
    st.sampled_from(["pad", "drop"]),
    st.data(),
)
def test_plans_serve_whole_blocks_once_on_any_topology(draws, batch_size, composition, ranks, workers, even, data):
    order = layout(draws, composition, batch_size)
    total, blocks = order.total, order.blocks
    ids = blocks.ids(np.arange(total))
    done = data.draw(st.lists(st.integers(0, blocks.count - 1), unique=True, max_size=blocks.count))
    loose = data.draw(st.lists(st.integers(0, total - 1), max_size=4))  # a ledger of other batch edges
    consumed = RangeSet.from_positions(np.concatenate((np.flatnonzero(np.isin(ids, done)), loose)).astype(np.int64))
    plan = plan_epoch(
        Span(total, blocks),
        consumed,
        world_size=ranks,
        num_workers=workers,
        batch_size=batch_size,
        even_batches=even,
    )
    served: list[int] = []
    for r in range(ranks):
        rank = plan.rank(r)
        tasks = list(rank.tasks())
        assert len(tasks) == plan.num_batches, "every rank yields the same number of batches"
        for task in tasks:
            real = task.positions[: task.positions.size - task.num_padding]
            assert len(set(ids[real].tolist())) <= 1, "a batch never crosses a block"
            served += real.tolist()
        assert rank.num_padding == plan.padding_per_rank[r] and rank.num_dropped == plan.dropped_per_rank[r]
    remaining = consumed.complement(total)
    assert len(served) == len(set(served)) and set(served) <= set(remaining)
    assert len(served) + int(plan.dropped_per_rank.sum()) == len(remaining), "nothing lost unreported"


def batches_held(ranks: int, workers: int, composition: str) -> set[tuple[int, ...]]:
    order = layout([50, 30, 7], composition, 8)
    plan = plan_epoch(Span(order.total, order.blocks), RangeSet(), world_size=ranks, num_workers=workers, batch_size=8)
    stream = order.streams(np.arange(order.total))[0]
    return {tuple(np.bincount(stream[t.positions], minlength=3)) for r in range(ranks) for t in plan.rank(r).tasks()}


@pytest.mark.parametrize("composition", ["stratified", "per_stream"])
def test_what_batches_hold_does_not_depend_on_the_topology(composition) -> None:
    # 11 blocks on 1, 2 or 3 ranks: whole blocks, but for the halves of a block that a short rank splits
    alone = batches_held(1, 0, composition)
    assert alone == batches_held(1, 3, composition)
    assert {held for held in batches_held(3, 2, composition) if sum(held) == 8} <= alone


def mixture(composition: str, batch_size: int | None = 8) -> MixtureReader:
    streams = [Stream("web", SyntheticReader(4, 25, 2), weight=3), Stream("code", SyntheticReader(2, 10, 2))]
    return MixtureReader(streams, 64, composition=composition, batch_size=batch_size)


def test_the_manifest_keeps_the_composition_and_a_changed_batch_size_is_named() -> None:

    eight, sixteen, mixed = (
        mixture("stratified").manifest(),
        mixture("stratified").manifest(16),
        mixture("mixed").manifest(),
    )
    eight_blocks, sixteen_blocks = eight.blocks_at(0), sixteen.blocks_at(0)
    assert eight_blocks is not None and eight_blocks.size == 8 and sixteen_blocks is not None
    assert sixteen_blocks.size == 16
    assert mixed.blocks_at(0) is None and "composition" not in mixed.summary(), "mixed checkpoints stay as they were"
    assert len({eight.fingerprint, sixteen.fingerprint, mixed.fingerprint}) == 3
    assert "the mixture's batch_size was 8, now 16" in sixteen.explain_mismatch(eight.summary())
    assert "composition was 'stratified', now 'mixed'" in mixed.explain_mismatch(eight.summary())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"composition": "blocked"}, "batch_composition='blocked' is not one of"),
        ({"composition": "stratified", "batch_size": None}, "needs a batch_size of 1 or more"),
    ],
)
def test_bad_compositions_name_the_value(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        MixtureReader([Stream("a", SyntheticReader(1, 4, 2))], **kwargs)


def test_the_datamodule_refuses_a_composition_without_streams_or_with_a_strategy_that_cannot() -> None:
    from lightning_sharding import ShardedDataModule

    with pytest.raises(ValueError, match=r"batch_composition='stratified'\)` composes batches of a mixture"):
        ShardedDataModule(SyntheticReader(1, 4, 2), batch_composition="stratified")
    dm = ShardedDataModule(streams=mixture("mixed").streams, batch_composition="per_stream", sharding="shard")
    assert dm.make_reader().manifest(8).blocks_at(0) is not None
    from lightning_sharding.strategies import get_strategy

    class Blocked(type(get_strategy("shard"))):  # a strategy that mixes but plans only mixed batches
        name = "mixed_only"

        @classmethod
        def refusal(cls, setting: str, value: object) -> str | None:
            return "plans only ['mixed'] batches" if setting == "streams" and value != "mixed" else None

    with pytest.raises(ValueError, match=r"strategy 'mixed_only' plans only \['mixed'\] batches; use .*'shard'"):
        Blocked().check_data(dm.make_reader(), "ShardedDataModule")


def test_inspect_counts_a_blocked_mixtures_streams_through_its_layout() -> None:
    from lightning_sharding.cli.checkpoint import _stream_lines
    from lightning_sharding.core.ledger import Ledger

    manifest = mixture("per_stream").manifest()  # web 48 = 6 batches of 8, code 16 = 2
    order = manifest.order(0, 0)
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    ledger.merge(RangeSet.interval(0, 16))  # the first two batches
    first_two = np.bincount(order.streams(np.arange(16))[0], minlength=2).tolist()
    summary = manifest.summary()
    lines = _stream_lines(summary["streams"], ledger, summary)
    assert lines.pop(0) == "mixture      2 streams in per_stream batches of 8 (resume with batch_size=8)"
    assert f"consumed {first_two[0]} of 48 draws" in lines[0] and f"consumed {first_two[1]} of 16 draws" in lines[1]
    assert sorted(first_two) in ([0, 16], [8, 8]), "whole batches of one stream"


@pytest.mark.parametrize(("even_batches", "warns"), [("drop", False), ("pad", True)])
def test_a_resume_after_a_blocked_epoch_that_dropped_a_batch_warns_only_when_samples_were_lost(
    even_batches, warns
) -> None:
    import warnings

    from lightning_sharding.core.ledger import Ledger
    from lightning_sharding.core.world import World
    from lightning_sharding.loading.keeper import LedgerKeeper
    from lightning_sharding.strategies.options import LoaderOptions

    manifest = mixture("stratified").manifest()  # 64 samples in 8 blocks of 8
    ledger = Ledger(seed=0, total=64, manifest=manifest.summary())
    ledger.merge(RangeSet.interval(0, 56))  # "drop" on 3 ranks: 8 blocks, 2 each, one rank's last left
    options = LoaderOptions(batch_size=8, even_batches=even_batches)
    keeper = LedgerKeeper(ledger, manifest, World(rank=0, world_size=3), options)
    keeper.restored_from = "last.ckpt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keeper.start_epoch(1)
    assert any("the other 8 samples of epoch 0 are not trained" in str(w.message) for w in caught) == warns


def test_resuming_a_blocked_mixture_with_another_batch_size_says_which_batch_size_to_use() -> None:
    from lightning_sharding.core.ledger import CheckpointMismatchError, Ledger
    from lightning_sharding.core.world import World
    from lightning_sharding.loading.keeper import LedgerKeeper
    from lightning_sharding.strategies.options import LoaderOptions

    saved = mixture("per_stream").manifest(8)
    ledger = Ledger(seed=0, total=saved.total, manifest=saved.summary())
    ledger.merge(RangeSet.interval(0, 16))
    state = ledger.state_dict()
    now = mixture("per_stream").manifest(16)
    keeper = LedgerKeeper(Ledger(seed=0, total=now.total, manifest=now.summary()), now, World(), LoaderOptions(16))
    with pytest.raises(CheckpointMismatchError) as err:
        keeper.restore(state, source="last.ckpt")
    assert "last.ckpt holds a mixture of per_stream batches of 8 samples, and batch_size is now 16" in str(err.value)
    assert "Resume with batch_size=8" in str(err.value) and "training its 16 consumed samples again" in str(err.value)
