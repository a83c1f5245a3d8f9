"""DALI's merged layout (pure integers) and the fields of a sample; DALI itself is imported lazily.

DALI runs every *iterable* parallel external source in one dedicated worker, assigned round-robin
(``WorkerPool.assign_dedicated_workers`` in ``nvidia/dali/_multiproc/pool.py``). With as many
iterable sources as ``py_num_workers``, source ``w`` therefore owns one worker process: it yields
the plan's positions for (rank, ``w``) in order, so that worker reads its own run of shards
sequentially. Each source fills only its own slots of every batch and leaves the other slots as
empty arrays; ``fn.cat`` of all sources along axis 0 then merges the mini-batches into one batch
with no padding copies. The epoch positions come out as an extra output, for the ledger.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.plan import RankPlan

Int64Array = npt.NDArray[np.int64]


def require_dali(module: str = "nvidia.dali") -> Any:
    """Import a module of NVIDIA DALI (untyped, as DALI is), or raise an ImportError that names the
    extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            "lightning_sharding.lightning.dali needs NVIDIA DALI, which is not installed: "
            "`pip install 'lightning-sharding[dali]'` (it installs nvidia-dali-cuda120)"
        ) from err


@dataclass(frozen=True)
class MergedLayout:
    """How ``num_sources`` pinned sources fill the merged batches of one rank's epoch.

    The rank's sequence is its served positions followed by its padding (``RankPlan``). Batch
    sizes are the plan's; batch ``s`` takes ``parts[s, w]`` samples from source ``w`` (int64, shape
    ``(num_batches, num_sources)``, near-equal shares), placed after those of sources ``< w``.
    Source ``w`` reads a contiguous run of the sequence, starting at ``starts[w]``.
    """

    rank_plan: RankPlan
    parts: Int64Array

    @property
    def sizes(self) -> Int64Array:
        """Samples per merged batch, shape ``(num_batches,)``."""
        return np.asarray(self.parts.sum(axis=1), dtype=np.int64)

    @property
    def offsets(self) -> Int64Array:
        """Where source ``w``'s samples start inside batch ``s``, shape ``(num_batches, num_sources)``."""
        return np.asarray(np.cumsum(self.parts, axis=1) - self.parts, dtype=np.int64)

    @property
    def starts(self) -> Int64Array:
        """Where each source's run starts in the rank's sequence, shape ``(num_sources,)``."""
        lengths = self.parts.sum(axis=0)
        return np.asarray(np.cumsum(lengths) - lengths, dtype=np.int64)

    def run(self, source: int) -> tuple[Int64Array, int]:
        """Source ``source``'s positions in reading order (shape ``(n,)``) and how many of the last
        ones are padding."""
        plan = self.rank_plan
        lo = int(self.starts[source])
        hi = lo + int(self.parts[:, source].sum())
        served = plan.num_served
        real = plan.positions.select(min(lo, served), min(hi, served)).to_array()
        pad = hi - max(lo, served) if hi > served else 0
        return np.concatenate((real, np.full(pad, plan.pad_position, dtype=np.int64))), pad


def merge_layout(rank_plan: RankPlan, num_sources: int) -> MergedLayout:
    """The :class:`MergedLayout` of ``rank_plan`` for ``num_sources`` sources (at least one)."""
    if num_sources < 1:
        raise ValueError(f"merge_layout(num_sources={num_sources}) needs at least one source")
    sizes = np.array(
        [hi - lo for lo, hi in (rank_plan.bounds(i) for i in range(rank_plan.num_batches))], dtype=np.int64
    )
    if sizes.size:
        sizes[-1] += rank_plan.num_padding
    base, extra = np.divmod(sizes, num_sources)
    parts = base[:, None] + (np.arange(num_sources)[None, :] < extra[:, None])
    return MergedLayout(rank_plan, parts.astype(np.int64).reshape(len(sizes), num_sources))


# -- the fields of a sample --------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One array of a sample: its name in the batch, NumPy dtype and number of dimensions."""

    name: str
    dtype: str
    ndim: int


def sample_arrays(sample: Any) -> list[tuple[str, npt.NDArray[Any]]]:
    """A sample as named arrays: a dict by key, a tuple or list by index, anything else as ``data``."""
    if isinstance(sample, Mapping):
        pairs = [(str(k), v) for k, v in sample.items()]
    elif isinstance(sample, (tuple, list)):
        pairs = [(str(i), v) for i, v in enumerate(sample)]
    else:
        pairs = [("data", sample)]
    return [(name, np.asarray(value)) for name, value in pairs]


def fields_of(sample: Any, where: str) -> tuple[Field, ...]:
    """The fields of ``sample`` (read at ``where``); DALI carries only numeric and boolean arrays."""
    fields = []
    for name, array in sample_arrays(sample):
        if array.dtype.kind not in "biuf":
            raise TypeError(
                f"{where}: field {name!r} has dtype {array.dtype}, which DALI cannot carry. Return numeric "
                "arrays from the reader (for bytes, `np.frombuffer(data, dtype=np.uint8)`)."
            )
        fields.append(Field(name, array.dtype.str, array.ndim))
    return tuple(fields)
