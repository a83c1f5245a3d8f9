"""``skip=``: leave a loss spike's data out of a resume.

A resume from a checkpoint written before a spike names what to leave out: global steps (as the run
that wrote the checkpoint went on to train them, replayed from its history without reading data:
:func:`~lightning_sharding.core.history.replay_steps`; or as a later checkpoint's history says, for
steps trained after another resume), or samples (epoch positions, as ``inspect --step`` prints them).
The positions go into the ledger as *skipped*: the plan leaves them out of their epoch, they are never
trained nor served again there, and they stay apart from ``consumed`` (the samples in the weights).
A checkpoint records each skip it applied, so a requeue with the same ``skip=`` resuming from a later
checkpoint applies it once.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_sharding.core.history import replay_steps, segments_of
from lightning_sharding.core.rangeset import RangeSet

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_KEYS = ("steps", "samples", "documents", "epoch", "checkpoint")
_CHUNK = 1 << 18  # sequences whose pieces are looked at at once, for documents=


class SkipError(ValueError):
    """A ``skip=`` that cannot be applied to this resume."""


def _ranges(value: Any, what: str) -> tuple[tuple[int, int], ...]:
    """``"4-5,9"`` or ``[4, 5, 9]`` (or one int, or a NumPy array of them) as inclusive ranges
    ``((4, 5), (9, 9))``."""
    if isinstance(value, bool | np.bool_):
        raise SkipError(f"skip= {what}: {value!r} is not a step or sample number")
    if isinstance(value, numbers.Integral):
        value = [int(value)]
    if isinstance(value, np.ndarray) and value.ndim == 1 and np.issubdtype(value.dtype, np.integer):
        value = value.tolist()
    parts: list[tuple[int, int]] = []
    if isinstance(value, str):
        for piece in value.split(","):
            m = _RANGE.match(piece)
            if m is None:
                raise SkipError(
                    f"skip= {what}: {piece.strip()!r} is not a number or a range 'first-last' "
                    "(write them like '81200-81400,81500', both ends included)"
                )
            first, last = int(m.group(1)), int(m.group(2) or m.group(1))
            if last < first:
                raise SkipError(f"skip= {what}: the range {piece.strip()!r} ends before it starts")
            parts.append((first, last))
    elif isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        for x in value:
            if isinstance(x, bool | np.bool_) or not isinstance(x, numbers.Integral) or x < 0:
                raise SkipError(f"skip= {what}: {x!r} is not a non-negative integer")
            parts.append((int(x), int(x)))
    else:
        raise SkipError(f"skip= {what}: {value!r} is neither ranges like '4-5,9' nor a list of integers")
    if not parts:
        raise SkipError(f"skip= {what}: names nothing")
    merged: list[tuple[int, int]] = []  # sorted, touching ranges joined: [4, 5, 6] says 4-6
    for a, b in sorted(parts):
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return tuple(merged)


@dataclass(frozen=True)
class Skip:
    """What a resume leaves out. ``steps``: global steps (``trainer.global_step`` while they trained,
    as logged), inclusive ranges; ``samples``: epoch positions of ``epoch`` (default: the checkpoint's
    epoch), inclusive ranges; ``documents``: of packed token sequences, the sequences of ``epoch`` that
    hold any token of these documents (numbered as ``inspect --step --data`` prints them), inclusive
    ranges; ``checkpoint``: a later checkpoint whose history holds ``steps`` (they were trained after
    another resume, on a topology the resumed checkpoint does not know)."""

    steps: tuple[tuple[int, int], ...] = ()
    samples: tuple[tuple[int, int], ...] = ()
    documents: tuple[tuple[int, int], ...] = ()
    epoch: int | None = None
    checkpoint: str | None = None

    @classmethod
    def of(cls, value: Any) -> Skip | None:
        """``skip=`` as given: ``"81200-81400"`` (steps), a list of steps, a mapping of :data:`_KEYS`,
        or a :class:`Skip`; ``None`` skips nothing. A bad value is a :class:`SkipError` naming it."""
        if value is None or isinstance(value, Skip):
            return value
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in _KEYS]
            if unknown:
                raise SkipError(f"skip= has no key {unknown[0]!r}: give {', '.join(_KEYS)}")
            if all(value.get(k) is None for k in ("steps", "samples", "documents")):
                raise SkipError(
                    "skip= names no steps, samples or documents: give steps='first-last', samples= or documents="
                )
            epoch = value.get("epoch")
            if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
                raise SkipError(f"skip= epoch: {epoch!r} is not a non-negative integer")
            if value.get("epoch") is not None and value.get("samples") is None and value.get("documents") is None:
                raise SkipError("skip= epoch: names the epoch of samples= or documents=, and neither is given")
            if value.get("checkpoint") is not None and value.get("steps") is None:
                raise SkipError("skip= checkpoint: replays steps=, and none are given")
            return cls(
                steps=_ranges(value["steps"], "steps") if value.get("steps") is not None else (),
                samples=_ranges(value["samples"], "samples") if value.get("samples") is not None else (),
                documents=_ranges(value["documents"], "documents") if value.get("documents") is not None else (),
                epoch=epoch,
                checkpoint=str(value["checkpoint"]) if value.get("checkpoint") is not None else None,
            )
        return cls(steps=_ranges(value, "steps"))

    def describe(self) -> str:
        """As a user would write it: ``steps 4-5``, ``samples 10-19 of epoch 1``."""

        def shown(ranges: tuple[tuple[int, int], ...]) -> str:
            return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in ranges)

        parts = [f"steps {shown(self.steps)}"] if self.steps else []
        epoch = f" of epoch {self.epoch}" if self.epoch is not None else ""
        if self.samples:
            parts.append(f"samples {shown(self.samples)}{epoch}")
        if self.documents:
            parts.append(f"the sequences of documents {shown(self.documents)}{epoch}")
        if self.checkpoint is not None:
            parts.append(f"as {self.checkpoint} trained them")
        return ", ".join(parts)

    def positions(
        self,
        state: Mapping[str, Any],
        global_step: int | None,
        orders: Callable[[int, int], Any] | None,
        load: Callable[[str], Mapping[str, Any]] | None = None,
        order_of: Callable[[int], Any] | None = None,
    ) -> tuple[dict[int, RangeSet], str]:
        """``({epoch: positions}, how the steps were replayed)`` of this skip at a resume from the ledger
        ``state`` (a checkpoint's entry) whose weights are of ``global_step``; ``orders`` gives an epoch's
        order (a mixture's), ``load(path)`` a checkpoint's ledger entry (for ``checkpoint``),
        ``order_of(epoch)`` an epoch's order of packed sequences (for ``documents``; ``None``: not packed)."""
        found: dict[int, RangeSet] = {}
        how = ""
        held = int(global_step if global_step is not None else state.get("global_step") or 0)
        epoch, total = int(state["epoch"]), int(state["total"])
        if self.steps:
            steps = [s for a, b in self.steps for s in range(a, b + 1)]
            early = [s for s in steps if s < held]
            if early:
                raise SkipError(
                    f"skip= steps: step {early[0]} is in this checkpoint's weights already (it holds steps 0 to "
                    f"{held - 1}): resume from a checkpoint written before step {early[0]}, or skip only later steps"
                )
            source, end, beyond = state, held, True
            if self.checkpoint is not None:
                if load is None:
                    raise SkipError("skip= checkpoint: this resume cannot read another checkpoint")
                source = load(self.checkpoint)
                if source.get("manifest", {}).get("fingerprint") != state["manifest"]["fingerprint"] or int(
                    source["seed"]
                ) != int(state["seed"]):
                    raise SkipError(
                        f"skip= checkpoint: {self.checkpoint} was trained on other data or another seed than "
                        "the checkpoint resumed: its steps name other samples"
                    )
                end, beyond = int(source.get("global_step") or 0), False
            far = replay_steps(source, [steps[-1]], end, orders, beyond=beyond)[steps[-1]][0].epoch
            if far > epoch + 1:  # a typo (a digit too many) would leave out epochs of data
                raise SkipError(
                    f"skip= steps: step {steps[-1]} would be trained in epoch {far}, and the checkpoint is in epoch "
                    f"{epoch}: skip= leaves out steps of this epoch and the next; check the step numbers"
                )
            for step, ranks in replay_steps(source, steps, end, orders, beyond=beyond).items():
                for got in ranks:
                    if got.epoch < epoch:
                        raise SkipError(
                            f"skip= steps: step {step} trained epoch {got.epoch}, which the checkpoint (in epoch "
                            f"{epoch}) has finished: its samples cannot be left out of it"
                        )
                    found[got.epoch] = found.get(got.epoch, RangeSet()) | RangeSet.from_positions(got.positions)
            last = segments_of(source)[-1]
            how = (
                f"as {self.checkpoint}'s history replays them"
                if self.checkpoint is not None
                else f"as the run that wrote the checkpoint trained them: {last['world_size']} data-parallel rank(s) "
                f"x {last['num_workers']} worker(s), batch_size {last['batch_size']}, accumulate {last['accumulate']}"
            )
        if self.samples:
            at = self.epoch if self.epoch is not None else epoch
            if at < epoch:
                raise SkipError(f"skip= epoch {at}: the checkpoint is in epoch {epoch} already; epoch {at} is over")
            bad = [b for _, b in self.samples if b >= total]
            if bad:
                raise SkipError(f"skip= samples: position {bad[0]} is outside an epoch of {total} samples")
            chosen = RangeSet.from_ranges((a, b + 1) for a, b in self.samples)
            found[at] = found.get(at, RangeSet()) | chosen
        if self.documents:
            at = self.epoch if self.epoch is not None else epoch
            if at < epoch:
                raise SkipError(f"skip= epoch {at}: the checkpoint is in epoch {epoch} already; epoch {at} is over")
            order = order_of(at) if order_of is not None else None
            if order is None or not hasattr(order, "pieces"):
                raise SkipError(
                    "skip= documents: names documents of packed token sequences (one reader with packing=), and "
                    "this data is not that: give samples= (epoch positions, as inspect --step prints them)"
                )
            found[at] = found.get(at, RangeSet()) | _holding(order, self.documents)
        return found, how


def _holding(order: Any, documents: tuple[tuple[int, int], ...]) -> RangeSet:
    """The sequences of a packed ``order`` holding a token of ``documents`` (inclusive ranges)."""
    count = int(order.epochs.lengths.size)
    beyond = [b for _, b in documents if b >= count]
    if beyond:
        raise SkipError(f"skip= documents: document {beyond[0]} is not in this data, which holds {count} documents")
    wanted = RangeSet.from_ranges((a, b + 1) for a, b in documents)
    starts, ends = wanted.starts, wanted.ends
    hits = []
    for lo in range(0, int(order.total), _CHUNK):
        positions = np.arange(lo, min(lo + _CHUNK, int(order.total)), dtype=np.int64)
        rows, docs, _, _ = order.pieces(positions)
        k = np.searchsorted(starts, docs, side="right") - 1
        inside = (k >= 0) & (docs < ends[np.maximum(k, 0)])
        hits.append(positions[rows[inside]])
    held = RangeSet.from_positions(np.concatenate(hits)) if hits else RangeSet()
    if not held:
        raise SkipError("skip= documents: no sequence of the epoch holds a token of them (a document of no tokens?)")
    return held
