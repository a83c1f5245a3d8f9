"""The resume contract every registered strategy passes, in one process (like torchdata's
``run_test_save_load_state``): read a few batches on every rank of one topology, checkpoint the
union of the ranks' ledgers, rebuild on another number of ranks, finish the epoch, and find every
sample served exactly once; then the next epoch is the one a fresh run would serve.

A strategy gets this test by registering: the parameters are the registry's names, and the data
is chosen by what the strategy ``takes``. Loading runs in the training process (``num_workers=0``)
so that the whole matrix stays within seconds; the kill-and-resume process tests
(tests/process/) cover real workers, ranks and signals.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding import SyntheticReader
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import World
from lightning_sharding.readers.sources import SqliteSource
from lightning_sharding.strategies import EpochSampler, Strategy, TrainLoader, get_strategy, strategy_names
from lightning_sharding.strategies.options import LoaderOptions
from tests.support.data.sources import make_db, row_to_sample
from tests.support.data.windows import MonthWindows, write_months
from tests.support.extras import require

SEED = 5
BATCH = 4
# (ranks before the checkpoint, ranks after it, batches each rank reads before it)
TOPOLOGIES = [(2, 3, 2), (3, 1, 1)]


def data_for(strategy: Strategy, tmp_path: Path) -> tuple[Any, LoaderOptions]:
    """Data of the kind the strategy takes, whose samples carry their id (0..total-1) in ``"id"``."""
    if strategy.takes == "source":
        db = make_db(tmp_path / "rows.sqlite", 53)
        return SqliteSource(db, "SELECT id, payload FROM samples ORDER BY id"), LoaderOptions(
            batch_size=BATCH, transform=row_to_sample
        )
    if strategy.takes == "windows":
        return MonthWindows(write_months(tmp_path, (19, 23, 17, 21)), window=4), LoaderOptions(batch_size=BATCH)
    return SyntheticReader(sizes=[11, 17, 3, 13, 9]), LoaderOptions(batch_size=BATCH)


def served_batches(loader: Any, ledger: Ledger, batches: int | None = None) -> list[tuple[Any, Any]]:
    """``(batch, provenance)`` of ``batches`` batches (all when None); their steps are accounted."""
    out = []
    iterator = iter(loader)
    try:
        for _ in iter(int, 1) if batches is None else range(batches):
            try:
                batch = next(iterator)
            except StopIteration:
                break
            provenance = loader.pop_delivered()
            ledger.record(provenance.consumed_positions)
            ledger.commit()
            out.append((batch, provenance))
    finally:
        iterator.close()  # type: ignore[attr-defined]  # a generator: abandons the pass and releases it
    return out


def serve(loader: Any, ledger: Ledger, batches: int | None = None) -> list[int]:
    """The real sample ids of ``batches`` batches (all when None); their steps are accounted."""
    return [
        i for batch, _ in served_batches(loader, ledger, batches) for i in batch["id"][~batch["is_padding"]].tolist()
    ]


def next_epoch(
    strategy: Strategy, data: Any, manifest: Any, state: dict[str, Any] | None, ranks: int, options: LoaderOptions
) -> list[list[int]]:
    """Each rank's ids in epoch 1, served after the resumed epoch 0 (``state``) or by a fresh run (None)."""
    out = []
    for rank in range(ranks):
        ledger = (
            Ledger.from_state_dict(state)
            if state is not None
            else Ledger(seed=SEED, total=manifest.total, manifest=manifest.summary(), epoch=1)
        )
        loader = strategy.build(data, manifest, ledger, World(rank, ranks), options, track=True)
        if state is not None:
            serve(loader, ledger)  # what is left of epoch 0
            loader.set_epoch(1)
        out.append(serve(loader, ledger))
        loader.close()
    return out


@pytest.mark.parametrize("name", strategy_names())
@pytest.mark.parametrize(("before", "after", "read"), TOPOLOGIES, ids=[f"{a}to{b}ranks" for a, b, _ in TOPOLOGIES])
def test_a_checkpoint_resumes_on_another_topology_serving_every_sample_once(
    tmp_path: Path, name: str, before: int, after: int, read: int
) -> None:
    if name == "dali":
        require("nvidia.dali")  # a skip without the extra; a failure in CI, which installs every extra
    strategy = get_strategy(name)
    data, options = data_for(strategy, tmp_path)
    strategy.check(options, data)
    manifest = strategy.manifest(data)
    fresh = Ledger(seed=SEED, total=manifest.total, manifest=manifest.summary())

    # Every rank of the first topology reads `read` batches; the checkpoint holds their union.
    served: Counter[int] = Counter()
    union = Ledger.from_state_dict(fresh.state_dict())
    for rank in range(before):
        ledger = Ledger.from_state_dict(fresh.state_dict())
        loader = strategy.build(data, manifest, ledger, World(rank, before), options, track=True)
        # What the callback and Lightning rely on: a TrainLoader whose sampler is an EpochSampler.
        assert isinstance(loader, TrainLoader) and isinstance(loader.sampler, EpochSampler)
        served.update(serve(loader, ledger, read))
        loader.close()
        union.merge(ledger.consumed)
    assert sum(served.values()) == len(union.consumed) > 0
    state = union.state_dict()

    # Rebuilt on another number of ranks, the epoch finishes: every sample once in all.
    for rank in range(after):
        ledger = Ledger.from_state_dict(state)
        loader = strategy.build(data, manifest, ledger, World(rank, after), options, track=True)
        served.update(serve(loader, ledger))
        loader.close()
    assert sorted(served) == list(range(manifest.total)), f"missing: {set(range(manifest.total)) - set(served)}"
    assert max(served.values()) == 1, f"served twice: {[i for i, n in served.items() if n > 1]}"

    # The next epoch carries nothing over from the resumed one: it is what a fresh run serves.
    resumed = next_epoch(strategy, data, manifest, state, after, options)
    assert resumed == next_epoch(strategy, data, manifest, None, after, options)
    assert sorted(i for ids in resumed for i in ids) == list(range(manifest.total))


def replica_world(rank: int, world_size: int, replica: int) -> World:
    """Global ``rank`` of ``world_size`` ranks in model replicas of ``replica`` consecutive ranks."""
    return World(rank, world_size, data_rank=rank // replica, data_size=world_size // replica)


@pytest.mark.parametrize("name", strategy_names())
def test_the_ranks_of_a_replica_get_the_same_batches_and_resume_on_other_replicas(tmp_path: Path, name: str) -> None:
    """4 ranks in 2 replicas of 2 (tensor parallel) read 2 batches; the checkpoint holds one ledger per
    replica; it resumes as 4 ranks in 1 replica of 4, then the epoch is whole: every sample once."""
    if name == "dali":
        require("nvidia.dali")  # a skip without the extra; a failure in CI, which installs every extra
    from lightning_sharding.loading.keeper import one_ledger_per_replica

    strategy = get_strategy(name)
    data, options = data_for(strategy, tmp_path)
    manifest = strategy.manifest(data)
    fresh = Ledger(seed=SEED, total=manifest.total, manifest=manifest.summary())
    state = fresh.state_dict()
    served: Counter[int] = Counter()
    for world_size, replica, read in [(4, 2, 2), (4, 4, None)]:
        ids, gathered = [], []
        for rank in range(world_size):
            ledger = Ledger.from_state_dict(state)
            world = replica_world(rank, world_size, replica)
            loader = strategy.build(data, manifest, ledger, world, options, track=True)
            ids.append(serve(loader, ledger, read))
            loader.close()
            gathered.append((world.data_rank, ledger.epoch, ledger.consumed.to_state()))
        for first in range(0, world_size, replica):
            assert all(ids[r] == ids[first] for r in range(first, first + replica)), f"replica of rank {first}"
            served.update(ids[first])
        union = Ledger.from_state_dict(state)
        for consumed in one_ledger_per_replica(gathered):
            union.merge(consumed)
        state = union.state_dict()
    assert sorted(served) == list(range(manifest.total)), f"missing: {set(range(manifest.total)) - set(served)}"
    assert max(served.values()) == 1, f"served twice: {[i for i, n in served.items() if n > 1]}"


# Every kind of epoch order the planner takes, with the strategies that read it: a plain epoch, a
# mixture in each batch composition, the rest of an epoch whose mixture changed on resume, and
# packed token sequences.
ORDER_KINDS = ["plain", "mixed", "stratified", "per_stream", "changed", "packed", "packed_mixture"]
COMPOSITION = {
    "plain": None,
    "packed": None,
    "packed_mixture": None,
    "mixed": "mixed",
    "stratified": "stratified",
    "per_stream": "per_stream",
    "changed": "stratified",
}
STREAM_SIZES = {"web": [13, 9, 11], "code": [7, 12], "books": [5]}


def ordered_data(kind: str, tmp_path: Path) -> tuple[Any, Any, dict[str, Any]]:
    """The data, the manifest whose epochs follow ``kind`` of order, and the ledger state to start from."""
    from lightning_sharding.core.world import World as OneWorld
    from lightning_sharding.loading.keeper import LedgerKeeper
    from lightning_sharding.mixture import MixtureReader, Stream

    def reader(shares: dict[str, dict[str, Any]], per_epoch: int, composition: str) -> MixtureReader:
        streams = [Stream(n, SyntheticReader(sizes=STREAM_SIZES[n]), **share) for n, share in shares.items()]
        size = None if composition == "mixed" else BATCH
        return MixtureReader(streams, per_epoch, composition=composition, batch_size=size)

    if kind == "plain":
        data: Any = SyntheticReader(sizes=[11, 17, 3, 13, 9])
    elif kind == "packed":
        from lightning_sharding.tokens import IndexedTokens, PackedReader, Packing
        from tests.support.data.tokens import write_corpus

        write_corpus(tmp_path, files=3, documents=7)
        data = PackedReader(IndexedTokens(f"{tmp_path}/part-*.idx"), Packing(8, "concat"))
    elif kind == "packed_mixture":  # two token streams, packed, at shares that repeat one and sample the other
        from lightning_sharding.mixture import MixtureReader, Stream
        from lightning_sharding.tokens import IndexedTokens, PackedReader, Packing
        from tests.support.data.tokens import write_corpus

        write_corpus(tmp_path / "a", files=2, documents=9)
        write_corpus(tmp_path / "b", files=1, documents=6, seed=1)
        packed = [PackedReader(IndexedTokens(f"{tmp_path / n}/part-*.idx"), Packing(8, "best_fit")) for n in "ab"]
        data = MixtureReader([Stream("a", packed[0], repeat=1.5), Stream("b", packed[1], proportion=0.5)])
    elif kind != "changed":
        data = reader({"web": {"weight": 2}, "code": {"weight": 1}, "books": {"repeat": 2.0}}, 61, kind)
    else:  # a checkpoint of one mixture, a third of each rank's share consumed, resumed under another
        first = reader({"web": {"weight": 3}, "code": {"weight": 1}}, 50, "mixed").manifest()
        consumed = Ledger(seed=SEED, total=first.total, manifest=first.summary())
        consumed.merge(RangeSet.from_ranges([(0, 7), (25, 33)]))
        state = LedgerKeeper(consumed, first, OneWorld(), LoaderOptions(BATCH)).state(global_step=4)
        data = reader({"web": {"weight": 1}, "code": {"weight": 1}, "books": {"choose": 6}}, 56, "stratified")
        now = data.manifest(BATCH)
        keeper = LedgerKeeper(
            Ledger(seed=SEED, total=now.total, manifest=now.summary()),
            now,
            OneWorld(),
            LoaderOptions(BATCH),
            allow_mixture_change=True,
        )
        keeper.restore(state, global_step=4, source="changed.ckpt")
        return data, keeper.manifest, keeper.ledger.state_dict()
    manifest = data.manifest() if kind in ("plain", "packed") else data.manifest(BATCH)
    return data, manifest, Ledger(seed=SEED, total=manifest.total, manifest=manifest.summary()).state_dict()


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (name, kind)
        for name in strategy_names()
        for kind in ORDER_KINDS
        # Strategies that read a source or windows plan plain orders: the contract test above covers them.
        if get_strategy(name).takes == "reader"
        and (
            kind == "plain"
            or (kind.startswith("packed") and get_strategy(name).refusal("packing", True) is None)
            or (not kind.startswith("packed") and get_strategy(name).refusal("streams", COMPOSITION[kind]) is None)
        )
    ],
)
@pytest.mark.parametrize(("before", "after", "read"), TOPOLOGIES, ids=[f"{a}to{b}ranks" for a, b, _ in TOPOLOGIES])
def test_every_kind_of_order_resumes_on_another_topology_serving_every_position_once(
    name: str, kind: str, before: int, after: int, read: int, tmp_path: Path
) -> None:
    if name == "dali":
        require("nvidia.dali")  # a skip without the extra; a failure in CI, which installs every extra
    strategy = get_strategy(name)
    options = LoaderOptions(batch_size=BATCH)
    data, manifest, start = ordered_data(kind, tmp_path)
    strategy.check(options, data)
    order = manifest.order(SEED, 0)
    left = RangeSet.from_state(np.asarray(start["consumed"])).complement(order.total)
    assert len(left) > 0 and (kind != "changed" or len(left) < order.total)

    served: Counter[int] = Counter()
    batches = []
    union = Ledger.from_state_dict(start)
    for rank in range(before):
        ledger = Ledger.from_state_dict(start)
        loader = strategy.build(data, manifest, ledger, World(rank, before), options, track=True)
        batches += [p.consumed_positions for _, p in served_batches(loader, ledger, read)]
        loader.close()
        union.merge(ledger.consumed)
    state = union.state_dict()
    for rank in range(after):
        ledger = Ledger.from_state_dict(state)
        loader = strategy.build(data, manifest, ledger, World(rank, after), options, track=True)
        batches += [p.consumed_positions for _, p in served_batches(loader, ledger)]
        loader.close()
    for positions in batches:
        served.update(positions.tolist())
        if order.blocks is not None:  # a blocked order's batch never crosses a block
            assert len(set(order.blocks.ids(positions).tolist())) <= 1
    assert sorted(served) == left.to_array().tolist(), f"missing: {set(left.to_array().tolist()) - set(served)}"
    assert max(served.values()) == 1, f"served twice: {[p for p, n in served.items() if n > 1]}"
    assert (order.blocks is not None) == (kind in ("stratified", "per_stream", "changed"))
