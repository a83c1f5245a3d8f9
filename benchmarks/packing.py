"""Packed token sequences (issue 35): ``python -m benchmarks.packing [--quick] [--repeats R]``.

Prints, measured side by side in this one run:

1. Packed tokens per second delivered to the training step, ``seq_len`` 2048, batch 8, 0 and 2
   workers: ours (``PackedReader`` over Megatron files, ``concat``: each batch also carries
   ``labels``, ``position_ids``, ``document_ids`` and ``cu_seqlens``) against LitData's
   ``TokensLoader`` over the same tokens (blocks of 2049 cut from one concatenated stream, no
   document boundaries), when LitData is installed (``benchmarks/requirements.txt``). The systems
   run alternately, round by round; the ratio is the median of the per-round ratios.
2. Listing 10^6 documents from a Megatron index (``IndexedTokens``: items and lengths).
3. Planning an epoch of 10^9 tokens in 10^7 documents (``concat``: the epoch's document order,
   its token ends, the first batch's pieces), time and the bytes it holds; target under 2 s.
   ``best_fit`` packing of 10^6 documents, for scale (its packing is a Python loop over documents).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

import numpy as np  # noqa: E402

from lightning_sharding.core.ledger import Ledger  # noqa: E402
from lightning_sharding.core.world import World  # noqa: E402
from lightning_sharding.strategies import get_strategy  # noqa: E402
from lightning_sharding.strategies.options import LoaderOptions  # noqa: E402
from lightning_sharding.tokens import IndexedTokens, PackedEpochs, PackedReader, Packing, write_indexed  # noqa: E402

SEQ_LEN = 2048
BATCH = 8
PLAN_TARGET_S = 2.0


def write_corpus(root: Path, tokens: int, files: int = 4, seed: int = 0) -> list[list[np.ndarray]]:
    """Documents of 20 to 4000 tokens (ids below 50,000), ``tokens`` in all, in ``files`` Megatron files."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_file: list[list[np.ndarray]] = [[] for _ in range(files)]
    made = 0
    while made < tokens:
        n = int(rng.integers(20, 4001))
        per_file[int(rng.integers(files))].append(rng.integers(1, 50_000, n, dtype=np.uint16))
        made += n
    for f, docs in enumerate(per_file):
        write_indexed(str(root / f"part-{f}"), docs, dtype=np.uint16)
    return per_file


def ours(root: Path, workers: int) -> Iterable[Any]:
    reader = PackedReader(IndexedTokens(f"{root}/part-*.idx"), Packing(SEQ_LEN, "concat"))
    manifest = reader.manifest()
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    options = LoaderOptions(batch_size=BATCH, num_workers=workers, multiprocessing_context="spawn" if workers else None)
    return get_strategy("shard").build(reader, manifest, ledger, World(), options, track=False)


def prepare_litdata(per_file: list[list[np.ndarray]], out: Path) -> None:
    """The same tokens, file by file, written by LitData's own ``optimize`` for its ``TokensLoader``."""
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    arrays = [np.concatenate(docs) for docs in per_file]
    for i, a in enumerate(arrays):
        np.save(out.parent / f"litdata-input-{i}.npy", a)

    optimize(
        fn=_litdata_documents,
        inputs=[str(out.parent / f"litdata-input-{i}.npy") for i in range(len(arrays))],
        output_dir=str(out),
        chunk_size=(SEQ_LEN + 1) * 64,
        item_loader=TokensLoader(),
        num_workers=1,
        verbose=False,
    )


def _litdata_documents(path: str) -> Any:
    import torch

    yield torch.from_numpy(np.load(path).astype(np.int64))


def litdata_loader(out: Path, workers: int) -> Iterable[Any]:
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    dataset = StreamingDataset(str(out), item_loader=TokensLoader(block_size=SEQ_LEN + 1), shuffle=True, seed=0)
    return StreamingDataLoader(
        dataset, batch_size=BATCH, num_workers=workers, multiprocessing_context="spawn" if workers else None
    )


def tokens_per_s(make: Callable[[], Iterable[Any]], batches: int) -> float:
    """Tokens of ``batches`` batches over the time they took, after the first (start-up) batch."""
    loader = make()
    iterator = iter(loader)
    first = next(iterator)
    del first
    start = time.perf_counter()
    tokens = 0
    for _ in range(batches):
        batch = next(iterator)
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        tokens += int(ids.shape[0]) * SEQ_LEN
    elapsed = time.perf_counter() - start
    close = getattr(iterator, "close", None) or getattr(loader, "close", None)
    if close is not None:
        close()
    del iterator, loader
    gc.collect()
    return tokens / elapsed


def throughput(root: Path, corpus_tokens: int, batches: int, repeats: int) -> list[dict[str, Any]]:
    per_file = write_corpus(root / "corpus", corpus_tokens)
    rows = []
    try:
        import litdata  # noqa: F401

        has_litdata = True
        prepare_litdata(per_file, root / "litdata")
    except ImportError:
        has_litdata = False
    for workers in (0, 2):
        runs: list[tuple[float, float | None]] = []
        for _ in range(repeats):
            a = tokens_per_s(partial(ours, root / "corpus", workers), batches)
            b = tokens_per_s(partial(litdata_loader, root / "litdata", workers), batches) if has_litdata else None
            runs.append((a, b))
        row: dict[str, Any] = {"workers": workers, "ours": statistics.median(a for a, _ in runs)}
        if has_litdata:
            row["litdata"] = statistics.median(b for _, b in runs if b is not None)
            row["ratio"] = statistics.median(a / b for a, b in runs if b is not None)
        rows.append(row)
    return rows


def listing(root: Path, documents: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 60, documents)
    tokens = np.ones(int(lengths.sum()), dtype=np.uint16)
    prefix = root / "million"
    # Written directly (one sequence per document): write_indexed takes a list of arrays.
    write_indexed(str(prefix), np.split(tokens, np.cumsum(lengths)[:-1]), dtype=np.uint16)
    start = time.perf_counter()
    reader = IndexedTokens(str(prefix))
    items = reader.items()
    got = reader.lengths(items)
    elapsed = time.perf_counter() - start
    assert got.size == documents
    return {"documents": documents, "seconds": elapsed}


def planning(documents: int, files: int, mean: int) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 2 * mean, documents)
    counts = np.full(files, documents // files)
    counts[-1] += documents - int(counts.sum())
    gc.collect()
    tracemalloc.start()
    start = time.perf_counter()
    epochs = PackedEpochs(lengths, counts, Packing(SEQ_LEN, "concat"))
    order = epochs.order(epochs.counts, 0, 0)
    order.pieces(np.arange(BATCH))
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    held = epochs.lengths.nbytes + epochs.token_start_in_item.nbytes + order.documents.nbytes + order._ends.nbytes
    tracemalloc.stop()
    return {
        "documents": documents,
        "tokens": epochs.tokens,
        "sequences": epochs.total,
        "seconds": elapsed,
        "peak_bytes": peak,
        "held_bytes": held,
        "bytes_per_document": held / documents,
        "target_s": PLAN_TARGET_S,
        "met": elapsed < PLAN_TARGET_S,
    }


def best_fit_scale(documents: int) -> dict[str, Any]:
    lengths = np.random.default_rng(3).integers(1, 2000, documents)
    start = time.perf_counter()
    epochs = PackedEpochs(lengths, [documents], Packing(SEQ_LEN, "best_fit"))
    total = epochs.total
    return {
        "documents": documents,
        "seconds": time.perf_counter() - start,
        "sequences": total,
        "padding": epochs.padding / (total * SEQ_LEN),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller corpus and plans (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    quick = args.quick
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = throughput(root, 2_000_000 if quick else 12_000_000, 20 if quick else 120, 1 if quick else args.repeats)
        listed = listing(root, 100_000 if quick else 1_000_000)
    plan = planning(10**6 if quick else 10**7, 100 if quick else 1000, 100)
    fit = best_fit_scale(10**5 if quick else 10**6)
    print(f"## Packed tokens per second (seq_len {SEQ_LEN}, batch {BATCH}; ours with labels, positions, documents)")
    print("| workers | ours tokens/s | LitData TokensLoader tokens/s | ours / LitData |")
    print("|---|---|---|---|")
    for row in rows:
        lit = f"{row['litdata']:,.0f}" if "litdata" in row else "not installed"
        ratio = f"{row['ratio']:.2f}" if "ratio" in row else "-"
        print(f"| {row['workers']} | {row['ours']:,.0f} | {lit} | {ratio} |")
    print(f"\nListing {listed['documents']:,} documents from a Megatron index: {listed['seconds']:.2f} s")
    status = "met" if plan["met"] else "NOT met"
    print(
        f"\nPlanning an epoch of {plan['tokens']:,} tokens in {plan['documents']:,} documents (concat, "
        f"{plan['sequences']:,} sequences): {plan['seconds']:.2f} s (target < {PLAN_TARGET_S:.0f} s: {status}); "
        f"holds {plan['held_bytes'] / 2**20:,.0f} MiB ({plan['bytes_per_document']:.0f} bytes a document, "
        f"linear in documents), peak {plan['peak_bytes'] / 2**20:,.0f} MiB while planning"
    )
    print(
        f"best_fit packing of {fit['documents']:,} documents: {fit['seconds']:.2f} s, "
        f"{fit['sequences']:,} sequences, padding {100 * fit['padding']:.2f} %"
    )


if __name__ == "__main__":
    main()
