"""``lightning-sharding tokenize DATA... --tokenizer T --output DIR``: text into Megatron token files, once.

The work (parts, workers, the record a killed run continues from) belongs to
:mod:`lightning_sharding.tokens.text`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightning_sharding.cli._common import CliError, _int_at_least, storage_options


def register(sub: Any) -> None:
    """Add the ``tokenize`` subcommand to the subparsers ``sub``."""
    parser = sub.add_parser(
        "tokenize",
        help="tokenize a text field of JSONL or Parquet files into Megatron .bin/.idx files (resumable)",
        description="Tokenize the text field of every document of JSONL or Parquet files with a Hugging Face "
        "tokenizers tokenizer, in worker processes, into one NAME.bin + NAME.idx per input file in DIR, which "
        "IndexedTokens('DIR/*.idx') reads. A killed run, started again with the same arguments, keeps every "
        "file and part already written and tokenizes the rest. Needs the [text] extra.",
    )
    parser.add_argument(
        "data", nargs="+", metavar="DATA_URL", help="the .jsonl or .parquet files: paths, URLs or globs (quoted)"
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="TOKENIZER",
        help="a tokenizer.json file, or a Hugging Face Hub model name such as gpt2",
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="the local directory of the token files")
    parser.add_argument(
        "--text-field", default="text", metavar="NAME", help="the JSON field or Parquet column (default: text)"
    )
    parser.add_argument(
        "--eos", metavar="TOKEN", help="a token appended to each document: its text (such as '<|endoftext|>') or id"
    )
    parser.add_argument(
        "--workers", type=_int_at_least(1), default=1, metavar="N", help="processes tokenizing at once (default: 1)"
    )
    parser.add_argument(
        "--batch-size", type=_int_at_least(1), default=1000, metavar="N", help="documents per encode_batch call"
    )
    parser.add_argument(
        "--part-mb",
        type=_int_at_least(1),
        default=64,
        metavar="MB",
        help="a worker's task: about this many MB of a file (default: 64); also what a killed run keeps",
    )
    parser.add_argument(
        "--storage-options",
        metavar="JSON",
        help="fsspec options of the input files' store, e.g. '{\"anon\": true}'",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.set_defaults(func=_tokenize)


def _tokenize(args: argparse.Namespace) -> int:
    from lightning_sharding.tokens import tokenize_files

    storage = storage_options(args.storage_options)
    eos: str | int | None = int(args.eos) if args.eos is not None and args.eos.isdigit() else args.eos
    try:
        done = tokenize_files(
            args.data,
            args.output,
            args.tokenizer,
            text_field=args.text_field,
            eos=eos,
            workers=args.workers,
            batch_size=args.batch_size,
            part_bytes=args.part_mb << 20,
            storage_options=storage,
            progress=None if args.quiet else sys.stderr,
        )
    except ImportError as err:
        raise CliError(str(err)) from None
    now = f"{done['written']} tokenized now at {done['tokens_per_s']:,.0f} tokens/s" if done["written"] else ""
    kept = f"{done['kept']} kept from an earlier run" if done["kept"] else ""
    print(
        f"wrote {done['documents']:,} documents, {done['tokens']:,} tokens ({done['dtype']}) of {done['files']} "
        f"file(s) to {done['output']} in {done['seconds']:.1f} s ({', '.join(p for p in (now, kept) if p)}). "
        f"Read them with IndexedTokens('{done['output']}/*.idx')."
    )
    return 0
