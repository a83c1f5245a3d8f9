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

from lightning_sharding._version import __version__

_EXPORTS = {
    "BatchContext": "world",
    "BatchTask": "plan",
    "CheckpointMismatchError": "ledger",
    "DispatchLoader": "strategies.dispatch",
    "EpochOrder": "order",
    "EpochPlan": "plan",
    "EpochReport": "summary",
    "FileReader": "readers",
    "Item": "manifest",
    "JsonlReader": "readers",
    "Ledger": "ledger",
    "LoaderOptions": "options",
    "Manifest": "manifest",
    "NpyReader": "readers",
    "NpyWindows": "readers",
    "ParquetReader": "readers",
    "plan_epoch": "plan",
    "register_strategy": "strategies",
    "RangeSet": "rangeset",
    "RankPlan": "plan",
    "Reader": "readers",
    "ReleaseProcessGroup": "release",
    "ReplicaMismatchError": "keeper",
    "SampleContext": "world",
    "SampleError": "strategies",
    "Source": "sources",
    "Strategy": "strategies",
    "SqliteSource": "sources",
    "Stream": "streams",
    "ShardContext": "world",
    "ShardedDataModule": "datamodule",
    "ShardedLoader": "strategies.shard",
    "ShardingCallback": "callbacks",
    "SyntheticReader": "readers",
    "TarReader": "readers",
    "WindowedReader": "readers",
    "World": "world",
}

__all__ = [
    "__version__",
    "BatchContext",
    "BatchTask",
    "CheckpointMismatchError",
    "DispatchLoader",
    "EpochOrder",
    "EpochPlan",
    "EpochReport",
    "FileReader",
    "Item",
    "JsonlReader",
    "Ledger",
    "LoaderOptions",
    "Manifest",
    "NpyReader",
    "NpyWindows",
    "ParquetReader",
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
    "ShardedDataModule",
    "ShardedLoader",
    "ShardingCallback",
    "SyntheticReader",
    "TarReader",
    "WindowedReader",
    "World",
]

if TYPE_CHECKING:
    from lightning_sharding.callbacks import ShardingCallback
    from lightning_sharding.datamodule import ShardedDataModule
    from lightning_sharding.keeper import ReplicaMismatchError
    from lightning_sharding.ledger import CheckpointMismatchError, Ledger
    from lightning_sharding.manifest import Item, Manifest
    from lightning_sharding.options import LoaderOptions
    from lightning_sharding.order import EpochOrder
    from lightning_sharding.plan import BatchTask, EpochPlan, RankPlan, plan_epoch
    from lightning_sharding.rangeset import RangeSet
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
    from lightning_sharding.release import ReleaseProcessGroup
    from lightning_sharding.sources import Source, SqliteSource
    from lightning_sharding.strategies import SampleError, Strategy, register_strategy
    from lightning_sharding.strategies.dispatch import DispatchLoader
    from lightning_sharding.strategies.shard import ShardedLoader
    from lightning_sharding.streams import Stream
    from lightning_sharding.summary import EpochReport
    from lightning_sharding.world import BatchContext, SampleContext, ShardContext, World


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_sharding' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_sharding.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
