"""``LoaderOptions``: how every strategy's loader batches, parallelises and treats bad samples.

One object, validated once, in place of keyword arguments repeated through every ``build()``.
The messages name the owner the options were given to (``ShardedDataModule(batch_size=0)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch.utils.data import default_collate

from lightning_sharding.core.plan import EvenBatches
from lightning_sharding.core.world import BatchContext, SampleContext
from lightning_sharding.strategies._start import check_start_method

Transform = Callable[[Any, SampleContext], Any]
BatchTransform = Callable[[Any, BatchContext], Any]
OnError = Literal["raise", "skip"]
ON_ERROR_POLICIES: tuple[str, ...] = ("raise", "skip")


def _count(value: Any, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


@dataclass(frozen=True)
class LoaderOptions:
    """The loader settings a strategy builds from.

    Args:
        batch_size: samples per batch on each rank.
        num_workers: DataLoader worker processes per rank (0 loads in the training process).
        shuffle: permute items and samples every epoch.
        even_batches: ``"pad"``, ``"drop"`` or (strategy ``dispatch``) ``"sync"``; which ones a
            strategy takes it says in ``Strategy.refusal``.
        transform: ``transform(sample, SampleContext) -> sample``, run per sample in the worker.
        collate_fn: turns a list of samples into a batch (PyTorch's default collate).
        batch_transform: ``batch_transform(batch, BatchContext) -> batch``, run in the worker on the
            collated batch (or the columns of a batch-level reader), one row per sample in and out.
        padding_key: the key of the padding flags added to dict batches; ``None`` adds none.
        on_error: ``"raise"`` or ``"skip"`` (the strategies that take it: ``shard``).
        persistent_workers, prefetch_factor, pin_memory, timeout: passed to the DataLoader.
        multiprocessing_context: how workers start: ``None`` (the default) is ``"forkserver"`` with
            torch, the package and the modules of the reader and the script preloaded
            (``strategies/_start.py``); ``"spawn"`` or ``"fork"``.

    What only one strategy uses is a setting of that strategy (``ShardStrategy(transport=...)``,
    ``BroadcastStrategy(prefetch_items=...)``), not a loader option.
    """

    batch_size: int = 32
    num_workers: int = 0
    shuffle: bool = True
    even_batches: EvenBatches | Literal["sync"] = "pad"
    transform: Transform | None = None
    collate_fn: Callable[[list[Any]], Any] = field(default=default_collate)
    batch_transform: BatchTransform | None = None
    padding_key: str | None = "is_padding"
    on_error: OnError = "raise"
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    pin_memory: bool = False
    multiprocessing_context: str | None = None
    timeout: float = 0

    def check(self, owner: str = "LoaderOptions") -> LoaderOptions:
        """Raise a ValueError naming ``owner`` and the first value at fault; ``self`` when all fit."""
        if not _count(self.batch_size, 1):
            raise ValueError(f"`{owner}(batch_size={self.batch_size!r})` must be a positive integer")
        if not _count(self.num_workers, 0):
            raise ValueError(
                f"`{owner}(num_workers={self.num_workers!r})` must be an integer >= 0 (0 loads in-process)"
            )
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError(f"`{owner}(persistent_workers=True)` needs num_workers > 0")
        if self.prefetch_factor is not None and (self.num_workers == 0 or self.prefetch_factor < 1):
            raise ValueError(
                f"`{owner}(prefetch_factor={self.prefetch_factor})` needs num_workers > 0 and a value >= 1"
            )
        for name in ("transform", "batch_transform"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"`{owner}({name}={getattr(self, name)!r})` must be a function (or None)")
        if self.on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"`{owner}(on_error={self.on_error!r})` must be one of {list(ON_ERROR_POLICIES)}")
        check_start_method(self.multiprocessing_context, owner)
        return self

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> LoaderOptions:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def dataloader_kwargs(self) -> dict[str, Any]:
        """What goes to ``torch.utils.data.DataLoader`` unchanged."""
        return dict(
            persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.pin_memory,
            timeout=self.timeout,
        )


DEFAULT_OPTIONS = LoaderOptions()


class OptionAttribute:
    """``owner.<name>`` reads ``owner.options.<name>``; setting it replaces the options and checks them
    again (``dm.batch_size = 64``, as Lightning's batch-size finder does, takes effect at the next loader)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj.options, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.options = obj.options.replace(**{self.name: value}).check(type(obj).__name__)
