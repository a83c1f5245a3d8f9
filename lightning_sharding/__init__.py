"""lightning_sharding: exactly-once, two-level sharded data loading for PyTorch Lightning.

Ranks and DataLoader workers each take their own share of a topology-free epoch order; a ledger of
consumed samples travels in Lightning checkpoints, so training resumes mid-epoch, also on another
number of ranks or workers, with every sample seen exactly once per epoch.

Names are imported lazily: a spawned DataLoader worker unpickles only the light loader and reader
modules, without paying for importing Lightning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lightning_sharding._version import __version__

_EXPORTS = {
    "BatchContext": "core.world",
    "BatchTask": "core.plan",
    "CheckpointMismatchError": "core.ledger",
    "DispatchLoader": "strategies.dispatch",
    "DocumentReader": "tokens",
    "EpochOrder": "core.order",
    "EpochPlan": "core.plan",
    "EpochReport": "lightning.summary",
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
    "ReplicaMismatchError": "lightning.keeper",
    "SampleContext": "core.world",
    "SampleError": "strategies",
    "Source": "readers.sources",
    "Strategy": "strategies",
    "SqliteSource": "readers.sources",
    "Stream": "mixture",
    "ShardContext": "core.world",
    "ShardedDataModule": "lightning.datamodule",
    "ShardedData": "lightning.loop",
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
    from lightning_sharding.lightning.keeper import ReplicaMismatchError
    from lightning_sharding.lightning.loop import ShardedData
    from lightning_sharding.lightning.release import ReleaseProcessGroup
    from lightning_sharding.lightning.summary import EpochReport
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


# Modules that moved into folders in 0.2 (issue 33): their old paths still import, for one release,
# as the new module itself, with a DeprecationWarning naming the new path. (``lightning_sharding.mixture``
# is now the mixture package, which exports what the old module did.)
_MOVED = {
    "manifest": "core.manifest",
    "order": "core.order",
    "plan": "core.plan",
    "rangeset": "core.rangeset",
    "ledger": "core.ledger",
    "world": "core.world",
    "options": "strategies.options",
    "streams": "mixture.streams",
    "interleave": "mixture.interleave",
    "composition": "mixture.composition",
    "mixture_change": "mixture.change",
    "lookahead": "mixture.order",
    "datamodule": "lightning.datamodule",
    "callbacks": "lightning.callbacks",
    "keeper": "lightning.keeper",
    "accounting": "lightning.accounting",
    "progress_bar": "lightning.progress_bar",
    "summary": "lightning.summary",
    "release": "lightning.release",
    "restart": "lightning.datamodule",
    "audit": "lightning.audit",
    "dali": "lightning.dali",
    "_distributed": "distributed.collectives",
    "agreement": "distributed.agreement",
    "segments": "strategies._shared_memory",
    "processes": "strategies._helper_deaths",
    "dispatcher": "strategies._dispatch_process",
    "storage": "readers.storage",
    "sources": "readers.sources",
    "plots": "cli.plots",
    "datasets": "recipes.synthetic_files",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``lightning_sharding.<old>`` as the module it moved to, warning once per import."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        """A spec for a moved module's old path; ``None`` for every other name."""
        prefix, _, old = fullname.partition(".")
        if prefix != __name__ or old not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The new module itself, so classes and functions are the same objects under both paths."""
        new = f"{__name__}.{_MOVED[spec.name.partition('.')[2]]}"
        warnings.warn(
            f"{spec.name} moved to {new} in lightning_sharding 0.2; import it from there "
            "(the old path goes away in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module is already loaded."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
