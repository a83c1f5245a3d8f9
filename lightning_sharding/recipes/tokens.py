"""Recipe ``tokens``: LLM-style token files (each a 1-d ``.npy`` array of tokens), strategy ``shard``.

Each file is one item; a sample is ``sample_length + 1`` consecutive tokens (inputs and the
shifted targets). The checkpoint's ledger counts samples, not ranks or workers, so a run can
resume on another number of devices or workers (see the README, "Resuming").
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lightning_sharding.core.world import SampleContext
from lightning_sharding.lightning.datamodule import ShardedDataModule
from lightning_sharding.recipes.data import cache_root, datamodule, generated


def write_tokens(directory: Path, num_files: int, tokens_per_file: int, vocab_size: int, seed: int = 0) -> None:
    """``num_files`` files ``tokens-NNNNN.npy`` of ``tokens_per_file`` uint16 tokens below ``vocab_size``.

    The stream is a noisy counter (token ``t+1`` is usually ``t + 1 mod vocab``), so a model can learn it.
    """
    if vocab_size > 2**16:
        raise ValueError(f"data.vocab_size={vocab_size}: generated tokens are uint16, so at most 65536")
    rng = np.random.default_rng(seed)
    for n in range(num_files):
        steps = np.where(rng.random(tokens_per_file) < 0.9, 1, rng.integers(0, vocab_size, tokens_per_file))
        tokens = (np.cumsum(steps) % vocab_size).astype(np.uint16)
        np.save(directory / f"tokens-{n:05d}.npy", tokens)


class AsTokens:
    """``{"x": (L + 1,) tokens}`` -> ``{"tokens": int64 (L + 1,)}`` (a transform, runs in the workers).

    A token outside ``[0, vocab_size)`` would fail deep in the model's embedding with a bare
    ``index out of range``; here it fails naming the token and ``data.vocab_size`` (and the loader
    adds the file and the sample).
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, sample: Mapping[str, Any], ctx: SampleContext | None = None) -> dict[str, Any]:
        """Check one sample's tokens and convert them."""
        tokens = np.asarray(sample["x"], dtype=np.int64)
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"token {bad} is outside data.vocab_size={self.vocab_size} (tokens must be in [0, vocab_size)): "
                "set data.vocab_size to your tokenizer's vocabulary size"
            )
        return {"tokens": tokens}


def token_files(
    *,
    urls: list[str] | None,
    storage_options: Mapping[str, Any],
    sample_length: int,
    vocab_size: int,
    num_files: int,
    tokens_per_file: int,
    sharding: Mapping[str, Any],
    audit_dir: str | None = None,
    **options: Any,
) -> ShardedDataModule:
    """``data=tokens``: token files (generated when ``urls`` is empty), samples of ``sample_length + 1``."""
    from lightning_sharding.readers.npy import NpyReader

    if not urls:
        name = f"tokens-{num_files}x{tokens_per_file}-v{vocab_size}"
        where = generated(options["cache_dir"], name, lambda d: write_tokens(d, num_files, tokens_per_file, vocab_size))
        urls = [str(where / "tokens-*.npy")]
    reader = NpyReader(
        list(urls),
        sample_length=sample_length + 1,
        storage_options=dict(storage_options),
        cache_dir=cache_root(options["cache_dir"]),
    )
    return datamodule(options, sharding, reader=reader, transform=AsTokens(vocab_size), audit_dir=audit_dir)
