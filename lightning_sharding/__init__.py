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
    "BatchTask": "plan",
    "CheckpointMismatchError": "ledger",
    "DispatchLoader": "dispatch",
    "EpochOrder": "order",
    "EpochPlan": "plan",
    "EpochReport": "callbacks",
    "Item": "manifest",
    "Ledger": "ledger",
    "Manifest": "manifest",
    "RangeSet": "rangeset",
    "RankPlan": "plan",
    "ReleaseProcessGroup": "callbacks",
    "Reader": "readers",
    "SampleContext": "world",
    "Source": "sources",
    "SqliteSource": "sources",
    "ShardedLoader": "loader",
    "ShardContext": "world",
    "ShardedDataModule": "datamodule",
    "ShardingCallback": "callbacks",
    "SyntheticReader": "readers",
    "World": "world",
    "plan_epoch": "plan",
}

__all__ = [
    "BatchTask",
    "CheckpointMismatchError",
    "DispatchLoader",
    "EpochOrder",
    "EpochPlan",
    "EpochReport",
    "Item",
    "Ledger",
    "Manifest",
    "RangeSet",
    "RankPlan",
    "ReleaseProcessGroup",
    "Reader",
    "SampleContext",
    "ShardedLoader",
    "Source",
    "SqliteSource",
    "ShardContext",
    "ShardedDataModule",
    "ShardingCallback",
    "SyntheticReader",
    "World",
    "__version__",
    "plan_epoch",
]

if TYPE_CHECKING:
    from lightning_sharding.callbacks import EpochReport, ReleaseProcessGroup, ShardingCallback
    from lightning_sharding.datamodule import ShardedDataModule
    from lightning_sharding.dispatch import DispatchLoader
    from lightning_sharding.ledger import CheckpointMismatchError, Ledger
    from lightning_sharding.loader import ShardedLoader
    from lightning_sharding.manifest import Item, Manifest
    from lightning_sharding.order import EpochOrder
    from lightning_sharding.plan import BatchTask, EpochPlan, RankPlan, plan_epoch
    from lightning_sharding.rangeset import RangeSet
    from lightning_sharding.readers import Reader, SyntheticReader
    from lightning_sharding.sources import Source, SqliteSource
    from lightning_sharding.world import SampleContext, ShardContext, World


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_sharding' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_sharding.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
