"""The manifest: the items a reader opens, their sample counts, and a fingerprint of the whole.

The fingerprint goes into every checkpoint, so resuming against changed data is a clear error
instead of silently wrong positions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from lightning_sharding.core.order import EpochOrder
    from lightning_sharding.mixture.change import MixtureChange
    from lightning_sharding.mixture.composition import Blocks
    from lightning_sharding.mixture.order import Mixture, MixtureOrder


@dataclass(frozen=True)
class Item:
    """One unit of storage: a file, a tar shard, a row group, a month.

    ``key`` names it (a path or URL), ``num_samples`` is how many samples it holds, and
    ``fingerprint`` is anything that changes when its content changes (size and mtime, an ETag).
    """

    key: str
    num_samples: int
    fingerprint: str = ""


@dataclass(frozen=True)
class Manifest:
    """An ordered, non-empty tuple of items with their sample counts.

    ``counts`` is an int64 array of shape ``(num_items,)``; ``total`` the samples of an epoch (their
    sum, or what a ``mixture`` of streams draws); ``fingerprint`` a SHA-256 of every item's key,
    count and fingerprint, in order, and of the mixture's streams and shares.
    """

    items: tuple[Item, ...]
    mixture: Mixture | None = None
    change: MixtureChange | None = None  # the epoch a checkpoint's mixture changed in, resumed

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
        """Samples in an epoch: all of them, or what the mixture draws."""
        return sum(self.mixture.draws) if self.mixture is not None else int(self.counts.sum())

    def order(self, seed: int, epoch: int, *, shuffle: bool = True) -> EpochOrder | MixtureOrder | MixtureChange:
        """The epoch order of these items: positions ``[0, total)`` to ``(item, index)``."""
        from lightning_sharding.core.order import EpochOrder

        if self.change is not None and epoch == self.change.epoch:
            return self.change
        if self.mixture is not None:
            return self.mixture.order(self.counts, seed, epoch, shuffle=shuffle)
        return EpochOrder(self.counts, seed, epoch, shuffle=shuffle)

    @property
    def blocks(self) -> Blocks | None:
        """The blocks a stratified or per_stream mixture's batches follow (``None``: batches anywhere)."""
        return self.mixture.blocks if self.mixture is not None else None

    def blocks_at(self, epoch: int) -> Blocks | None:
        """The blocks of ``epoch``'s batches: :attr:`blocks`, or those of a changed epoch."""
        return self.change.blocks if self.change is not None and epoch == self.change.epoch else self.blocks

    @cached_property
    def fingerprint(self) -> str:
        """A SHA-256 over every item's key, count and fingerprint, in order."""
        return self._digests[0]

    @property
    def stream_fingerprints(self) -> list[str]:
        """A SHA-256 of each mixture stream's items (keys without the stream's name, counts,
        fingerprints), in stream order: the same data under another stream name has the same one."""
        return self._digests[1]

    @cached_property
    def _digests(self) -> tuple[str, list[str]]:
        """The fingerprint and each stream's, in one pass over the items."""
        whole, streams = hashlib.sha256(), []
        firsts = set(np.cumsum((0, *self.mixture.stream_items[:-1])).tolist()) if self.mixture is not None else set()
        names = iter(self.mixture.names) if self.mixture is not None else iter(())
        prefix = 0
        for i, it in enumerate(self.items):
            if i in firsts:
                streams.append(hashlib.sha256())
                prefix = len(next(names)) + 1
            # JSON-encoded, so a tab or newline inside a key or an ETag cannot forge another item list.
            whole.update(json.dumps([it.key, int(it.num_samples), it.fingerprint]).encode() + b"\n")
            if streams:  # without the "<stream>/" of its key: a renamed stream is known by its data
                streams[-1].update(json.dumps([it.key[prefix:], int(it.num_samples), it.fingerprint]).encode() + b"\n")
        if self.mixture is not None:
            whole.update(json.dumps(self.mixture.summary(self.counts)).encode())
            if self.mixture.composition_summary():
                whole.update(json.dumps(self.mixture.composition_summary()).encode())
        return whole.hexdigest(), [h.hexdigest() for h in streams]

    def summary(self) -> dict[str, Any]:
        """What a checkpoint keeps of the manifest to explain a later mismatch."""
        return {
            "fingerprint": self.fingerprint,
            "num_items": len(self.items),
            "total": self.total,
            "first_key": self.items[0].key,
            "last_key": self.items[-1].key,
            **({"streams": self._streams()} if self.mixture is not None else {}),
            **(self.mixture.composition_summary() if self.mixture is not None else {}),
        }

    def _streams(self) -> list[dict[str, Any]]:
        """The mixture's streams with their data's fingerprint (outside :attr:`fingerprint`, which
        predates it: a mixture change checks that a kept stream's data is the same)."""
        assert self.mixture is not None
        streams = self.mixture.summary(self.counts)
        return [{**s, "data": f} for s, f in zip(streams, self.stream_fingerprints, strict=True)]

    def explain_mismatch(self, saved: Mapping[str, Any]) -> str:
        """Say, in one sentence, how this manifest differs from a saved :meth:`summary`."""
        return describe_change(saved, self.summary())


def describe_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """Say, in one sentence, how manifest summary ``after`` differs from ``before``."""
    diffs = [
        f"{name} was {before.get(name)!r}, now {after.get(name)!r}"
        for name in ("num_items", "total", "first_key", "last_key")
        if before.get(name) != after.get(name)
    ]
    diffs += _stream_changes(before.get("streams") or [], after.get("streams") or [])
    for name in ("composition", "batch_size"):  # a mixture's stratified or per_stream blocks
        default = "mixed" if name == "composition" else None
        was, now = before.get(name, default), after.get(name, default)
        if before.get("streams") and after.get("streams") and was != now:
            diffs.append(f"the mixture's {name} was {was!r}, now {now!r}")
    if not diffs:
        diffs = ["the item list has the same size and ends, but an item's key, count or fingerprint changed"]
    return "; ".join(diffs)


def _stream_changes(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """How a mixture's streams changed, one phrase per stream: added, removed, or its share or size."""
    old, new = {s["name"]: s for s in before}, {s["name"]: s for s in after}
    changes = [f"stream {name!r} was removed" for name in old if name not in new]
    changes += [f"stream {name!r} was added" for name in new if name not in old]
    for name in (n for n in new if n in old):
        if old[name].get("data", new[name].get("data")) != new[name].get("data"):
            changes.append(f"stream {name!r} holds other data (its items or their fingerprints changed)")
        for key in ("share", "samples", "draws"):
            if old[name][key] != new[name][key]:
                changes.append(f"stream {name!r} {key} was {old[name][key]!r}, now {new[name][key]!r}")
    return changes
