"""``data=mixture``: several streams of files, each its own format, mixed at chosen shares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_sharding.lightning.datamodule import ShardedDataModule
from lightning_sharding.recipes.data import datamodule, file_reader

SHARES = ("weight", "proportion", "repeat", "choose", "tokens")  # a Stream's shares (a test holds them equal)


def mixture(
    *,
    streams: Sequence[Mapping[str, Any]],
    samples_per_epoch: int | None,
    batch_composition: str,
    allow_mixture_change: bool,
    schedule: Sequence[Mapping[str, Any]] | None = None,
    storage_options: Mapping[str, Any],
    dim: int,
    sharding: Mapping[str, Any],
    audit_dir: str | None = None,
    **options: Any,
) -> ShardedDataModule:
    """A :class:`ShardedDataModule` over ``streams`` (see ``config.data.StreamOptions``), with a
    share ``schedule`` when given (``config.data.PhaseOptions``)."""
    from lightning_sharding.mixture import Stream
    from lightning_sharding.recipes.synthetic_files import to_regression

    if not streams:
        raise ValueError("data.streams is empty: give one or more {name, format, ...} (see recipe=mixture)")
    built = []
    for i, spec in enumerate(streams):
        key = f"data.streams[{i}]"
        reader = file_reader(
            spec["format"],
            spec["urls"],
            spec["num_items"],
            spec["samples_per_item"],
            dim,
            storage_options=storage_options,
            cache_dir=options["cache_dir"],
            key=key,
        )
        shares = {k: spec[k] for k in SHARES if spec.get(k) is not None}
        try:
            built.append(Stream(spec["name"], reader, **shares))
        except ValueError as err:
            hint = ""
            if len(shares) > 1:  # the recipe's own share stays unless set to null
                override = f"data.streams.{i}.{next(iter(shares))}=null"
                hint = f" (from the command line, set the others to null, e.g. {override})"
            raise ValueError(f"{key}: {err}{hint}") from None
    return datamodule(
        options,
        sharding,
        transform=to_regression,
        audit_dir=audit_dir,
        streams=built,
        samples_per_epoch=samples_per_epoch,
        batch_composition=batch_composition,
        allow_mixture_change=allow_mixture_change,
        schedule=None if schedule is None else [phase_of(p) for p in schedule],
    )


def phase_of(phase: Mapping[str, Any]) -> dict[str, Any]:
    """A ``data.schedule`` phase as :class:`~lightning_sharding.mixture.Phase` takes it: the keys a user
    set (``shares`` a dict)."""
    out: dict[str, Any] = {key: value for key, value in phase.items() if value is not None}
    out["shares"] = dict(phase.get("shares") or {})
    return out
