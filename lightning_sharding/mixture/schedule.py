"""Share schedules: a mixture whose shares change at chosen points of every epoch (a curriculum,
an annealing phase that upweights some streams for the last part of the epoch).

A schedule is a list of :class:`Phase`, each from a fraction of the epoch on (the first from 0),
with its own shares: weights over the streams' names; a stream a phase does not name draws nothing
in it. An epoch of ``N`` positions is cut at ``floor(start * N)``. A phase's positions are split
over the streams by its shares (largest remainders) and laid out by the interleave inside the
phase (:class:`Phased`).

A stream's draws go on from phase to phase: its epoch order is one sequence of passes and cycle
chunks (:class:`~lightning_sharding.mixture.order.StreamOrder`) over all its draws of the epoch, so
a phase draws what the phases before it did not serve, and no sample is served twice in an epoch
unless the phases together ask more of a stream than it holds. Like every order, the epoch is a pure
function of (streams, schedule, seed, epoch): a resume on any topology serves the positions an
uninterrupted run would, and the ledger, the plan and the audit work on positions as for any mixture.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.mixture.composition import apportion
from lightning_sharding.mixture.interleave import Interleave

Int64Array = npt.NDArray[np.int64]


RAMP_STEPS = 16  # a ramp is this many sub-phases, each at the interpolated shares of its middle


@dataclass(frozen=True)
class Phase:
    """From ``start`` (a fraction of the epoch, ``0 <= start < 1``), or from ``samples`` (or, of packed
    token streams, ``tokens``) trained since the start of training, on, the streams draw at
    ``shares`` (stream name -> weight; streams not named draw nothing). ``ramp``: the shares move
    from the previous phase's to these linearly over that much after the start (a fraction of the
    epoch, samples or tokens), in :data:`RAMP_STEPS` steps."""

    start: float = 0.0
    shares: Mapping[str, float] = field(default_factory=dict)
    samples: int | None = None
    ramp: float = 0.0
    note: str = ""  # what made a phase that phases_of inserted (a ramp's step)
    tokens: int | None = None

    def __post_init__(self) -> None:
        where = f"Phase(start={self.start!r})"
        where = f"Phase(samples={self.samples!r})" if self.samples is not None else where
        where = f"Phase(tokens={self.tokens!r})" if self.tokens is not None else where
        if self.tokens is not None:
            if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
                raise ValueError(f"{where}: tokens is a number of tokens trained since the start of training, >= 0")
            if self.start or self.samples is not None:
                raise ValueError(f"{where}: give one of start (of the epoch), samples or tokens (of training)")
        if isinstance(self.start, bool) or not isinstance(self.start, (int, float)) or not 0 <= self.start < 1:
            raise ValueError(f"{where}: start is a fraction of the epoch, 0 <= start < 1")
        if self.samples is not None:
            if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 0:
                raise ValueError(f"{where}: samples is a number of samples trained since the start of training, >= 0")
            if self.start:
                raise ValueError(f"{where}: give start (a fraction of the epoch) or samples (of training), not both")
        if isinstance(self.ramp, bool) or not isinstance(self.ramp, (int, float)) or self.ramp < 0:
            raise ValueError(f"{where}: ramp={self.ramp!r} must be >= 0")
        if not isinstance(self.shares, Mapping) or not self.shares:
            raise ValueError(f"{where}: shares must map stream names to weights, got {self.shares!r}")
        for name, share in self.shares.items():
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) or share < 0:
                raise ValueError(f"{where}: the share of stream {name!r} is {share!r}; give a number >= 0")
        if sum(self.shares.values()) <= 0:
            raise ValueError(f"{where}: the shares {dict(self.shares)} sum to nothing; give one stream a share > 0")

    @property
    def unit(self) -> str:
        """What the phase's start and ramp count: ``"epoch"`` (a fraction of it), ``"samples"`` or ``"tokens"``."""
        return "tokens" if self.tokens is not None else "samples" if self.samples is not None else "epoch"

    @property
    def at(self) -> float:
        """Where the phase starts: its fraction of the epoch, or its samples or tokens of training."""
        return float(
            self.tokens if self.tokens is not None else self.samples if self.samples is not None else self.start
        )


def phases_of(schedule: Sequence[Phase | Mapping[str, Any]], names: Sequence[str]) -> tuple[Phase, ...]:
    """``schedule`` as :class:`Phase` objects (mappings ``{"start" or "samples", "shares", "ramp"}``
    too, as Hydra gives them), checked against the streams' ``names``: the first starts at 0, starts
    increase, a ramp ends before the next phase, every share names a stream and every stream is
    named by a phase. A ramp becomes :data:`RAMP_STEPS` phases of interpolated shares."""
    if isinstance(schedule, (Phase, Mapping, str)) or not isinstance(schedule, Sequence):
        raise ValueError(f"schedule={schedule!r} must be a list of phases: [Phase(0, {{...}}), Phase(0.7, {{...}})]")
    phases = []
    for i, phase in enumerate(schedule):
        if isinstance(phase, Mapping):
            unknown = sorted(set(phase) - {"start", "shares", "samples", "tokens", "ramp"})
            if unknown or "shares" not in phase:
                raise ValueError(
                    f"schedule phase {i}: {dict(phase)!r} needs `shares` (and `start` or `samples`), not "
                    f"{unknown or 'nothing'}"
                )
            start, shares = phase.get("start") or 0.0, phase["shares"]
            if isinstance(start, bool) or not isinstance(start, (int, float)):
                raise ValueError(f"schedule phase {i}: start={start!r} must be a fraction of the epoch, 0 <= start < 1")
            if not isinstance(shares, Mapping):
                raise ValueError(
                    f"schedule phase {i}: shares={shares!r} must map stream names to weights, e.g. {{web: 3}}"
                )
            ramp = phase.get("ramp") or 0.0
            phase = Phase(float(start), dict(shares), phase.get("samples"), ramp, tokens=phase.get("tokens"))
        if not isinstance(phase, Phase):
            raise ValueError(f"schedule phase {i} is {phase!r}; give Phase(start, shares) or a mapping")
        phases.append(phase)
    if not phases:
        raise ValueError("schedule=[] has no phase; give None for fixed shares, or one Phase(0, {...}) or more")
    if phases[0].unit == "epoch" and phases[0].start == 0 and len(phases) > 1 and phases[1].unit != "epoch":
        # the first phase of a schedule over training starts at its start
        phases[0] = replace(phases[0], **{phases[1].unit: 0})  # type: ignore[arg-type]
    if len({p.unit for p in phases}) > 1:
        raise ValueError(
            "the schedule mixes phases from a fraction of the epoch (start=) and of training (samples= or tokens=): "
            f"{[p.unit for p in phases]}"
        )
    unit = {"epoch": "of the epoch", "samples": "samples of training", "tokens": "tokens of training"}[phases[0].unit]
    if phases[0].at != 0:
        raise ValueError(f"the schedule's first phase starts at {phases[0].at:g} {unit}; it must start at 0")
    if phases[0].ramp:
        raise ValueError("the schedule's first phase has a ramp, but no phase before it to ramp from")
    for i in range(1, len(phases)):
        if phases[i].at <= phases[i - 1].at:
            raise ValueError(
                f"schedule phase {i} starts at {phases[i].at:g}, not after phase {i - 1} ({phases[i - 1].at:g}) "
                f"{unit}: list the phases in order of their starts"
            )
        if phases[i - 1].at + phases[i - 1].ramp > phases[i].at:
            raise ValueError(
                f"schedule phase {i - 1}'s ramp ends at {phases[i - 1].at + phases[i - 1].ramp:g} {unit}, after phase "
                f"{i} starts ({phases[i].at:g}): shorten the ramp"
            )
    if phases[-1].unit == "epoch" and phases[-1].start + phases[-1].ramp > 1:
        raise ValueError(f"schedule phase {len(phases) - 1}'s ramp runs past the end of the epoch: shorten it")
    for i, phase in enumerate(phases):
        unknown = sorted(set(phase.shares) - set(names))
        if unknown:
            raise ValueError(f"schedule phase {i} names {unknown}, which are not streams; the streams: {list(names)}")
    unnamed = [n for n in names if all(n not in p.shares for p in phases)]
    if unnamed:
        raise ValueError(
            f"streams {unnamed} are named by no phase of the schedule, so they would draw nothing: give them a "
            "share in a phase, or remove them from streams="
        )
    return tuple(_with_ramps(phases, names))


def _with_ramps(phases: Sequence[Phase], names: Sequence[str]) -> list[Phase]:
    """The phases, each ramp as RAMP_STEPS phases of linearly interpolated (normalized) shares."""
    out: list[Phase] = []
    for k, phase in enumerate(phases):
        if not phase.ramp:
            out.append(phase)
            continue
        before, after = _normalized(phases[k - 1].shares, names), _normalized(phase.shares, names)
        for j in range(RAMP_STEPS):
            t = (j + 0.5) / RAMP_STEPS
            shares = {
                n: (1 - t) * a + t * b for n, a, b in zip(names, before, after, strict=True) if (1 - t) * a + t * b
            }
            at = phase.at + j * phase.ramp / RAMP_STEPS
            note = f"ramp {j + 1}/{RAMP_STEPS} to phase {k}"
            out.append(_at(phase.unit, at, shares, note))
        out.append(_at(phase.unit, phase.at + phase.ramp, phase.shares, ""))
    return out


def _at(unit: str, at: float, shares: Mapping[str, float], note: str) -> Phase:
    """A phase from ``at`` (of the epoch, or samples or tokens of training)."""
    if unit == "epoch":
        return Phase(at, shares, note=note)
    return Phase(0.0, shares, note=note, **{unit: round(at)})


def _normalized(shares: Mapping[str, float], names: Sequence[str]) -> list[float]:
    total = sum(shares.values())
    return [float(shares.get(n, 0.0)) / total for n in names]


def phase_draws(phases: Sequence[Phase], names: Sequence[str], total: int) -> list[list[int]]:
    """Each phase's draws of each stream in an epoch of ``total`` positions (a phase with no
    position, in an epoch too short for it, is an error naming it)."""
    bounds = [math.floor(p.start * total) for p in phases] + [total]
    out = []
    for k, (phase, lo, hi) in enumerate(zip(phases, bounds[:-1], bounds[1:], strict=True)):
        if hi <= lo and not phase.note:  # a ramp's step may be empty in a short epoch
            raise ValueError(
                f"schedule phase {k} (from {phase.start:g}) gets no position of an epoch of {total} samples: "
                "move its start, or raise samples_per_epoch"
            )
        shares = [float(phase.shares.get(name, 0.0)) for name in names]
        out.append(apportion(hi - lo, shares))
    return out


def schedule_summary(phases: Sequence[Phase], draws: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """The schedule as a checkpoint keeps it: each phase's start, shares and draws per stream."""
    return [
        {
            "start": p.start,
            "shares": dict(p.shares),
            "draws": [int(d) for d in row],
            **({"note": p.note} if p.note else {}),
        }
        for p, row in zip(phases, draws, strict=True)
    ]


class Phased:
    """The layout of a scheduled epoch: phase after phase, each an :class:`Interleave` of its
    draws, every stream's draw numbers going on from the phases before (a Layout, see
    :mod:`~lightning_sharding.mixture.composition`).

    ``lengths`` cuts phases short: phase ``k`` then holds the first ``lengths[k]`` positions of the
    interleave of its draws (an online decision ended it there, :mod:`~lightning_sharding.mixture.control`),
    so a phase's positions mean the same whether or not a later decision cuts it."""

    def __init__(self, draws: Sequence[Sequence[int]], lengths: Sequence[int] | None = None) -> None:
        rows = [tuple(int(d) for d in row) for row in draws]
        if not rows or len({len(r) for r in rows}) != 1:
            raise ValueError(f"Phased needs one row of draws per phase, all of one length, got {rows}")
        self.phases = [Interleave(r) if sum(r) else None for r in rows]
        if lengths is None:
            lengths = [sum(r) for r in rows]
        if len(lengths) != len(rows) or any(not 0 <= n <= sum(r) for n, r in zip(lengths, rows, strict=True)):
            raise ValueError(f"Phased: lengths {list(lengths)} do not fit the phases' draws {rows}")
        cut = [
            row if n == sum(row) else tuple(inner.prefix(n)) if inner is not None else row
            for row, n, inner in zip(rows, lengths, self.phases, strict=True)
        ]
        self.phase_draws = tuple(tuple(int(d) for d in row) for row in cut)
        self.offsets: Int64Array = np.cumsum([[0] * len(rows[0]), *self.phase_draws], axis=0).astype(np.int64)
        self.draws = tuple(int(d) for d in self.offsets[-1])
        self.total = sum(self.draws)
        self.bounds: Int64Array = np.cumsum([0, *lengths]).astype(np.int64)

    def phase_of(self, positions: npt.ArrayLike) -> Int64Array:
        """The phase of each position (a phase with no position never holds one)."""
        return np.searchsorted(self.bounds, np.asarray(positions, dtype=np.int64), side="right") - 1

    def streams(self, positions: npt.ArrayLike) -> tuple[Int64Array, Int64Array]:
        """Stream and draw (in the stream's epoch order) of each position, shape ``(n,)`` each."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.total):
            bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
            raise ValueError(f"epoch position {bad} is outside [0, {self.total})")
        stream, draw = np.empty_like(pos), np.empty_like(pos)
        which = self.phase_of(pos)
        for k in np.unique(which).tolist():
            where = which == k
            inner = self.phases[k]
            assert inner is not None
            s, d = inner.streams(pos[where] - self.bounds[k])
            stream[where], draw[where] = s, d + self.offsets[k][s]
        return stream, draw

    def prefix(self, position: int) -> list[int]:
        """Each stream's draws among the first ``position`` positions."""
        if not 0 <= position <= self.total:
            raise ValueError(f"mixture position {position} is outside [0, {self.total}]")
        if position == self.total:
            return list(self.draws)
        k = int(self.phase_of(position))
        inner = self.phases[k]
        assert inner is not None
        within = inner.prefix(position - int(self.bounds[k]))
        return [int(o) + w for o, w in zip(self.offsets[k], within, strict=True)]


def schedule_changes(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]) -> list[str]:
    """How two saved schedules differ, one phrase per phase (none: the same schedule)."""
    if [(p["start"], p["shares"]) for p in before] == [(p["start"], p["shares"]) for p in after]:
        return []
    if not before or not after:
        return [f"the mixture's share schedule was {_show(before)}, now {_show(after)}"]
    changes = []
    for k in range(max(len(before), len(after))):
        was = _show(before[k : k + 1]) if k < len(before) else "absent"
        now = _show(after[k : k + 1]) if k < len(after) else "absent"
        if was != now:
            changes.append(f"schedule phase {k} was {was}, now {now}")
    return changes


def _show(schedule: Sequence[Mapping[str, Any]]) -> str:
    if not schedule:
        return "none (fixed shares)"
    return "; ".join(f"from {p['start']:g}: {dict(p['shares'])}" for p in schedule)
