"""DALI: pinned parallel external sources (affinity), merged batches, exactly-once and resume.

The layout tests are pure. The others run real DALI pipelines: CPU-only (``device_id=None``),
Python workers started with spawn, and a real Lightning Trainer with DDP over gloo.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding import SyntheticReader
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.order import EpochOrder
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import World
from lightning_sharding.lightning.dali import DaliStrategy, merge_layout
from lightning_sharding.strategies.options import LoaderOptions
from tests.support.data.dali import RecordingReader, add_image
from tests.support.harness import Job, Loading, Topology, Training, assert_exactly_once, check_resume

needs_dali = pytest.mark.needs("nvidia.dali")


# -- the layout (pure) -------------------------------------------------------------------------


@pytest.mark.parametrize("even_batches", ["pad", "drop"])
@pytest.mark.parametrize("num_sources", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_layout_gives_each_source_one_run_and_keeps_the_plans_batches(
    world_size: int, num_sources: int, even_batches: str
) -> None:
    for total, batch_size, done in [(200, 8, ()), (37, 4, ((3, 11),)), (5, 1, ()), (64, 8, ((0, 60),))]:
        plan = plan_epoch(
            total,
            RangeSet.from_ranges(done),
            epoch=0,
            world_size=world_size,
            num_workers=num_sources,
            batch_size=batch_size,
            even_batches=even_batches,  # type: ignore[arg-type]
        )
        served: list[int] = []
        for rank in range(world_size):
            rank_plan = plan.rank(rank)
            layout = merge_layout(rank_plan, num_sources)
            plan_sizes = [len(rank_plan.batch(i).positions) for i in range(rank_plan.num_batches)]
            assert layout.sizes.tolist() == plan_sizes
            assert (layout.parts.max(initial=0)) <= -(-batch_size // num_sources)
            runs = [layout.run(w) for w in range(num_sources)]
            sequence = np.concatenate([positions for positions, _ in runs]) if runs else np.zeros(0)
            real = rank_plan.positions.select(0, rank_plan.num_served).to_array().tolist()
            assert sequence.tolist() == real + [rank_plan.pad_position] * rank_plan.num_padding
            assert sum(pad for _, pad in runs) == rank_plan.num_padding
            served += real
        dropped = int(plan.dropped_per_rank.sum())
        assert len(served) == len(set(served)) == len(plan.remaining) - dropped


# -- real pipelines ----------------------------------------------------------------------------

SIZES = (37, 41, 29, 53, 40)


def _ids_of(reader: SyntheticReader, manifest: Manifest, seed: int, epoch: int, positions: np.ndarray) -> list[int]:
    items, index = EpochOrder([it.num_samples for it in manifest.items], seed, epoch).locate(positions)
    first = np.concatenate(([0], np.cumsum(reader.sizes)))
    return (first[items] + index).tolist()


def _reads(log_dir: Path) -> dict[int, list[tuple[str, int]]]:
    """(item, index) read by each process, in reading order."""
    reads: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for path in sorted(log_dir.glob("reads-*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            reads[r["pid"]] += [(r["item"], i) for i in r["indices"]]
    return reads


@needs_dali
@pytest.mark.processes
@pytest.mark.timeout(120)
def test_pinned_sources_merged_batches_and_exactly_once(tmp_path: Path) -> None:
    """2 ranks (one after the other in this process) x 2 DALI workers, 2 epochs on one pipeline each."""
    seed, batch_size, world_size, workers = 7, 8, 2, 2
    reader = RecordingReader(str(tmp_path), sizes=SIZES)
    manifest = Manifest.from_items(reader.items())
    order_items = [it.key for it in manifest.items]
    seen: dict[int, Counter[int]] = defaultdict(Counter)
    planned: dict[tuple[int, int, int], list[tuple[str, int]]] = {}
    for rank in range(world_size):
        ledger = Ledger(seed=seed, total=manifest.total, manifest=manifest.summary())
        options = LoaderOptions(batch_size=batch_size, num_workers=workers, transform=add_image)
        loader = DaliStrategy().build(reader, manifest, ledger, World(rank, world_size), options, track=True)
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            batches = list(loader)
            rank_plan = loader.sampler.rank_plan
            assert rank_plan is not None
            # The merged batches have the plan's sizes and carry the samples their provenance names.
            assert [len(b["id"]) for b in batches] == [len(rank_plan.batch(i).positions) for i in range(len(batches))]
            for batch in batches:
                provenance = loader.pop_delivered()
                assert provenance.epoch == epoch
                assert batch["pos"].tolist() == provenance.positions.tolist()
                ids = _ids_of(reader, manifest, seed, epoch, provenance.positions)
                assert batch["id"].tolist() == ids
                x = np.sin(np.array(ids)[:, None] * 0.618 + np.arange(8)[None, :]).astype(np.float32)
                np.testing.assert_array_equal(batch["x"].numpy(), x)
                np.testing.assert_array_equal(batch["img"].numpy(), x.reshape(-1, 2, 4))
                assert batch["is_padding"].tolist() == [False] * len(ids)
                seen[epoch].update(ids)
            # What each source was planned to read, as (item key, index) in reading order.
            layout = merge_layout(rank_plan, workers)
            for w in range(workers):
                positions, _ = layout.run(w)
                items, index = EpochOrder([it.num_samples for it in manifest.items], seed, epoch).locate(positions)
                planned[(rank, epoch, w)] = [(order_items[i], int(j)) for i, j in zip(items, index, strict=True)]
        loader.close()
    assert_exactly_once(seen, manifest.total, epochs=2)
    # Affinity: each worker process read exactly one (rank, source) run in order, in both epochs,
    # and no two processes read the same sample.
    reads = _reads(tmp_path)
    main = reads.pop(os.getpid())  # the one sample read to learn the fields
    assert len(main) == 2  # once per rank's loader
    assert len(reads) == world_size * workers, f"{len(reads)} reading processes: {sorted(reads)}"
    owners = set()
    for pid, got in reads.items():
        owner = [key for key in planned if key[1] == 0 and got == planned[key] + planned[(key[0], 1, key[2])]]
        assert len(owner) == 1, f"process {pid} did not read exactly one planned (rank, source) run in order"
        owners.add(owner[0])
    assert len(owners) == world_size * workers


@needs_dali
@pytest.mark.processes
@pytest.mark.timeout(60)
def test_each_worker_reads_only_its_own_shards(tmp_path: Path) -> None:
    """Unshuffled shards whose boundaries meet the workers' runs: no shard is opened by two workers."""
    reader = RecordingReader(str(tmp_path), sizes=(16, 16, 16, 16))
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    loader = DaliStrategy().build(
        reader, manifest, ledger, World(), LoaderOptions(batch_size=8, num_workers=2, shuffle=False), track=True
    )
    ids = [i for batch in loader for i in batch["id"].tolist()]
    loader.close()
    assert sorted(ids) == list(range(64))
    reads = _reads(tmp_path)
    reads.pop(os.getpid())
    shards = {pid: sorted({key for key, _ in got}) for pid, got in reads.items()}
    assert sorted(shards.values()) == [["synthetic-00000", "synthetic-00001"], ["synthetic-00002", "synthetic-00003"]]


@needs_dali
@pytest.mark.timeout(60)
def test_without_workers_one_source_serves_the_epoch_in_process() -> None:
    reader = SyntheticReader(sizes=SIZES)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=1, total=manifest.total, manifest=manifest.summary())
    loader = DaliStrategy().build(
        reader, manifest, ledger, World(), LoaderOptions(batch_size=16, num_workers=0), track=True
    )
    seen: dict[int, Counter[int]] = defaultdict(Counter)
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            seen[epoch].update(batch["id"].tolist())
            loader.pop_delivered()
    loader.close()
    assert_exactly_once(seen, manifest.total, epochs=2)


@needs_dali
@pytest.mark.processes
@pytest.mark.chain
@pytest.mark.timeout(240)
def test_resume_under_lightning_on_other_ranks_and_workers(tmp_path: Path) -> None:
    """Real Trainer, 2 DDP ranks x 2 DALI workers, killed after a checkpoint; resumed on 1 rank x 1
    worker for the rest of epoch 0 and all of epoch 1: every sample exactly once per epoch."""
    first = Job(Topology(2, 2), loading=Loading(loader="dali"), training=Training(epochs=2))
    then = [first.on(1, 1)]
    seen, segments = check_resume(tmp_path, first, then, checkpoint_every=3, die_after=2)
    assert_exactly_once(seen, sum(SIZES), epochs=2)
    report: Any = segments[-1].report
    assert report["datamodule"] == "DaliDataModule"
    assert [e["consumed"] for e in report["epochs"]] == [sum(SIZES)] * 2


def test_missing_dali_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_sharding.lightning.dali import require_dali

    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` fail
    with pytest.raises(ImportError, match=r"lightning-sharding\[dali\]"):
        require_dali()
