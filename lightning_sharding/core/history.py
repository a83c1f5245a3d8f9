"""The history of a checkpoint's training: one entry per run that trained into it, and the replay of
its plan that names the epoch positions each rank trained at any global step.

A run (the first, or a resume) trains from one global step and one ledger, on one topology; the plan
(:mod:`~lightning_sharding.core.plan`) is a pure function of the ledger's consumed set and that
topology, so the entry records exactly those: the global ``step`` and ``epoch`` the run started at,
the ``consumed`` positions it started from (as ``[start, end)`` pairs, flat), its data-parallel
``world_size``, ``num_workers``, ``batch_size`` (the micro-batch), ``accumulate`` (micro-batches an
optimizer step), ``even_batches`` and ``worker_layout`` (how the plan deals batches to workers).
The seed, the manifest and the epoch's total are the ledger's.

Global step ``N`` is the optimizer step Lightning trains while ``trainer.global_step == N`` (the
step its loss is logged at); the audit trail writes its micro-batches' lines with ``gs`` up to
``N + 1``. A rank's micro-batches are delivered in :meth:`RankPlan.tasks` order (round-robin over
the DataLoader's workers), ``accumulate`` of them a step, as Lightning counts them: a window ends
where the epoch's batch count is a multiple of ``accumulate``, and at the epoch's last batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_sharding.core.order import Order
from lightning_sharding.core.plan import RankPlan, plan_epoch
from lightning_sharding.core.rangeset import RangeSet

HISTORY_VERSION = 1
HISTORY_KEY = "history"  # where a ledger's state holds {"version", "segments"}
SEGMENT_KEYS = ("step", "epoch", "consumed", "world_size", "num_workers", "batch_size", "accumulate", "even_batches")


class StepNotInHistoryError(ValueError):
    """The step asked for is not one this checkpoint's history can replay."""


def segment_entry(
    *,
    step: int,
    epoch: int,
    consumed: RangeSet,
    world_size: int,
    num_workers: int,
    batch_size: int,
    accumulate: int,
    even_batches: str,
    worker_layout: str | None = "runs",
    batches_before: int = 0,
    fingerprint: str | None = None,
    limited: bool = False,
    ahead: Mapping[int, RangeSet] | None = None,
) -> dict[str, Any]:
    """One run's history entry (plain ints and strings: checkpoints load with ``weights_only=True``);
    ``worker_layout`` is the plan's (``None``: the strategy deals batches otherwise than by a plan's
    workers, the dispatch strategy's, and its steps cannot be replayed); ``batches_before`` is how many
    batches of its epoch Lightning counted before the run (a resume's): its accumulation windows end
    where that count plus the run's batches is a multiple of ``accumulate``. ``fingerprint``: the data
    the run trained on (a run before a mixture change trained on another); ``limited``: the run's
    epochs were cut short (``limit_train_batches``) where the plan does not end them; ``consumed`` is
    what the plan of the run's first epoch leaves out (consumed or skipped), ``ahead`` the samples of
    later epochs a ``skip=`` resume left out (``{epoch: positions}``)."""
    return {
        "step": int(step),
        "epoch": int(epoch),
        "consumed": flat_ranges(consumed),
        "world_size": int(world_size),
        "num_workers": int(num_workers),
        "batch_size": int(batch_size),
        "accumulate": int(accumulate),
        "even_batches": str(even_batches),
        "worker_layout": worker_layout or "",
        "batches_before": int(batches_before),
        **({"fingerprint": str(fingerprint)} if fingerprint is not None else {}),
        **({"limited": True} if limited else {}),
        **({"ahead": [[int(e), *flat_ranges(r)] for e, r in sorted(ahead.items())]} if ahead else {}),
    }


def ranges_of_flat(flat: Sequence[int]) -> RangeSet:
    """The range set of :func:`flat_ranges`' plain ints ``[start, end, start, end, ...]``."""
    return RangeSet.from_state(np.asarray(flat, dtype=np.int64).reshape(-1, 2))


def flat_ranges(ranges: RangeSet) -> list[int]:
    """A range set as plain ints ``[start, end, start, end, ...]`` (checkpoints load with ``weights_only``)."""
    return [int(x) for x in np.asarray(ranges.to_state()).reshape(-1)]


def history_state(segments: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ledger state's ``history`` value."""
    return {"version": HISTORY_VERSION, "segments": [dict(s) for s in segments]}


def segments_of(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The history entries of a ledger state (none for a checkpoint written before histories, or of a
    later history version this release does not read)."""
    held = state.get(HISTORY_KEY)
    if not isinstance(held, Mapping) or held.get("version") != HISTORY_VERSION:
        return []
    segments = held.get("segments")
    if not isinstance(segments, list) or not all(isinstance(s, Mapping) for s in segments):
        return []
    return [dict(s) for s in segments if all(k in s for k in SEGMENT_KEYS)]


@dataclass(frozen=True)
class RankStep:
    """What one data-parallel rank trained at one global step: ``batches`` holds each micro-batch's
    epoch positions (int64, padding left out), in the order trained."""

    rank: int
    epoch: int
    batches: list[np.ndarray]

    @property
    def positions(self) -> np.ndarray:
        """Every position of the step on this rank, in the order trained."""
        return np.concatenate(self.batches) if self.batches else np.zeros(0, dtype=np.int64)


def replay_step(
    state: Mapping[str, Any],
    step: int,
    global_step: int | None = None,
    orders: Callable[[int, int], Order] | None = None,
) -> list[RankStep]:
    """Which epoch positions every data-parallel rank trained at global step ``step``, replayed from
    the history of the ledger ``state`` (a checkpoint's entry) without reading data.

    ``global_step`` is the checkpoint's (the steps it holds end there; default: the ledger's own
    record of it); ``orders(seed, epoch)`` gives an epoch's order, needed for an order with blocks or
    in time order (a mixture): without it the epoch is planned as ``total`` positions. A step outside
    the history is a :class:`StepNotInHistoryError` naming the range it covers.
    """
    return next(iter(replay_steps(state, [step], global_step, orders).values()))


def replay_steps(
    state: Mapping[str, Any],
    steps: Iterable[int],
    global_step: int | None = None,
    orders: Callable[[int, int], Order] | None = None,
    *,
    beyond: bool = False,
) -> dict[int, list[RankStep]]:
    """:func:`replay_step` of each of ``steps`` (in the order given), each epoch planned once.

    ``beyond``: steps from the checkpoint's ``global_step`` on are replayed too, as the run that
    wrote the checkpoint went on to train them on its topology (the last history entry's): what a
    resume with ``skip=`` names when the steps after a checkpoint went wrong.
    """
    segments = segments_of(state)
    end = global_step if global_step is not None else state.get("global_step")
    if not segments:
        raise StepNotInHistoryError(
            "the checkpoint records no training history (it was written by an earlier lightning_sharding, "
            "or by ShardedData without the Trainer): no step can be replayed"
        )
    first = int(segments[0]["step"])
    last = None if beyond or end is None else int(end)
    plans: dict[tuple[int, int], Any] = {}  # (history entry, epoch) -> (plan, step it starts at, offset)
    rank_plans: dict[tuple[int, int, int], RankPlan] = {}
    answers: dict[int, list[RankStep]] = {}
    for step in steps:
        if step < first or (last is not None and step >= last):
            covers = f"steps {first} to {last - 1}" if last is not None and last > first else "no step"
            raise StepNotInHistoryError(
                f"step {step} is not in this checkpoint's training history, which covers {covers}"
                + (f" (its history starts at the resume at step {first})" if first > 0 else "")
            )
        k = max(i for i, s in enumerate(segments) if int(s["step"]) <= step)
        if beyond and state.get("decisions") is not None and (end is None or step >= int(end)):
            raise StepNotInHistoryError(
                "the checkpoint's mixture is under online control: the decisions made after it plan its epochs "
                "again, so steps after it cannot be named from it"
            )
        epoch, plan, start, offset, accumulate = _epoch_of(state, segments[k], k, step, orders, plans)
        lo = max(0, (step - start) * accumulate - offset)
        hi = min((step - start + 1) * accumulate - offset, plan.num_batches)
        answer = []
        for rank in range(plan.world_size):
            if (k, epoch, rank) not in rank_plans:  # a rank's plan can cost O(epoch) to make (time order)
                rank_plans[k, epoch, rank] = plan.rank(rank)
            rank_plan = rank_plans[k, epoch, rank]
            tasks = [rank_plan.batch(_delivered(rank_plan, d)) for d in range(lo, hi)]
            batches = [t.positions[: t.positions.size - t.num_padding] for t in tasks]
            answer.append(RankStep(rank, epoch, batches))
        answers[step] = answer
    return answers


def _epoch_of(
    state: Mapping[str, Any],
    seg: Mapping[str, Any],
    k: int,
    step: int,
    orders: Callable[[int, int], Order] | None,
    plans: dict[tuple[int, int], Any],
) -> tuple[int, Any, int, int, int]:
    """The epoch of history entry ``seg`` (the ``k``-th) that trained ``step``: ``(epoch, its plan,
    the step it starts at, the batches its first window held already, accumulate)``; ``plans`` caches
    each epoch's plan."""
    _check_replayable(state, seg, orders)
    layout = seg.get("worker_layout", "runs")
    seed, total = int(state["seed"]), int(state["total"])
    epoch, start = int(seg["epoch"]), int(seg["step"])
    consumed = ranges_of_flat(seg["consumed"])
    ahead = {int(e): ranges_of_flat(r) for e, *r in seg.get("ahead", [])}
    accumulate = max(1, int(seg["accumulate"]))
    offset = int(seg.get("batches_before", 0)) % accumulate  # the first window may be part-filled already
    while True:
        if (k, epoch) not in plans:
            order: Order | int = orders(seed, epoch) if orders is not None else total
            plan = plan_epoch(
                order,
                consumed,
                epoch=epoch,
                world_size=int(seg["world_size"]),
                num_workers=int(seg["num_workers"]),
                batch_size=int(seg["batch_size"]),
                even_batches=seg["even_batches"],
                worker_layout=layout,
            )
            plans[k, epoch] = (plan, start, offset)
        plan, start, offset = plans[k, epoch]
        steps = (
            -(-(offset + plan.num_batches) // accumulate) if plan.num_batches else 0
        )  # Lightning steps at the epoch's last batch too
        if step < start + steps:
            return epoch, plan, start, offset, accumulate
        start, epoch, offset = start + steps, epoch + 1, 0
        consumed = ahead.get(epoch, RangeSet())  # a later epoch starts with nothing but its skipped samples


def _check_replayable(state: Mapping[str, Any], seg: Mapping[str, Any], orders: Callable[..., Any] | None) -> None:
    """A :class:`StepNotInHistoryError` for a history entry whose steps cannot be replayed."""
    if seg["even_batches"] not in ("pad", "drop"):
        raise StepNotInHistoryError(
            f"steps {seg['step']} on were trained with even_batches={seg['even_batches']!r}, whose batches are "
            "dealt as workers finish them: they cannot be replayed"
        )
    manifest = state.get("manifest") or {}
    if seg.get("fingerprint", manifest.get("fingerprint")) != manifest.get("fingerprint"):
        raise StepNotInHistoryError(
            f"steps {seg['step']} on were trained on other data or another mixture than the checkpoint's "
            "(it was resumed with allow_mixture_change or allow_data_change): they cannot be replayed from it"
        )
    if state.get("decisions"):
        raise StepNotInHistoryError(
            "the checkpoint's mixture is under online control, whose decisions plan its epochs again as "
            "training goes: its steps cannot be replayed"
        )
    if seg.get("limited"):
        raise StepNotInHistoryError(
            f"steps {seg['step']} on were trained with limit_train_batches, which ends epochs where the plan "
            "does not: they cannot be replayed"
        )
    if orders is None and (manifest.get("streams") or manifest.get("schedule")):
        raise ValueError("replay_step: the steps of a mixture need orders= (its epochs' order)")
    if seg.get("worker_layout", "runs") not in ("runs", "interleaved"):
        raise StepNotInHistoryError(
            f"steps {seg['step']} on were trained by a strategy that deals batches otherwise than a plan's workers "
            "(dispatch, as its workers finish them; dali with several sources, merged): they cannot be replayed"
        )


def _delivered(plan: RankPlan, d: int) -> int:
    """The index of the ``d``-th batch :meth:`RankPlan.tasks` deals (round-robin over the workers'
    batches), in O(workers): the workers' batch counts differ by at most one, the longer first."""
    runs = [plan.worker_batches(w) for w in range(max(1, plan.num_workers))]
    shortest = min(len(r) for r in runs)
    if d < shortest * len(runs):
        step, worker = divmod(d, len(runs))
        return runs[worker][step]
    longer = [r for r in runs if len(r) > shortest]
    step, k = divmod(d - shortest * len(runs), max(1, len(longer)))
    return longer[k][shortest + step]
