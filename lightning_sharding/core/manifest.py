"""The manifest: the items a reader opens, their sample counts, and a fingerprint of the whole.

The fingerprint goes into every checkpoint, so resuming against changed data is a clear error
instead of silently wrong positions. A manifest orders its epochs plainly
(:class:`~lightning_sharding.core.order.EpochOrder`) unless it carries
:class:`Epochs` of another kind, such as a mixture's, which it
knows only through that protocol.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.identity import SHOWN, item_changes, item_table
from lightning_sharding.core.order import EpochOrder

if TYPE_CHECKING:
    from lightning_sharding.core.blocks import Blocks
    from lightning_sharding.core.order import Order


@dataclass(frozen=True)
class Item:
    """One unit of storage: a file, a tar shard, a row group, a month.

    ``key`` names it (a path or URL), ``num_samples`` is how many samples it holds, and
    ``fingerprint`` is anything that changes when its content changes (size and mtime, an ETag).
    A reader may also say what identifies it wherever its bytes live
    (:mod:`~lightning_sharding.core.identity`): ``name``, its key relative to the data set's root,
    and ``content``, an id of its bytes (``size=N;etag=...`` or ``size=N;digest=...``), which a
    touch or a copy does not change. Without them an item is known by its key and fingerprint.
    """

    key: str
    num_samples: int
    fingerprint: str = ""
    name: str = ""
    content: str = ""

    @property
    def identity(self) -> tuple[str, str]:
        """``(name, content id)``: what a checkpoint knows the item by (key and fingerprint without them)."""
        return (self.name or self.key, self.content or self.fingerprint)


class Epochs(Protocol):
    """How a manifest's epochs are ordered when not plainly: an :class:`Order` per ``(seed, epoch)``.

    ``total`` is the positions of an epoch; ``blocks_at(epoch)`` that epoch's order's blocks
    without building the order; ``identity`` what the manifest's fingerprint hashes of it, and
    ``summary`` what a checkpoint keeps of it beside the manifest's items.
    """

    @property
    def total(self) -> int:
        """Positions of an epoch."""
        ...

    def order(self, counts: npt.NDArray[np.int64], seed: int, epoch: int, *, shuffle: bool = True) -> Order:
        """The order of ``epoch`` over items of sample ``counts`` (shape ``(num_items,)``)."""
        ...

    def blocks_at(self, epoch: int) -> Blocks | None:
        """The blocks ``epoch``'s batches follow (``None``: batches anywhere)."""
        ...

    def identity(self, counts: npt.NDArray[np.int64]) -> list[Any]:
        """JSON values the manifest's fingerprint hashes after its items, in order."""
        ...

    def summary(self, items: Sequence[Item], counts: npt.NDArray[np.int64]) -> dict[str, Any]:
        """What a checkpoint keeps of these epochs beside the manifest's ``items`` (and their ``counts``)."""
        ...

    def explain(self, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
        """How two manifest summaries differ in what :meth:`summary` wrote, one phrase each."""
        ...


@dataclass(frozen=True)
class Manifest:
    """An ordered, non-empty tuple of items with their sample counts.

    ``counts`` is an int64 array of shape ``(num_items,)``; ``total`` the positions of an epoch
    (the samples, or what ``epochs`` of another kind lay out); ``fingerprint`` a SHA-256 of every
    item's key, count and fingerprint, in order, and of what ``epochs`` adds to their identity.
    """

    items: tuple[Item, ...]
    epochs: Epochs | None = None  # how epochs are ordered when not plainly (a mixture)

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError(
                "the manifest is empty: the reader returned no items. "
                "Check the data path or glob, or the reader's items() method."
            )
        seen: set[str] = set()
        for item in self.items:
            if (
                isinstance(item.num_samples, bool)
                or not isinstance(item.num_samples, (int, np.integer))
                or item.num_samples < 0
            ):
                raise ValueError(f"item {item.key!r} has num_samples={item.num_samples!r}; it must be an integer >= 0")
            if item.key in seen:
                raise ValueError(f"item {item.key!r} appears twice in the manifest; item keys must be unique")
            seen.add(item.key)
        if self.total == 0:
            raise ValueError(
                f"the dataset is empty: all {len(self.items)} items hold 0 samples "
                f"(first item: {self.items[0].key!r}). Check the data or the reader's sample counts."
            )

    @classmethod
    def from_items(cls, items: Iterable[Item]) -> Manifest:
        """Build a manifest from any iterable of :class:`Item`."""
        return cls(tuple(items))

    @cached_property
    def counts(self) -> npt.NDArray[np.int64]:
        """Sample count per item, shape ``(num_items,)``."""
        counts = np.fromiter((it.num_samples for it in self.items), dtype=np.int64, count=len(self.items))
        counts.flags.writeable = False
        return counts

    @cached_property
    def total(self) -> int:
        """Positions in an epoch: every sample, or what :attr:`epochs` lay out."""
        return self.epochs.total if self.epochs is not None else int(self.counts.sum())

    def order(self, seed: int, epoch: int, *, shuffle: bool = True) -> Order:
        """The order of ``epoch``: positions ``[0, total)`` to ``(item, index)``."""
        if self.epochs is not None:
            return self.epochs.order(self.counts, seed, epoch, shuffle=shuffle)
        return EpochOrder(self.counts, seed, epoch, shuffle=shuffle)

    def blocks_at(self, epoch: int) -> Blocks | None:
        """The blocks ``epoch``'s batches follow (``None``: the plan cuts batches anywhere)."""
        return self.epochs.blocks_at(epoch) if self.epochs is not None else None

    def with_epochs(self, epochs: Epochs | None, *, same_identity: bool = False) -> Manifest:
        """These items, their epochs ordered by ``epochs``. ``same_identity``: ``epochs`` has the
        identity and summary of this manifest's (only the order changed, as by a mixture decision), so
        the new manifest keeps what this one computed of them (cheap for a manifest of 10^7 items)."""
        if not same_identity:
            return Manifest(self.items, epochs)
        new = object.__new__(Manifest)
        object.__setattr__(new, "items", self.items)
        object.__setattr__(new, "epochs", epochs)
        for key in ("counts", "table", "_by_path", "fingerprint", "_summary"):
            if key in self.__dict__:
                new.__dict__[key] = self.__dict__[key]
        return new

    @cached_property
    def fingerprint(self) -> str:
        """A SHA-256 over every item's identity (name, count, content id), in order, then what
        :attr:`epochs` adds: the same for the same data under another root, or touched."""
        return self._digest([(*it.identity, it.num_samples) for it in self.items])

    def fingerprint_by_path(self, root_map: Mapping[str, str] | None = None) -> str:
        """The fingerprint of 0.1 releases: over every item's key (where it lives) and fingerprint
        (size and mtime or ETag); a checkpoint they wrote resumes when this one matches. With
        ``root_map`` (``{old prefix: new prefix}``), of the keys the items had under the old prefixes."""
        if not root_map:
            return self._by_path
        back = sorted(((new, old) for old, new in root_map.items()), key=lambda m: -len(m[0]))

        def old_key(key: str) -> str:
            return next((old + key[len(new) :] for new, old in back if key.startswith(new)), key)

        return self._digest([(old_key(it.key), it.fingerprint, it.num_samples) for it in self.items])

    @cached_property
    def _by_path(self) -> str:
        return self._digest([(it.key, it.fingerprint, it.num_samples) for it in self.items])

    def _digest(self, rows: list[tuple[str, str, int]]) -> str:
        whole = hashlib.sha256()
        for key, content, count in rows:
            # JSON-encoded, so a tab or newline inside a key or an ETag cannot forge another item list.
            whole.update(json.dumps([key, int(count), content]).encode() + b"\n")
        for value in self.epochs.identity(self.counts) if self.epochs is not None else []:
            whole.update(json.dumps(value).encode())
        return whole.hexdigest()

    @property
    def root(self) -> str:
        """Where the data set lives: the first item's key without its name (``""``: items have no name)."""
        key, name = self.items[0].key, self.items[0].identity[0]
        return key[: len(key) - len(name)] if name != key and key.endswith(name) else ""

    @cached_property
    def table(self) -> dict[str, npt.NDArray[Any]]:
        """One row per item for a checkpoint (:func:`~lightning_sharding.core.identity.item_table`)."""
        return item_table(self.items)

    def summary(self) -> dict[str, Any]:
        """What a checkpoint keeps of the manifest to explain a later mismatch (a copy: computed once,
        since a mixture's streams hash every item)."""
        return copy.deepcopy(self._summary)

    @cached_property
    def _summary(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "num_items": len(self.items),
            "total": self.total,
            "first_key": self.items[0].key,
            "last_key": self.items[-1].key,
            **({"root": self.root} if self.root else {}),
            **(self.epochs.summary(self.items, self.counts) if self.epochs is not None else {}),
        }

    def explain_mismatch(self, saved: Mapping[str, Any]) -> str:
        """Say, in one sentence, how this manifest differs from a saved :meth:`summary`."""
        return describe_change(saved, self.summary(), self.epochs)

    def differences(
        self, saved: Mapping[str, Any], table: Mapping[str, Any] | None, shown: int | None = SHOWN
    ) -> list[str]:
        """How this manifest differs from a saved :meth:`summary`, one phrase each: every item that
        changed, by name, from a checkpoint's item ``table`` (0.2 and later; at most ``shown``), the
        item and sample totals, and what :attr:`epochs` tells of their own part (a mixture's streams);
        without a table, the summaries' sentence."""
        if table is None:
            return [describe_change(saved, self.summary(), self.epochs)]
        now = self.summary()
        found = item_changes(table, self.items, shown)
        found += [
            f"{key} was {saved.get(key)!r}, now {now[key]!r}"
            for key in ("num_items", "total")
            if saved.get(key) != now[key]
        ]
        if self.epochs is not None:
            found += self.epochs.explain(dict(saved), now)
        return found or [describe_change(saved, now, self.epochs)]


def describe_change(before: Mapping[str, Any], after: Mapping[str, Any], epochs: Epochs | None = None) -> str:
    """Say, in one sentence, how manifest summary ``after`` differs from ``before``; ``epochs`` (of
    the manifest ``after`` describes) explains the parts of the summaries it wrote."""
    diffs = [
        f"{name} was {before.get(name)!r}, now {after.get(name)!r}"
        for name in ("num_items", "total", "first_key", "last_key")
        if before.get(name) != after.get(name)
    ]
    if epochs is not None:
        diffs += epochs.explain(dict(before), dict(after))
    if not diffs:
        diffs = ["the item list has the same size and ends, but an item's key, count or fingerprint changed"]
    return "; ".join(diffs)
