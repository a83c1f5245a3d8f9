"""Windowed time series: items are time-major arrays (months), samples are windows of T steps.

Without a halo, item ``k`` of ``n_k`` steps holds ``(n_k - T) // S + 1`` windows and no window
crosses an item boundary. With ``halo=True`` the items are read as one continuous series in
manifest order: windows start at every multiple of ``S`` of that series, and a window starting in
item ``k`` may run into the next items, so no window is lost at a boundary.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.identity import common_root
from lightning_sharding.core.manifest import Item
from lightning_sharding.core.spelling import option
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.readers.base import Reader
from lightning_sharding.readers.storage import local_content_digest

Int64Array = npt.NDArray[np.int64]
# (key, start, stop): steps [start, stop) of item `key`.
Piece = tuple[str, int, int]


class WindowedReader(Reader):
    """Items are time-major arrays of shape ``(steps, *shape)``; a sample is a window ``(T, *shape)``.

    Subclasses say what the items are and how to read a run of steps:
    :meth:`keys`, :meth:`length` and :meth:`load`; :meth:`signature` defaults to loading one step.
    :meth:`make_batch` turns a stack of windows into the batch the model gets.

    Args:
        window: steps per window, ``T``.
        stride: steps between the starts of consecutive windows, ``S``.
        halo: let windows run into the next item (manifest order = time order).
    """

    def __init__(self, window: int, stride: int = 1, halo: bool = False) -> None:
        name = type(self).__name__
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"`{name}(window={window!r})` must be a positive number of steps")
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"`{name}(stride={stride!r})` must be a positive number of steps")
        self.window = window
        self.stride = stride
        self.halo = bool(halo)
        self._lengths: Int64Array | None = None
        self._keys: tuple[str, ...] = ()

    # -- what a subclass provides ------------------------------------------------------------------

    @abstractmethod
    def keys(self) -> Sequence[str]:
        """The items, in time order (e.g. one path per month)."""

    @abstractmethod
    def length(self, key: str) -> int:
        """Number of time steps of item ``key``."""

    @abstractmethod
    def load(self, key: str, start: int, stop: int) -> npt.NDArray[Any]:
        """Steps ``[start, stop)`` of item ``key``: an array of shape ``(stop - start, *shape)``."""

    def signature(self, key: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
        """The per-step shape and the dtype of item ``key`` (every item must agree with the first)."""
        first = np.asarray(self.load(key, 0, 1))
        return tuple(first.shape[1:]), first.dtype

    def make_batch(self, windows: npt.NDArray[Any], ids: Int64Array, starts: Int64Array) -> Any:
        """The batch of ``windows`` (shape ``(B, T, *shape)``); ``ids`` (``(B,)``) number windows in
        manifest order, ``starts`` (``(B,)``) are their first steps in the continuous series.

        The default is ``{"x": windows, "id": ids, "start": starts}`` as tensors; override it to
        split inputs from targets.
        """
        import torch

        return {"x": torch.from_numpy(windows), "id": torch.from_numpy(ids), "start": torch.from_numpy(starts)}

    # -- items and windows -------------------------------------------------------------------------

    def items(self) -> Sequence[Item]:
        """One item per key, with its window count; checks lengths, shapes and dtypes first."""
        keys = tuple(self.keys())
        if not keys:
            raise ValueError(f"{type(self).__name__} found no items: check its paths")
        lengths = np.array([int(self.length(k)) for k in keys], dtype=np.int64)
        self._check_items(keys, lengths)
        self._keys, self._lengths = keys, lengths
        counts = self.window_counts()
        tag = f"T={self.window},S={self.stride},halo={int(self.halo)}"
        names = self.names(keys)
        items = []
        for key, name, n in zip(keys, names, counts.tolist(), strict=True):
            content = self.content(key) if name else ""
            items.append(
                Item(key, int(n), f"{tag},{self.fingerprint(key)}", name, f"{content};{tag}" if content else "")
            )
        return items

    def fingerprint(self, key: str) -> str:
        """Anything that changes when item ``key`` changes; the default is its length."""
        return f"steps={self.length(key)}"

    def names(self, keys: Sequence[str]) -> Sequence[str]:
        """What each item is called wherever the data lives (its key relative to the data set's
        root), so a checkpoint resumes on a copy elsewhere; ``""`` each (the default): items are known
        by key and :meth:`fingerprint`. A reader that names its items gives :meth:`content` too."""
        return [""] * len(keys)

    def content(self, key: str) -> str:
        """An id of item ``key``'s bytes, ``size=N;...``, that a copy or a touch does not change
        (asked only of items :meth:`names` names)."""
        return ""

    def _check_items(self, keys: tuple[str, ...], lengths: Int64Array) -> None:
        shape, dtype = self.signature(keys[0])
        for key, n in zip(keys, lengths.tolist(), strict=True):
            if not self.halo and n < self.window:
                raise ValueError(
                    f"item {key!r} has {n} steps, fewer than the window of {self.window}: "
                    f"pass {option('halo', True)} to let windows run into the next item, or use a shorter window"
                )
            got_shape, got_dtype = self.signature(key)
            if got_shape != shape or got_dtype != dtype:
                raise ValueError(
                    f"item {key!r} holds steps of shape {got_shape} and dtype {got_dtype}, but the first item "
                    f"{keys[0]!r} holds {shape} and {dtype}: every item must have the same per-step shape and dtype"
                )
        if self.halo and int(lengths.sum()) < self.window:
            raise ValueError(
                f"the series has {int(lengths.sum())} steps in all (last item {keys[-1]!r}), "
                f"fewer than the window of {self.window}"
            )

    def _require_listing(self) -> Int64Array:
        if self._lengths is None:
            raise RuntimeError(f"{type(self).__name__}.items() must run before windows are located")
        return self._lengths

    def offsets(self) -> Int64Array:
        """First step of every item in the continuous series, shape ``(num_items + 1,)``."""
        return np.concatenate(([0], np.cumsum(self._require_listing()))).astype(np.int64)

    def window_counts(self) -> Int64Array:
        """Windows per item, shape ``(num_items,)``."""
        lengths = self._require_listing()
        t, s = self.window, self.stride
        if not self.halo:
            return ((lengths - t) // s + 1).astype(np.int64)
        # Window starts are the multiples of S in [0, L - T]; item k owns those in [off_k, off_k+1).
        off = self.offsets()
        last_start = int(off[-1]) - t
        ends = np.minimum(off[1:], last_start + 1)
        first = -(-off[:-1] // s)  # ceil(off_k / S): the number of starts before item k
        return np.maximum(-(-ends // s) - first, 0).astype(np.int64)

    def bases(self) -> Int64Array:
        """First window start inside every item, shape ``(num_items,)`` (0 without a halo)."""
        if not self.halo:
            return np.zeros(len(self._require_listing()), dtype=np.int64)
        off = self.offsets()[:-1]
        return ((-off) % self.stride).astype(np.int64)

    def first_ids(self) -> Int64Array:
        """Manifest-order id of every item's first window, shape ``(num_items,)``."""
        return np.concatenate(([0], np.cumsum(self.window_counts())[:-1])).astype(np.int64)

    def pieces_with_halo(self, item: int) -> list[Piece]:
        """The steps the windows of item ``item`` need: the item, then (with a halo) the next ``T - 1``
        steps (what strategy ``broadcast`` loads into one shared array)."""
        lengths = self._require_listing()
        pieces: list[Piece] = [(self._keys[item], 0, int(lengths[item]))]
        need = self.window - 1 if self.halo else 0
        nxt = item + 1
        while need > 0 and nxt < len(lengths):
            take = min(need, int(lengths[nxt]))
            pieces.append((self._keys[nxt], 0, take))
            need -= take
            nxt += 1
        return pieces

    # -- per-sample path (strategy "shard"): every worker reads its own windows -----------------------

    def read(self, item: Item, index: int, ctx: WorkerContext) -> Any:
        """Window ``index`` of ``item`` as a one-sample batch entry ``{"x", "id", "start"}``."""
        return self.read_batch(item, np.array([index], dtype=np.int64), ctx)[0]

    def read_batch(self, item: Item, indices: Int64Array, ctx: WorkerContext) -> list[Any]:
        """Windows ``indices`` of ``item``, each read from storage by this worker (no shared memory)."""
        k = self._keys.index(item.key)
        starts = self.bases()[k] + indices * self.stride
        ids = self.first_ids()[k] + indices
        global_starts = self.offsets()[k] + starts
        return [
            {"x": self._steps(k, int(s), int(s) + self.window), "id": int(i), "start": int(g)}
            for s, i, g in zip(starts, ids, global_starts, strict=True)
        ]

    def _steps(self, item: int, start: int, stop: int) -> npt.NDArray[Any]:
        """Steps ``[start, stop)`` counted from item ``item``'s first step, running into later items."""
        lengths = self._require_listing()
        parts = []
        while start < stop:
            n = int(lengths[item])
            if start < n:
                parts.append(np.asarray(self.load(self._keys[item], start, min(stop, n))))
            start, stop, item = max(0, start - n), stop - n, item + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class NpyWindows(WindowedReader):
    """One ``.npy`` file per item (e.g. per month), time-major, read through a memory map.

    ``paths`` are in time order (sort them: file names like ``2020-01.npy`` sort by time).
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], window: int, stride: int = 1, halo: bool = False):
        super().__init__(window, stride, halo)
        self.paths = [os.fspath(p) for p in paths]

    def keys(self) -> Sequence[str]:
        """The file paths."""
        return self.paths

    def _open(self, key: str) -> np.memmap[Any, Any]:
        try:
            arr = np.load(key, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise ValueError(f"item {key!r} is not a readable .npy array: {err}") from err
        if arr.ndim < 1:
            raise ValueError(f"item {key!r} is a 0-d array; items must be time-major arrays (steps, ...)")
        return arr  # type: ignore[no-any-return]

    def length(self, key: str) -> int:
        """Steps in the file (its first dimension), read from the header only."""
        return int(self._open(key).shape[0])

    def signature(self, key: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
        """Per-step shape and dtype, from the header only."""
        arr = self._open(key)
        return tuple(arr.shape[1:]), arr.dtype

    def fingerprint(self, key: str) -> str:
        """Size and modification time of the file (what 0.1 checkpoints knew a month by)."""
        st = os.stat(key)
        return f"size={st.st_size},mtime={st.st_mtime_ns}"

    def names(self, keys: Sequence[str]) -> Sequence[str]:
        """The paths relative to the directory they share (``2020-01.npy``, or ``era5/2020-01.npy``
        for months in several folders)."""
        root = common_root([os.path.abspath(k) for k in keys])
        return [os.path.abspath(k)[len(root) :] for k in keys]

    def content(self, key: str) -> str:
        """The file's size and a digest of its bytes (blocks of it for a large file), so a copy
        elsewhere or a touch resumes and a rewrite is named."""
        try:
            return local_content_digest(key)
        except OSError as err:
            raise ValueError(f"item {key!r} could not be read: {err}") from err

    def load(self, key: str, start: int, stop: int) -> npt.NDArray[Any]:
        """Steps ``[start, stop)``, copied out of the memory map (the map is dropped on return)."""
        return np.array(self._open(key)[start:stop])
