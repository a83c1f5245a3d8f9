"""lightning_sharding: exactly-once, two-level sharded data loading for PyTorch Lightning.

Ranks and DataLoader workers each take their own share of a topology-free epoch order; a ledger of
consumed samples travels in Lightning checkpoints, so training resumes mid-epoch, also on another
number of ranks or workers, with every sample seen exactly once per epoch.

Names are imported lazily: a spawned DataLoader worker unpickles only the light loader and reader
modules, without paying for importing Lightning.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from lightning_sharding import _deprecated
from lightning_sharding._version import __version__

_EXPORTS = {
    "BatchContext": "core.world",
    "CheckpointMismatchError": "core.ledger",
    "IndexedTokens": "tokens",
    "Item": "core.manifest",
    "JsonlReader": "readers",
    "MixtureController": "lightning.controller",
    "NpyReader": "readers",
    "NpyWindows": "readers",
    "Packing": "tokens",
    "ParquetReader": "readers",
    "ParquetTokens": "tokens",
    "Phase": "mixture",
    "Reader": "readers",
    "ReleaseProcessGroup": "lightning.release",
    "SampleContext": "core.world",
    "SampleError": "strategies",
    "ShardedData": "loading.loop",
    "ShardedDataModule": "lightning.datamodule",
    "ShardingCallback": "lightning.callbacks",
    "SqliteSource": "readers.sources",
    "Stream": "mixture",
    "SyntheticReader": "readers",
    "TarReader": "readers",
    "TokenFiles": "tokens",
    "log_stream_loss": "lightning.controller",
}

__all__ = [
    "BatchContext",
    "CheckpointMismatchError",
    "IndexedTokens",
    "Item",
    "JsonlReader",
    "MixtureController",
    "NpyReader",
    "NpyWindows",
    "Packing",
    "ParquetReader",
    "ParquetTokens",
    "Phase",
    "Reader",
    "ReleaseProcessGroup",
    "SampleContext",
    "SampleError",
    "ShardedData",
    "ShardedDataModule",
    "ShardingCallback",
    "SqliteSource",
    "Stream",
    "SyntheticReader",
    "TarReader",
    "TokenFiles",
    "__version__",
    "log_stream_loss",
]

if TYPE_CHECKING:
    from lightning_sharding.core.ledger import CheckpointMismatchError
    from lightning_sharding.core.manifest import Item
    from lightning_sharding.core.world import BatchContext, SampleContext
    from lightning_sharding.lightning.callbacks import ShardingCallback
    from lightning_sharding.lightning.controller import MixtureController, log_stream_loss
    from lightning_sharding.lightning.datamodule import ShardedDataModule
    from lightning_sharding.lightning.release import ReleaseProcessGroup
    from lightning_sharding.loading.loop import ShardedData
    from lightning_sharding.mixture import Phase, Stream
    from lightning_sharding.readers import (
        JsonlReader,
        NpyReader,
        NpyWindows,
        ParquetReader,
        Reader,
        SyntheticReader,
        TarReader,
    )
    from lightning_sharding.readers.sources import SqliteSource
    from lightning_sharding.strategies import SampleError
    from lightning_sharding.tokens import IndexedTokens, Packing, ParquetTokens, TokenFiles


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a name the root exported before: warned once, or an AttributeError
        # Not cached in the root's namespace, so that a tool probing for import paths never finds it there.
        return _deprecated.root_name(name, sys._getframe(1).f_globals.get("__name__", ""))
    value = getattr(importlib.import_module(f"lightning_sharding.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


# Old module paths still import, for one release, with a DeprecationWarning naming the new path.
_deprecated.install()
