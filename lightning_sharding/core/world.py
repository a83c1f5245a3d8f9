"""Who is reading: the distributed world of ranks and, inside a rank, the DataLoader worker.

``World`` is taken from the Lightning trainer at ``setup()``; the worker part comes from
``torch.utils.data.get_worker_info()`` inside the worker. Nothing here reads environment
variables: the trainer has already resolved them, whatever the launcher.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.order import derive_seed, derive_seeds

# Distinct second words keep worker seeds and sample seeds apart for every (rank, worker, position).
_WORKER_SEEDS = 0x3017
_SAMPLE_SEEDS = 0x5A3C
_BATCH_SEEDS = 0xBA7C


DataParallel = tuple[int, int]
"""``(data-parallel rank, data-parallel size)``: which model replica a rank belongs to, and how many there are."""


@dataclass(frozen=True)
class World:
    """The distributed topology of one training process.

    ``rank`` and ``world_size`` count every process; ``data_rank`` and ``data_size`` count model
    replicas (data-parallel ranks). They are equal under DDP and FSDP. Under tensor, context or
    pipeline parallelism several ranks make one replica: they share a ``data_rank`` and read the
    identical batch sequence, and only the replicas split the data. ``replica_rank`` is this rank's
    place among the ranks of its replica (0 writes the replica's audit trail); the DataModule sets
    it once every rank's ``data_rank`` is known.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0
    data_rank: int = -1  # -1: the same as ``rank``
    data_size: int = -1  # -1: the same as ``world_size``
    replica_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"World(rank={self.rank}, world_size={self.world_size}) is not a valid topology")
        if (self.data_rank == -1) != (self.data_size == -1):
            raise ValueError("World: give both data_rank and data_size, or neither")
        if self.data_size == -1:
            object.__setattr__(self, "data_rank", self.rank)
            object.__setattr__(self, "data_size", self.world_size)
        check_data_parallel(
            (self.data_rank, self.data_size),
            self.world_size,
            f"World(data_rank={self.data_rank}, data_size={self.data_size})",
        )
        if not 0 <= self.replica_rank < self.replica_size:
            raise ValueError(
                f"World(replica_rank={self.replica_rank}) is outside a replica of {self.replica_size} rank(s)"
            )

    @property
    def replica_size(self) -> int:
        """Ranks per model replica: the tensor x context x pipeline parallel size (1 under DDP)."""
        return self.world_size // self.data_size

    @classmethod
    def from_trainer(
        cls, trainer: Any, data_parallel: DataParallel | Callable[[Any], DataParallel] | None = None
    ) -> World:
        """The world as the Lightning trainer sees it (works for every launcher).

        The data-parallel view is ``data_parallel`` when given (a pair, or a function of the trainer
        returning one), else the ``num_replicas`` and ``rank`` of the strategy's
        ``distributed_sampler_kwargs`` (what Lightning gives its own ``DistributedSampler``; a
        ``ModelParallelStrategy`` names its data-parallel mesh dimension there), else every rank.
        """
        rank, world_size = int(trainer.global_rank), int(trainer.world_size)
        where = "the strategy's distributed_sampler_kwargs"
        if data_parallel is None:
            kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if world_size > 1 else None
            pair: Any = (kwargs["rank"], kwargs["num_replicas"]) if kwargs else (rank, world_size)
        elif callable(data_parallel):
            pair = data_parallel(trainer)
            name = getattr(data_parallel, "__name__", type(data_parallel).__name__)
            where = f"ShardedDataModule(data_parallel={name}) on rank {rank} of {world_size}"
        else:
            pair = data_parallel
            where = f"ShardedDataModule(data_parallel={data_parallel!r}) on rank {rank} of {world_size}"
        data_rank, data_size = check_data_parallel(pair, world_size, where)
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=int(trainer.local_rank),
            node_rank=int(trainer.node_rank),
            data_rank=data_rank,
            data_size=data_size,
        )

    def describe(self) -> str:
        """``rank 3 = node 0 local 3 data 1`` (the data-parallel rank only where it differs)."""
        data = f" data {self.data_rank}" if self.data_size != self.world_size else ""
        return f"rank {self.rank} = node {self.node_rank} local {self.local_rank}{data}"


def check_data_parallel(pair: Any, world_size: int | None, where: str) -> DataParallel:
    """``pair`` as ``(data_rank, data_size)`` of a world of ``world_size`` ranks (``None``: not known
    yet), or a ValueError naming ``where``."""
    ok = isinstance(pair, (tuple, list)) and len(pair) == 2
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
    if not ok:
        raise ValueError(f"{where} gave {pair!r}; it must be a pair of integers (data-parallel rank, size)")
    data_rank, data_size = int(pair[0]), int(pair[1])
    if data_size < 1:
        raise ValueError(f"{where} gave a data-parallel size of {data_size}; it must be at least 1")
    if world_size is not None and world_size % data_size:
        raise ValueError(
            f"{where} gave a data-parallel size of {data_size}, which does not divide the world of {world_size} "
            f"rank(s): every model replica must have the same number of ranks (choose one of "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]})"
        )
    if not 0 <= data_rank < data_size:
        raise ValueError(f"{where} gave data-parallel rank {data_rank}, outside 0..{data_size - 1}")
    return data_rank, data_size


@dataclass(frozen=True)
class WorkerContext:
    """Read-only facts a reader or transform may use inside a DataLoader worker.

    Named ``ShardContext`` before 0.2; a *shard* is a file of the data set, and this is a worker's.

    ``data_rank`` and ``data_size`` are the data-parallel rank and size, as :class:`World` names
    them (``World.rank`` is the global rank): every rank of one model replica gets the same context,
    so its readers and seeded transforms do the same work. Before 0.2 they were ``rank`` and
    ``world_size``: those names still read them, and build a context, for this release, warned.

    ``worker_id`` is 0 and ``num_workers`` is 0 when loading runs in the main process.
    """

    data_rank: int
    data_size: int
    worker_id: int
    num_workers: int
    epoch: int
    seed: int

    @property
    def worker_seed(self) -> int:
        """The seed of this (epoch, data rank, worker); the loader seeds torch, NumPy and ``random`` with it."""
        return derive_seed(self.seed, _WORKER_SEEDS, self.epoch, self.data_rank, self.worker_id)

    @property
    def rank(self) -> int:
        """The old name of :attr:`data_rank` (deprecated in 0.2, goes away in the next release)."""
        _old_field("rank")
        return self.data_rank

    @property
    def world_size(self) -> int:
        """The old name of :attr:`data_size` (deprecated in 0.2, goes away in the next release)."""
        _old_field("world_size")
        return self.data_size

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A context pickled before 0.2 (``rank``, ``world_size``) unpickles under today's names."""
        for old, new in _OLD_FIELDS.items():
            if old in state:
                state[new] = state.pop(old)
        for name, value in state.items():
            object.__setattr__(self, name, value)


# WorkerContext's fields 0.2 renamed (one word per meaning: a rank is a global rank): old -> new.
_OLD_FIELDS = {"rank": "data_rank", "world_size": "data_size"}


def _old_field(old: str) -> None:
    """Warn that ``WorkerContext.<old>`` is spelt ``WorkerContext.<new>`` since 0.2."""
    new = _OLD_FIELDS[old]
    warnings.warn(
        f"WorkerContext.{old} is WorkerContext.{new} since lightning_sharding 0.2 (the data-parallel "
        f"{new.removeprefix('data_')}; World.{old} is the global one); the old name goes away in the next release",
        DeprecationWarning,
        stacklevel=3,  # the caller of the property or of the constructor
    )


def _taking_old_fields(init: Callable[..., None]) -> Callable[..., None]:
    """``WorkerContext.__init__`` that also takes the old keywords ``rank=`` and ``world_size=``, warned."""

    @functools.wraps(init)
    def __init__(self: WorkerContext, *args: Any, **kwargs: Any) -> None:
        for old, new in _OLD_FIELDS.items():
            if old in kwargs:
                _old_field(old)
                if new in kwargs:
                    raise TypeError(f"WorkerContext() got both {old}= and {new}=; give {new}= alone")
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)

    return __init__


setattr(WorkerContext, "__init__", _taking_old_fields(WorkerContext.__init__))  # noqa: B010 - mypy: no method assignment


@dataclass(frozen=True, slots=True)  # one per sample: slots make it cheap to build
class SampleContext:
    """What a per-sample transform gets: the worker's context (``worker``) and the sample's identity.

    ``sample_seed`` depends only on ``(seed, epoch, position)``, so a sample's augmentation is
    bit-identical whatever rank or worker produced it, also after a resume on another topology.
    ``stream`` names the stream of a mixture the sample came from (``None`` outside a mixture).
    """

    worker: WorkerContext
    position: int
    item: int
    index: int
    stream: str | None = None
    # (its batch's seeds, its row) where the loader made it (sample_contexts): the same value, derived
    # for the whole batch at once the first time a sample asks. Not an argument: dataclasses.replace
    # of another position derives that position's own.
    _batch_seeds: tuple[_BatchSeeds, int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def sample_seed(self) -> int:
        """A seed for this sample's randomness."""
        if self._batch_seeds is not None:
            seeds, row = self._batch_seeds
            return seeds[row]
        return derive_seed(self.worker.seed, _SAMPLE_SEEDS, self.worker.epoch, self.position)

    @property
    def shard(self) -> WorkerContext:
        """The old name of :attr:`worker` (deprecated in 0.2, goes away in the next release)."""
        return _old_shard(self, "SampleContext")


def sample_seeds(worker: WorkerContext, positions: npt.NDArray[np.int64]) -> list[int]:
    """:attr:`SampleContext.sample_seed` of the samples at ``positions``, derived at once (a batch's,
    for its per-sample transforms: about 0.6 us a sample instead of 12; a few one by one)."""
    if len(positions) < 4:  # the array's fixed cost is more than a few samples'
        return [derive_seed(worker.seed, _SAMPLE_SEEDS, worker.epoch, p) for p in np.asarray(positions).tolist()]
    seeds: list[int] = derive_seeds(worker.seed, (_SAMPLE_SEEDS, worker.epoch), positions).tolist()
    return seeds


class _BatchSeeds:
    """A batch's sample seeds, derived together when a sample first asks for its own (a transform
    that draws none costs nothing)."""

    __slots__ = ("_positions", "_values", "_worker")

    def __init__(self, worker: WorkerContext, positions: npt.NDArray[np.int64]) -> None:
        self._worker, self._positions = worker, positions
        self._values: list[int] | None = None

    def __getitem__(self, row: int) -> int:
        if self._values is None:
            self._values = sample_seeds(self._worker, self._positions)
        return self._values[row]


def sample_contexts(
    worker: WorkerContext,
    positions: npt.NDArray[np.int64],
    items: list[int],
    indices: list[int],
    streams: list[str | None] | None = None,
) -> list[SampleContext]:
    """The contexts of a batch's samples (its rows' positions, items, indices and streams), whose
    seeds are derived for the whole batch at once when one is first read."""
    seeds = _BatchSeeds(worker, positions)
    names = streams if streams is not None else [None] * len(items)
    contexts = []
    for row, (p, i, j, n) in enumerate(zip(positions.tolist(), items, indices, names, strict=True)):
        ctx = SampleContext(worker, p, i, j, n)
        object.__setattr__(ctx, "_batch_seeds", (seeds, row))  # frozen: set once, here
        contexts.append(ctx)
    return contexts


@dataclass(frozen=True)
class BatchContext:
    """What a ``batch_transform`` gets: the worker's context (``worker``) and the batch's epoch ``positions``, shape
    ``(n,)``, one per row (the last ``num_padding`` rows are padding, flagged later). In a mixture,
    ``streams`` (int64, shape ``(n,)``) is each row's stream, an index into ``stream_names``."""

    worker: WorkerContext
    positions: npt.NDArray[np.int64]
    num_padding: int
    streams: npt.NDArray[np.int64] | None = None
    stream_names: tuple[str, ...] = ()

    @property
    def sample_seeds(self) -> npt.NDArray[np.uint64]:
        """A seed per row, shape ``(n,)``, from ``(seed, epoch, position)`` only (as
        :attr:`SampleContext.sample_seed` is): a row's randomness is the same on any rank, worker or
        topology. Seed a vectorised augmentation with them, e.g. ``np.random.default_rng(seeds)``."""
        base = np.uint64(derive_seed(self.worker.seed, _BATCH_SEEDS, self.worker.epoch))
        with np.errstate(over="ignore"):  # splitmix64: wrapping arithmetic is the point
            z = base + self.positions.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        seeds: npt.NDArray[np.uint64] = (z ^ (z >> np.uint64(31))) >> np.uint64(1)
        return seeds

    @property
    def shard(self) -> WorkerContext:
        """The old name of :attr:`worker` (deprecated in 0.2, goes away in the next release)."""
        return _old_shard(self, "BatchContext")


def _old_shard(context: SampleContext | BatchContext, owner: str) -> WorkerContext:
    """``context.worker``, warned: ``.shard`` is its name before 0.2."""
    warnings.warn(
        f"{owner}.shard is {owner}.worker since lightning_sharding 0.2 (a shard is a file of the data set); "
        "the old name goes away in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    return context.worker


# The old names of this module's classes, 0.2 gave them a new word (issue 52): old -> new. They import
# for one release, warned, from here and from the modules that offered them (readers.base,
# readers.sources; the package root through lightning_sharding._deprecated).
OLD_NAMES = {"ShardContext": "WorkerContext"}


def old_name(module: str, name: str) -> Any:
    """``<module>.<name>`` for a name of :data:`OLD_NAMES`, with a DeprecationWarning naming the new
    one; else an AttributeError (a module's ``__getattr__`` calls this)."""
    if name not in OLD_NAMES:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = OLD_NAMES[name]
    warnings.warn(
        f"{module}.{name} is {__name__}.{new} since lightning_sharding 0.2; import that "
        "(the old name goes away in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    return globals()[new]


if not TYPE_CHECKING:  # type checkers see only today's names

    def __getattr__(name: str) -> Any:
        """An old name of :data:`OLD_NAMES`, warned."""
        return old_name(__name__, name)
