"""Packed token sequences (issues 35, 54): ``python -m benchmarks.packing [--quick] [--repeats R]``.

Prints, measured side by side in this one run:

1. Packed tokens per second delivered to the training step, ``seq_len`` 2048, batch 8, 0 and 2
   workers, one table in the suite's form (measure, system, figure, ratio, target, status):
   - ours with every field (``PackedReader`` over Megatron files, ``concat``: ``input_ids``,
     ``labels``, ``position_ids``, ``document_ids``, ``cu_seqlens``), each batch also accounted in
     the ledger as the training callback does (``StepAccounting.sync``: recorded, committed);
   - ours with ``Packing(fields=("input_ids", "labels"))``, the same way;
   - LitData's ``TokensLoader`` over the same tokens (blocks of 2049 cut from one concatenated
     stream, no document boundaries), when LitData is installed (``benchmarks/requirements.txt``);
   - a bare copy of the same tokens: ``(8, 2048)`` int64 from 8 slices of the memory-mapped files
     per batch, in a loop (0 workers) or through a plain ``DataLoader`` (2 workers);
   - a bare write of the four int64 fields: the tokens into ``input_ids`` and, shifted, ``labels``,
     and two ready arrays copied as ``position_ids`` and ``document_ids``, nothing else: the floor of
     a loader with every field, and its ratio to LitData, the most the target could reach.
   In each round every system is started, then they serve in turns of 100 batches, so a change in
   the machine's load falls on all alike; a figure is the median of the rounds, a ratio the median
   of the per-round ratios.
   Target: ours with every field at least 1.5x LitData at 0 and at 2 workers.
2. Where a batch's time goes at 0 workers, every field (the mean over the batches of each part,
   timed inside one loop, less the 2 % slowest steps): the plan's task, the sequences' pieces
   (none when a stretch of consecutive sequences is built at once), reading the tokens and building
   the fields, the ledger's bookkeeping, and the rest (the DataLoader, the delivery, the accounting).
3. Listing 10^6 documents from a Megatron index (``IndexedTokens``: items and lengths).
4. Planning an epoch of 10^9 tokens in 10^7 documents (``concat``: the epoch's document order,
   its token ends, the first batch's pieces), time and the bytes it holds; target under 2 s.
   ``best_fit`` packing of 10^7 documents of 1 to 1999 tokens (10^5 with ``--quick``), the default
   window: ``PackedEpochs`` and its sequences, wall and CPU time; target at most 2 s for 10^7.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_sharding.core.ledger import Ledger  # noqa: E402
from lightning_sharding.core.world import World  # noqa: E402
from lightning_sharding.loading.accounting import StepAccounting, TrainerProgress  # noqa: E402
from lightning_sharding.strategies import get_strategy  # noqa: E402
from lightning_sharding.strategies.options import LoaderOptions  # noqa: E402
from lightning_sharding.tokens import IndexedTokens, PackedEpochs, PackedReader, Packing, write_indexed  # noqa: E402

SEQ_LEN = 2048
BATCH = 8
PLAN_TARGET_S = 2.0
BEST_FIT_DOCUMENTS = 10**7
BEST_FIT_TARGET_S = 2.0  # best_fit packs BEST_FIT_DOCUMENTS documents in at most this (issue 55)


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


EVERY_FIELD = "lightning_sharding, every field"
IDS_LABELS = "lightning_sharding, input_ids + labels"
LITDATA = "LitData TokensLoader"
BARE = "bare copy of the same tokens"
# The least any loader of every field writes: the same tokens into input_ids and, shifted by one, labels,
# and two more (8, 2048) int64 arrays copied from ready ones (position_ids, document_ids), with no plan,
# pieces, ledger or delivery: a floor for ours with every field, in the same loop or DataLoader.
BARE_FIELDS = "bare write of the four int64 fields, nothing else"
TARGET = 1.5  # ours with every field / LitData, at 0 and at 2 workers


class Accounted:
    """Our loader with each batch accounted in the ledger as the training callback does: its step
    runs, an optimizer step applies it, ``StepAccounting.sync`` records and commits it."""

    def __init__(self, loader: Any, ledger: Ledger) -> None:
        self.loader, self.ledger = loader, ledger

    def __iter__(self) -> Iterator[Any]:
        accounting = StepAccounting()
        accounting.start_run(0)
        for step, batch in enumerate(self.loader):
            accounting.batch_starts(TrainerProgress(step, step, step))
            yield batch
            accounting.sync(TrainerProgress(step + 1, step + 1, step + 1), self.loader.delivered.pop, self.ledger)

    def close(self) -> None:
        self.loader.close()


def ours(root: Path, workers: int, fields: tuple[str, ...] | None = None) -> Accounted:
    packing = Packing(SEQ_LEN, "concat") if fields is None else Packing(SEQ_LEN, "concat", fields=fields)
    reader = PackedReader(IndexedTokens(f"{root}/part-*.idx"), packing)
    manifest = reader.manifest()
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    options = LoaderOptions(batch_size=BATCH, num_workers=workers, multiprocessing_context="spawn" if workers else None)
    loader = get_strategy("shard").build(reader, manifest, ledger, World(), options, track=True)
    return Accounted(loader, ledger)


class BareTokens(Dataset[torch.Tensor]):
    """Batch ``b``: 8 consecutive slices of 2048 tokens of the Megatron ``.bin`` files, as one
    ``(8, 2048)`` int64 tensor (the files memory-mapped in the process that reads)."""

    def __init__(self, root: Path) -> None:
        self.paths = sorted(str(p) for p in Path(root).glob("part-*.bin"))
        self._maps: list[np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "_maps": None}

    def __len__(self) -> int:
        return sum(os.path.getsize(p) // 2 for p in self.paths) // (BATCH * SEQ_LEN)

    def __getitem__(self, b: int) -> torch.Tensor:
        if self._maps is None:
            self._maps = [np.memmap(p, dtype=np.uint16, mode="r") for p in self.paths]
        tokens = self._maps[b % len(self._maps)]
        at = (b // len(self._maps)) * BATCH * SEQ_LEN % (tokens.size - BATCH * SEQ_LEN)
        out = np.empty((BATCH, SEQ_LEN), dtype=np.int64)
        for row in range(BATCH):  # one slice per sequence, as a loader of sequences reads them
            out[row] = tokens[at + row * SEQ_LEN : at + (row + 1) * SEQ_LEN]
        return torch.from_numpy(out)


class BareFields(BareTokens):
    """Batch ``b``: :class:`BareTokens`' slices written into ``input_ids`` and shifted by one into
    ``labels``, and ready position and document ids copied into two more int64 arrays."""

    positions = np.tile(np.arange(SEQ_LEN, dtype=np.int64), (BATCH, 1))
    documents = np.repeat(np.arange(BATCH, dtype=np.int64)[:, None], SEQ_LEN, axis=1)

    def __getitem__(self, b: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if self._maps is None:
            self._maps = [np.memmap(p, dtype=np.uint16, mode="r") for p in self.paths]
        tokens = self._maps[b % len(self._maps)]
        at = (b // len(self._maps)) * BATCH * SEQ_LEN % (tokens.size - BATCH * SEQ_LEN - 1)
        ids, labels = np.empty((BATCH, SEQ_LEN), dtype=np.int64), np.empty((BATCH, SEQ_LEN), dtype=np.int64)
        ids.reshape(-1)[:] = tokens[at : at + BATCH * SEQ_LEN]
        labels.reshape(-1)[:] = tokens[at + 1 : at + 1 + BATCH * SEQ_LEN]
        fields = {"input_ids": ids, "labels": labels, "position_ids": self.positions.copy()}
        fields["document_ids"] = self.documents.copy()
        return {k: torch.from_numpy(v) for k, v in fields.items()}


def bare_fields(root: Path, workers: int) -> Iterable[Any]:
    dataset = BareFields(root)
    if not workers:
        return (dataset[b] for b in range(len(dataset)))
    return DataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context="spawn")


def bare_copy(root: Path, workers: int) -> Iterable[Any]:
    dataset = BareTokens(root)
    if not workers:
        return (dataset[b] for b in range(len(dataset)))
    return DataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context="spawn")


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
    loader: Iterable[Any] = StreamingDataLoader(
        dataset, batch_size=BATCH, num_workers=workers, multiprocessing_context="spawn" if workers else None
    )
    return loader


# Batches a system serves before the next one's turn. With workers, a turn starts with the few
# batches its workers prepared meanwhile (prefetch_factor 2 x 2 workers for every system): 4 % of a turn.
CHUNK = 100


def one_round(systems: dict[str, Callable[[], Iterable[Any]]], batches: int) -> dict[str, float]:
    """Each system's tokens/s over ``batches`` batches after its first (start-up) one, all of them
    started first and then served in turns of :data:`CHUNK` batches, so that a change in the
    machine's load (other work on it) falls on every system alike."""
    loaders = {name: make() for name, make in systems.items()}
    iterators = {name: iter(loader) for name, loader in loaders.items()}
    for iterator in iterators.values():
        next(iterator)
    seconds = dict.fromkeys(systems, 0.0)
    tokens = dict.fromkeys(systems, 0)
    served = 0
    while served < batches:
        turn = min(CHUNK, batches - served)
        for name, iterator in iterators.items():
            start = time.perf_counter()
            for _ in range(turn):
                batch = next(iterator)
                ids = batch["input_ids"] if isinstance(batch, dict) else batch
                tokens[name] += int(ids.shape[0]) * SEQ_LEN
            seconds[name] += time.perf_counter() - start
        served += turn
    for name, iterator in iterators.items():
        for held in (loaders[name], iterator):  # our loader stops its workers; a generator ends
            close = getattr(held, "close", None)
            if close is not None:
                close()
    del iterators, loaders
    gc.collect()
    return {name: tokens[name] / seconds[name] for name in systems}


def throughput(root: Path, corpus_tokens: int, batches: int, repeats: int) -> list[dict[str, Any]]:
    """One cell per worker count: each system's tokens/s (median of the rounds) and its ratios."""
    per_file = write_corpus(root / "corpus", corpus_tokens)
    systems: dict[str, Callable[[int], Iterable[Any]]] = {
        EVERY_FIELD: partial(ours, root / "corpus"),
        IDS_LABELS: partial(ours, root / "corpus", fields=("input_ids", "labels")),
        BARE: partial(bare_copy, root / "corpus"),
        BARE_FIELDS: partial(bare_fields, root / "corpus"),
    }
    missing: dict[str, str] = {}
    try:
        import litdata  # noqa: F401

        prepare_litdata(per_file, root / "litdata")
        systems[LITDATA] = partial(litdata_loader, root / "litdata")
    except ImportError:
        missing[LITDATA] = "LitData is not installed (benchmarks/requirements.txt)"
    cells = []
    for workers in (0, 2):
        before = os.getloadavg()[0]
        rounds: dict[str, list[float]] = {name: [] for name in systems}
        for _ in range(repeats):
            measured = one_round({name: partial(make, workers) for name, make in systems.items()}, batches)
            for name, value in measured.items():
                rounds[name].append(value)
        rows: dict[str, dict[str, Any]] = {}
        for name, values in rounds.items():
            rows[name] = {"tokens_per_s": statistics.median(values), "runs": values}
        if LITDATA in rounds:
            for name in (EVERY_FIELD, IDS_LABELS):
                per_round = [a / b for a, b in zip(rounds[name], rounds[LITDATA], strict=True)]
                rows[name].update(ratio=statistics.median(per_round), rounds=per_round)
            rows[EVERY_FIELD].update(target=TARGET, met=rows[EVERY_FIELD]["ratio"] >= TARGET)
        per_round = [a / b for a, b in zip(rounds[EVERY_FIELD], rounds[BARE], strict=True)]
        rows[BARE].update(ratio=statistics.median(per_round), rounds=per_round)
        if LITDATA in rounds:  # the floor of every field against LitData: the most the target could get
            per_round = [a / b for a, b in zip(rounds[BARE_FIELDS], rounds[LITDATA], strict=True)]
            rows[BARE_FIELDS].update(ratio=statistics.median(per_round), rounds=per_round)
        for name, why in missing.items():
            rows[name] = {"unavailable": why}
        load = (before, os.getloadavg()[0])
        cells.append({"workers": workers, "batches": batches, "load_average": load, "systems": rows})
    return cells


def _ratio(row: dict[str, Any]) -> str:
    """A ratio as the suite's table writes it: the median, then the rounds' range."""
    if "ratio" not in row:
        return "1x"
    rounds = row.get("rounds") or [row["ratio"]]
    return f"{row['ratio']:.2f}x (rounds {min(rounds):.2f}-{max(rounds):.2f})"


def _status(row: dict[str, Any]) -> str:
    """A target's verdict as the suite's table writes it."""
    if "met" not in row:
        return ""
    return "met" if row["met"] else "**missed**"


def throughput_rows(cells: list[dict[str, Any]], corpus_tokens: int) -> list[str]:
    """The cells in the suite's table form; the ratio of our rows is to LitData, the bare copy's is
    ours (every field) to it."""
    lines = ["| measure | system / setting | figure | ratio | target | status |", "|---|---|---:|---:|---|---|"]
    for cell in cells:
        before, after = cell["load_average"]
        setting = (
            f"packed tokens/s ({corpus_tokens / 1e6:.0f} M tokens in 4 Megatron files, seq_len {SEQ_LEN}, batch "
            f"{BATCH}, 1 rank x {cell['workers']} workers, load average {before:.1f} -> {after:.1f})"
        )
        for name in (EVERY_FIELD, IDS_LABELS, LITDATA, BARE, BARE_FIELDS):
            row = cell["systems"][name]
            target = f">= {TARGET}x LitData" if name == EVERY_FIELD else "-"
            if "unavailable" in row:
                lines.append(f"| {setting} | {name} | not run: {row['unavailable']} | - | - | not measured |")
                continue
            shown = {EVERY_FIELD: f"{name} (ratio: / LitData)", IDS_LABELS: f"{name} (ratio: / LitData)"}.get(
                name, name
            )
            if name == BARE:
                shown = f"{name} (ratio: ours, every field / it)"
            if name == BARE_FIELDS:
                shown = f"{name} (ratio: it / LitData, the most any every-field loader gets)"
            status = _status(row) or ("not measured" if name == EVERY_FIELD else "")
            figure = f"{row['tokens_per_s']:,.0f} tokens/s"
            ratio = _ratio(row) if "ratio" in row or name == LITDATA else "-"
            lines.append(f"| {setting} | {shown} | {figure} | {ratio} | {target} | {status} |")
    return lines


PARTS = {
    "plan": "the plan's task (RankPlan.batch)",
    "pieces": "the sequences' pieces (PackedOrder.pieces)",
    "read": "reading the tokens and building every field (read_sequences less its pieces)",
    "ledger": "the ledger's bookkeeping (Ledger.record + commit)",
    "rest": "the rest: DataLoader, task, delivery, padding flags, StepAccounting",
    "whole": "the whole step",
}


def breakdown(root: Path, batches: int) -> dict[str, float]:
    """Microseconds per batch at 0 workers, every field: the parts timed inside one loop (each call
    wrapped in a clock), the mean over the batches of each part, the rest being what the whole step
    spent outside them."""
    from lightning_sharding.core.plan import RankPlan
    from lightning_sharding.tokens.packing import PackedOrder

    clock = time.perf_counter_ns
    spent = dict.fromkeys(PARTS, 0)

    def timed(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += clock() - start

        return wrapper

    made = ours(root, 0)
    dataset = made.loader._dataset
    dataset.reader.read_sequences = timed("read", dataset.reader.read_sequences)
    made.ledger.record = timed("ledger", made.ledger.record)  # type: ignore[method-assign]
    made.ledger.commit = timed("ledger", made.ledger.commit)  # type: ignore[method-assign]
    plain = (RankPlan.batch, PackedOrder.pieces)
    RankPlan.batch = timed("plan", RankPlan.batch)  # type: ignore[method-assign]
    PackedOrder.pieces = timed("pieces", PackedOrder.pieces)  # type: ignore[method-assign]
    rows: list[dict[str, int]] = []
    try:
        iterator = iter(made)
        next(iterator)
        for _ in range(batches):
            spent.update(dict.fromkeys(PARTS, 0))
            start = clock()
            next(iterator)  # the step's own accounting of the batch before runs in this call (Accounted)
            spent["whole"] = clock() - start
            rows.append(dict(spent))
    finally:
        RankPlan.batch, PackedOrder.pieces = plain  # type: ignore[method-assign]
        made.close()
    for row in rows:
        row["read"] -= row["pieces"]
        row["rest"] = row["whole"] - sum(row[k] for k in ("plan", "pieces", "read", "ledger"))
    # The mean of each part over the batches, less the 2 % of slowest steps (the machine preempted
    # them): a median would hide the work done every few batches for several (ConcatRun's stretch).
    kept = sorted(rows, key=lambda row: row["whole"])[: max(1, len(rows) * 98 // 100)]
    return {PARTS[k]: statistics.mean(row[k] for row in kept) / 1000 for k in PARTS}


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
    """``best_fit`` as a run's start pays it: ``PackedEpochs`` over ``documents`` documents of 1 to
    1999 tokens and its sequences (the packing), in wall and CPU time, with the load average."""
    lengths = np.random.default_rng(3).integers(1, 2000, documents)
    gc.collect()
    before = os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    epochs = PackedEpochs(lengths, [documents], Packing(SEQ_LEN, "best_fit"))
    total = epochs.total
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "documents": documents,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "load_average": (before, os.getloadavg()[0]),
        "sequences": total,
        "padding": epochs.padding / (total * SEQ_LEN),
        "target_s": BEST_FIT_TARGET_S,
        "met": seconds <= BEST_FIT_TARGET_S if documents >= BEST_FIT_DOCUMENTS else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller corpus and plans (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    quick = args.quick
    corpus_tokens = 2_000_000 if quick else 12_000_000
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cells = throughput(root, corpus_tokens, 100 if quick else 600, 1 if quick else args.repeats)
        parts = breakdown(root / "corpus", 100 if quick else 600)
        listed = listing(root, 100_000 if quick else 1_000_000)
    plan = planning(10**6 if quick else 10**7, 100 if quick else 1000, 100)
    fit = best_fit_scale(10**5 if quick else BEST_FIT_DOCUMENTS)
    print(f"## Packed tokens per second (median of {1 if quick else args.repeats} rounds)\n")
    print("\n".join(throughput_rows(cells, corpus_tokens)))
    print(
        f"\nWhere a batch of {BATCH} x {SEQ_LEN} tokens goes at 0 workers, every field (us, the mean over "
        "the batches of each part, timed inside one loop, less the 2 % slowest steps):\n"
    )
    print("| part | us |")
    print("|---|---:|")
    for name, us in parts.items():
        print(f"| {name} | {us:.1f} |")
    print(f"\nListing {listed['documents']:,} documents from a Megatron index: {listed['seconds']:.2f} s")
    status = "met" if plan["met"] else "NOT met"
    print(
        f"\nPlanning an epoch of {plan['tokens']:,} tokens in {plan['documents']:,} documents (concat, "
        f"{plan['sequences']:,} sequences): {plan['seconds']:.2f} s (target < {PLAN_TARGET_S:.0f} s: {status}); "
        f"holds {plan['held_bytes'] / 2**20:,.0f} MiB ({plan['bytes_per_document']:.0f} bytes a document, "
        f"linear in documents), peak {plan['peak_bytes'] / 2**20:,.0f} MiB while planning"
    )
    before, after = fit["load_average"]
    verdict = {True: "met", False: "missed", None: f"not measured at {fit['documents']:,}"}[fit["met"]]
    print(
        f"best_fit packing of {fit['documents']:,} documents: {fit['seconds']:.2f} s, "
        f"{fit['sequences']:,} sequences, padding {100 * fit['padding']:.2f} % (CPU {fit['cpu_seconds']:.2f} s, "
        f"load average {before:.1f} -> {after:.1f}; target: best_fit packing of 10^7 documents "
        f"<= {BEST_FIT_TARGET_S:.0f} s: {verdict})"
    )


if __name__ == "__main__":
    main()
