"""``lightning-sharding index DATA_URL``: write the data's index beside it, for every later job to read.

The index's format, and how a reader uses it, belong to :mod:`lightning_sharding.readers.data_index`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_sharding.cli._common import FORMATS, CliError, data_files, storage_options


def register(sub: Any) -> None:
    """Add the ``index`` subcommand to the subparsers ``sub``."""
    parser = sub.add_parser(
        "index",
        help="write the index of data files beside them, read by every later job instead of the files",
        description="Index the files (a tar shard's headers, a JSONL file's lines...) once and write the index "
        "into a directory lightning_sharding.index in their common directory (or --output). A job whose reader "
        "lists these files then takes each unchanged file's index from it, on any machine, and indexes only "
        "files changed since (a warning names them). Run it again after changing the data: it indexes only "
        "the files that changed.",
    )
    parser.add_argument(
        "data",
        nargs="+",
        metavar="DATA_URL",
        help="the files: paths, URLs or globs (quoted), e.g. 's3://bucket/ds/*.tar', or a local directory of "
        "files of one format",
    )
    parser.add_argument(
        "--format", choices=sorted(set(FORMATS.values())), help="the files' format (default: their extension)"
    )
    parser.add_argument(
        "--output", metavar="DIR_URL", help="write the index into this directory (default: the files' own)"
    )
    parser.add_argument(
        "--storage-options",
        metavar="JSON",
        help='fsspec options of the store, e.g. \'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'',
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the reader that changes its index, as the jobs pass it (npy: sample_length=128); "
        "VALUE is read as JSON when it parses",
    )
    parser.set_defaults(func=_index)


def _reader(args: argparse.Namespace) -> Any:
    from lightning_sharding.readers import FILE_READERS

    urls, fmt = data_files(args.data, args.format)
    options: dict[str, Any] = {}
    for text in args.option:
        key, eq, value = text.partition("=")
        if not eq or not key:
            raise CliError(f"--option {text!r}: give KEY=VALUE, e.g. sample_length=128")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    storage = storage_options(args.storage_options)
    cls = FILE_READERS[fmt]
    try:
        return cls(urls, storage_options=storage, **options)
    except TypeError as err:
        raise CliError(f"--option: {cls.__name__} takes no such option ({err})") from None


def _index(args: argparse.Namespace) -> int:
    from lightning_sharding.readers.data_index import write_data_index

    reader = _reader(args)
    done = write_data_index(reader, args.output)
    print(
        f"wrote the index of {done['files']} {reader.format} file(s), {done['samples']} samples, to {done['url']} "
        f"in {done['seconds']:.1f} s ({done['indexed']} indexed now, {done['files'] - done['indexed']} taken from an "
        "index already there or the cache). Jobs reading these files take their indexes from it."
    )
    return 0
