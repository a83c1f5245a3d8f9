"""Mixture data for the process tests: synthetic streams whose sample ids do not overlap.

Light on imports (no Lightning): DataLoader workers unpickle :class:`OffsetReader` from here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from lightning_sharding import SyntheticReader
from lightning_sharding.core.manifest import Item
from lightning_sharding.mixture import MixtureReader, Stream


class OffsetReader(SyntheticReader):
    """Synthetic samples whose ids start at ``offset``, so that streams' ids differ."""

    def __init__(self, offset: int, sizes: list[int]) -> None:
        super().__init__(sizes=sizes)
        self.offset = offset

    def read_batch(self, item: Item, indices: Any, ctx: Any) -> list[Any]:
        samples = super().read_batch(item, indices, ctx)
        for sample in samples:
            sample["id"] = sample["id"] + self.offset
        return samples


def make_streams(specs: list[dict[str, Any]]) -> list[Stream]:
    """``[{"name", "sizes", <share>: value}, ...]`` as streams with ids ``0..`` in stream order (or
    from a spec's own ``"offset"``, to keep a stream's ids when others are added or removed)."""
    streams, offset = [], 0
    for spec in specs:
        share = {k: v for k, v in spec.items() if k not in ("name", "sizes", "offset")}
        offset = spec.get("offset", offset)
        streams.append(Stream(spec["name"], OffsetReader(offset, spec["sizes"]), **share))
        offset += sum(spec["sizes"])
    return streams


def planned_ids(
    specs: list[dict[str, Any]],
    samples_per_epoch: int | None,
    seed: int,
    epoch: int,
    composition: str = "mixed",
    batch_size: int | None = None,
    schedule: Any = None,
) -> Counter[int]:
    """How often each sample id is planned in ``epoch``: every draw of the mixture's order, once."""
    return Counter(_ids(specs, samples_per_epoch, seed, epoch, composition, batch_size, schedule)[0].tolist())


def planned_under_decisions(
    specs: list[dict[str, Any]],
    samples_per_epoch: int,
    seed: int,
    epoch: int,
    decisions: list[dict[str, Any]],
    schedule: Any = None,
) -> Counter[int]:
    """How often each sample id is planned in ``epoch`` of a mixture under online control, given the
    decisions (as a ledger keeps them) a run made, and a share ``schedule`` over training."""
    from lightning_sharding.mixture import ControlledMixture, Decision, mixture_of

    manifest = MixtureReader(make_streams(specs), samples_per_epoch, schedule=schedule).manifest()
    mixture = mixture_of(manifest)
    controlled = ControlledMixture(mixture, tuple(Decision.from_state(d) for d in decisions))  # type: ignore[arg-type]
    items, index = controlled.order(manifest.counts, seed, epoch).locate(np.arange(manifest.total))
    starts = np.concatenate(([0], np.cumsum(manifest.counts)))
    return Counter((starts[items] + index).tolist())


def planned_blocks(
    specs: list[dict[str, Any]], samples_per_epoch: int | None, seed: int, epoch: int, composition: str, batch_size: int
) -> dict[int, set[int]]:
    """The blocks of a stratified or per_stream epoch that hold each sample id (more than one if repeated)."""
    ids, blocks = _ids(specs, samples_per_epoch, seed, epoch, composition, batch_size)
    held: dict[int, set[int]] = {}
    for i, b in zip(ids.tolist(), blocks.tolist(), strict=True):
        held.setdefault(i, set()).add(b)
    return held


def _ids(
    specs: list[dict[str, Any]],
    samples_per_epoch: int | None,
    seed: int,
    epoch: int,
    composition: str,
    batch_size: int | None,
    schedule: Any = None,
) -> tuple[Any, Any]:
    """The sample id at each position of the epoch, and the block of each position (zeros: none)."""
    reader = MixtureReader(
        make_streams(specs), samples_per_epoch, composition=composition, batch_size=batch_size, schedule=schedule
    )
    manifest = reader.manifest()
    positions = np.arange(manifest.total)
    items, index = manifest.order(seed, epoch).locate(positions)
    starts = np.concatenate(([0], np.cumsum(manifest.counts)))
    edges = manifest.blocks_at(epoch)
    blocks = edges.ids(positions) if edges is not None else np.zeros_like(positions)
    return starts[items] + index, blocks
