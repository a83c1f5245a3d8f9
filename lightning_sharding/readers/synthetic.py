"""A built-in synthetic data set: a noisy linear regression whose every sample knows its id.

It needs no files, so the main job and the tests run on a fresh machine. Sample ``id`` is the
sample's manifest-order identity, which lets tests check that each sample is seen exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.readers.base import Columns, Reader


def regression_arrays(ids: npt.NDArray[np.int64], dim: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """The regression pair of samples ``ids`` (shape ``(n,)``): ``x`` of shape ``(n, dim)``, ``y`` of ``(n,)``."""
    phase = ids[:, None].astype(np.float64) * 0.618 + np.arange(dim)[None, :]
    x = np.sin(phase).astype(np.float32)
    weights = np.linspace(-1.0, 1.0, dim, dtype=np.float32)
    y = (x @ weights + 0.01 * np.cos(ids * 1.7)).astype(np.float32)
    return x, y


class SyntheticReader(Reader):
    """``num_items`` items of ``samples_per_item`` samples, each ``{"id", "x", "y"}``.

    ``x`` is a float32 vector of shape ``(dim,)`` and ``y`` a float32 scalar; both are pure
    functions of ``id``. ``sizes`` (one count per item) overrides the uniform size.
    """

    def __init__(
        self, num_items: int = 8, samples_per_item: int = 128, dim: int = 8, sizes: Sequence[int] | None = None
    ) -> None:
        if sizes is None:
            if num_items < 1 or samples_per_item < 0:
                raise ValueError(
                    f"SyntheticReader(num_items={num_items}, samples_per_item={samples_per_item}): "
                    "need at least one item and a non-negative size"
                )
            sizes = [samples_per_item] * num_items
        if dim < 1:
            raise ValueError(f"SyntheticReader(dim={dim}) must be positive")
        self.sizes = [int(s) for s in sizes]
        self.dim = dim
        self._first_id = np.concatenate(([0], np.cumsum(self.sizes))).astype(np.int64)

    def items(self) -> Sequence[Item]:
        """One item per size, named ``synthetic-NNNNN``."""
        return [Item(f"synthetic-{i:05d}", n, fingerprint=f"dim={self.dim}") for i, n in enumerate(self.sizes)]

    def _item_number(self, item: Item) -> int:
        return int(item.key.rsplit("-", 1)[1])

    def read(self, item: Item, index: int, ctx: WorkerContext) -> Any:
        """One sample, through :meth:`read_batch`."""
        return self.read_batch(item, np.array([index], dtype=np.int64), ctx)[0]

    def read_columns(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> Columns:
        """Samples ``indices`` (shape ``(n,)``) of ``item`` as columns ``id``, ``x`` and ``y``."""
        ids, x, y = self._arrays(item, indices)
        return {"id": ids, "x": x, "y": y}

    def _arrays(self, item: Item, indices: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], Any, Any]:
        if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= item.num_samples):
            bad = int(indices.min()) if int(indices.min()) < 0 else int(indices.max())
            raise IndexError(f"{item.key}: sample index {bad} is outside [0, {item.num_samples})")
        ids = (self._first_id[self._item_number(item)] + indices).astype(np.int64)
        x, y = regression_arrays(ids, self.dim)
        return ids, x, y

    def read_batch(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> list[Any]:
        """Samples ``indices`` (shape ``(n,)``) of ``item``, computed in one vectorised pass."""
        ids, x, y = self._arrays(item, indices)
        return [
            {"id": torch.tensor(i), "x": torch.from_numpy(xi), "y": torch.tensor(yi)}
            for i, xi, yi in zip(ids.tolist(), x, y, strict=True)
        ]
