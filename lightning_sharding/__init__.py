"""lightning_sharding: exactly-once, two-level sharded data loading for PyTorch Lightning.

Ranks and DataLoader workers each take their own share of a topology-free epoch order; a ledger of
consumed samples travels in Lightning checkpoints, so training resumes mid-epoch, also on another
number of ranks or workers, with every sample seen exactly once per epoch.

Names are imported lazily: a spawned DataLoader worker unpickles only the light loader and reader
modules, without paying for importing Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_sharding import _deprecated
from lightning_sharding._version import __version__

_EXPORTS = {
    "BatchContext": "core.world",
    "BatchTask": "core.plan",
    "CheckpointMismatchError": "core.ledger",
    "DispatchLoader": "strategies.dispatch",
    "DocumentReader": "tokens",
    "EpochOrder": "core.order",
    "EpochPlan": "core.plan",
    "EpochReport": "loading.summary",
    "FileReader": "readers",
    "IndexedTokens": "tokens",
    "Item": "core.manifest",
    "JsonlReader": "readers",
    "Ledger": "core.ledger",
    "LoaderOptions": "strategies.options",
    "Manifest": "core.manifest",
    "NpyReader": "readers",
    "NpyWindows": "readers",
    "Order": "core.order",
    "PackedReader": "tokens",
    "Phase": "mixture",
    "Packing": "tokens",
    "ParquetReader": "readers",
    "ParquetTokens": "tokens",
    "plan_epoch": "core.plan",
    "register_strategy": "strategies",
    "RangeSet": "core.rangeset",
    "RankPlan": "core.plan",
    "Reader": "readers",
    "ReleaseProcessGroup": "lightning.release",
    "ReplicaMismatchError": "loading.keeper",
    "SampleContext": "core.world",
    "SampleError": "strategies",
    "Source": "readers.sources",
    "Strategy": "strategies",
    "SqliteSource": "readers.sources",
    "Stream": "mixture",
    "ShardContext": "core.world",
    "ShardedDataModule": "lightning.datamodule",
    "ShardedData": "loading.loop",
    "ShardedLoader": "strategies.shard",
    "ShardingCallback": "lightning.callbacks",
    "MixtureController": "lightning.controller",
    "ExcessLossWeights": "lightning.controller",
    "StreamStats": "lightning.controller",
    "log_stream_loss": "lightning.controller",
    "SyntheticReader": "readers",
    "TarReader": "readers",
    "TokenFiles": "tokens",
    "WindowedReader": "readers",
    "World": "core.world",
}

__all__ = [
    "__version__",
    "BatchContext",
    "BatchTask",
    "CheckpointMismatchError",
    "DispatchLoader",
    "DocumentReader",
    "EpochOrder",
    "EpochPlan",
    "EpochReport",
    "FileReader",
    "IndexedTokens",
    "Item",
    "JsonlReader",
    "Ledger",
    "LoaderOptions",
    "Manifest",
    "NpyReader",
    "NpyWindows",
    "Order",
    "PackedReader",
    "Packing",
    "ParquetReader",
    "Phase",
    "ParquetTokens",
    "plan_epoch",
    "register_strategy",
    "RangeSet",
    "RankPlan",
    "Reader",
    "ReleaseProcessGroup",
    "ReplicaMismatchError",
    "SampleContext",
    "SampleError",
    "Source",
    "Strategy",
    "SqliteSource",
    "Stream",
    "ShardContext",
    "ShardedData",
    "ShardedDataModule",
    "ShardedLoader",
    "ShardingCallback",
    "MixtureController",
    "ExcessLossWeights",
    "StreamStats",
    "log_stream_loss",
    "SyntheticReader",
    "TarReader",
    "TokenFiles",
    "WindowedReader",
    "World",
]

if TYPE_CHECKING:
    from lightning_sharding.core.ledger import CheckpointMismatchError, Ledger
    from lightning_sharding.core.manifest import Item, Manifest
    from lightning_sharding.core.order import EpochOrder, Order
    from lightning_sharding.core.plan import BatchTask, EpochPlan, RankPlan, plan_epoch
    from lightning_sharding.core.rangeset import RangeSet
    from lightning_sharding.core.world import BatchContext, SampleContext, ShardContext, World
    from lightning_sharding.lightning.callbacks import ShardingCallback
    from lightning_sharding.lightning.controller import (
        ExcessLossWeights,
        MixtureController,
        StreamStats,
        log_stream_loss,
    )
    from lightning_sharding.lightning.datamodule import ShardedDataModule
    from lightning_sharding.lightning.release import ReleaseProcessGroup
    from lightning_sharding.loading.keeper import ReplicaMismatchError
    from lightning_sharding.loading.loop import ShardedData
    from lightning_sharding.loading.summary import EpochReport
    from lightning_sharding.mixture import Phase, Stream
    from lightning_sharding.readers import (
        FileReader,
        JsonlReader,
        NpyReader,
        NpyWindows,
        ParquetReader,
        Reader,
        SyntheticReader,
        TarReader,
        WindowedReader,
    )
    from lightning_sharding.readers.sources import Source, SqliteSource
    from lightning_sharding.strategies import SampleError, Strategy, register_strategy
    from lightning_sharding.strategies.dispatch import DispatchLoader
    from lightning_sharding.strategies.options import LoaderOptions
    from lightning_sharding.strategies.shard import ShardedLoader
    from lightning_sharding.tokens import (
        DocumentReader,
        IndexedTokens,
        PackedReader,
        Packing,
        ParquetTokens,
        TokenFiles,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_sharding' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_sharding.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


# Old module paths still import, for one release, with a DeprecationWarning naming the new path.
_deprecated.install()
