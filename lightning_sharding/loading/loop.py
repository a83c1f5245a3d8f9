"""``ShardedData``: the same exactly-once loading for a training loop of your own, without the ``Trainer``.

For Lightning Fabric and for plain PyTorch under ``torchrun``. It takes the same arguments as
:class:`~lightning_sharding.ShardedDataModule` and drives the same
:class:`~lightning_sharding.loading.engine.LoadingEngine`, without importing Lightning; and the optimizer(s)
whose steps apply the batches, and the topology: from Fabric (``world=fabric``) or from
``torch.distributed`` (the default).

- **Accounting.** A batch counts once an optimizer step that used it has returned: every batch the
  loader yielded before a ``step()`` returns went into that step (a hook on the optimizer,
  ``register_step_post_hook``). So a checkpoint written at any point of the loop holds exactly what
  its weights hold, with gradient accumulation too. The loop must step after the batches it fetched,
  not fetch ahead.
- **State.** :meth:`ShardedData.state_dict` and :meth:`ShardedData.load_state_dict` follow the
  ``Stateful`` protocol of ``torch.distributed.checkpoint`` and of ``fabric.save``/``fabric.load``.
  ``state_dict()`` *gathers*: it merges every rank's consumed samples (a collective call, on every
  rank), so the state is the whole job's topology-free ledger, the same on every rank, and resumes on
  any number of ranks or workers. ``dcp.save`` and ``fabric.save`` call it on every rank; for a
  ``torch.save`` on rank 0, call it on every rank and write on rank 0. A rank that calls it alone (a
  rank-0-only save) fails after ``gather_timeout`` seconds, naming the ranks that did not, instead of
  writing a state that would lose their samples.
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from lightning_sharding.core.ledger import LOOP_STATE_KEY, Ledger, loop_state_entry
from lightning_sharding.core.world import DataParallel, World, check_data_parallel
from lightning_sharding.distributed.collectives import cpu_group
from lightning_sharding.loading.accounting import StepAccounting, TrainerProgress
from lightning_sharding.loading.engine import LoadingEngine
from lightning_sharding.loading.keeper import LedgerKeeper
from lightning_sharding.strategies.base import TrainLoader

# What only the Trainer's side does: its callback writes the audit, and its loops evaluate.
_TRAINER_ONLY = {
    "audit_dir": "is written by the Trainer's callback",
    "skip": "replays the steps of the Trainer's history, which ShardedData does not write",
    "val_reader": "is read by the Trainer's validation loop; evaluate in your loop from a loader of your own",
    "test_reader": "is read by the Trainer's test loop; evaluate in your loop from a loader of your own",
}


class ShardedData:
    """Exactly-once sharded training data for a loop of your own (Lightning Fabric, or PyTorch under torchrun).

    Build it on every rank, after the process group exists (``fabric.launch()``,
    ``dist.init_process_group``) and before the first batch::

        data = ShardedData(reader, optimizer=optimizer, world=fabric, batch_size=8, num_workers=2)
        fabric.load(path, {"model": model, "optimizer": optimizer, "data": data})  # on a resume
        for epoch in range(data.epoch, max_epochs):
            for batch in data.train_loader(epoch):
                ...  # forward, backward, optimizer.step() (every k batches with accumulation)
                fabric.save(path, {"model": model, "optimizer": optimizer, "data": data})

    Args:
        reader: the training data, as for :class:`~lightning_sharding.ShardedDataModule`.
        optimizer: the optimizer (or a list of them) whose ``step()`` applies the batches.
        world: a Fabric object (its ``global_rank``, ``world_size``, ``local_rank``, ``node_rank``
            and strategy), a :class:`~lightning_sharding.core.world.World`, or ``None``: ``torch.distributed``'s
            rank and world size (``LOCAL_RANK`` and ``GROUP_RANK``, which ``torchrun`` sets, give the
            local and node rank).
        data_parallel: ``(rank, size)`` of this rank's model replica, when several ranks make one.
        gather_timeout: seconds :meth:`state_dict` waits for every rank to call it.
        **options: every other keyword argument of :class:`~lightning_sharding.ShardedDataModule`
            (``batch_size``, ``num_workers``, ``seed``, ``streams``, ``packing``, ``sharding``, ...).
    """

    def __init__(
        self,
        reader: Any = None,
        *,
        optimizer: Any,
        world: Any = None,
        data_parallel: DataParallel | None = None,
        gather_timeout: float = 600.0,
        **options: Any,
    ) -> None:
        refused = [name for name in _TRAINER_ONLY if name in options]
        if refused:
            raise TypeError(f"ShardedData({refused[0]}=...) {_TRAINER_ONLY[refused[0]]}, or use ShardedDataModule")
        optimizers = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
        if not optimizers or not all(hasattr(o, "register_step_post_hook") for o in optimizers):
            raise TypeError(
                f"ShardedData(optimizer={optimizer!r}) needs the torch optimizer(s) whose step() applies the "
                "batches: a batch counts once a step that used it has returned"
            )
        if gather_timeout <= 0:
            raise ValueError(f"ShardedData(gather_timeout={gather_timeout!r}) must be a positive number of seconds")
        self._engine = LoadingEngine.from_arguments("ShardedData", reader, data_parallel=data_parallel, **options)
        data = self._engine.source if self._engine.source is not None else self._engine.reader
        if data is None:
            raise TypeError("ShardedData has no data: pass a reader (or `streams=`, or `source=` with its strategy)")
        self._engine.setup(data, world_of(world, data_parallel))  # collective: every rank lists and agrees
        self._group = cpu_group(self.world.world_size)  # for the state's gather, never mixed with training's
        self.keeper.group = self._group
        self.gather_timeout = float(gather_timeout)
        self._accounting = StepAccounting()
        self._steps = 0  # optimizer steps that returned, over the whole run (from the state on a resume)
        self._accounting.start_run(self._steps)
        self._yielded = 0  # batches of the current pass handed to the loop
        self._saved = False  # a state was taken since the last batch: its source may be told
        self._hooks = [o.register_step_post_hook(self._stepped) for o in optimizers]

    @property
    def keeper(self) -> LedgerKeeper:
        """The ledger and the manifest it plans by."""
        keeper = self._engine.keeper
        assert keeper is not None  # set up in __init__
        return keeper

    @property
    def world(self) -> World:
        """This rank's place in the job."""
        return self._engine.world

    @property
    def epoch(self) -> int:
        """The epoch the ledger is in: 0, or a loaded state's, until :meth:`train_loader` starts another."""
        return self.keeper.ledger.epoch

    @property
    def ledger(self) -> Ledger:
        """This rank's view of the ledger: what its own steps applied, and what the last :meth:`state_dict`
        gathered from every rank (``len(data.ledger.consumed)`` of ``data.ledger.total`` this epoch)."""
        return self.keeper.ledger

    @property
    def manifest(self) -> Any:
        """The training data's manifest, as the ledger plans by it."""
        return self.keeper.manifest

    def train_loader(self, epoch: int | None = None) -> Iterator[Any]:
        """This rank's batches of ``epoch`` (default :attr:`epoch`) not yet in the ledger: the rest of a
        loaded state's epoch, or a whole new one. Every rank yields the same number of batches."""
        epoch = self.epoch if epoch is None else int(epoch)
        if epoch < self.epoch:
            raise ValueError(
                f"ShardedData.train_loader({epoch}): the ledger is at epoch {self.epoch} already; "
                f"loop `for epoch in range(data.epoch, max_epochs)`"
            )
        self._sync()
        # Every rank plans the rest of the epoch from the same ledger (a collective call: every rank
        # asks for its loader at the same point of the loop), also after a pass left early.
        self.keeper.gather()
        if epoch != self.epoch and self.keeper.ledger.pending:
            warnings.warn(
                f"epoch {epoch} starts while {len(self.keeper.ledger.pending)} samples of epoch {self.epoch} were "
                f"yielded but no optimizer step has applied them yet: epoch {self.epoch}'s ledger does not count "
                "them, and a resume from a later state will not train them in that epoch. Step the optimizer after "
                "an epoch's last batch (as Lightning does with gradient accumulation)",
                stacklevel=2,
            )
        behind = self.keeper.left_behind(epoch)
        if behind is not None:
            consumed, total, left = behind
            warnings.warn(
                f"train_loader({epoch}) leaves epoch {self.epoch} after {consumed} of its {total} samples: the "
                f"other {left} are not trained in it. To finish it, call train_loader({self.epoch}) first (it serves "
                "what is left)",
                stacklevel=2,
            )
        self.keeper.restored_from = None  # said above, in a loop's words
        self.keeper.start_epoch(epoch)
        loader = self.keeper.train_loader
        if loader is None:
            loader = self._engine.build_train_loader()
        loader.set_epoch(epoch)
        return self._batches(loader)

    def _batches(self, loader: TrainLoader) -> Iterator[Any]:
        self._accounting.start_epoch()
        self._yielded = 0
        for batch in loader:
            if self._saved:  # the state taken before this batch is written by now
                self.keeper.committed()
                self._saved = False
            self._accounting.batch_starts(self._progress())
            self._yielded += 1
            yield batch

    def _progress(self) -> TrainerProgress:
        return TrainerProgress(self._yielded, self._yielded, self._steps)

    def _stepped(self, *args: Any) -> None:
        """An optimizer step returned: every batch yielded so far is in the weights."""
        self._steps += 1
        self._sync()

    def _sync(self) -> None:
        loader = self.keeper.train_loader
        if loader is not None:
            self._accounting.sync(self._progress(), loader.pop_delivered, self.keeper.ledger)

    def state_dict(self) -> dict[str, Any]:
        """The whole job's ledger, gathered from every rank (call it on every rank), as of the optimizer
        steps that have returned: ``{"ledger": (entry,)}``, the entry of a Lightning checkpoint."""
        self._wait_for_every_rank("state_dict()")
        self._sync()
        entry = self.keeper.state(global_step=self._steps)
        self._saved = True
        return {LOOP_STATE_KEY: (entry,)}  # a tuple: DCP loads tensors in place, and ledgers differ in size

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a state of :meth:`state_dict`, written on any number of ranks or workers."""
        ledger = loop_state_entry(state)
        if ledger is None:
            found = f"a dict with keys {sorted(state)}" if isinstance(state, dict) else f"a {type(state).__name__}"
            raise ValueError(
                f"ShardedData.load_state_dict() takes what ShardedData.state_dict() returned, {{'ledger': (entry,)}}; "
                f"got {found}"
            )
        self.keeper.restore(dict(ledger), None, "the loaded state")
        self._steps = int(ledger.get("global_step") or 0)
        self._accounting.start_run(self._steps)
        self._engine.forget_train_loader()  # built on the ledger just replaced

    def _wait_for_every_rank(self, call: str) -> None:
        """A rank that calls :meth:`state_dict` alone would wait forever in the gather: fail, naming the others."""
        if self._group is None:
            return
        try:
            dist.monitored_barrier(
                self._group, timeout=datetime.timedelta(seconds=self.gather_timeout), wait_all_ranks=True
            )
        except RuntimeError as err:
            raise RuntimeError(
                f"ShardedData.{call} on rank {self.world.rank} gathers every rank's ledger, and the other ranks did "
                f"not call it (waited up to {self.gather_timeout:g} s: {err}). Call it on every rank: fabric.save and "
                "torch.distributed.checkpoint.save do; for torch.save on rank 0, take `state = data.state_dict()` "
                "on every rank and write it on rank 0 alone. A state of one rank would lose the others' samples"
            ) from err

    def close(self) -> None:
        """Release the loader's workers and shared memory, and the optimizer hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._engine.close()


def world_of(world: Any, data_parallel: DataParallel | None) -> World:
    """This rank's :class:`World` from a Fabric object, a World, or ``torch.distributed``."""
    if isinstance(world, World):
        return world
    if world is not None:  # Fabric: the Trainer's attribute names, and a strategy
        return World.from_trainer(world, data_parallel)
    if not (dist.is_available() and dist.is_initialized()):
        return World(data_rank=data_parallel[0], data_size=data_parallel[1]) if data_parallel else World()
    rank, size = dist.get_rank(), dist.get_world_size()
    data_rank, data_size = check_data_parallel(data_parallel or (rank, size), size, f"ShardedData on rank {rank}")
    return World(
        rank=rank,
        world_size=size,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        node_rank=int(os.environ.get("GROUP_RANK", 0)),
        data_rank=data_rank,
        data_size=data_size,
    )
