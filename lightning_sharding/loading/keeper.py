"""``LedgerKeeper``: the ledger of one fit and everything done to it, with no Lightning in sight.

The DataModule makes one at ``setup("fit")``; :class:`~lightning_sharding.lightning.callbacks.ShardingCallback`
drives it: it starts epochs, gathers every rank's consumed positions, writes the checkpoint entry
and restores one, and tells the train loader when a checkpoint is saved. Under a
:class:`~lightning_sharding.lightning.controller.MixtureController` it also records the decisions
(:meth:`LedgerKeeper.decide`) and replays a checkpoint's.
"""

from __future__ import annotations

import pickle
import sys
import warnings
from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
import torch

from lightning_sharding.core.identity import item_changes
from lightning_sharding.core.ledger import GLOBAL_STEP_KEY, CheckpointMismatchError, Ledger, ledger_step_mismatch
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.skip import Skip, SkipError
from lightning_sharding.core.spelling import option
from lightning_sharding.core.world import World
from lightning_sharding.distributed.collectives import gather_objects
from lightning_sharding.mixture import (
    ChangedMixture,
    ControlledMixture,
    Decision,
    MixtureChangeError,
    change_mixture,
    change_of,
    check_shares,
    mixture_of,
)
from lightning_sharding.strategies.base import TrainLoader
from lightning_sharding.strategies.options import LoaderOptions


class LedgerKeeper:
    """The ledger of ``manifest`` on this rank of ``world``, and the train loader that serves it.

    ``seed_given`` is the seed the user asked for (``None``: drawn); ``allow_data_change`` lets a
    checkpoint of other data restart its epoch instead of failing; ``allow_mixture_change`` lets a
    checkpoint of another mixture of the same streams' data go on with the rest of its epoch at the
    new shares (:mod:`~lightning_sharding.mixture.change`); ``audit_dir`` is where the callback writes
    the audit trail (``None``: none); ``root_map`` (``{old prefix: new prefix}``) lets a checkpoint
    of a 0.1 release, which knew items by path, resume on data that moved.
    """

    def __init__(
        self,
        ledger: Ledger,
        manifest: Manifest,
        world: World,
        options: LoaderOptions,
        *,
        seed_given: int | None = None,
        allow_data_change: bool = False,
        allow_mixture_change: bool = False,
        audit_dir: str | None = None,
        root_map: Mapping[str, str] | None = None,
        skip: Skip | None = None,
    ) -> None:
        self.ledger = ledger
        self.manifest = manifest
        self.world = world
        self.options = options
        self.seed_given = seed_given
        self.allow_data_change = allow_data_change
        self.allow_mixture_change = allow_mixture_change
        self.audit_dir = audit_dir
        self.root_map = dict(root_map or {})
        self.skip = skip
        self.skip_settled = skip is None  # applied (or found applied) at a resume; checked at the run's start
        self.train_loader: TrainLoader | None = None
        self.group: Any = None  # the process group the ledgers are gathered over (None: the default one)
        self.restored_from: str | None = None  # the checkpoint restored, until the first loader after it
        # The manifest fingerprint of a checkpoint of another mixture this run went on from (the audit
        # links the runs through it), and what rank 0 says of the change once the epoch is known.
        self.mixture_from: str | None = None
        self._change_note: str | None = None

    def gather(self) -> None:
        """Union every replica's consumed positions into every rank's ledger (a collective call).

        The ranks of one model replica read the same batches, so their ledgers must be equal; one
        that differs is a :class:`ReplicaMismatchError`, never a silent union.
        """
        mine = (self.world.data_rank, self.ledger.epoch, self.ledger.consumed.to_state())
        for consumed in one_ledger_per_replica(gather_objects(mine, self.world.world_size, self.group)):
            self.ledger.merge(consumed)

    def state(self, global_step: int | None = None) -> dict[str, Any]:
        """The checkpoint entry: the union of all ranks' ledgers (a collective call), with the optimizer
        step whose weights it matches."""
        self.gather()
        if self.train_loader is not None:
            self.train_loader.note_checkpoint(self.ledger)
        state = self.ledger.state_dict()
        # A tensor, not a NumPy array: checkpoints must load with torch.load(weights_only=True).
        state["consumed"] = torch.from_numpy(state["consumed"])
        if self.ledger.change is not None:
            before = dict(self.ledger.change["before"])
            before["consumed"] = torch.as_tensor(before["consumed"], dtype=torch.int64)
            state["change"] = {**self.ledger.change, "before": before}
        # One row per item (hashes of its name and content, its size and count): a resume on changed
        # data names the item and what changed (lightning_sharding.core.identity).
        state["items"] = {key: torch.from_numpy(column) for key, column in self.manifest.table.items()}
        state["writer"] = {
            "world_size": self.world.world_size,
            "data_parallel_size": self.world.data_size,
            "num_workers": self.options.num_workers,
            "batch_size": self.options.batch_size,
        }
        if global_step is not None:
            state[GLOBAL_STEP_KEY] = int(global_step)
        return state

    def start_epoch(self, epoch: int) -> None:
        """Move the ledger to ``epoch``, the one Lightning trains next. Right after a restore, an
        epoch the checkpoint left part-trained that Lightning skips is warned about, never silent."""
        ledger = self.ledger
        source = self.restored_from
        self.restored_from = None
        behind = self.left_behind(epoch)
        if source is not None and behind is not None:
            consumed, total, left = behind
            warnings.warn(
                f"{source} stopped epoch {ledger.epoch} after {consumed} of its {total} samples, and "
                f"Lightning goes on with epoch {epoch}: the other {left} samples of epoch {ledger.epoch} are "
                "not trained. Lightning counts an epoch as done in a checkpoint written after fit() returned "
                "(max_steps reached, say) or cut short by limit_train_batches; to finish the epoch, resume "
                "from one written during training (ModelCheckpoint(every_n_train_steps=...)).",
                stacklevel=2,
            )
        if self._change_note is not None and self.world.rank == 0:
            change = change_of(self.manifest)
            print(
                f"lightning_sharding: {self._change_note};\n"
                + (
                    change.describe()
                    if change is not None and epoch == change.epoch
                    else f"Lightning goes on with epoch {epoch}, so nothing of epoch {ledger.epoch} is drawn "
                    f"under the new mixture: epoch {epoch} is its first"
                ),
                file=sys.stderr,
            )
        self._change_note = None
        ledger.start_epoch(epoch)

    def left_behind(self, epoch: int) -> tuple[int, int, int] | None:
        """``(consumed, total, left)`` of the ledger's epoch when moving on to ``epoch`` would leave part
        of it untrained (more than ``even_batches="drop"`` may leave by design); None otherwise."""
        ledger = self.ledger
        # A mixture changed in an epoch Lightning does not go on with (a checkpoint written at its end):
        # what counts is what the checkpoint consumed of its own epoch, and no rest is drawn.
        changed_now = self._change_note is not None and ledger.change is not None
        skipped = ledger.change["before"] if changed_now and epoch > ledger.epoch else None  # type: ignore[index]
        total = int(skipped["total"]) if skipped is not None else ledger.total
        consumed = (
            len(RangeSet.from_state(np.asarray(skipped["consumed"])))
            if skipped
            else len(ledger.consumed) + len(ledger.skipped)
        )
        left = total - consumed
        # "drop" (and "sync") may leave up to one sample per data-parallel rank untrained by design (a
        # batch per rank when a stratified or per_stream mixture's batches are blocks).
        mixture = mixture_of(self.manifest)
        blocks = mixture.blocks if mixture is not None else None
        per_rank = blocks.size if blocks is not None else 1
        if skipped is not None:  # the blocks of the mixture that epoch was planned under
            was = skipped["manifest"]
            per_rank = int(was.get("batch_size") or 1) if was.get("composition", "mixed") != "mixed" else 1
        tolerated = self.world.data_size * per_rank if self.options.even_batches != "pad" else 1
        if epoch > ledger.epoch and consumed and left >= tolerated:
            return consumed, total, left
        return None

    def committed(self) -> None:
        """The checkpoint written last is saved: the train loader may tell its source."""
        if self.train_loader is not None:
            self.train_loader.flush_commit()

    def restore(
        self, state: dict[str, Any] | None, global_step: int | None = None, source: str = "the checkpoint"
    ) -> None:
        """Restore a checkpoint's ledger; a checkpoint of other data is a clear error, and a ledger
        that does not record ``global_step`` (the checkpoint's optimizer step) is warned about."""
        if state is None:
            if self.skip is not None:
                raise SkipError(
                    f"skip={self.skip.describe()!r}: {source} holds no lightning_sharding data ledger, so nothing "
                    "names what it trained: resume from a checkpoint of ShardedDataModule, or without skip="
                )
            warnings.warn(
                f"{source} holds no lightning_sharding data ledger (it was written without "
                "ShardedDataModule): the interrupted epoch restarts from its beginning",
                stacklevel=2,
            )
            return
        mismatch = ledger_step_mismatch(state, global_step)
        if mismatch:
            warnings.warn(f"{source}: {mismatch}", stacklevel=2)
        try:
            restored = Ledger.from_state_dict(state)
        except CheckpointMismatchError as err:
            raise CheckpointMismatchError(f"{source}: {err}") from err
        if self.seed_given is not None and restored.seed != self.seed_given:
            warnings.warn(
                f"seed={self.seed_given} is not used: {source} continues its epoch with its own seed {restored.seed}",
                stacklevel=2,
            )
        if self._same_data(restored, source):
            if restored.change is not None:  # an epoch whose mixture changed: its order goes on
                self._change(restored.change["before"], source, restored.total)
            self._control(restored, source)
            self.ledger = restored
            self.restored_from = source
            if self.skip is not None:
                self._skip(state, global_step, source)
            return
        if self.skip is not None:
            raise SkipError(
                f"skip={self.skip.describe()!r}: {source} was written for other data or another mixture, and skip= "
                "leaves out samples of the checkpoint's own: resume without skip=, or on the checkpoint's data"
            )
        change = self._explain(restored, state.get("items"))
        if self.allow_mixture_change and restored.manifest.get("streams") and self._go_on(restored, source, change):
            return
        composition, size = restored.manifest.get("composition", "mixed"), restored.manifest.get("batch_size")
        if not self.allow_data_change and composition != "mixed" and size != self.options.batch_size:
            raise CheckpointMismatchError(
                f"{source} holds a mixture of {composition} batches of {size} samples, and batch_size is now "
                f"{self.options.batch_size}: such an epoch's order depends on the batch size. Resume with "
                f"{option('batch_size', size)}, pass `{option('allow_mixture_change', True)}` to go on with the rest "
                f"of epoch {restored.epoch} in batches of {self.options.batch_size}, or pass "
                f"`{option('allow_data_change', True)}` to "
                f"start it afresh (training its {len(restored.consumed)} consumed samples again)."
            )
        if not self.allow_data_change:
            raise CheckpointMismatchError(
                f"{source} was written for other data: {change}. {self._ways_on(restored, state.get('items'))}"
            )
        warnings.warn(
            f"the data changed since {source} ({change}); epoch {restored.epoch} restarts "
            "with a fresh order because allow_data_change=True",
            stacklevel=2,
        )
        self.ledger = Ledger(
            seed=restored.seed, total=self.manifest.total, manifest=self.manifest.summary(), epoch=restored.epoch
        )

    def _skip(self, state: Mapping[str, Any], global_step: int | None, source: str) -> None:
        """Leave out what ``skip=`` names (a resume from ``state``, of weights of ``global_step``): into the
        ledger as skipped, said on rank 0; once only, when the checkpoint records it applied already."""
        skip, ledger = self.skip, self.ledger
        assert skip is not None
        asked = skip.describe()
        self.skip_settled = True
        done = next((s for s in ledger.skips if s.get("asked") == asked), None)
        if done is not None:
            if self.world.rank == 0:
                print(
                    f"lightning_sharding: {source}: skip= {asked} was applied at the resume from step "
                    f"{done.get('at_step')} already, and this checkpoint holds it: nothing more is left out",
                    file=sys.stderr,
                )
            return
        saved, order = state["manifest"], partial(self.manifest.order, shuffle=self.options.shuffle)  # the loader's
        orders = order if saved.get("streams") or saved.get("schedule") else None  # as replay_step takes them
        try:
            packed = None if mixture_of(self.manifest) is not None else partial(order, ledger.seed)
            found, how = skip.positions(state, global_step, orders, load=_ledger_of, order_of=packed)
        except ValueError as err:  # a step the history cannot replay names why
            raise SkipError(f"{source}: {err}") from err
        trained = {e: r.intersection(ledger.consumed) for e, r in found.items() if e == ledger.epoch}
        if any(trained.values()):
            ((e, r),) = ((e, r) for e, r in trained.items() if r)
            finished = len(ledger.consumed) + len(ledger.skipped) >= ledger.total
            hint = f" (it finished epoch {e}: name epoch={e + 1} for the next one)" if finished else ""
            raise SkipError(
                f"{source}: skip= {asked}: {len(r)} of its samples of epoch {e} (positions from "
                f"{int(r.starts[0])}) are in the checkpoint's weights already{hint}: resume from a checkpoint "
                "written before they trained"
            )
        ledger.skip(found)
        counts = [[e, len(r)] for e, r in sorted(found.items())]
        ledger.skips.append({"asked": asked, "at_step": int(global_step or 0), "counts": counts})
        if self.world.rank == 0:
            left = "; ".join(f"{n} sample(s) of epoch {e}" for e, n in counts) or "nothing"
            replayed = f" (steps replayed {how})" if how else ""
            print(
                f"lightning_sharding: {source}: skip= {asked}: {left} left out{replayed}; "
                "they are recorded as skipped, never trained nor served again in their epoch",
                file=sys.stderr,
            )

    @property
    def controlled(self) -> bool:
        """Whether the mixture is under online control (its ledger keeps decisions)."""
        return self.ledger.decisions is not None

    def start_control(self, decisions: list[Decision] | None = None) -> None:
        """Put the mixture under online control (a MixtureController is in the trainer's callbacks),
        from ``decisions`` made before (a replay; none: the mixture's own shares to begin with)."""
        mixture = mixture_of(self.manifest)
        if mixture is None:
            raise ValueError("a MixtureController decides the shares of a mixture: give ShardedDataModule(streams=...)")
        controlled = ControlledMixture(mixture, tuple(decisions or ()))
        for d in controlled.decisions:
            where = f"the replayed decision of step {d.step} (epoch {d.epoch}, position {d.position})"
            check_shares(d.shares, mixture.names, where)
            if (d.total is not None and d.total != mixture.total) or d.position > mixture.total:
                raise ValueError(
                    f"{where} was made in epochs of {d.total or 'other'} samples, and these have {mixture.total}: its "
                    "position would fall elsewhere. Replay decisions with the samples_per_epoch they were made with"
                )
        self.manifest = self.manifest.with_epochs(controlled)
        self.ledger.decisions = [d.state() for d in controlled.decisions]

    def _control(self, restored: Ledger, source: str) -> None:
        """A restored ledger's decisions replayed (they are its epochs' orders), or a checkpoint written
        without control taken under control (only at an epoch's start: its positions would move)."""
        mixture = mixture_of(self.manifest)
        if restored.decisions is not None:
            if mixture is None:
                raise CheckpointMismatchError(f"{source} holds mixture decisions but the data is no mixture")
            if restored.change is not None:
                raise CheckpointMismatchError(
                    f"{source}: an epoch whose mixture changed on resume cannot be under a MixtureController"
                )
            decisions = tuple(Decision.from_state(d) for d in restored.decisions)
            self.manifest = self.manifest.with_epochs(ControlledMixture(mixture, decisions))
            if decisions and not self.controlled and self.world.rank == 0:
                warnings.warn(
                    f"{source} holds {len(decisions)} decision(s) of a MixtureController and this run has none: "
                    f"they are replayed, and the shares of the last one (step {decisions[-1].step}) hold from there "
                    "on. Add the MixtureController to the trainer's callbacks to go on deciding.",
                    stacklevel=3,
                )
            return
        if self.controlled:
            if restored.consumed:
                raise CheckpointMismatchError(
                    f"{source} was written without a MixtureController in the middle of epoch {restored.epoch}, whose "
                    "order a controller would change: resume without the controller until the epoch ends, then add it"
                )
            restored.decisions = []

    def decide(self, shares: dict[str, float], step: int, position: int, batches: int) -> Decision:
        """Record a decision of the controller, the same on every rank: ``shares`` from ``position`` of
        the current epoch on (rank 0's :meth:`decision_point`, which every rank checks against its own
        count of ``batches``), and replan the train loader from its next batch."""
        loader = self.train_loader
        assert loader is not None and self.controlled
        mine, counted = loader.decision_point()
        if (mine, counted) != (position, batches):
            raise RuntimeError(
                f"rank {self.world.rank} yielded {counted} batches of this pass (its decision point {mine}), rank 0 "
                f"{batches} (point {position}): the ranks are not in step, so a mixture decision cannot be placed"
            )
        decision = Decision(self.ledger.epoch, position, dict(shares), step, self.ledger.total)
        controlled = self.manifest.epochs
        assert isinstance(controlled, ControlledMixture)
        self.manifest = self.manifest.with_epochs(controlled.decided(decision))
        assert self.ledger.decisions is not None
        self.ledger.decisions.append(decision.state())
        loader.switch_order(self.manifest, now=position < self.ledger.total)
        return decision

    def _same_data(self, restored: Ledger, source: str) -> bool:
        """Whether ``restored`` was written for this data: the same items by name, count and content
        wherever they live now, or (a 0.1 checkpoint, which knew items by path and mtime) the same
        paths, or the same paths under :attr:`root_map`. A move is said in one line on rank 0, and
        the ledger goes on with this manifest's summary."""
        saved = restored.manifest
        if restored.fingerprint == self.manifest.fingerprint:
            how = ""
            old_root = saved.get("root", "")
            if old_root and self.manifest.root and old_root != self.manifest.root:
                how = f"the data moved: {old_root} -> {self.manifest.root} (the same items, counts and contents)"
        elif restored.fingerprint == self.manifest.fingerprint_by_path():
            how = ""
        elif self.root_map and restored.fingerprint == self.manifest.fingerprint_by_path(self.root_map):
            moves = ", ".join(f"{old} -> {new}" for old, new in self.root_map.items())
            how = f"the data moved: {moves} (root_map; the same paths under it, counts and fingerprints)"
        else:
            return False
        if how and self.world.rank == 0:
            print(f"lightning_sharding: {source}: {how}", file=sys.stderr)
        restored.manifest = self.manifest.summary()  # the next checkpoint knows the data as it is now
        return True

    def _explain(self, restored: Ledger, items: Any) -> str:
        """How this data differs from ``restored``'s: the items that changed, by name, when the
        checkpoint keeps its item table (0.2 and later), else the manifests' summaries."""
        return "; ".join(self.manifest.differences(restored.manifest, items))

    def _ways_on(self, restored: Ledger, items: Any) -> str:
        """What the user can do about a checkpoint of other data, only the ways that would work."""
        fresh = f"pass `{option('allow_data_change', True)}` to start epoch {restored.epoch} afresh on the new data"
        saved = restored.manifest
        if (
            saved.get("streams")
            and mixture_of(self.manifest)
            and not (items is not None and self._contents_differ(items))
        ):
            return (
                "If only the mixture's streams or shares changed, pass "
                f"`{option('allow_mixture_change', True)}` to go on with the rest of the epoch at the new shares; "
                f"if the data changed, {fresh}."
            )
        if (
            items is None
            and saved.get("num_items") == len(self.manifest.items)
            and saved.get("first_key") != (self.manifest.items[0].key)
        ):
            old, new = moved_prefixes(str(saved.get("first_key")), self.manifest.items[0].key)
            return (
                f"If the data only moved, give its old and new roots: `{option('root_map', {old: new})}`; "
                f"if it changed, {fresh}."
            )
        return f"Resume with the data it was written for, or {fresh}."

    def _contents_differ(self, items: Any) -> bool:
        """Whether any kept item's content or count differs from the checkpoint's table."""
        return any("changed" in c or "holds" in c for c in item_changes(items, self.manifest.items))

    def _go_on(self, restored: Ledger, source: str, change: str) -> bool:
        """Go on with ``restored``'s epoch under this manifest's changed mixture (``allow_mixture_change``);
        ``False`` when that cannot be done and ``allow_data_change`` restarts the epoch instead."""
        before = restored.state_dict()
        try:
            if restored.skipped or restored.skip_ahead:
                raise CheckpointMismatchError(
                    f"{source} left samples of epoch {restored.epoch} out at a resume with skip=, and a changed "
                    "mixture would draw them again: resume with the checkpoint's mixture until the epoch ends"
                )
            if restored.change is not None:
                raise CheckpointMismatchError(
                    f"{source}: its epoch {restored.epoch} already changed its mixture once, and the mixture differs "
                    f"again from the one it was changed to: {change}. Resume with that mixture until epoch "
                    f"{restored.epoch} ends, or pass {option('allow_data_change', True)} to start the epoch afresh"
                )
            changed = self._change(before, source)
        except CheckpointMismatchError as err:
            if not self.allow_data_change:
                raise
            warnings.warn(f"{err}; allow_data_change=True restarts the epoch instead", stacklevel=3)
            return False
        self.ledger = Ledger(
            seed=restored.seed,
            total=changed.total,
            manifest=self.manifest.summary(),
            epoch=restored.epoch,
            change={"before": before, "next_total": self.manifest.total},
        )
        self.ledger.consumed = RangeSet.interval(changed.rest, changed.total) if changed.before else RangeSet()
        self.restored_from = source
        self.mixture_from = restored.fingerprint
        self._change_note = f"{source}: {change}"
        return True

    def _change(self, before: dict[str, Any], source: str, total: int | None = None) -> Any:
        """Give the manifest the changed epoch of ``before`` (a ledger state of another mixture)."""
        try:
            changed = change_mixture(before, self.manifest, shuffle=self.options.shuffle)
        except MixtureChangeError as err:
            raise CheckpointMismatchError(f"{source}: {err}") from err
        if total is not None and changed.total != total:
            raise CheckpointMismatchError(
                f"{source}: its epoch {changed.epoch} changed its mixture to {total} samples, but the same change "
                f"gives {changed.total} now: the data or lightning_sharding differs from the run that wrote it"
            )
        mixture = mixture_of(self.manifest)
        assert mixture is not None  # change_mixture refuses a manifest without one
        self.manifest = self.manifest.with_epochs(ChangedMixture(mixture, changed))
        return changed


def _ledger_of(path: str) -> Mapping[str, Any]:
    """The ledger entry of the checkpoint file ``path`` (``skip=``'s ``checkpoint``)."""
    from lightning_sharding.core.ledger import CHECKPOINT_KEY

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        raise SkipError(f"skip= checkpoint: cannot read {path}: {err}") from err
    entry = ckpt.get(CHECKPOINT_KEY) if isinstance(ckpt, Mapping) else None
    if not isinstance(entry, Mapping):
        raise SkipError(f"skip= checkpoint: {path} holds no lightning_sharding data ledger")
    return {**entry, "global_step": entry.get("global_step", ckpt.get("global_step"))}


class ReplicaMismatchError(RuntimeError):
    """Two ranks of one model replica consumed different data: their batches were not the same."""


def one_ledger_per_replica(gathered: list[tuple[int, int, Any]]) -> list[RangeSet]:
    """The consumed set of each replica from every rank's ``(data_rank, epoch, consumed state)``, in
    global rank order; ranks of one replica that disagree raise :class:`ReplicaMismatchError`."""
    replicas: dict[int, tuple[int, int, RangeSet]] = {}
    for rank, (data_rank, epoch, state) in enumerate(gathered):
        consumed = RangeSet.from_state(state)
        if data_rank not in replicas:
            replicas[data_rank] = (rank, epoch, consumed)
            continue
        first, first_epoch, first_consumed = replicas[data_rank]
        if (epoch, consumed) != (first_epoch, first_consumed):
            only_first = len(first_consumed.difference(consumed))
            only_this = len(consumed.difference(first_consumed))
            raise ReplicaMismatchError(
                f"ranks {first} and {rank} are one model replica (data-parallel rank {data_rank}) but consumed "
                f"different data: epoch {first_epoch} vs {epoch}, {len(first_consumed)} vs {len(consumed)} "
                f"positions ({only_first} only on rank {first}, {only_this} only on rank {rank}). The ranks of a "
                "replica must read the same batches: give them the same seed, batch size and data, and check the "
                "strategy's distributed_sampler_kwargs or ShardedDataModule(data_parallel=...)"
            )
    return [consumed for _, _, consumed in replicas.values()]


def moved_prefixes(old: str, new: str) -> tuple[str, str]:
    """The differing heads of two keys of the same item: ``old`` and ``new`` without their longest
    common tail of whole path parts (``/a/ds/f0.npy``, ``/b/ds/f0.npy`` -> ``/a/``, ``/b/``)."""
    n = 0
    while n < min(len(old), len(new)) and old[len(old) - 1 - n] == new[len(new) - 1 - n]:
        n += 1
    tail = old[len(old) - n :]
    cut = tail.find("/") + 1 if "/" in tail else 0
    return old[: len(old) - n + cut], new[: len(new) - n + cut]
