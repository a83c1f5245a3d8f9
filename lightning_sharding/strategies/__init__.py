"""Strategies: how one rank reads its share of the epoch, looked up by name.

Built in: ``shard`` (each worker reads its own items), ``broadcast`` (each rank loads an item once
into shared memory; workers crop windows), ``dispatch`` (one process per rank reads a
non-replicable source and deals batches to the workers) and ``dali`` (an NVIDIA DALI pipeline per
rank). The built-in modules load when the registry is first asked, so a worker that unpickles one
strategy's dataset imports only that strategy.

Your own strategy (the README's "Your own strategy" shows one): a :class:`Strategy` subclass,
registered with :func:`register_strategy`, builds a :class:`TrainLoader` per rank. The loader's
``sampler`` is an :class:`EpochSampler` (``epoch``, ``set_epoch``, and ``epoch_plan``, an
:class:`EpochOutline` such as :class:`~lightning_sharding.core.plan.EpochPlan`). Each batch is read
as a :class:`Delivery` (the batch, its epoch and its epoch positions, the last ``num_padding`` of
them padding) and handed to the loader's :class:`DeliveredLog`, whose ``accept`` returns the batch
for training (padding flagged) and keeps its :class:`Provenance` until the training step that used
it is accounted in the ledger.
"""

import importlib
from typing import TYPE_CHECKING, Any

from lightning_sharding.strategies._delivery import DeliveredLog, Delivery, Provenance
from lightning_sharding.strategies._samples import SampleError
from lightning_sharding.strategies.base import (
    EpochOutline,
    EpochSampler,
    Strategy,
    TrainLoader,
    get_strategy,
    register_strategy,
    strategy_names,
)

# The built-in strategies, by class, imported when first asked for (a worker imports only its own).
_BUILT_IN_CLASSES = {
    "ShardStrategy": "shard",
    "BroadcastStrategy": "broadcast",
    "DispatchStrategy": "dispatch",
    "DaliStrategy": "dali",
}

__all__ = [
    "BroadcastStrategy",
    "DaliStrategy",
    "DispatchStrategy",
    "ShardStrategy",
    "DeliveredLog",
    "Delivery",
    "EpochOutline",
    "EpochSampler",
    "Provenance",
    "SampleError",
    "Strategy",
    "TrainLoader",
    "get_strategy",
    "register_strategy",
    "strategy_names",
]


def __getattr__(name: str) -> Any:
    module = _BUILT_IN_CLASSES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


if TYPE_CHECKING:
    from lightning_sharding.strategies.broadcast import BroadcastStrategy
    from lightning_sharding.strategies.dali import DaliStrategy
    from lightning_sharding.strategies.dispatch import DispatchStrategy
    from lightning_sharding.strategies.shard import ShardStrategy
