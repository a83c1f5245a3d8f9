"""Recipe ``pretrain``: tokenized documents of varied lengths, packed into sequences (strategy ``shard``).

The documents are Megatron indexed files (``prefix.bin`` + ``prefix.idx``); with none given, a
corpus of ``documents`` documents of 8 to ``longest`` tokens is generated once: each document a
noisy counter from a random start (token ``t + 1`` is usually ``t + 1 mod vocab``), so a small
model learns it and the loss falls.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lightning_sharding.lightning.datamodule import ShardedDataModule
from lightning_sharding.recipes.data import datamodule, generated
from lightning_sharding.tokens import IndexedTokens, Packing, write_indexed


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


def packed_documents(
    *,
    prefixes: list[str] | None,
    seq_len: int,
    mode: str,
    vocab_size: int,
    labels_across_documents: bool,
    window: int,
    pad_id: int,
    files: int,
    documents: int,
    longest: int,
    sharding: Mapping[str, Any],
    audit_dir: str | None = None,
    **options: Any,
) -> ShardedDataModule:
    """``data=pretrain``: Megatron files (generated when ``prefixes`` is empty) packed into ``seq_len``."""
    if not prefixes:
        name = f"documents-{files}x{documents}-l{longest}-v{vocab_size}"
        where = generated(
            options["cache_dir"], name, lambda d: write_documents(d, files, documents, longest, vocab_size)
        )
        prefixes = [str(where / "part-*.idx")]
    packing = Packing(
        seq_len=seq_len,
        mode=mode,  # type: ignore[arg-type]  # checked by Packing
        vocab_size=vocab_size,
        labels_across_documents=labels_across_documents,
        window=window,
        pad_id=pad_id,
    )
    reader = IndexedTokens(list(prefixes))
    return datamodule(options, sharding, reader=reader, packing=packing, audit_dir=audit_dir)
