"""The sources of a DALI pipeline: one :class:`ShardedSource` per Python worker, merged by ``fn.cat``.

These classes are pickled into DALI's worker processes, so this module imports no Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.plan import BatchTask, EvenBatches, plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import World
from lightning_sharding.strategies._batches import PlannedBatches
from lightning_sharding.strategies._dali_layout import (
    Field,
    Int64Array,
    MergedLayout,
    merge_layout,
    require_dali,
    sample_arrays,
)


@dataclass(frozen=True)
class SourcePlan:
    """What a source needs to plan its epochs by itself: the first epoch continues ``consumed``,
    every later one starts afresh (as the ledger does), so a pipeline serves consecutive epochs."""

    total: int
    epoch: int
    consumed: RangeSet
    world: World
    num_sources: int
    batch_size: int
    even_batches: EvenBatches

    def layout(self, epochs_done: int) -> tuple[int, MergedLayout]:
        """The epoch and layout of this pipeline's ``epochs_done``-th epoch."""
        epoch = self.epoch + epochs_done
        plan = plan_epoch(
            self.total,
            self.consumed if epochs_done == 0 else RangeSet(),
            epoch=epoch,
            world_size=self.world.data_size,
            num_workers=self.num_sources,
            batch_size=self.batch_size,
            even_batches=self.even_batches,
        )
        return epoch, merge_layout(plan.rank(self.world.data_rank), self.num_sources)


class ShardedSource:
    """The iterable external source of source ``source``: each ``iter()`` is one epoch.

    Every step yields one batch per output: for each field its flattened samples (and, for 2+
    dimensions, their shapes), then provenance rows ``(epoch, position, is_padding, source)``.
    Slots of the merged batch that other sources fill get empty arrays, which ``fn.cat`` skips.
    """

    def __init__(self, batches: PlannedBatches, source: int, plan: SourcePlan, fields: tuple[Field, ...]) -> None:
        self.batches = batches
        self.source = source
        self.plan = plan
        self.fields = fields
        self._epochs = 0

    def __iter__(self) -> Iterator[tuple[list[npt.NDArray[Any]], ...]]:
        # One iter() per epoch: DALI calls it when the worker starts and again after each reset
        # that follows the end of the data (cycle="raise"). It also calls it once in the training
        # process when the source is defined, before pickling it into the worker; so the epoch
        # advances only when an iterator is actually started, never on iter() alone.
        epoch, layout = self.plan.layout(self._epochs)
        self._epochs += 1
        positions, num_padding = layout.run(self.source)
        first_padding = len(positions) - num_padding
        cursor = 0
        for step, size in enumerate(layout.sizes.tolist()):
            count, offset = int(layout.parts[step, self.source]), int(layout.offsets[step, self.source])
            mine = positions[cursor : cursor + count]
            padding = max(0, cursor + count - max(cursor, first_padding))
            cursor += count
            samples: list[Any] = []
            if count:
                samples = self.batches[BatchTask(epoch, step, self.source, mine, padding)].batch
            yield self._outputs(epoch, size, offset, mine, count - padding, samples)

    def _outputs(
        self, epoch: int, size: int, offset: int, positions: Int64Array, num_real: int, samples: list[Any]
    ) -> tuple[list[npt.NDArray[Any]], ...]:
        outputs: list[list[npt.NDArray[Any]]] = []
        empty = [np.empty(0, dtype=np.dtype(f.dtype)) for f in self.fields]
        arrays = [self._checked(s, int(p)) for s, p in zip(samples, positions, strict=True)]
        for i, field in enumerate(self.fields):
            flat = [empty[i]] * size
            flat[offset : offset + len(arrays)] = [np.ascontiguousarray(a[i]).reshape(-1) for a in arrays]
            outputs.append(flat)
            if field.ndim >= 2:
                shapes = [np.empty(0, dtype=np.int32)] * size
                shapes[offset : offset + len(arrays)] = [np.array(a[i].shape, dtype=np.int32) for a in arrays]
                outputs.append(shapes)
        rows = [np.empty(0, dtype=np.int64)] * size
        flags = np.arange(len(positions)) >= num_real
        rows[offset : offset + len(positions)] = [
            np.array([epoch, p, f, self.source], dtype=np.int64) for p, f in zip(positions, flags, strict=True)
        ]
        outputs.append(rows)
        return tuple(outputs)

    def _checked(self, sample: Any, position: int) -> list[npt.NDArray[Any]]:
        arrays = sample_arrays(sample)
        got = tuple((name, a.dtype.str, a.ndim) for name, a in arrays)
        want = tuple((f.name, f.dtype, f.ndim) for f in self.fields)
        if got != want:
            raise ValueError(
                f"the sample at epoch position {position} has fields (name, dtype, ndim) {got}, but the "
                f"first sample had {want}. DALI needs every sample of a field to share its dtype and number "
                "of dimensions: make the reader (or transform) return the same structure for every sample."
            )
        return [a for _, a in arrays]


def sharded_sources(sources: Sequence[ShardedSource], *, parallel: bool) -> tuple[dict[str, Any], Any]:
    """Inside a pipeline definition: one external source per :class:`ShardedSource`, merged.

    Returns ``(fields, provenance)``: a DataNode per field (named as in :func:`sample_arrays`) and the
    provenance DataNode (int64, shape ``(4,)`` per sample).
    """
    fn = require_dali("nvidia.dali.fn")
    types = require_dali("nvidia.dali.types")

    slots = _expand(sources[0].fields)
    dtypes = [types.INT32 if f is None else types.to_dali_type(np.dtype(f.dtype)) for f in slots] + [types.INT64]
    nodes = [
        fn.external_source(
            source=s,
            num_outputs=len(dtypes),
            parallel=parallel,
            batch=True,
            cycle="raise",
            dtype=dtypes,
            ndim=[1] * len(dtypes),
        )
        for s in sources
    ]
    merged = [fn.cat(*(n[i] for n in nodes), axis=0) for i in range(len(dtypes))]
    out: dict[str, Any] = {}
    for i, f in enumerate(slots):
        if f is None:
            continue
        if f.ndim == 0:
            out[f.name] = fn.reshape(merged[i], shape=[])
        elif f.ndim == 1:
            out[f.name] = merged[i]
        else:  # the next slot holds the shapes
            out[f.name] = fn.reshape(merged[i], shape=merged[i + 1])
    return out, merged[-1]


def _expand(fields: tuple[Field, ...]) -> list[Field | None]:
    """Output slots of a source: each field, followed by ``None`` for its shapes when 2+-d."""
    return [x for f in fields for x in ((f, None) if f.ndim >= 2 else (f,))]
