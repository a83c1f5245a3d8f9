"""Who is reading: the distributed world of ranks and, inside a rank, the DataLoader worker.

``World`` is taken from the Lightning trainer at ``setup()``; the worker part comes from
``torch.utils.data.get_worker_info()`` inside the worker. Nothing here reads environment
variables: the trainer has already resolved them, whatever the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_sharding.order import derive_seed

# Distinct second words keep worker seeds and sample seeds apart for every (rank, worker, position).
_WORKER_SEEDS = 0x3017
_SAMPLE_SEEDS = 0x5A3C


@dataclass(frozen=True)
class World:
    """The distributed topology of one training process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"World(rank={self.rank}, world_size={self.world_size}) is not a valid topology")

    @classmethod
    def from_trainer(cls, trainer: Any) -> World:
        """The world as the Lightning trainer sees it (works for every launcher)."""
        return cls(
            rank=int(trainer.global_rank),
            world_size=int(trainer.world_size),
            local_rank=int(trainer.local_rank),
            node_rank=int(trainer.node_rank),
        )


@dataclass(frozen=True)
class ShardContext:
    """Read-only facts a reader or transform may use inside a DataLoader worker.

    ``worker_id`` is 0 and ``num_workers`` is 0 when loading runs in the main process.
    """

    rank: int
    world_size: int
    worker_id: int
    num_workers: int
    epoch: int
    seed: int

    @property
    def worker_seed(self) -> int:
        """The seed of this (epoch, rank, worker); the loader seeds torch, NumPy and ``random`` with it."""
        return derive_seed(self.seed, _WORKER_SEEDS, self.epoch, self.rank, self.worker_id)


@dataclass(frozen=True, slots=True)  # one per sample: slots make it cheap to build
class SampleContext:
    """What a per-sample transform gets: the shard context and the sample's identity.

    ``sample_seed`` depends only on ``(seed, epoch, position)``, so a sample's augmentation is
    bit-identical whatever rank or worker produced it, also after a resume on another topology.
    """

    shard: ShardContext
    position: int
    item: int
    index: int

    @property
    def sample_seed(self) -> int:
        """A seed for this sample's randomness."""
        return derive_seed(self.shard.seed, _SAMPLE_SEEDS, self.shard.epoch, self.position)
