"""Online control of a mixture: shares decided while training runs, still a pure function per epoch.

A controller (the :class:`~lightning_sharding.lightning.controller.MixtureController` callback) decides
new shares every so many optimizer steps. Each :class:`Decision` names the epoch and the *position*
of that epoch from which its shares hold: the first position no rank has delivered yet when it
is made. The ledger keeps every decision, so an epoch's order is a pure function of (streams, seed,
epoch, decisions), like every order, and a resume on any topology replays them exactly.

An epoch under control (:class:`ControlledMixture`) is laid out as :class:`~lightning_sharding.mixture.schedule.Phased`
segments: the first at the shares in force when the epoch starts (the last decision before it,
or the mixture's own draws), one more from each decision's position. A segment is laid out as if
it ran to the epoch's end and is cut where the next decision starts, so the positions before a
decision keep their samples when it is made. Each stream draws *running* passes
(:func:`~lightning_sharding.mixture.order.running_portions`): its ``k``-th draw of the epoch is
the same sample however many draws later decisions give it, and no sample is drawn twice in an
epoch before the stream's whole pass is. The epoch keeps its size; only its split changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.blocks import Blocks
from lightning_sharding.mixture.composition import Layout, apportion, layout
from lightning_sharding.mixture.order import Mixture, MixtureOrder, OnMixture
from lightning_sharding.mixture.schedule import Phased


@dataclass(frozen=True)
class Decision:
    """From ``position`` of ``epoch`` on, the streams draw at ``shares`` (name -> weight; a stream
    not named draws nothing). ``step`` is the optimizer step that made it (for the record only);
    a position at or past the epoch's end means "from the next epoch on"."""

    epoch: int
    position: int
    shares: Mapping[str, float]
    step: int = -1
    total: int | None = None  # the positions of the epochs it was made in (a replay checks it)

    def state(self) -> dict[str, Any]:
        """As a checkpoint keeps it."""
        state = {"epoch": self.epoch, "position": self.position, "shares": dict(self.shares), "step": self.step}
        return state | ({"total": self.total} if self.total is not None else {})

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Decision:
        """From :meth:`state`."""
        shares = {str(k): float(v) for k, v in dict(state["shares"]).items()}
        total = int(state["total"]) if state.get("total") is not None else None
        return cls(int(state["epoch"]), int(state["position"]), shares, int(state.get("step", -1)), total)


def check_shares(shares: Any, names: Sequence[str], where: str) -> dict[str, float]:
    """``shares`` as ``{stream: weight}``; anything else (an unknown stream, a negative, NaN or
    infinite share, shares that sum to nothing) is a ValueError that says ``where`` it came from."""
    if not isinstance(shares, Mapping) or not shares:
        raise ValueError(f"{where}: the shares must map stream names to weights, got {shares!r}")
    unknown = sorted(str(k) for k in shares if k not in names)
    if unknown:
        raise ValueError(f"{where}: {unknown} are not streams of the mixture; the streams: {list(names)}")
    out = {}
    for name, share in shares.items():
        try:  # a Python, NumPy or 0-d torch number
            value = float(share) if not isinstance(share, (bool, str, bytes)) else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: the share of stream {name!r} is {share!r}; give a finite number >= 0")
        out[str(name)] = value
    if sum(out.values()) <= 0:
        raise ValueError(f"{where}: the shares {out} sum to nothing; give at least one stream a share > 0")
    return out


def shares_of_draws(names: Sequence[str], draws: Sequence[int]) -> dict[str, float]:
    """The shares a row of draws stands for, summing to 1."""
    total = sum(draws) or 1
    return {name: d / total for name, d in zip(names, draws, strict=True)}


def static_decisions(training: Sequence[Mapping[str, Any]], total: int) -> list[Decision]:
    """A share schedule over training (phases from ``samples`` trained since its start, in epochs of
    ``total`` samples) as the decisions it stands for (``step`` -1: the schedule's)."""
    return [Decision(int(p["samples"]) // total, int(p["samples"]) % total, dict(p["shares"])) for p in training]


def in_order(decisions: Sequence[Decision], total: int) -> list[Decision]:
    """``decisions`` by epoch and position (one at or past its epoch's end last in it); ties keep their
    order, so a schedule's phase (listed first) gives way to an online decision at the same point."""
    return sorted(decisions, key=lambda d: (d.epoch, min(d.position, total)))


def epoch_decisions(decisions: Sequence[Decision], epoch: int, total: int) -> list[Decision]:
    """The decisions that start a phase inside ``epoch``, in order."""
    return [d for d in in_order(decisions, total) if d.epoch == epoch and d.position < total]


def controlled_layout(names: Sequence[str], draws: Sequence[int], decisions: Sequence[Decision], epoch: int) -> Phased:
    """The layout of ``epoch`` of a mixture of streams ``names`` whose own ``draws`` an epoch (of their
    sum's positions) are changed by ``decisions`` (see the module)."""
    total = sum(draws)
    before = [d for d in in_order(decisions, total) if d.epoch < epoch]  # the last holds when the epoch starts
    first = list(draws) if not before else apportion(total, _row(before[-1].shares, names))
    rows, starts = [first], [0]
    for d in epoch_decisions(decisions, epoch, total):
        if d.position == 0:  # from the epoch's start: its first phase
            rows[0] = apportion(total, _row(d.shares, names))
            continue
        rows.append(apportion(total - d.position, _row(d.shares, names)))
        starts.append(d.position)
    lengths = [b - a for a, b in zip(starts, [*starts[1:], total], strict=True)]
    return Phased(rows, lengths)


def _row(shares: Mapping[str, float], names: Sequence[str]) -> list[float]:
    return [float(shares.get(name, 0.0)) for name in names]


@dataclass(frozen=True)
class Decided:
    """The online decisions made so far, as a worker's task carries them: ``apply(epochs)`` gives the
    controlled epochs of the mixture the worker's manifest holds (a few hundred bytes a decision)."""

    decisions: tuple[Decision, ...]

    def apply(self, epochs: Any) -> ControlledMixture:
        """The epochs of ``epochs``' mixture under these decisions."""
        return ControlledMixture(getattr(epochs, "mixture", epochs), self.decisions)


@dataclass(frozen=True)
class ControlledMixture(OnMixture):
    """The epochs of a manifest whose mixture is under online control: each epoch laid out by the
    :class:`Decision` s made so far (:func:`controlled_layout`). Its identity and summary are the
    mixture's: decisions change which samples an epoch draws, never what the data is."""

    mixture: Mixture
    decisions: tuple[Decision, ...] = ()  # made online (the mixture's schedule over training adds its own)

    def __post_init__(self) -> None:
        if self.mixture.composition != "mixed" or self.mixture.schedule:
            what = (
                f"batch_composition={self.mixture.composition!r}"
                if self.mixture.composition != "mixed"
                else "a share schedule of the epoch (Phase(start=...); Hydra data.schedule with start:)"
            )
            raise ValueError(
                f"a MixtureController decides the shares of a mixture with batch_composition='mixed' and no schedule "
                f"of the epoch (a schedule over training, Phase(samples=...) or Hydra data.schedule with samples:, "
                f"goes with it); this one has {what}"
            )

    def decided(self, decision: Decision) -> ControlledMixture:
        """These epochs with one more decision."""
        return ControlledMixture(self.mixture, (*self.decisions, decision))

    def for_tasks(self) -> Decided:
        """What a worker needs to order epochs as these: the decisions, without the mixture it holds."""
        return Decided(self.decisions)

    @property
    def all_decisions(self) -> list[Decision]:
        """The schedule's (over training) and the online decisions, in order."""
        static = static_decisions(self.mixture.training, self.mixture.total)
        return in_order([*static, *self.decisions], self.mixture.total)

    def layout(self, epoch: int) -> Phased:
        """The layout of ``epoch``."""
        return controlled_layout(self.mixture.names, self.mixture.draws, self.all_decisions, epoch)

    def shares_at(self, epoch: int, position: int) -> dict[str, float]:
        """The shares in force at ``position`` of ``epoch``, summing to 1: the last decision's (or
        schedule phase's) before it, as it was given, or the mixture's own draws' before any."""
        total = self.mixture.total
        last = [d for d in self.all_decisions if (d.epoch, min(d.position, total)) <= (epoch, position)]
        if not last:
            return shares_of_draws(self.mixture.names, self.mixture.draws)
        weights = _row(last[-1].shares, self.mixture.names)
        return {name: w / sum(weights) for name, w in zip(self.mixture.names, weights, strict=True)}

    def order(self, counts: npt.NDArray[np.int64], seed: int, epoch: int, *, shuffle: bool = True) -> MixtureOrder:
        """The order of ``epoch`` under the decisions made so far."""
        m = self.mixture
        return MixtureOrder(
            m.names,
            counts,
            m.stream_items,
            m.draws,
            seed,
            epoch,
            shuffle=shuffle,
            stream_epochs=m.stream_epochs,
            controlled=self.layout(epoch),
        )

    def blocks_at(self, epoch: int) -> Blocks | None:
        """None: a controlled epoch is ``mixed``."""
        return None


def layout_of_summary(streams: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], epoch: int = 0) -> Layout:
    """The layout of ``epoch`` a saved manifest summary or audit header describes: its online
    ``decisions`` and ``training_schedule`` (:mod:`~lightning_sharding.mixture.control`), its share
    ``schedule``'s phases, or its ``streams``' draws under its ``composition`` and ``batch_size``
    (absent for ``mixed``)."""
    if summary.get("decisions") is not None or summary.get("training_schedule"):
        draws = [int(s["draws"]) for s in streams]
        decisions = static_decisions(summary.get("training_schedule") or [], sum(draws))
        decisions += [Decision.from_state(d) for d in summary.get("decisions") or []]
        return controlled_layout([s["name"] for s in streams], draws, decisions, epoch)
    if summary.get("schedule"):
        return Phased([p["draws"] for p in summary["schedule"]])
    return layout([int(s["draws"]) for s in streams], summary.get("composition", "mixed"), summary.get("batch_size"))
