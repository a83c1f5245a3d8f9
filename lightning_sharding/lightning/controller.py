"""``MixtureController``: a mixture's shares decided online, from per-stream training statistics.

Every ``every_n_steps`` optimizer steps the controller hands a user ``policy`` the statistics of the
steps since its last decision (:class:`StreamStats`: each stream's mean training loss and samples,
summed over all ranks) on rank 0, and gets new shares back. The decision is broadcast, checked,
recorded in the data ledger with the epoch position it holds from (the first position no rank has
delivered yet), and every rank's loader replans the rest of the epoch from its next batch
(:mod:`~lightning_sharding.mixture.control`). A checkpoint holds the decisions, and the statistics
of the steps since the last one, so a resume on any topology replays the decisions exactly and makes
the later ones again from the resumed training.

Per-stream losses come from the training step: call :func:`log_stream_loss` with the per-sample
losses of the batch; it logs ``train/loss/<stream>`` and hands them to the controller.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_sharding.core.ledger import CHECKPOINT_KEY
from lightning_sharding.mixture import ControlledMixture, Decision, check_shares, mixture_of


@dataclass(frozen=True)
class StreamStats:
    """What a policy decides from: the optimizer ``step`` and ``epoch``, the ``shares`` in force, and,
    per stream over the steps since the last decision (all ranks together), the mean training
    ``loss`` (NaN for a stream that trained nothing) and the ``samples`` trained; ``samples_total``
    counts the samples of each stream trained since the controller started."""

    step: int
    epoch: int
    shares: dict[str, float]
    loss: dict[str, float]
    samples: dict[str, int]
    samples_total: dict[str, int] = field(default_factory=dict)


Policy = Callable[[StreamStats], Mapping[str, float]]


class ExcessLossWeights:
    """A DoReMi-style policy: exponentiated-gradient ascent on each stream's excess loss over a
    reference (``reference[stream]``, e.g. a small reference model's loss on it), mixed with the
    uniform shares by ``smoothing``: ``w = softmax(log(shares) + lr * max(loss - reference, 0))``,
    then ``(1 - smoothing) * w + smoothing / streams``. A stream that trained nothing keeps its
    excess at 0. It keeps no state of its own: the shares in force carry it."""

    def __init__(self, reference: Mapping[str, float], lr: float = 1.0, smoothing: float = 1e-3) -> None:
        if not 0 <= smoothing <= 1:
            raise ValueError(f"ExcessLossWeights(smoothing={smoothing!r}) must be within [0, 1]")
        self.reference = dict(reference)
        self.lr = float(lr)
        self.smoothing = float(smoothing)

    def __call__(self, stats: StreamStats) -> dict[str, float]:
        """The new shares."""
        names = list(stats.shares)
        logits = []
        for name in names:
            loss = stats.loss.get(name, math.nan)
            excess = 0.0 if math.isnan(loss) else max(loss - self.reference.get(name, 0.0), 0.0)
            logits.append(math.log(max(stats.shares[name], 1e-12)) + self.lr * excess)
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        return {
            n: (1 - self.smoothing) * w / total + self.smoothing / len(names)
            for n, w in zip(names, weights, strict=True)
        }


class MixtureController(pl.Callback):
    """Decide a mixture's shares while training runs (see the module).

    Args:
        policy: ``policy(stats: StreamStats) -> {stream: share}``, called on rank 0 every
            ``every_n_steps`` optimizer steps; shares are weights (>= 0, not all 0; a stream not named
            draws nothing). ``None`` makes no decision (with ``decisions``: a replay).
        every_n_steps: optimizer steps between decisions.
        decisions: decisions an earlier run made, to hold again at their positions (a replay, or the
            start of a new run); :meth:`decisions_in` reads them from a checkpoint. A checkpoint being
            resumed brings its own and wins.
    """

    def __init__(
        self,
        policy: Policy | None,
        every_n_steps: int = 100,
        decisions: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"MixtureController(every_n_steps={every_n_steps!r}) must be a whole number >= 1")
        if policy is not None and not callable(policy):
            raise TypeError(f"MixtureController(policy={policy!r}) must be a function of StreamStats, or None")
        self.policy = policy
        self.every_n_steps = every_n_steps
        self.replay = [Decision.from_state(d) for d in decisions]
        self.decisions: list[Decision] = []  # made by this run
        self._names: tuple[str, ...] = ()
        self._pending = torch.zeros(0, dtype=torch.float64)  # this rank's loss sums and counts since the last step
        self._window = torch.zeros(0, dtype=torch.float64)  # all ranks', over the steps since the last decision
        self._totals = torch.zeros(0, dtype=torch.float64)
        self._last_step: int | None = None
        self._restored: dict[str, Any] | None = None
        self._warned = False

    @staticmethod
    def decisions_in(checkpoint: str | Path) -> list[dict[str, Any]]:
        """The decisions a checkpoint's data ledger holds (to replay them in another run)."""
        state = torch.load(str(checkpoint), map_location="cpu", weights_only=True).get(CHECKPOINT_KEY) or {}
        if state.get("decisions") is None:
            raise ValueError(f"{checkpoint} holds no mixture decisions: it was not written under a MixtureController")
        return [dict(d) for d in state["decisions"]]

    def observe(self, streams: torch.Tensor, losses: torch.Tensor) -> None:
        """One micro-batch's per-sample ``losses`` of the rows' ``streams`` (padding left out)."""
        if not self._names:
            return
        n = len(self._names)
        s = streams.detach().to("cpu", torch.int64).reshape(-1)
        loss = losses.detach().to("cpu", torch.float64).reshape(-1)
        self._pending[:n] += torch.bincount(s, weights=loss, minlength=n)[:n]
        self._pending[n:] += torch.bincount(s, minlength=n)[:n].to(torch.float64)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        keeper = _keeper(trainer)
        mixture = mixture_of(keeper.manifest)
        assert mixture is not None  # start_control refused data without a mixture
        self._names = mixture.names
        size = 2 * len(self._names)
        self._pending = torch.zeros(size, dtype=torch.float64)
        self._window = torch.zeros(size, dtype=torch.float64)
        self._totals = torch.zeros(size, dtype=torch.float64)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        if self._restored is not None:
            state, self._restored = self._restored, None
            if list(state.get("names", [])) == list(self._names):
                self._window = torch.as_tensor(state["window"], dtype=torch.float64).clone()
                self._totals = torch.as_tensor(state["totals"], dtype=torch.float64).clone()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:  # inside an accumulation window: no optimizer step yet
            return
        self._last_step = step
        # The micro-batches of the step just applied, from every rank (the same call on all of them).
        summed = trainer.strategy.reduce(self._pending.to(trainer.strategy.root_device, copy=True), reduce_op="sum")
        self._pending.zero_()
        self._window += summed.to("cpu", torch.float64)
        if self.policy is not None and step % self.every_n_steps == 0:
            self._decide(trainer, pl_module, step)

    def _stats(self, step: int, epoch: int, shares: dict[str, float]) -> StreamStats:
        n = len(self._names)
        sums, counts = self._window[:n].tolist(), self._window[n:].tolist()
        totals = (self._totals[n:] + self._window[n:]).tolist()
        return StreamStats(
            step=step,
            epoch=epoch,
            shares=shares,
            loss={name: s / c if c else math.nan for name, s, c in zip(self._names, sums, counts, strict=True)},
            samples={name: int(c) for name, c in zip(self._names, counts, strict=True)},
            samples_total={name: int(c) for name, c in zip(self._names, totals, strict=True)},
        )

    def _decide(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        keeper = _keeper(trainer)
        controlled = keeper.manifest.epochs
        assert isinstance(controlled, ControlledMixture) and keeper.train_loader is not None
        position, batches = keeper.train_loader.decision_point()
        shares, error, cause = None, None, None
        if trainer.is_global_zero:
            assert self.policy is not None
            stats = self._stats(step, keeper.ledger.epoch, controlled.shares_at(keeper.ledger.epoch, position))
            if not any(stats.samples.values()) and not self._warned:
                self._warned = True
                warnings.warn(
                    f"MixtureController at step {step}: no per-stream loss was handed to it since its last decision "
                    "(every StreamStats.loss is NaN). Call lightning_sharding.log_stream_loss(self, per_sample_loss, "
                    "batch) in training_step.",
                    stacklevel=2,
                )
            where = f"MixtureController: the policy's shares at step {step}"
            try:
                returned = self.policy(stats)
            except Exception as err:  # noqa: BLE001 - said on every rank, so that none waits forever
                cause, error = err, f"MixtureController: the policy raised at step {step}: {type(err).__name__}: {err}"
            else:
                try:
                    shares = check_shares(returned, self._names, where)
                except ValueError as err:
                    cause, error = err, str(err)
        shares, error, position, batches = trainer.strategy.broadcast((shares, error, position, batches), src=0)
        if error is not None or shares is None:
            raise ValueError(error) from cause
        decision = keeper.decide(shares, step, position, batches)
        self.decisions.append(decision)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if hasattr(callback, "note_decision"):  # the ShardingCallback: the audit trail
                callback.note_decision(decision.state())
        self._totals += self._window
        self._window.zero_()
        pl_module.log_dict(
            {f"data/share/{name}": share / sum(shares.values()) for name, share in shares.items()},
            on_step=True,
            on_epoch=False,
            rank_zero_only=True,
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"names": list(self._names), "window": self._window.clone(), "totals": self._totals.clone()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)


def controllers_of(trainer: pl.Trainer) -> list[MixtureController]:
    """The trainer's MixtureControllers."""
    return [cb for cb in trainer.callbacks if isinstance(cb, MixtureController)]  # type: ignore[attr-defined]


def log_stream_loss(module: pl.LightningModule, losses: torch.Tensor, batch: Mapping[str, Any]) -> None:
    """Log each stream's mean loss of this batch as ``train/loss/<stream>`` and hand the per-sample
    ``losses`` (shape ``(batch,)``) to the trainer's :class:`MixtureController`, if any. The batch is
    a mixture's dict batch: its ``"stream"`` rows name each sample's stream, ``"is_padding"`` its padding."""
    trainer = module.trainer
    if "stream" not in batch:
        raise KeyError("log_stream_loss needs a mixture's dict batch, whose 'stream' rows name each sample's stream")
    streams = batch["stream"]
    if losses.shape[:1] != streams.shape[:1]:
        raise ValueError(
            f"log_stream_loss: losses of shape {tuple(losses.shape)} for a batch of {streams.shape[0]} rows; "
            "give one loss per sample (reduction='none')"
        )
    keep = ~batch["is_padding"] if "is_padding" in batch else torch.ones_like(streams, dtype=torch.bool)
    streams, losses = streams[keep], losses[keep]
    for controller in controllers_of(trainer):
        controller.observe(streams, losses)
    mixture = mixture_of(trainer.datamodule.manifest)  # type: ignore[attr-defined]
    if mixture is None:
        return
    for s, name in enumerate(mixture.names):
        mine = streams == s
        if bool(mine.any()):
            module.log(f"train/loss/{name}", losses[mine].detach().mean(), on_step=True, on_epoch=False)


def _keeper(trainer: pl.Trainer) -> Any:
    from lightning_sharding.lightning.callbacks import ShardingCallback

    return ShardingCallback._keeper(trainer)
