"""Token corpora for the packing process tests: documents whose every token is a distinct id.

Token ``t`` (1..T) of the corpus appears once in all its documents, so a batch's ``input_ids`` tell
exactly which tokens of which documents a step trained, and a weight per token id counts, in the
model's weights, how many times each token's gradient was applied. Id 0 pads. Light to import.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from lightning_sharding.mixture import Stream
from lightning_sharding.tokens import IndexedTokens, Packing, write_indexed


def write_corpus(
    directory: Path, files: int, documents: int, seed: int = 0, longest: int = 40, first_token: int = 1
) -> int:
    """``files`` Megatron files ``part-N.bin/.idx`` of ``documents`` documents each, of 1 to
    ``longest`` tokens (some longer than a sequence, some shorter), token ids from ``first_token``
    on (another corpus of a mixture starts after this one's); returns the corpus's tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t = first_token
    for f in range(files):
        docs = []
        for _ in range(documents):
            n = int(rng.integers(1, longest + 1))
            docs.append(np.arange(t, t + n))
            t += n
        write_indexed(str(directory / f"part-{f}"), docs, dtype=np.uint16)
    return t - first_token


def packed_reader(directory: str, **options: Any) -> IndexedTokens:
    """The corpus of ``directory`` (every ``part-*.idx``; a URL too, with the file readers' ``options``)."""
    return IndexedTokens(f"{directory}/part-*.idx", **options)


def upload_corpus(directory: Path, url: str, client: Any) -> str:
    """Put the corpus files of ``directory`` under ``url`` (``s3://bucket/prefix``) with the boto3
    ``client``; returns ``url``."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    for path in sorted(directory.iterdir()):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
    return url


def packed_streams(directories: list[str], shares: list[dict[str, Any]] | None = None) -> list[Stream]:
    """One stream per corpus directory, ``s0``, ``s1``..., each drawn once an epoch (``repeat=1.0``)
    or at its share of ``shares`` (``{"tokens": 600}``...)."""
    given = shares or [{"repeat": 1.0}] * len(directories)
    return [
        Stream(f"s{i}", packed_reader(d), **share) for i, (d, share) in enumerate(zip(directories, given, strict=True))
    ]


def packed_mixture(streams: list[str], spec: dict[str, Any]) -> Any:
    """The ``MixtureReader`` of the corpora ``streams`` packed by ``spec`` (a job's ``tokens`` spec, with
    its ``shares`` and ``schedule``), as the job builds it."""
    from lightning_sharding.mixture import MixtureReader
    from lightning_sharding.tokens import PackedReader

    packing = packed_spec(spec)
    mixed = [replace(s, reader=PackedReader(s.reader, packing)) for s in packed_streams(streams, spec.get("shares"))]
    return MixtureReader(mixed, schedule=spec.get("schedule"))


def token_counts(reader: Any, manifest: Any, order: Any, positions: Any, size: int) -> Any:
    """How often each token id (index = id, ``size`` of them; 0, the padding id, left at 0) the
    sequences at ``positions`` of ``order`` hold, read by ``reader`` (a packed mixture's)."""
    positions = np.asarray(positions, dtype=np.int64)
    if not positions.size:
        return np.zeros(size, dtype=np.int64)
    ids = reader.read_sequences(order, positions, manifest.items)["input_ids"].numpy().ravel()
    return np.bincount(ids[ids != 0], minlength=size)


def packed_spec(spec: dict[str, Any]) -> Packing:
    """``Packing`` of a job's ``tokens`` data spec."""
    return Packing(seq_len=spec["seq_len"], mode=spec["mode"])


def planned_tokens(streams: list[str], spec: dict[str, Any], seed: int, epoch: int, decisions: list[Any]) -> Any:
    """How often each token id (index = id; 0, the padding id, left at 0) is planned in ``epoch`` of a
    mixture of the corpora ``streams`` packed by ``spec`` (a job's ``tokens`` spec) under a share
    ``spec["schedule"]`` and the online ``decisions`` a run made: every sequence of the order, read."""
    from lightning_sharding.mixture import ControlledMixture, Decision, mixture_of

    reader = packed_mixture(streams, {**spec, "shares": None})
    manifest = reader.manifest()
    controlled = ControlledMixture(mixture_of(manifest), tuple(Decision.from_state(d) for d in decisions))  # type: ignore[arg-type]
    order = controlled.order(manifest.counts, seed, epoch)
    batch = reader.read_sequences(order, np.arange(order.total), manifest.items)
    ids = batch["input_ids"].numpy().ravel()
    return np.bincount(ids[ids != 0], minlength=int(ids.max()) + 1)
