"""Planning at scale, and the checkpointed ledger: its size and its gather-plus-save cost at 2 ranks.

Planning: one rank's plan (every batch task built) plus all ranks' batch counts, padding and drops,
for 4,096 ranks x 8 workers x 10^6 items with a ledger of 10,000 ranges.

Checkpoint: ledgers as real runs leave them, built by planning and consuming half of every
worker's run: once mid-epoch on 2 ranks x 2 workers, then after three rescales (3x2, 1x1, 4x2).
Two gloo processes each hold their rank's share; rank 0 times the gather and union (the
checkpoint callback's ``gather_objects`` and ``Ledger.merge``) and the ``torch.save`` of the entry.
"""

from __future__ import annotations

import io
import os
import socket
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.distributed.collectives import gather_objects

ITEMS, RANKS, WORKERS, LEDGER_RANGES, PLAN_BATCH = 1_000_000, 4096, 8, 10_000, 16
STREAMS = 16  # the mixture row: 16 streams of ITEMS items each (one sample per item), weights 1..16


def planning_seconds(repeats: int) -> dict[str, Any]:
    """Median seconds to plan one rank (all its tasks built) and every rank's counts."""
    starts = np.arange(LEDGER_RANGES, dtype=np.int64) * (ITEMS // LEDGER_RANGES)
    consumed = RangeSet(starts, starts + ITEMS // LEDGER_RANGES // 2)
    assert consumed.num_ranges == LEDGER_RANGES
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_epoch(ITEMS, consumed, epoch=0, world_size=RANKS, num_workers=WORKERS, batch_size=PLAN_BATCH)
        tasks = list(plan.rank(RANKS - 1).tasks())
        counts = (plan.num_batches, plan.rank_counts, plan.padding_per_rank, plan.dropped_per_rank)
        times.append(time.perf_counter() - start)
        assert len(tasks) == counts[0] and len(counts[1]) == RANKS
    return {"seconds": statistics.median(times), "runs": times, "batches_per_rank": plan.num_batches}


def mixture_planning_seconds(repeats: int, composition: str = "mixed") -> dict[str, Any]:
    """Median seconds to plan a mixture epoch of 16 streams x 10^6 items for 4,096 ranks x 8 workers
    (the mixture's order, one rank's tasks, every rank's counts and the stream of each of the rank's
    positions, with a 10,000-range ledger), and separately to map that rank's positions to items:
    that builds each stream's item order (a permutation of its 10^6 items), once per epoch. A
    ``stratified`` or ``per_stream`` composition plans blocks of the batch size (one batch each)."""
    from lightning_sharding.mixture.order import Mixture, StreamSpec, plan_draws

    specs = [StreamSpec(f"s{i}", weight=float(i + 1)) for i in range(STREAMS)]
    draws = plan_draws(specs, [ITEMS] * STREAMS)
    names, shares = tuple(s.name for s in specs), tuple(s.describe() for s in specs)
    batch = None if composition == "mixed" else PLAN_BATCH
    mixture = Mixture(names, shares, (ITEMS,) * STREAMS, tuple(draws), composition, batch)
    counts = np.ones(STREAMS * ITEMS, dtype=np.int64)
    total = sum(draws)
    starts = np.arange(LEDGER_RANGES, dtype=np.int64) * (total // LEDGER_RANGES)
    consumed = RangeSet(starts, starts + total // LEDGER_RANGES // 2)
    plan_times, locate_times = [], []
    for epoch in range(repeats):
        start = time.perf_counter()
        order = mixture.order(counts, 0, epoch)
        plan = plan_epoch(
            order,
            consumed,
            world_size=RANKS,
            num_workers=WORKERS,
            batch_size=PLAN_BATCH,
        )
        tasks = list(plan.rank(RANKS - 1).tasks())
        positions = np.concatenate([t.positions for t in tasks])
        streams, _ = order.streams(positions)
        plan_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        items, _ = order.locate(positions)
        locate_times.append(time.perf_counter() - start)
        assert len(plan.rank_counts) == RANKS and items.size == positions.size
        assert np.array_equal(np.searchsorted(np.arange(1, STREAMS + 1) * ITEMS, items, side="right"), streams)
    return {
        "seconds": statistics.median(plan_times),
        "runs": plan_times,
        "locate_seconds": statistics.median(locate_times),
        "locate_runs": locate_times,
        "streams": STREAMS,
        "composition": composition,
        "samples_per_epoch": total,
    }


def mixture_decision_seconds(repeats: int, decisions: int = 10) -> dict[str, Any]:
    """Median seconds one rank spends replanning after a MixtureController's decision: 16 streams x
    10^6 items under ``decisions`` earlier decisions of the epoch, 4,096 ranks x 8 workers, half the
    epoch consumed (a prefix, as a controlled epoch is trained). It builds the decided epoch's order,
    plans the rest without what was delivered, and builds the rank's tasks and their streams: what
    :meth:`ShardedLoader._replan` and the first batches after it do, once per decision."""
    from lightning_sharding.mixture.control import ControlledMixture, Decision
    from lightning_sharding.mixture.order import Mixture, StreamSpec, plan_draws

    specs = [StreamSpec(f"s{i}", weight=float(i + 1)) for i in range(STREAMS)]
    draws = plan_draws(specs, [ITEMS] * STREAMS)
    names = tuple(s.name for s in specs)
    mixture = Mixture(names, tuple(s.describe() for s in specs), (ITEMS,) * STREAMS, tuple(draws))
    counts = np.ones(STREAMS * ITEMS, dtype=np.int64)
    total = sum(draws)
    half = total // 2
    rng = np.random.default_rng(0)
    made = tuple(
        Decision(0, (k + 1) * half // (decisions + 1), dict(zip(names, rng.random(STREAMS).tolist(), strict=True)), k)
        for k in range(decisions)
    )
    controlled = ControlledMixture(mixture, made)
    delivered = RangeSet.interval(half, half + RANKS * PLAN_BATCH * 2)  # two windows delivered ahead
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        decided = controlled.decided(Decision(0, half + RANKS * PLAN_BATCH * 2, {"s0": 1.0, "s15": 2.0}, decisions))
        order = decided.order(counts, 0, 0)
        plan = plan_epoch(
            order, RangeSet.interval(0, half) | delivered, world_size=RANKS, num_workers=WORKERS, batch_size=PLAN_BATCH
        )
        tasks = list(plan.rank(RANKS - 1).tasks())
        streams, _ = order.streams(np.concatenate([t.positions for t in tasks]))
        times.append(time.perf_counter() - start)
        assert plan.in_time and len(tasks) == plan.num_batches and set(np.unique(streams).tolist()) <= {0, 15}
    return {"seconds": statistics.median(times), "runs": times, "decisions": decisions, "streams": STREAMS}


def mixture_change_seconds(items: int, samples_per_item: int) -> dict[str, Any]:
    """Seconds a resume with ``allow_mixture_change`` spends once to change a mixture's epoch: 16
    streams of ``items`` items of ``samples_per_item`` samples, a quarter of the epoch consumed in 16
    runs (as 16 ranks leave it), weights 1..16 reversed. It locates every consumed sample (each
    item's sample order is drawn once: items of few samples cost the most), and then the rest."""
    from lightning_sharding.core.manifest import Item, Manifest
    from lightning_sharding.mixture.change import change_mixture
    from lightning_sharding.mixture.order import Mixture, StreamSpec, plan_draws

    names = [f"s{i}" for i in range(STREAMS)]
    all_items = tuple(Item(f"{n}/{i}", samples_per_item) for n in names for i in range(items))

    def manifest(weights: list[float]) -> Manifest:
        specs = [StreamSpec(n, weight=w) for n, w in zip(names, weights, strict=True)]
        draws = plan_draws(specs, [items * samples_per_item] * STREAMS)
        shares = tuple(s.describe() for s in specs)
        return Manifest(all_items, Mixture(tuple(names), shares, (items,) * STREAMS, tuple(draws)))

    before, after = (
        manifest([float(i + 1) for i in range(STREAMS)]),
        manifest([float(STREAMS - i) for i in range(STREAMS)]),
    )
    run = before.total // 16
    ledger = Ledger(seed=0, total=before.total, manifest=before.summary())
    ledger.merge(RangeSet.from_ranges((r * run, r * run + run // 4) for r in range(16)))
    after.summary()  # the fingerprints: computed at setup, before any resume
    start = time.perf_counter()
    change = change_mixture(ledger.state_dict(), after, shuffle=True)
    seconds = time.perf_counter() - start
    assert change.before == len(ledger.consumed) and change.rest == after.total - change.before
    return {"seconds": seconds, "consumed": change.before, "items": items, "samples_per_item": samples_per_item}


def _consume_half(ledger: Ledger, world_size: int, workers: int, batch: int) -> None:
    """Every rank's every worker completes the first half of its batches, as a run stopped mid-epoch does."""
    plan = plan_epoch(
        ledger.total, ledger.trained, epoch=0, world_size=world_size, num_workers=workers, batch_size=batch
    )
    for rank in range(world_size):
        rank_plan = plan.rank(rank)
        for worker in range(max(1, workers)):
            run = rank_plan.worker_batches(worker)
            for index in list(run)[: len(run) // 2]:
                task = rank_plan.batch(index)
                ledger.record(task.positions[: len(task.positions) - task.num_padding])
    ledger.commit()


def ledgers(total: int, batch: int) -> dict[str, Ledger]:
    """The ledger after a mid-epoch stop on 2x2, and after three more stops on other topologies."""
    ledger = Ledger(seed=0, total=total, manifest={"fingerprint": "bench"})
    _consume_half(ledger, 2, 2, batch)
    mid = Ledger.from_state_dict(ledger.state_dict())
    for world_size, workers in ((3, 2), (1, 1), (4, 2)):
        _consume_half(ledger, world_size, workers, batch)
    return {"mid-epoch (2x2)": mid, "after 3 rescales": ledger}


def entry_bytes(ledger: Ledger) -> int:
    """Bytes of the ledger's checkpoint entry as ``torch.save`` writes it."""
    state = ledger.state_dict()
    state["consumed"] = torch.from_numpy(state["consumed"])
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.tell()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gather_and_save(rank: int, port: int, states: list[dict[str, Any]], repeats: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for name_state in states:
            times = []
            for _ in range(repeats):
                ledger = Ledger.from_state_dict(name_state["shares"][rank])
                dist.barrier()
                start = time.perf_counter()
                for state in gather_objects(ledger.consumed.to_state(), 2):
                    ledger.merge(RangeSet.from_state(state))
                entry = ledger.state_dict()
                entry["consumed"] = torch.from_numpy(entry["consumed"])
                if rank == 0:
                    torch.save({"lightning_sharding": entry}, io.BytesIO())
                times.append(time.perf_counter() - start)
            if rank == 0:
                out.put((name_state["name"], statistics.median(times)))
    finally:
        dist.destroy_process_group()


def checkpoint(repeats: int, total: int = ITEMS, batch: int = 256) -> dict[str, Any]:
    """Ledger bytes and median gather-plus-save seconds at 2 ranks, per ledger of :func:`ledgers`."""
    rows: dict[str, Any] = {}
    states = []
    for name, ledger in ledgers(total, batch).items():
        rows[name] = {"ranges": ledger.consumed.num_ranges, "bytes": entry_bytes(ledger)}
        # Each rank holds the positions of its own half of the epoch, as after a restore and more steps.
        halves = (RangeSet.interval(0, total // 2), RangeSet.interval(total // 2, total))
        shares = []
        for half in halves:
            share = Ledger.from_state_dict(ledger.state_dict())
            share.consumed = ledger.consumed.intersection(half)
            shares.append(share.state_dict())
        states.append({"name": name, "shares": shares})
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_gather_and_save, args=(_free_port(), states, repeats, out), nprocs=2, start_method="spawn")
    while not out.empty():
        name, seconds = out.get()
        rows[name]["gather_save_seconds"] = seconds
    return rows
