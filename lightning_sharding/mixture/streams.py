"""Streams: several readers mixed into one epoch at chosen shares (see :mod:`lightning_sharding.mixture.order`).

``ShardedDataModule(streams=[Stream("web", web, weight=3), Stream("code", code, weight=1)])`` reads
them as one :class:`MixtureReader`: its items are every stream's items, stream after stream (keys
prefixed ``"<stream>/"``), and its manifest carries the mixture, whose epoch order every strategy
that ``mixes`` plans like any other. The ledger, checkpoints and resumes are unchanged: they count
positions of the mixture's epoch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.manifest import Item, Manifest
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.mixture.composition import COMPOSITIONS
from lightning_sharding.mixture.control import ControlledMixture
from lightning_sharding.mixture.order import Mixture, StreamSpec, plan_draws
from lightning_sharding.mixture.schedule import Phase, phase_draws, phases_of, schedule_summary
from lightning_sharding.readers.base import Columns, Reader


def shown_key(key: str, names: Sequence[str]) -> str:
    """A mixture item's key as a person reads it: its stream's name, a colon, then the key its reader
    gave it (``web:/data/web/part-0.idx``), where the item's key (``web//data/web/part-0.idx``, the
    ``"<stream>/"`` prefix on an absolute path) stays as checkpoints keep it. A key of none of the
    streams ``names`` is shown as it is."""
    for name in sorted(names, key=len, reverse=True):
        if key.startswith(f"{name}/"):
            return f"{name}:{key[len(name) + 1 :]}"
    return key


@dataclass(frozen=True)
class Stream:
    """A named reader and its share of the mixture: one of ``weight`` (relative share of what the
    other streams leave of ``samples_per_epoch``; the default, ``weight=1``), ``proportion`` (a
    fraction of the stream per epoch, up to 1), ``repeat`` (passes per epoch: 2.0 serves every
    sample twice, 0.5 half of them) or ``choose`` (a number of samples per epoch). A stream of
    packed token sequences may give ``tokens`` instead (tokens per epoch, with
    ``ShardedDataModule(packing=...)``): it draws that many tokens' worth of sequences, within one
    sequence of it."""

    name: str
    reader: Reader
    weight: float | None = None
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        self.spec  # noqa: B018 - checks the share now, naming the stream
        if not isinstance(self.reader, Reader):
            raise TypeError(f"stream {self.name!r}: reader must be a Reader, got {type(self.reader).__name__}")
        if self.tokens is not None:
            given = [k for k in ("weight", "proportion", "repeat", "choose") if getattr(self, k) is not None]
            if given:
                raise ValueError(f"stream {self.name!r} sets tokens and {' and '.join(given)}; give one share")
            if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
                raise ValueError(f"stream {self.name!r}: tokens={self.tokens!r} must be a whole number of 1 or more")

    @property
    def spec(self) -> StreamSpec:
        """The stream's share, without its reader."""
        return StreamSpec(self.name, self.weight, self.proportion, self.repeat, self.choose)


class MixtureReader(Reader):
    """The readers of ``streams`` as one reader whose manifest draws ``samples_per_epoch`` samples
    an epoch (default: what the streams' shares imply) at the streams' shares, composed into
    batches of ``batch_size`` by ``composition`` (``"mixed"``, ``"stratified"`` or ``"per_stream"``).
    With a ``schedule`` (:class:`~lightning_sharding.mixture.schedule.Phase` list), the epoch keeps
    its size and each phase draws at its own shares (:mod:`~lightning_sharding.mixture.schedule`)."""

    def __init__(
        self,
        streams: Sequence[Stream],
        samples_per_epoch: int | None = None,
        *,
        composition: str = "mixed",
        batch_size: int | None = None,
        schedule: Sequence[Phase | Mapping[str, Any]] | None = None,
    ) -> None:
        streams = tuple(streams)
        if not streams or not all(isinstance(s, Stream) for s in streams):
            raise ValueError(f"streams= needs one or more Stream(name, reader, ...), got {streams!r}")
        for s in streams:
            if s.tokens is not None and not s.reader.reads_sequences:
                raise ValueError(
                    f"stream {s.name!r}: a share in tokens (tokens={s.tokens}) needs packed token sequences: "
                    "give ShardedDataModule(packing=Packing(...)), or a share in samples"
                )
        names = [s.name for s in streams]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"stream names must be unique; {twice} appear more than once")
        if composition not in COMPOSITIONS:
            raise ValueError(f"batch_composition={composition!r} is not one of {list(COMPOSITIONS)}")
        if composition != "mixed" and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_composition={composition!r} needs a batch_size of 1 or more, got {batch_size!r}")
        self.phases = phases_of(schedule, names) if schedule is not None else ()
        if self.phases and composition != "mixed":
            raise ValueError(
                f"a share schedule needs batch_composition='mixed', not {composition!r}: its phases cut the epoch "
                "at fractions of it, not at batch blocks"
            )
        self.streams = streams
        self.samples_per_epoch = samples_per_epoch
        self.composition = composition
        self.batch_size = batch_size if composition != "mixed" else None
        self._listed: list[tuple[Item, ...]] | None = None
        self._origin: dict[str, tuple[int, Item]] = {}
        self.fetch_ahead = max(s.reader.fetch_ahead for s in streams)  # a stream that fetches ahead is told
        self.read_threads = max(s.reader.read_threads for s in streams)  # a batch's items of remote streams at once

    def _list(self) -> list[tuple[Item, ...]]:
        """Every stream's items, listed once (in the main process; workers get them pickled)."""
        if self._listed is None:
            listed = [tuple(s.reader.items()) for s in self.streams]
            for s, (stream, items) in enumerate(zip(self.streams, listed, strict=True)):
                if sum(it.num_samples for it in items) == 0:
                    raise ValueError(
                        f"stream {stream.name!r} has no samples ({len(items)} items): check its data or remove it"
                    )
                self._origin.update((f"{stream.name}/{it.key}", (s, it)) for it in items)
            self._listed = listed
        return self._listed

    def items(self) -> Sequence[Item]:
        """Every stream's items, stream after stream, keys prefixed with ``"<stream>/"``."""
        return [
            Item(
                f"{stream.name}/{it.key}",
                it.num_samples,
                it.fingerprint,
                f"{stream.name}/{it.name}" if it.name else "",
                it.content,
            )
            for stream, items in zip(self.streams, self._list(), strict=True)
            for it in items
        ]

    def scrub(self, text: str) -> str:
        """``text`` without the secrets of any stream's reader."""
        for stream in self.streams:
            text = stream.reader.scrub(text)
        return text

    @property
    def reads_sequences(self) -> bool:  # type: ignore[override]
        """Whether the streams are packed token sequences (every stream's reader reads them)."""
        return all(s.reader.reads_sequences for s in self.streams)

    def manifest(self, batch_size: int | None = None) -> Manifest:
        """The items of every stream and the mixture that draws from them (in blocks of
        ``batch_size``, default the one given, for a ``stratified`` or ``per_stream`` composition).
        Packed streams draw sequences: a stream's samples are its packed epochs' sequences."""
        listed = self._list()
        sizes = [sum(it.num_samples for it in items) for items in listed]
        packed = [s.reader.reads_sequences for s in self.streams]
        stream_epochs: tuple[Any, ...] = ()
        if any(packed):
            if not all(packed):
                names = [s.name for s, p in zip(self.streams, packed, strict=True) if not p]
                raise ValueError(f"streams {names} are not packed: pack every stream of a mixture, or none")
            # Each stream's packed epochs over the items listed above (listed once: no second digest).
            stream_epochs = tuple(
                s.reader.epochs(items)  # type: ignore[attr-defined]  # a reader that reads sequences packs
                for s, items in zip(self.streams, listed, strict=True)
            )
            sizes = [int(e.total) for e in stream_epochs]
        specs = [s.spec for s in self.streams]
        for i, s in enumerate(self.streams):
            if s.tokens is not None:  # whole passes, then the rest at the stream's tokens per sequence
                epochs = stream_epochs[i]
                passes, rest = divmod(s.tokens, int(epochs.planned_tokens))
                sequences = passes * int(epochs.total) + round(rest * int(epochs.total) / int(epochs.planned_tokens))
                specs[i] = replace(specs[i], choose=max(1, sequences))
        draws = plan_draws(specs, sizes, self.samples_per_epoch)
        schedule: tuple[dict[str, Any], ...] = ()
        training: tuple[dict[str, Any], ...] = ()
        if self.phases and self.phases[0].unit != "epoch":  # phases over training: decisions made in advance
            training = tuple(self._over_training(p, stream_epochs) for p in self.phases)
        elif self.phases:  # the epoch keeps its size; each phase splits its part at its own shares
            names = [s.name for s in self.streams]
            rows = phase_draws(self.phases, names, sum(draws))
            schedule = tuple(schedule_summary(self.phases, rows))
            draws = [sum(column) for column in zip(*rows, strict=True)]
        mixture = Mixture(
            names=tuple(s.name for s in self.streams),
            shares=tuple(s.spec.describe() if s.tokens is None else f"tokens={s.tokens}" for s in self.streams),
            stream_items=tuple(len(items) for items in listed),
            draws=tuple(draws),
            composition=self.composition,
            batch_size=None if self.composition == "mixed" else batch_size or self.batch_size,
            stream_epochs=stream_epochs,
            schedule=schedule,
            training=training,
        )
        if training:
            return Manifest(tuple(self.items()), ControlledMixture(mixture))
        return Manifest(tuple(self.items()), mixture)

    def _over_training(self, phase: Phase, stream_epochs: Sequence[Any]) -> dict[str, Any]:
        """A phase of a schedule over training as the mixture keeps it: from ``samples`` (a phase in
        tokens starts at the sequence holding its token: tokens // seq_len, the streams packed alike)."""
        row: dict[str, Any] = {"samples": phase.samples, "shares": dict(phase.shares)}
        if phase.tokens is not None:
            if not stream_epochs:
                raise ValueError(
                    f"Phase(tokens={phase.tokens}) counts tokens, but the streams are not packed token sequences: "
                    "give samples= instead"
                )
            seq_len = int(stream_epochs[0].packing.seq_len)
            row = {"samples": phase.tokens // seq_len, "tokens": phase.tokens, "shares": dict(phase.shares)}
        return row | ({"note": phase.note} if phase.note else {})

    def read_sequences(self, order: Any, positions: npt.NDArray[np.int64], items: Sequence[Item]) -> Any:
        """The batch of the mixture's ``positions``: each stream's rows read by its own packed
        reader from the pass or cycle they come from, then joined in the batch's order."""
        from lightning_sharding.tokens import join_packed

        stream, draw = order.streams(positions)
        offsets = order.item_offsets.tolist()
        parts = []
        documents = 0
        for s, stream_order in enumerate(order.stream_orders):
            where = np.flatnonzero(stream == s)
            originals = self._originals(s, items[offsets[s] : offsets[s + 1]])
            for rows, portion_order, local in stream_order.portions_of(draw[where]) if where.size else []:
                part = self.streams[s].reader.read_sequences(portion_order, local, originals)
                parts.append((where[rows], part, documents))
            documents += int(stream_order.epochs.lengths.size)
        return join_packed(parts, len(positions))

    def _originals(self, s: int, items: Sequence[Item]) -> list[Item]:
        """Stream ``s``'s own items (as its reader knows them) of the mixture's ``items`` (kept)."""
        kept: dict[int, list[Item]] = self.__dict__.setdefault("_originals_of", {})
        if s not in kept:
            kept[s] = [self._origin_of(it)[1] for it in items]
        return kept[s]

    def _source(self, item: Item) -> tuple[Reader, Item]:
        s, original = self._origin_of(item)
        return self.streams[s].reader, original

    def worker_modules(self) -> list[str]:
        """What every stream's reader's workers import."""
        return list(dict.fromkeys(m for s in self.streams for m in s.reader.worker_modules()))

    def ahead(self, now: Sequence[Item], upcoming: Sequence[Item]) -> None:
        """Each stream's reader that fetches ahead is told its own items of ``now`` and ``upcoming``."""
        for s, stream in enumerate(self.streams):
            if stream.reader.fetch_ahead:
                mine = [
                    [original for k, original in map(self._origin_of, items) if k == s] for items in (now, upcoming)
                ]
                stream.reader.ahead(*mine)

    def take_stats(self) -> dict[str, float]:
        """The counters of every stream's reader since the last call, added up."""
        total: dict[str, float] = {}
        for stream in self.streams:
            for name, value in stream.reader.take_stats().items():
                total[name] = total.get(name, 0.0) + value
        return total

    def _origin_of(self, item: Item) -> tuple[int, Item]:
        if not self._origin:
            self._list()
        return self._origin[item.key]

    def read(self, item: Item, index: int, ctx: WorkerContext) -> Any:
        """Sample ``index`` of ``item``, read by its stream's reader."""
        reader, original = self._source(item)
        return reader.read(original, index, ctx)

    def read_batch(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> list[Any]:
        """Samples ``indices`` of ``item``, read by its stream's reader."""
        reader, original = self._source(item)
        return reader.read_batch(original, indices, ctx)

    def read_columns(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> Columns:
        """Samples ``indices`` of ``item`` as columns, read by its stream's reader."""
        reader, original = self._source(item)
        return reader.read_columns(original, indices, ctx)

    @property
    def columnar(self) -> bool:
        """Whether every stream's reader reads columns."""
        return all(s.reader.columnar for s in self.streams)


def reader_of(
    reader: Reader | None,
    streams: Sequence[Stream] | None,
    samples_per_epoch: int | None,
    owner: str,
    composition: str = "mixed",
    batch_size: int | None = None,
    schedule: Sequence[Phase | Mapping[str, Any]] | None = None,
) -> Reader | None:
    """The DataModule's training reader: ``reader`` as it is, or the mixture of ``streams`` composed
    by ``composition`` into batches of ``batch_size`` (with a share ``schedule``); a reader with
    ``samples_per_epoch`` is a mixture of that one stream (named ``"data"``)."""
    if streams is None and schedule is not None:
        raise ValueError(f"`{owner}(schedule=...)` changes the shares of a mixture's streams: give `streams=[...]`")
    if streams is None:
        if composition != "mixed":
            raise ValueError(
                f"`{owner}(batch_composition={composition!r})` composes batches of a mixture: give `streams=[...]`"
            )
        if samples_per_epoch is None or reader is None:
            return reader
        streams = [Stream("data", reader)]
    elif reader is not None:
        raise ValueError(f"`{owner}`: give `reader=` or `streams=`, not both (a reader is one stream of a mixture)")
    if isinstance(streams, (Stream, Reader)) or not isinstance(streams, Sequence):
        raise ValueError(f"`{owner}(streams=...)` takes a list of Stream(name, reader, ...), got {streams!r}")
    return MixtureReader(streams, samples_per_epoch, composition=composition, batch_size=batch_size, schedule=schedule)
