"""lightning_sharding: exactly-once, two-level sharded data loading for PyTorch Lightning.

Ranks and DataLoader workers each take their own share of a topology-free epoch order; a ledger of
consumed samples travels in Lightning checkpoints, so training resumes mid-epoch, also on another
number of ranks or workers, with every sample seen exactly once per epoch.
"""

from lightning_sharding._version import __version__
from lightning_sharding.callbacks import EpochReport, ShardingCallback
from lightning_sharding.datamodule import ShardedDataModule
from lightning_sharding.ledger import CheckpointMismatchError, Ledger
from lightning_sharding.manifest import Item, Manifest
from lightning_sharding.order import EpochOrder
from lightning_sharding.plan import BatchTask, EpochPlan, RankPlan, plan_epoch
from lightning_sharding.rangeset import RangeSet
from lightning_sharding.readers import Reader, SyntheticReader
from lightning_sharding.world import SampleContext, ShardContext, World

__all__ = [
    "BatchTask",
    "CheckpointMismatchError",
    "EpochOrder",
    "EpochPlan",
    "EpochReport",
    "Item",
    "Ledger",
    "Manifest",
    "RangeSet",
    "RankPlan",
    "Reader",
    "SampleContext",
    "ShardContext",
    "ShardedDataModule",
    "ShardingCallback",
    "SyntheticReader",
    "World",
    "__version__",
    "plan_epoch",
]
