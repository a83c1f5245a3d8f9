"""The reader interface: list the items once in the main process, read samples inside workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.manifest import Item, Manifest
from lightning_sharding.world import ShardContext


class Reader(ABC):
    """How a data set becomes items and samples.

    ``items()`` runs once, in the main process, to build the manifest. ``read`` (or the faster
    ``read_batch``) runs inside DataLoader workers; the reader is pickled into them, so keep it
    small: paths and options, not open files.
    """

    @abstractmethod
    def items(self) -> Sequence[Item]:
        """Every item with its sample count, in a stable order."""

    def manifest(self) -> Manifest:
        """The manifest of ``items()`` (a reader of several streams adds their mixture)."""
        return Manifest.from_items(self.items())

    @abstractmethod
    def read(self, item: Item, index: int, ctx: ShardContext) -> Any:
        """Sample ``index`` (``0 <= index < item.num_samples``) of ``item``."""

    def read_batch(self, item: Item, indices: npt.NDArray[np.int64], ctx: ShardContext) -> list[Any]:
        """Samples ``indices`` (shape ``(n,)``) of one item, in that order.

        Override it when the storage reads many samples faster at once (a memory map, a row group).
        """
        return [self.read(item, int(i), ctx) for i in indices]
