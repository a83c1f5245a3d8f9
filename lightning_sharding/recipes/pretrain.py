"""Recipe ``pretrain``: token streams of documents of varied lengths, mixed by tokens and packed
into sequences (strategy ``shard``).

Each stream is Megatron indexed files (``prefix.bin`` + ``prefix.idx``), or Parquet files of token
lists (``.parquet`` files or globs: a tokenized Hugging Face data set, its ``column`` of token ids, read
by :class:`~lightning_sharding.tokens.ParquetTokens`); a stream with none given
gets a corpus of ``documents`` documents of 8 to ``longest`` tokens, generated once: each
document a noisy counter from a random start (token ``t + 1`` is usually ``t + 1 mod vocab``), so
a small model learns it and the loss falls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from lightning_sharding.lightning.datamodule import ShardedDataModule
from lightning_sharding.mixture import Stream
from lightning_sharding.recipes.data import datamodule, generated
from lightning_sharding.recipes.mixture import SHARES, phase_of
from lightning_sharding.tokens import DocumentReader, IndexedTokens, Packing, ParquetTokens, write_indexed


def write_documents(directory: Path, files: int, documents: int, longest: int, vocab_size: int, seed: int = 0) -> None:
    """``files`` Megatron files ``part-NNNNN.bin/.idx`` holding ``documents`` documents in all."""
    if vocab_size > 2**16:
        raise ValueError(f"data.vocab_size={vocab_size}: generated tokens are uint16, so at most 65536")
    if documents < files:
        raise ValueError(f"data.documents={documents} is fewer than data.files={files}: every file needs a document")
    rng = np.random.default_rng(seed)
    for f in range(files):
        docs = []
        for _ in range(documents // files + (f < documents % files)):
            n = int(rng.integers(8, longest + 1))
            steps = np.where(rng.random(n) < 0.9, 1, rng.integers(0, vocab_size, n))
            docs.append(((int(rng.integers(vocab_size)) + np.cumsum(steps)) % vocab_size).astype(np.uint16))
        write_indexed(str(directory / f"part-{f:05d}"), docs, dtype=np.uint16)


def _write(files: int, documents: int, longest: int, vocab_size: int, seed: int, directory: Path) -> None:
    write_documents(directory, files, documents, longest, vocab_size, seed=seed)


def stream_documents(name: str, paths: Sequence[str], column: str = "input_ids") -> DocumentReader:
    """A stream's documents: :class:`ParquetTokens` (the token lists of ``column``) for ``.parquet``
    files or globs, else :class:`IndexedTokens` of Megatron prefixes or ``.idx`` globs."""
    parquet = [p for p in paths if str(p).endswith(".parquet")]
    if not parquet:
        return IndexedTokens(list(paths))
    if len(parquet) < len(paths):
        others = [p for p in paths if p not in parquet]
        raise ValueError(
            f"data.streams {name!r}: prefixes {others} are not .parquet files while {parquet} are: a stream reads "
            "one format (Megatron prefixes or .parquet files); give the others a stream of their own"
        )
    return ParquetTokens(list(parquet), column=column)


def packed_documents(
    *,
    streams: list[Mapping[str, Any]],
    sharding: Mapping[str, Any],
    schedule: list[Mapping[str, Any]] | None = None,
    audit_dir: str | None = None,
    **options: Any,
) -> ShardedDataModule:
    """``data=pretrain``: token streams of Megatron or Parquet files (each generated when its ``prefixes``
    are empty), each at its share in tokens (one pass without one), packed as the config's fields of
    :class:`Packing` say (``seq_len``, ``mode``, ...: the schema holds every field of Packing)."""
    if not streams:
        raise ValueError("data.streams is empty: give one or more {name, prefixes or documents, tokens}")
    packing = Packing(**{f.name: options.pop(f.name) for f in dataclasses.fields(Packing) if f.name in options})
    vocab_size = packing.vocab_size
    mixed = []
    for k, stream in enumerate(streams):
        prefixes = stream.get("prefixes")
        if not prefixes:
            if vocab_size is None:
                raise ValueError(
                    f"data.vocab_size=null: stream {stream['name']!r} has no prefixes, and its generated "
                    "documents need a vocabulary size (set data.vocab_size)"
                )
            files, documents, longest = stream["files"], stream["documents"], stream["longest"]
            name = f"documents-{stream['name']}-{files}x{documents}-l{longest}-v{vocab_size}"
            where = generated(options["cache_dir"], name, partial(_write, files, documents, longest, vocab_size, k))
            prefixes = [str(where / "part-*.idx")]
        share = {k: stream[k] for k in SHARES if stream.get(k) is not None} or {"repeat": 1.0}
        reader = stream_documents(stream["name"], list(prefixes), stream.get("column", "input_ids"))
        mixed.append(Stream(stream["name"], reader, **share))
    if len(mixed) == 1 and mixed[0].repeat == 1.0 and not schedule:  # one stream, one pass: no mixture to draw
        return datamodule(options, sharding, reader=mixed[0].reader, packing=packing, audit_dir=audit_dir)
    phases = None if schedule is None else [phase_of(p) for p in schedule]
    return datamodule(options, sharding, streams=mixed, packing=packing, schedule=phases, audit_dir=audit_dir)
