"""Text tokenized once (issue 55): ``python -m benchmarks.tokenize [--quick] [--repeats R]``.

Generates JSONL files of text documents (words of a Zipf-distributed vocabulary), trains a BPE
``tokenizers`` tokenizer on a sample of them (in memory, no network), then tokenizes every document,
each system with 2 worker processes and the same tokenizer, an EOS token appended to each document:

- ours: ``lightning-sharding tokenize`` (:func:`lightning_sharding.tokens.text.tokenize_files`):
  Megatron ``.bin`` + ``.idx`` files, one per input file;
- LitData's ``optimize`` (``TokensLoader`` chunks), its function reading a JSONL file and tokenizing
  it with ``encode_batch``, as its pretraining example does (``benchmarks/requirements.txt``);
- Hugging Face ``datasets``: ``load_dataset("json")`` (Arrow conversion, a fresh cache) then
  ``.map(batched=True, num_proc=2)`` with ``encode_batch``.

Each system runs in a fresh Python process of its own (so none inherits another's threads or
imports), timed inside it from the call to its output on disk (imports excluded), the rounds
interleaved (ours, LitData, datasets, then again), ``TOKENIZERS_PARALLELISM=false`` for all (2
processes on 2 cores, no threads on top). A figure is the median of the rounds' tokens/s; a ratio
(ours / the peer) the median of the per-round ratios. Every system's token count is checked equal to ours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402

WORKERS = 2
OURS, LITDATA, DATASETS = "ours: lightning-sharding tokenize", "LitData optimize", "HF datasets map(num_proc=2)"
EOS = "<eos>"


def write_corpus(root: Path, megabytes: float, files: int, seed: int = 0) -> list[Path]:
    """JSONL files of ``megabytes`` of text in all, documents of 50 to 1500 words."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["".join(rng.choice(letters, size=int(rng.integers(2, 10)))) for _ in range(20_000)]
    weights = 1.0 / np.arange(1, len(vocabulary) + 1)
    weights /= weights.sum()
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    per_file = megabytes * 1e6 / files
    for k in range(files):
        path = root / f"text-{k:02d}.jsonl"
        written = 0
        with open(path, "w") as f:
            while written < per_file:
                words = rng.choice(len(vocabulary), size=int(rng.integers(50, 1500)), p=weights)
                line = json.dumps({"id": written, "text": " ".join(vocabulary[w] for w in words)}) + "\n"
                f.write(line)
                written += len(line)
        paths.append(path)
    return paths


def train_tokenizer(paths: list[Path], out: Path) -> Path:
    """A byte-level BPE of 8,000 tokens trained on the first file, saved as ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = (json.loads(line)["text"] for line in open(paths[0]))
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=[EOS], show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(out))
    return out


def ours(paths: list[Path], tokenizer: Path, out: Path) -> int:
    from lightning_sharding.tokens import tokenize_files

    done = tokenize_files([str(p) for p in paths], out, str(tokenizer), eos=EOS, workers=WORKERS)
    return int(done["tokens"])


def _litdata_tokenize(path: str, tokenizer_path: str = "") -> Any:
    import torch
    from tokenizers import Tokenizer

    tokenizer = _TOKENIZERS.get(tokenizer_path) or _TOKENIZERS.setdefault(
        tokenizer_path, Tokenizer.from_file(tokenizer_path)
    )
    eos = tokenizer.token_to_id(EOS)
    texts: list[str] = []
    with open(path) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            if len(texts) == 1000:
                for e in tokenizer.encode_batch_fast(texts):
                    yield torch.tensor([*e.ids, eos], dtype=torch.int32)
                texts = []
    for e in tokenizer.encode_batch_fast(texts):
        yield torch.tensor([*e.ids, eos], dtype=torch.int32)


_TOKENIZERS: dict[str, Any] = {}


def litdata(paths: list[Path], tokenizer: Path, out: Path) -> int:
    from functools import partial

    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    optimize(
        fn=partial(_litdata_tokenize, tokenizer_path=str(tokenizer)),
        inputs=[str(p) for p in paths],
        output_dir=str(out),
        chunk_size=2049 * 1024,
        item_loader=TokensLoader(),
        num_workers=WORKERS,
        verbose=False,
    )
    index = json.loads((out / "index.json").read_text())
    return sum(int(c["dim"] or 0) for c in index["chunks"])


def datasets_map(paths: list[Path], tokenizer: Path, out: Path) -> int:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    loaded = Tokenizer.from_file(str(tokenizer))
    eos = loaded.token_to_id(EOS)

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        return {"input_ids": [[*e.ids, eos] for e in loaded.encode_batch_fast(batch["text"])]}

    table = datasets.load_dataset("json", data_files=[str(p) for p in paths], split="train", cache_dir=str(out))
    mapped = table.map(encode, batched=True, num_proc=WORKERS, remove_columns=table.column_names)
    return _lengths_sum(mapped)


def _lengths_sum(mapped: Any) -> int:
    import pyarrow.compute as pc

    column = mapped.data.column("input_ids")
    return int(pc.sum(pc.list_value_length(column)).as_py())


SYSTEMS: dict[str, Callable[[list[Path], Path, Path], int]] = {OURS: ours, LITDATA: litdata, DATASETS: datasets_map}


def available() -> dict[str, str]:
    """The peers that cannot run here, with why."""
    missing = {}
    for name, module in ((LITDATA, "litdata"), (DATASETS, "datasets")):
        try:
            __import__(module)
        except Exception as err:  # noqa: BLE001 - any import failure leaves the peer out, named
            missing[name] = f"{module} does not import ({type(err).__name__}: {err})"
    return missing


def run_alone(name: str, paths: list[Path], tokenizer: Path, out: Path) -> tuple[float, int]:
    """``SYSTEMS[name]`` in a fresh process: its seconds (the call alone) and the tokens it wrote."""
    argv = ["--one", name, "--tokenizer", str(tokenizer), "--out", str(out), *map(str, paths)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.tokenize", *argv], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    return float(done["seconds"]), int(done["tokens"])


def one(name: str, paths: list[Path], tokenizer: Path, out: Path) -> None:
    """Run one system here and print its seconds and tokens as JSON (the child of :func:`run_alone`)."""
    started = time.perf_counter()
    tokens = SYSTEMS[name](paths, tokenizer, out)
    print(json.dumps({"seconds": time.perf_counter() - started, "tokens": tokens}))


def measure(root: Path, megabytes: float, files: int, repeats: int) -> dict[str, Any]:
    paths = write_corpus(root / "text", megabytes, files)
    tokenizer = train_tokenizer(paths, root / "tokenizer.json")
    missing = available()
    rounds: dict[str, list[tuple[float, int]]] = {name: [] for name in SYSTEMS if name not in missing}
    load_before = os.getloadavg()[0]
    for r in range(repeats):
        for name in rounds:
            out = root / f"out-{r}-{list(SYSTEMS).index(name)}"
            rounds[name].append(run_alone(name, paths, tokenizer, out))
            shutil.rmtree(out, ignore_errors=True)
    load_after = os.getloadavg()[0]
    ours_rounds = rounds[OURS]
    rows: dict[str, dict[str, Any]] = {}
    for name, runs in rounds.items():
        counts = {tokens for _, tokens in runs}
        row: dict[str, Any] = {
            "tokens": runs[0][1],
            "tokens_per_s": statistics.median(tokens / seconds for seconds, tokens in runs),
            "seconds": [round(seconds, 2) for seconds, _ in runs],
            "same_tokens": counts == {ours_rounds[0][1]},
        }
        if name != OURS:
            per_round = [(t / s) / (pt / ps) for (s, t), (ps, pt) in zip(ours_rounds, runs, strict=True)]
            row["ratio"] = statistics.median(per_round)
            row["rounds"] = per_round
        rows[name] = row
    for name, why in missing.items():
        rows[name] = {"unavailable": why}
    size = sum(p.stat().st_size for p in paths)
    return {"bytes": size, "files": files, "load_average": (load_before, load_after), "systems": rows}


def table(result: dict[str, Any], repeats: int) -> list[str]:
    """The result in the suite's table form (measure, system, figure, ratio, target, status)."""
    before, after = result["load_average"]
    setting = (
        f"tokens/s, text to token files ({result['bytes'] / 1e6:.0f} MB of JSONL in {result['files']} files, "
        f"BPE of 8,000, {WORKERS} processes on {os.cpu_count()} cores, median of {repeats} rounds, "
        f"load average {before:.1f} -> {after:.1f})"
    )
    lines = ["| measure | system / setting | figure | ratio | target | status |", "|---|---|---:|---:|---|---|"]
    for name in SYSTEMS:
        row = result["systems"][name]
        if "unavailable" in row:
            lines.append(f"| {setting} | {name} | not run: {row['unavailable']} | - | - | not measured |")
            continue
        figure = f"{row['tokens_per_s']:,.0f} tokens/s ({row['tokens']:,} tokens)"
        if name == OURS:
            ratio = "1x"
        else:
            rounds = row["rounds"]
            ratio = f"ours / it: {row['ratio']:.2f}x (rounds {min(rounds):.2f}-{max(rounds):.2f})"
        status = "" if row["same_tokens"] else "**token count differs from ours**"
        lines.append(f"| {setting} | {name} | {figure} | {ratio} | - | {status} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small corpus, one round (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--megabytes", type=float, default=None, help="text to generate (default 60; 4 with --quick)")
    parser.add_argument("--one", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        one(args.one, [Path(p) for p in args.paths], Path(args.tokenizer), Path(args.out))
        return
    repeats = 1 if args.quick else args.repeats
    megabytes = args.megabytes or (4.0 if args.quick else 60.0)
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(Path(tmp), megabytes, 4 if args.quick else 8, repeats)
    print("## Text tokenized once: tokens per second, 2 workers each\n")
    print("\n".join(table(result, repeats)))


if __name__ == "__main__":
    main()
