"""Pooled shared-memory batch transport: workers write batches into reusable slots, the training
process views them in place.

PyTorch moves every tensor of every batch through a fresh shared-memory file and its own file
descriptor (created, sent, mapped and unmapped per batch). Here each worker keeps a few *slots*:
files under ``/dev/shm`` it maps once and writes each batch into (one copy), sending only the slot
and the tensors' layout. The training process maps a slot once, unlinks its name at once (so
nothing is left in ``/dev/shm`` whatever happens next), and hands out tensors that view the slot.

A slot is busy from the worker's write until every tensor viewing it is gone: the views hold a
per-batch base array whose finalizer marks the slot free again in a small state array shared with
the workers. A batch the consumer keeps simply keeps its slot (the worker uses another, or sends
through PyTorch's path when all are busy: never a wait, never an overwrite). A batch larger than
its slot gets a new, larger file. GPU tensors and tensors that need grad go PyTorch's way.

Names are ``lsh-<run>-<owner pid.start>-t<pool>-w<worker>.<pid>-s<slot>-g<generation>`` with the
training process as owner: a slot file a SIGKILL left behind before the training process mapped it
is removed by :func:`~lightning_sharding.strategies._shared_memory.sweep_dead` (a dead owner) or by the pool's close.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import secrets
import weakref
from multiprocessing.context import BaseContext
from typing import Any, NamedTuple

import numpy as np
import torch

import lightning_sharding.strategies._shared_memory as shared_memory
from lightning_sharding.core.private import create_file

# Batches smaller than this go through PyTorch's own path. The benchmark's transport rows found no
# batch size at which PyTorch's path is faster: the pool was 3.6x at 4 KiB batches, 1.3x at 67 KiB
# and level (0.97-1.02x, within the noise) from 268 KiB to 1 MiB, so none is set; the environment
# variable is there to measure again.
MIN_BYTES = int(os.environ.get("LIGHTNING_SHARDING_POOL_MIN_BYTES", 0))
_RUN = secrets.token_hex(3)
# The torch dtypes NumPy has too: a slot's tensor of one of them is a NumPy view handed to torch, about
# 2.5x cheaper in the training process than torch.frombuffer and two views (others take that way).
_NUMPY_TWINS: dict[torch.dtype, np.dtype[Any]] = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
_pools = itertools.count()


class Leaf(NamedTuple):
    """Where one tensor of a batch lies in its slot."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SlotBatch(NamedTuple):
    """What a worker sends instead of a batch: its slot and the batch with tensors as :class:`Leaf`."""

    worker: int
    slot: int
    name: str
    size: int
    tree: Any


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each CPU tensor replaced by its index in ``tensors`` (as a ``Leaf`` placeholder)."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or obj.requires_grad:
            raise _Unpoolable
        tensors.append(obj)
        return Leaf(len(tensors) - 1, 0, obj.dtype, tuple(obj.shape))
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_flatten(v, tensors) for v in obj)
    return obj


def _map_leaves(tree: Any, fn: Any) -> Any:
    if isinstance(tree, Leaf):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_map_leaves(v, fn) for v in tree)
    return tree


class _Unpoolable(Exception):
    """A batch the pool does not carry (a GPU tensor, one that needs grad): PyTorch's path takes it."""


class SlotStates:
    """The busy flags of every worker's slots, shared by the training process and its workers
    (a ``RawArray``: it travels to spawned workers with the dataset, and leaves no file behind)."""

    def __init__(self, num_workers: int, slots_per_worker: int, context: BaseContext) -> None:
        self.flags = context.RawArray("b", num_workers * slots_per_worker)
        self.per_worker = slots_per_worker
        self.owner = shared_memory.process_token()
        self.prefix = f"{shared_memory.PREFIX}{_RUN}-{self.owner}-t{next(_pools)}"

    def index(self, worker: int, slot: int) -> int:
        """The flag of ``slot`` of ``worker``."""
        return worker * self.per_worker + slot


def _aligned(nbytes: int) -> int:
    """The room a tensor of ``nbytes`` takes in a slot: each tensor starts 64-byte aligned."""
    return -(-nbytes // 64) * 64


class _Writing:
    """A free slot a batch's tensors are being made in (:meth:`WorkerSlots.take`): the tensors
    handed out so far, as ``{offset: nbytes}``, and where the next one goes."""

    def __init__(self, slot: int, buffer: mmap.mmap, address: int) -> None:
        self.slot, self.buffer, self.address = slot, buffer, address
        self.regions: dict[int, int] = {}
        self.at = 0


class WorkerSlots:
    """A worker's side: its slots, mapped once; ``pack`` writes a batch into a free one.

    A collate may make the batch's tensors in a free slot to begin with (:meth:`begin`, :meth:`take`):
    ``pack`` then sends them where they are, copying only what was made elsewhere. Only for a batch
    nothing else in the worker keeps: once sent, the slot's memory is the training process's until
    it lets go, and the next batch written there would change a tensor kept in the worker."""

    def __init__(self, states: SlotStates, worker: int) -> None:
        self.states = states
        self.worker = worker
        self.maps: list[tuple[str, mmap.mmap] | None] = [None] * states.per_worker
        self.generation = itertools.count()
        self._addresses: dict[int, int] = {}  # each mapped slot's address
        self._writing: _Writing | None = None
        self._dropped: dict[int, int] = {}  # the size of a slot's next file, where _leave dropped its mapping

    def begin(self) -> None:
        """The next batch's tensors may be made in a free slot (the largest one mapped), by :meth:`take`."""
        flags, best = self.states.flags, None
        for slot, mapped in enumerate(self.maps):
            if mapped is not None and flags[self.states.index(self.worker, slot)] == 0:
                if best is None or len(mapped[1]) > len(best[1][1]):
                    best = (slot, mapped)
        self._writing = None if best is None else _Writing(best[0], best[1][1], self._addresses[best[0]])

    def reset(self) -> None:
        """No batch is being made in a slot (a new one starts)."""
        self._writing = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An empty tensor of ``shape`` and ``dtype`` in the slot :meth:`begin` chose, after the ones
        taken before it; ``None`` where there is none, or it is full."""
        writing = self._writing
        nbytes = math.prod(shape) * dtype.itemsize
        if writing is None or not nbytes or writing.at + nbytes > len(writing.buffer):
            return None
        out = torch.frombuffer(writing.buffer, dtype=torch.uint8, count=nbytes, offset=writing.at)
        writing.regions[writing.at] = nbytes
        writing.at += _aligned(nbytes)
        return out.view(dtype).view(shape)

    def pack(self, batch: Any) -> Any:
        """``batch`` as a :class:`SlotBatch` in a free slot, or as it is (small, unpoolable, none free)."""
        writing, self._writing = self._writing, None
        tensors: list[torch.Tensor] = []
        try:
            tree = _flatten(batch, tensors)
        except _Unpoolable:
            return self._leave(batch, writing)
        sizes = [t.numel() * t.element_size() for t in tensors]
        total = sum(_aligned(n) for n in sizes)
        if total < MIN_BYTES or not total:  # nothing to carry (strings, empty tensors): PyTorch's path
            return self._leave(batch, writing)
        if writing is not None:
            placed = self._pack_in_place(writing, tensors, sizes, tree)
            if placed is not None:
                return placed
            self._leave(batch, writing, grew=True)  # copied from there into another slot, or a new file for it
        flags = self.states.flags
        free = [s for s in range(self.states.per_worker) if flags[self.states.index(self.worker, s)] == 0]
        if not free:
            return batch  # the consumer holds every slot: PyTorch's path, never a wait
        slot = next((s for s in free if self._fits(s, total)), free[0])
        name, buffer = self._slot(slot, total)
        flags[self.states.index(self.worker, slot)] = 1
        offsets = []
        at = 0  # where the next tensor starts in the slot
        for t, n in zip(tensors, sizes, strict=True):
            _copy_into(buffer, at, t, n)
            offsets.append(at)
            at += _aligned(n)
        tree = _map_leaves(tree, lambda leaf: Leaf(offsets[leaf.offset], sizes[leaf.offset], leaf.dtype, leaf.shape))
        return SlotBatch(self.worker, slot, name, len(buffer), tree)

    def _pack_in_place(
        self, writing: _Writing, tensors: list[torch.Tensor], sizes: list[int], tree: Any
    ) -> SlotBatch | None:
        """The batch sent from the slot its tensors were made in (:meth:`take`), the others copied
        in after them; ``None`` when they do not fit there."""
        offsets, copies = [], []
        at = writing.at
        for t, n in zip(tensors, sizes, strict=True):
            start = t.data_ptr() - writing.address
            if n and writing.regions.get(start) == n and t.is_contiguous():
                offsets.append(start)  # made there: nothing to copy
                continue
            offsets.append(at)  # after every tensor made there: this copy overwrites none of them
            copies.append((t, n, at))
            at += _aligned(n)
        if at > len(writing.buffer):
            return None
        self.states.flags[self.states.index(self.worker, writing.slot)] = 1
        for t, n, offset in copies:
            _copy_into(writing.buffer, offset, t, n)
        name = self.maps[writing.slot][0]  # type: ignore[index]  # begin() chose a mapped slot
        tree = _map_leaves(tree, lambda leaf: Leaf(offsets[leaf.offset], sizes[leaf.offset], leaf.dtype, leaf.shape))
        return SlotBatch(self.worker, writing.slot, name, len(writing.buffer), tree)

    def _leave(self, batch: Any, writing: _Writing | None, *, grew: bool = False) -> Any:
        """``batch`` for PyTorch's path. Tensors made in a slot (:meth:`take`) stay where they are
        while PyTorch's queue sends them: that slot is left to them (its mapping dropped here; the
        next batch that needs one maps a new file, of the old one's size, or twice it when the
        batch outgrew it, as a slot grows)."""
        if writing is not None and writing.regions:
            self._dropped[writing.slot] = len(writing.buffer) * (2 if grew else 1)
            self.maps[writing.slot] = None
        return batch

    def _fits(self, slot: int, total: int) -> bool:
        current = self.maps[slot]
        return current is not None and len(current[1]) >= total

    def _slot(self, slot: int, total: int) -> tuple[str, mmap.mmap]:
        """Slot ``slot``'s file and mapping, made (again, larger) when it is missing or too small."""
        current = self.maps[slot]
        if current is not None and len(current[1]) >= total:
            return current
        size = max(total, 2 * len(current[1]) if current is not None else self._dropped.pop(slot, total))
        name = f"{self.states.prefix}-w{self.worker}.{os.getpid()}-s{slot}-g{next(self.generation)}"
        fd = create_file(shared_memory.SHM_DIR / name, os.O_RDWR)  # 0600 whatever the umask
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.maps[slot] = (name, mapping)  # an old, smaller mapping goes once nothing views it
        self._addresses[slot] = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
        return name, mapping


def _copy_into(buffer: mmap.mmap, offset: int, t: torch.Tensor, nbytes: int) -> None:
    """``t``'s bytes into ``buffer`` at ``offset``."""
    if nbytes:
        view = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
        view.copy_(t.contiguous().view(-1).view(torch.uint8))


class SlotPool:
    """The training process's side: maps each slot once, unlinks its name, and turns a
    :class:`SlotBatch` into tensors viewing the slot, freeing the slot when they are all gone."""

    def __init__(self, num_workers: int, prefetch_factor: int | None, context: BaseContext, pin_memory: bool) -> None:
        shared_memory.sweep_dead()  # what a SIGKILLed run left behind
        # In flight per worker (prefetch_factor), plus what the trainer holds: the batch in the step,
        # the one prefetched ahead, and one of slack; more than that is a consumer keeping batches.
        self.states = SlotStates(num_workers, (prefetch_factor or 2) + 3, context)
        self.pin_memory = pin_memory and torch.cuda.is_available()  # as the DataLoader: no GPU, no pinning
        self.maps: dict[tuple[int, int], tuple[str, mmap.mmap]] = {}
        self._finalizer = weakref.finalize(self, _unlink_prefix, self.states.prefix)

    def unpack(self, batch: Any) -> Any:
        """The batch of a :class:`SlotBatch` (anything else as it is)."""
        if not isinstance(batch, SlotBatch):
            return batch
        key = (batch.worker, batch.slot)
        mapped = self.maps.get(key)
        if mapped is None or mapped[0] != batch.name:
            path = shared_memory.SHM_DIR / batch.name
            fd = os.open(path, os.O_RDWR)
            try:
                mapping = mmap.mmap(fd, batch.size)
            finally:
                os.close(fd)
                path.unlink(missing_ok=True)  # mapped on both sides: the name is no longer needed
            mapped = self.maps[key] = (batch.name, mapping)
        base = np.frombuffer(mapped[1], dtype=np.uint8)  # one per batch: its finalizer frees the slot
        flags = self.states.flags
        flag = self.states.index(*key)
        weakref.finalize(base, flags.__setitem__, flag, 0)

        def tensor(leaf: Leaf) -> torch.Tensor:
            if not leaf.nbytes:
                return torch.empty(leaf.shape, dtype=leaf.dtype)
            twin = _NUMPY_TWINS.get(leaf.dtype)
            if twin is not None:  # the view holds ``base``, as torch.frombuffer's does
                out = torch.from_numpy(np.ndarray(leaf.shape, twin, base, leaf.offset))
            else:
                raw = torch.frombuffer(base, dtype=torch.uint8, count=leaf.nbytes, offset=leaf.offset)
                out = raw.view(leaf.dtype).view(leaf.shape)
            return out.pin_memory() if self.pin_memory else out

        return _map_leaves(batch.tree, tensor)

    def close(self) -> None:
        """Unlink what a worker made but this process never mapped (mapped slots have no name)."""
        self._finalizer()


def _unlink_prefix(prefix: str) -> None:
    for path in shared_memory.SHM_DIR.glob(f"{prefix}-*"):
        path.unlink(missing_ok=True)
