"""Builders shared by every ``data`` option: the datamodule from loader options, generated data sets."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_sharding.config.data import DataOptions
from lightning_sharding.core.private import make_dirs, redact_url
from lightning_sharding.lightning.datamodule import ShardedDataModule
from lightning_sharding.loading.engine import LoadingEngine
from lightning_sharding.readers.base import Reader
from lightning_sharding.readers.sources import Source
from lightning_sharding.readers.storage import scheme_of
from lightning_sharding.strategies import get_strategy
from lightning_sharding.strategies.options import BatchTransform, Transform

# The loader options of config.DataOptions built here rather than passed as they are.
_BUILT_HERE = ("persistent_workers", "root_map")
# The loader options of config.DataOptions that go to ShardedDataModule unchanged: its fields that are
# arguments of LoadingEngine.from_arguments (the one definition of the loader options), less those built
# here; so a loader option added to DataOptions reaches the datamodule with no second edit.
_PASSED = tuple(
    f.name
    for f in dataclasses.fields(DataOptions)
    if f.name in inspect.signature(LoadingEngine.from_arguments).parameters and f.name not in _BUILT_HERE
)
# The DataLoader settings of a recipe that a strategy with workers of its own (dali) does without.
_WORKER_SETTINGS = ("persistent_workers", "multiprocessing_context")


def cache_root(cache_dir: str | None) -> Path:
    """``cache_dir``, or the readers' default cache (``$LIGHTNING_SHARDING_CACHE``, ``~/.cache/...``)."""
    from lightning_sharding.readers.index import default_cache_dir

    return Path(cache_dir) if cache_dir else default_cache_dir()


def generated(cache_dir: str | None, name: str, write: Callable[[Path], object]) -> Path:
    """The directory ``<cache>/datasets/<name>``, written once by ``write(directory)``.

    ``write`` fills a private temporary directory that is renamed into place, so ranks and jobs
    that start together never read a half-written set: the first rename wins, the others are
    discarded.
    """
    final = cache_root(cache_dir) / "datasets" / name
    if final.is_dir():
        return final
    make_dirs(final.parent)  # 0700, like the rest of the cache: the set is the owner's
    tmp = final.with_name(f".{name}.{uuid.uuid4().hex}")
    make_dirs(tmp)
    try:
        write(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def datamodule(
    options: Mapping[str, Any],
    sharding: Mapping[str, Any],
    *,
    reader: Reader | None = None,
    source: Source | None = None,
    transform: Transform | None = None,
    batch_transform: BatchTransform | None = None,
    audit_dir: str | None = None,
    **data: Any,
) -> ShardedDataModule:
    """A :class:`ShardedDataModule` over ``reader`` (or ``source``, or ``data``'s ``streams=``) with
    the config's loader options."""
    settings = dict(sharding)  # the strategy's name and its own settings (config/schemas.py)
    strategy = get_strategy(settings.pop("name"), **settings)  # built here: its fixed options are left out
    kwargs = {key: options[key] for key in _PASSED if key in options}  # one left out keeps its default
    kwargs["persistent_workers"] = bool(options["persistent_workers"]) and options["num_workers"] > 0
    for key in _WORKER_SETTINGS:  # DataLoader settings a strategy runs without (dali's own workers)
        if strategy.refusal(key, kwargs.get(key)) is not None:
            kwargs.pop(key, None)
    kwargs["root_map"] = dict(options.get("root_map") or {})
    return ShardedDataModule(
        reader,
        source=source,
        transform=transform,
        batch_transform=batch_transform,
        audit_dir=audit_dir,
        **data,
        **kwargs,
        sharding=strategy,
    )


def synthetic(
    *,
    num_items: int,
    samples_per_item: int,
    dim: int,
    sharding: Mapping[str, Any],
    audit_dir: str | None = None,
    **options: Any,
) -> ShardedDataModule:
    """``data=synthetic``: the built-in regression set, computed on the fly (no files)."""
    from lightning_sharding.readers.synthetic import SyntheticReader

    reader = SyntheticReader(num_items, samples_per_item, dim)
    return datamodule(options, sharding, reader=reader, audit_dir=audit_dir)


def files(
    *,
    format: str,
    urls: list[str] | None,
    storage_options: Mapping[str, Any],
    endpoint_url: str | None,
    num_items: int,
    samples_per_item: int,
    dim: int,
    sharding: Mapping[str, Any],
    cache_limit: int | float | None = None,
    index_once_per: str = "job",
    prefetch_files: int = 0,
    prefetch_bytes: int | None = None,
    audit_dir: str | None = None,
    data_index: str | bool | None = None,
    **options: Any,
) -> ShardedDataModule:
    """``data=files``: files of one reader format; with no ``urls`` a regression set is generated."""
    from lightning_sharding.recipes.synthetic_files import to_regression

    storage = dict(storage_options)
    if endpoint_url:
        storage.update(endpoint_options(endpoint_url, storage, urls or []))
    spec = (format, urls, num_items, samples_per_item, dim)
    cache = dict(cache_dir=options["cache_dir"], cache_limit=cache_limit)
    cache.update(prefetch_files=prefetch_files, prefetch_bytes=prefetch_bytes)
    cache.update(data_index=data_index)
    reader = file_reader(*spec, storage_options=storage, key="data", index_once_per=index_once_per, **cache)
    return datamodule(options, sharding, reader=reader, transform=to_regression, audit_dir=audit_dir)


def endpoint_options(endpoint_url: str, storage: Mapping[str, Any], urls: list[str]) -> dict[str, Any]:
    """``data.endpoint_url`` as the URLs' storage takes it: S3 in ``client_kwargs``, GCS as is."""
    schemes = {scheme_of(u) for u in urls}
    if any("::" in u for u in urls):
        raise ValueError(
            f"data.endpoint_url={endpoint_url!r} does not reach inside a chained URL "
            f"({redact_url(urls[0])!r}...): set the "
            "endpoint under the inner store's key of data.storage_options: {s3: {client_kwargs: {endpoint_url: ...}}}"
        )
    if schemes <= {"s3", "s3a"}:
        return {"client_kwargs": {**storage.get("client_kwargs", {}), "endpoint_url": endpoint_url}}
    if schemes <= {"gs", "gcs"}:
        return {"endpoint_url": endpoint_url}
    raise ValueError(
        f"data.endpoint_url={endpoint_url!r} sets the endpoint of s3:// or gs:// URLs, and data.urls has "
        f"{', '.join(sorted(s + '://' for s in schemes))}: set that storage's endpoint in data.storage_options"
    )


def file_reader(
    format: str,
    urls: list[str] | None,
    num_items: int,
    samples_per_item: int,
    dim: int,
    *,
    storage_options: Mapping[str, Any],
    cache_dir: str | None,
    key: str,
    cache_limit: int | float | None = None,
    index_once_per: str = "job",
    prefetch_files: int = 0,
    prefetch_bytes: int | None = None,
    data_index: str | bool | None = None,
) -> Reader:
    """A reader of ``format`` over ``urls``; with none, of a regression set generated once into the
    cache. ``key`` names the config key of ``format`` in errors (``data`` or ``data.streams[i]``)."""
    from lightning_sharding.readers import FILE_READERS
    from lightning_sharding.recipes.synthetic_files import FORMATS, write_regression

    if format not in FILE_READERS:
        raise ValueError(f"{key}.format={format!r} is unknown; choose one of {list(FORMATS)}")
    if not urls:

        def write(directory: Path) -> None:
            write_regression(str(directory), format, [samples_per_item] * num_items, dim=dim)

        where = generated(cache_dir, f"{format}-{num_items}x{samples_per_item}x{dim}", write)
        urls = [str(where / f"part-*.{format}")]
    return FILE_READERS[format](
        list(urls),
        storage_options=dict(storage_options),
        cache_dir=cache_root(cache_dir),
        cache_limit=cache_limit,
        index_once_per=index_once_per,
        prefetch_files=prefetch_files,
        prefetch_bytes=prefetch_bytes,
        data_index=data_index,
    )
