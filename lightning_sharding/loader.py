"""The sharded loader of one rank: the plan in the main process, batch reads in the workers.

Why a plain ``torch.utils.data.DataLoader`` and not torchdata's ``StatefulDataLoader``: the data
state that matters is the ledger, which is topology-free and lives in the main process. A
StatefulDataLoader's own state is per rank and per worker, counts batches a worker produced rather
than steps that completed, and its ``load_state_dict`` asserts the same ``num_workers`` (checked
with torchdata 0.11: Lightning restores it and resuming on another worker count crashes). We keep
no loader state at all, so there is nothing for it to save.

Why map-style tasks instead of an ``IterableDataset``: the main process deals each worker a
:class:`~lightning_sharding.plan.BatchTask` through the DataLoader's own index queues. A new epoch
is then a new plan in the main process; persistent workers need no message, and the DataLoader
itself discards every task still in flight when a new iterator starts. Workers return whole
batches with their provenance (epoch positions), which this loader strips before Lightning sees
the batch and keeps in order for the ledger.
"""

from __future__ import annotations

import multiprocessing
import pickle
import random
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate, get_worker_info

from lightning_sharding.ledger import Ledger
from lightning_sharding.manifest import Item
from lightning_sharding.order import EpochOrder
from lightning_sharding.plan import BatchTask, EpochPlan, EvenBatches, RankPlan, WorkerLayout, plan_epoch
from lightning_sharding.processes import reraise_if_dead, stop_workers, watch, worker_processes
from lightning_sharding.readers.base import Reader
from lightning_sharding.storage import is_transient
from lightning_sharding.world import SampleContext, ShardContext, World

Transform = Callable[[Any, SampleContext], Any]


OnError = Literal["raise", "skip"]
ON_ERROR_POLICIES: tuple[str, ...] = ("raise", "skip")
_NO_POSITIONS = np.zeros(0, dtype=np.int64)


class SampleError(RuntimeError):
    """A sample that could not be read or transformed; the message names the item and the sample."""


@dataclass(frozen=True)
class Provenance:
    """Where a delivered batch came from: epoch positions (int64, shape ``(n,)``), the last
    ``num_padding`` of which are padding, and the positions ``skipped`` (shape ``(k,)``) because
    they failed to read under ``on_error="skip"``; those are consumed but not in the batch."""

    epoch: int
    positions: npt.NDArray[np.int64]
    num_padding: int
    skipped: npt.NDArray[np.int64] = field(default_factory=lambda: _NO_POSITIONS)

    @property
    def real_positions(self) -> npt.NDArray[np.int64]:
        """Positions trained on, shape ``(n - num_padding,)``."""
        return self.positions[: len(self.positions) - self.num_padding]

    @property
    def consumed_positions(self) -> npt.NDArray[np.int64]:
        """Positions that count as consumed once the step completes: trained on or skipped."""
        return np.concatenate((self.real_positions, self.skipped)) if len(self.skipped) else self.real_positions


@dataclass(frozen=True)
class _Failed:
    """Stands in a sample that failed under ``on_error="skip"``."""

    message: str


def seed_rngs(seed: int) -> None:
    """Seed torch, NumPy and ``random`` of this process (a worker) with one derived seed."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def structure(sample: Any) -> Any:
    """A hashable summary of a sample's layout: the shape and dtype of every array, the type of the rest."""
    if isinstance(sample, Mapping):
        return ("dict", tuple((str(k), structure(v)) for k, v in sample.items()))
    if isinstance(sample, (list, tuple)):
        return ("seq", tuple(structure(v) for v in sample))
    if isinstance(sample, (torch.Tensor, np.ndarray)):
        return ("array", tuple(sample.shape), str(sample.dtype))
    return ("type", type(sample).__name__)


def describe_structure(layout: Any) -> str:
    """``structure(sample)`` as text, e.g. ``{'x': shape (8,) float32, 'id': int}``."""
    kind = layout[0]
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {describe_structure(v)}" for k, v in layout[1]) + "}"
    if kind == "seq":
        return "(" + ", ".join(describe_structure(v) for v in layout[1]) + ")"
    if kind == "array":
        return f"shape {layout[1]} {layout[2]}"
    return str(layout[1])


def difference(layout: Any, common: Any) -> str:
    """How sample layout ``layout`` differs from ``common``, naming the fields of dict samples."""
    if layout[0] == common[0] == "dict":
        mine, theirs = dict(layout[1]), dict(common[1])
        return "; ".join(
            f"field {key!r} is {describe_structure(mine[key]) if key in mine else 'missing'}, "
            f"the other samples' is {describe_structure(theirs[key]) if key in theirs else 'missing'}"
            for key in dict.fromkeys([*mine, *theirs])
            if mine.get(key) != theirs.get(key)
        )
    return f"it is {describe_structure(layout)}, the other samples are {describe_structure(common)}"


def _pass_through(data: Any) -> Any:
    return data


Delivery = tuple[Any, int, npt.NDArray[np.int64], int, npt.NDArray[np.int64]]


class PlannedBatches(Dataset[Delivery]):
    """Map-style dataset indexed by :class:`BatchTask`: reads, transforms and collates one batch.

    Runs inside workers. Returns ``(batch, epoch, positions, num_padding, skipped)``. A sample
    that fails to read or transform raises :class:`SampleError` naming the item and the sample;
    with ``on_error="skip"`` it is left out and counted, and a good sample of the same batch takes
    its place flagged as padding, so the batch keeps its size and the accounting stays exact.
    """

    def __init__(
        self,
        reader: Reader,
        items: Sequence[Item],
        *,
        seed: int,
        shuffle: bool,
        world: World,
        num_workers: int,
        transform: Transform | None,
        collate_fn: Callable[[list[Any]], Any],
        on_error: OnError = "raise",
    ) -> None:
        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"on_error={on_error!r} must be one of {list(ON_ERROR_POLICIES)}")
        self.on_error = on_error
        self.reader = reader
        self.items = tuple(items)
        self.counts = np.array([it.num_samples for it in self.items], dtype=np.int64)
        self.seed, self.shuffle, self.world, self.num_workers = seed, shuffle, world, num_workers
        self.transform, self.collate_fn = transform, collate_fn
        self._order: EpochOrder | None = None
        self._context: ShardContext | None = None

    def __len__(self) -> int:
        raise TypeError("PlannedBatches is indexed by BatchTask and has no length")

    def context(self, epoch: int) -> ShardContext:
        """The :class:`ShardContext` of this worker for ``epoch``; seeds the worker's RNGs once per epoch."""
        if self._context is None or self._context.epoch != epoch:
            info = get_worker_info()
            self._context = ShardContext(
                rank=self.world.rank,
                world_size=self.world.world_size,
                worker_id=info.id if info is not None else 0,
                num_workers=self.num_workers,
                epoch=epoch,
                seed=self.seed,
            )
            if info is not None:  # never reseed the training process itself
                seed_rngs(self._context.worker_seed)
        return self._context

    def _epoch_order(self, epoch: int) -> EpochOrder:
        if self._order is None or self._order.epoch != epoch:
            self._order = EpochOrder(self.counts, self.seed, epoch, shuffle=self.shuffle)
        return self._order

    def __getitem__(self, task: BatchTask) -> Delivery:
        ctx = self.context(task.epoch)
        item_ids, indices = self._epoch_order(task.epoch).locate(task.positions)
        # Read runs of consecutive positions that fall in the same item with one call.
        cuts = np.flatnonzero(np.diff(item_ids)) + 1
        samples: list[Any] = []
        for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(item_ids)])), strict=True):
            samples.extend(self._read_run(self.items[int(item_ids[lo])], indices[lo:hi], task.positions[lo:hi], ctx))
        if self.transform is not None:
            transform = self._transform  # the per-sample loop is the hot path: plain ints, no lookups
            samples = [
                transform(s, SampleContext(ctx, p, i, j))
                for s, p, i, j in zip(
                    samples, task.positions.tolist(), item_ids.tolist(), indices.tolist(), strict=True
                )
            ]
        while True:  # each pass marks at least one more misfit as failed, or raises
            try:
                if _Failed not in map(type, samples):
                    return self.collate_fn(samples), task.epoch, task.positions, task.num_padding, _NO_POSITIONS
                bad = np.array([isinstance(s, _Failed) for s in samples], dtype=bool)
                return self._without_failed(task, samples, bad)
            except SampleError:
                raise
            except Exception as err:  # noqa: BLE001 - a collate failure: name the sample that does not fit
                for i, failure in self._misfits(samples, err, task, item_ids, indices, ctx):
                    samples[i] = _Failed(str(failure))

    def _misfits(
        self,
        samples: list[Any],
        err: Exception,
        task: BatchTask,
        item_ids: npt.NDArray[np.int64],
        indices: npt.NDArray[np.int64],
        ctx: ShardContext,
    ) -> list[tuple[int, SampleError]]:
        """The samples whose shapes or dtypes differ from the rest of the batch, which ``collate_fn``
        could not stack (``err``); raises unless ``on_error="skip"`` or when none differs."""
        shapes = [None if isinstance(s, _Failed) else structure(s) for s in samples]
        counts: dict[Any, int] = {}
        for shape in shapes:
            if shape is not None:
                counts[shape] = counts.get(shape, 0) + 1
        common = max(counts, key=lambda k: counts[k]) if counts else None
        odd = [i for i, shape in enumerate(shapes) if shape is not None and shape != common]
        if not odd:
            keys = sorted({self.items[int(k)].key for k in item_ids})
            raise SampleError(
                f"collate_fn failed on batch {task.index} (epoch {task.epoch}, items {keys}, rank {ctx.rank}, "
                f"worker {ctx.worker_id}): {type(err).__name__}: {err}"
            ) from err
        out = []
        for i in odd:
            failure = SampleError(
                f"sample {int(indices[i])} of item {self.items[int(item_ids[i])].key!r} (epoch {task.epoch}, "
                f"position {int(task.positions[i])}, rank {ctx.rank}, worker {ctx.worker_id}) does not fit in a "
                f"batch with the others: {difference(shapes[i], common)} ({type(err).__name__}: {err}). "
                "Fix or remove the data, or pass on_error='skip' to skip bad samples (counted and reported)."
            )
            if self.on_error == "raise":
                raise failure from err
            out.append((i, failure))
        return out

    def _read_run(
        self, item: Item, indices: npt.NDArray[np.int64], positions: npt.NDArray[np.int64], ctx: ShardContext
    ) -> list[Any]:
        """Samples ``indices`` of ``item`` in one read; on failure, sample by sample to name the bad one."""
        try:
            got = self.reader.read_batch(item, indices, ctx)
        except Exception:  # noqa: BLE001 - find and name the failing sample below
            return [self._read_one(item, int(i), int(p), ctx) for i, p in zip(indices, positions, strict=True)]
        if len(got) != len(indices):
            raise RuntimeError(
                f"{type(self.reader).__name__}.read_batch returned {len(got)} samples for "
                f"{len(indices)} indices of item {item.key!r}; it must return one sample per index"
            )
        return list(got)

    def _read_one(self, item: Item, index: int, position: int, ctx: ShardContext) -> Any:
        try:
            return self.reader.read(item, index, ctx)
        except Exception as err:
            if is_transient(err):  # storage down beyond the retry budget is not bad data: never skip it
                raise SampleError(
                    f"cannot read item {item.key!r} (rank {ctx.rank}, worker {ctx.worker_id}): the storage "
                    f"failed beyond the retry budget: {err}. No sample of this batch counts as consumed; once "
                    "the storage is back, resume from the last checkpoint (or raise the reader's retry=RetryPolicy)."
                ) from err
            failure = SampleError(
                f"cannot read sample {index} of item {item.key!r} (epoch {ctx.epoch}, position {position}, "
                f"rank {ctx.rank}, worker {ctx.worker_id}): {type(err).__name__}: {err}. "
                "Fix or remove the data, or pass on_error='skip' to skip bad samples (counted and reported)."
            )
            if self.on_error == "raise":
                raise failure from err
            return _Failed(str(failure))

    def _transform(self, sample: Any, sctx: SampleContext) -> Any:
        if isinstance(sample, _Failed):
            return sample
        assert self.transform is not None
        try:
            return self.transform(sample, sctx)
        except Exception as err:
            failure = SampleError(
                f"the transform failed on sample {sctx.index} of item {self.items[sctx.item].key!r} "
                f"(epoch {sctx.shard.epoch}, position {sctx.position}): {type(err).__name__}: {err}"
            )
            if self.on_error == "raise":
                raise failure from err
            return _Failed(str(failure))

    def _without_failed(self, task: BatchTask, samples: list[Any], bad: npt.NDArray[np.bool_]) -> Delivery:
        """Leave failed samples out; good ones of the batch stand in for them, flagged as padding."""
        n_real = len(task.positions) - task.num_padding
        real_bad = bad.copy()
        real_bad[n_real:] = False
        good = np.flatnonzero(~bad)
        if good.size == 0:
            raise SampleError(
                f"every sample of batch {task.index} (epoch {task.epoch}, positions {task.positions.tolist()}) "
                f"failed, so on_error='skip' has nothing to fill the batch with. First error: {samples[0].message}"
            )
        fill = good[np.arange(int(bad.sum())) % good.size]
        keep_real, keep_pad = good[good < n_real], good[good >= n_real]
        order = np.concatenate((keep_real, keep_pad, fill))
        positions = task.positions[order]
        num_padding = len(order) - len(keep_real)
        return (
            self.collate_fn([samples[i] for i in order]),
            task.epoch,
            positions,
            num_padding,
            task.positions[np.flatnonzero(real_bad)],
        )


class PlanSampler(Sampler[BatchTask]):
    """Yields this rank's :class:`BatchTask` s for the ledger's current epoch.

    It deliberately has no ``__len__``: after an elastic resume an epoch's batch count differs
    from the next epoch's, and Lightning caches a loader's length for the whole run.
    """

    # How the rank's batches are laid out over workers (see plan.py); a strategy's sampler may change it.
    worker_layout: WorkerLayout = "runs"

    def __init__(
        self,
        ledger: Ledger,
        *,
        world: World,
        num_workers: int,
        batch_size: int,
        even_batches: EvenBatches,
    ) -> None:
        self.ledger = ledger
        self.world, self.num_workers = world, num_workers
        self.batch_size, self.even_batches = batch_size, even_batches
        self.epoch_plan: EpochPlan | None = None
        self.rank_plan: RankPlan | None = None

    @property
    def epoch(self) -> int:
        """The epoch being served."""
        return self.ledger.epoch

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at every epoch start: a new epoch starts with nothing consumed."""
        self.ledger.start_epoch(epoch)

    def plan(self) -> EpochPlan:
        """Plan what is left of the current epoch (every rank computes the same plan)."""
        return plan_epoch(
            self.ledger.total,
            self.ledger.done,
            epoch=self.ledger.epoch,
            world_size=self.world.world_size,
            num_workers=self.num_workers,
            batch_size=self.batch_size,
            even_batches=self.even_batches,
            worker_layout=self.worker_layout,
        )

    def __iter__(self) -> Iterator[BatchTask]:
        self.epoch_plan = self.plan()
        self.rank_plan = self.epoch_plan.rank(self.world.rank)
        return self.rank_plan.tasks()


class ShardedLoader:
    """The iterable Lightning gets for one rank: batches with provenance stripped.

    It is not a ``DataLoader`` subclass on purpose: Lightning then leaves it alone (no sampler
    injection, no re-instantiation). ``sampler`` is exposed so that Lightning's ``set_epoch``
    reaches the plan. When ``track`` is set, the provenance of every delivered batch is queued in
    ``delivered`` for the ledger, oldest first.
    """

    def __init__(
        self,
        dataset: PlannedBatches,
        sampler: PlanSampler,
        *,
        num_workers: int = 0,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        multiprocessing_context: str | None = None,
        timeout: float = 0,
        padding_key: str | None = "is_padding",
        track: bool = False,
    ) -> None:
        self.sampler = sampler
        # Lightning's evaluation loop reads `batch_sampler` off any loader that has a `sampler`.
        self.batch_sampler = None
        self.padding_key = padding_key
        self.track = track
        self._iterator: Iterator[Any] | None = None
        self.delivered: deque[Provenance] = deque()
        start_method = multiprocessing_context or multiprocessing.get_start_method()
        if num_workers > 0 and start_method in ("spawn", "forkserver"):
            _check_picklable(dataset, start_method)
        self._loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=_pass_through,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            pin_memory=pin_memory,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
            timeout=timeout,
        )

    @classmethod
    def build(
        cls,
        reader: Reader,
        items: Sequence[Item],
        ledger: Ledger,
        *,
        world: World,
        batch_size: int,
        num_workers: int = 0,
        shuffle: bool = True,
        even_batches: EvenBatches = "pad",
        transform: Transform | None = None,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        on_error: OnError = "raise",
        **options: Any,
    ) -> ShardedLoader:
        """The loader of ``world.rank`` for ``ledger``'s epoch; ``options`` go to :class:`ShardedLoader`.

        This is all :class:`~lightning_sharding.ShardedDataModule` does per loader; use it directly
        to shard outside Lightning.
        """
        dataset = PlannedBatches(
            reader,
            items,
            seed=ledger.seed,
            shuffle=shuffle,
            world=world,
            num_workers=num_workers,
            transform=transform,
            collate_fn=collate_fn,
            on_error=on_error,
        )
        sampler = PlanSampler(
            ledger, world=world, num_workers=num_workers, batch_size=batch_size, even_batches=even_batches
        )
        return cls(dataset, sampler, num_workers=num_workers, **options)

    def __iter__(self) -> Iterator[Any]:
        self.delivered.clear()
        for batch, epoch, positions, num_padding, skipped in self._guarded(iter(self._loader)):
            if epoch != self.sampler.epoch:
                raise RuntimeError(
                    f"a batch planned for epoch {epoch} arrived in epoch {self.sampler.epoch}; "
                    "this is a bug in lightning_sharding, please report it"
                )
            if self.track:
                self.delivered.append(Provenance(epoch, positions, num_padding, skipped))
            yield flag_padding(batch, len(positions), num_padding, self.padding_key)

    def pop_delivered(self) -> Provenance:
        """Provenance of the oldest delivered batch whose step has not been accounted yet."""
        return pop_delivered(self.delivered)

    def _guarded(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The DataLoader iterator's output; a dead worker is re-raised naming this rank, the worker and its pid."""
        self._iterator = iterator
        watch(iterator, self.sampler.world.rank)
        try:
            yield from iterator
        except Exception as err:
            reraise_if_dead(
                self.helper_processes, self.sampler.world.rank, iterator, err, "the training process waited for batches"
            )
            raise

    def close(self) -> None:
        """Stop the worker processes now (teardown, a dead worker) rather than when garbage collected."""
        stop_workers(self._iterator)
        self._iterator = None
        self._loader._iterator = None  # persistent workers: the next pass must start new ones, not reuse these

    def helper_processes(self) -> dict[str, Any]:
        """This rank's worker processes (``.pid``, ``.exitcode``) by name: ``"DataLoader worker 0"``..."""
        return worker_processes(self._iterator)


def flag_padding(batch: Any, size: int, num_padding: int, padding_key: str | None) -> Any:
    """``batch`` with a boolean ``padding_key`` entry of shape ``(size,)`` when it is a dict."""
    if padding_key is None or not isinstance(batch, Mapping):
        return batch
    if padding_key in batch:
        raise KeyError(
            f"the batch already has a key {padding_key!r}, where lightning_sharding puts its padding "
            "flags; pass another `padding_key=` (or None) to ShardedDataModule"
        )
    flags = torch.zeros(size, dtype=torch.bool)
    if num_padding:
        flags[size - num_padding :] = True
    return {**batch, padding_key: flags}


def pop_delivered(delivered: deque[Provenance]) -> Provenance:
    """The oldest delivered batch's provenance whose step has not been accounted yet."""
    if not delivered:
        raise RuntimeError(
            "a training step ended but no batch of the sharded loader is waiting to be accounted. "
            "Return the loader from train_dataloader() as it is (no wrapping or re-batching), "
            "and do not use `training_step(dataloader_iter)`, which this accounting does not support."
        )
    return delivered.popleft()


def _check_picklable(dataset: PlannedBatches, start_method: str) -> None:
    for name, obj in (("reader", dataset.reader), ("transform", dataset.transform), ("collate_fn", dataset.collate_fn)):
        try:
            pickle.dumps(obj)
        except Exception as err:  # noqa: BLE001 - any pickling failure means the same thing here
            raise TypeError(
                f"the {name} {obj!r} cannot be pickled into DataLoader workers started with {start_method} ({err}). "
                "Define it at module level (not inside a function or as a lambda), or use num_workers=0."
            ) from err
