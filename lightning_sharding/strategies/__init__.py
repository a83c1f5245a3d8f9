"""Strategies: how one rank reads its share of the epoch, looked up by name.

Built in: ``shard`` (each worker reads its own items), ``broadcast`` (each rank loads an item once
into shared memory; workers crop windows), ``dispatch`` (one process per rank reads a
non-replicable source and deals batches to the workers) and ``dali`` (an NVIDIA DALI pipeline per
rank). Register your own with :func:`register_strategy`; see :mod:`lightning_sharding.strategies.base`.
The built-in modules load when the registry is first asked, so a worker that unpickles one
strategy's dataset imports only that strategy.
"""

from lightning_sharding.strategies._delivery import Delivery, Provenance
from lightning_sharding.strategies._samples import SampleError
from lightning_sharding.strategies.base import Strategy, TrainLoader, get_strategy, register_strategy, strategy_names

__all__ = [
    "Delivery",
    "Provenance",
    "SampleError",
    "Strategy",
    "TrainLoader",
    "get_strategy",
    "register_strategy",
    "strategy_names",
]
