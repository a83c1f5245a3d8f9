"""Text tokenized once (issue 55 item 5): ``tokenize_files`` and ``lightning-sharding tokenize`` turn a
text field of JSONL or Parquet files into Megatron files that ``IndexedTokens`` reads, the documents'
tokens exactly those of the tokenizer; a killed run continues; bad input is named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding.cli import main as cli_main
from lightning_sharding.tokens import IndexedTokens

pytestmark = pytest.mark.needs("tokenizers")

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards hex every jolly vixen".split()


def texts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    out = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 60)))) for _ in range(count)]
    out[3] = ""  # a document of no token
    out[5] = 'zebra über ünïcode\n"quoted"'  # unknown words, a newline and quotes inside the JSON string
    return out


def make_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"], show_progress=False)
    tokenizer.train_from_iterator(texts(200, seed=9), trainer)
    tokenizer.save(str(path))
    return path


@pytest.fixture
def tokenizer(tmp_path: Path) -> Path:
    return make_tokenizer(tmp_path / "tokenizer.json")


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    with open(path, "w") as f:
        for k, doc in enumerate(docs):
            f.write(json.dumps({"id": k, field: doc}) + "\n")
            if k == 7:
                f.write("\n")  # a blank line is no document
    return path


def write_parquet(path: Path, docs: list[str], row_group: int = 17) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), path, row_group_size=row_group)
    return path


def expected(tokenizer: Path, docs: list[str], eos: int | None) -> list[list[int]]:
    from tokenizers import Tokenizer

    loaded = Tokenizer.from_file(str(tokenizer))
    out = [loaded.encode(d).ids + ([eos] if eos is not None else []) for d in docs]
    return [ids for ids in out if ids]


def documents(pattern: str) -> dict[str, list[list[int]]]:
    """Every file's documents as ``IndexedTokens`` reads them, by file name."""
    reader = IndexedTokens(pattern)
    out: dict[str, list[list[int]]] = {}
    for item in reader.items():
        lengths = reader.document_lengths(item)
        tokens = reader.read_tokens(item, 0, int(lengths.sum()))
        ends = np.cumsum(lengths)
        out[Path(item.key).name] = [
            tokens[e - n : e].tolist() for n, e in zip(lengths.tolist(), ends.tolist(), strict=True)
        ]
    return out


@pytest.mark.needs("pyarrow")
@pytest.mark.parametrize("workers", [1, 2])
def test_jsonl_and_parquet_hold_the_tokenizers_tokens_of_every_document(
    tmp_path: Path, tokenizer: Path, workers: int
) -> None:
    from lightning_sharding.tokens.text import tokenize_files

    a, b, c = texts(300, 1), texts(150, 2), texts(90, 3)
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", a)
    write_jsonl(tmp_path / "data" / "b.jsonl", b)
    # part_bytes small: each JSONL file is cut into several byte ranges, the Parquet into runs of row groups
    done = tokenize_files(
        str(tmp_path / "data" / "*.jsonl"), tmp_path / "out", tokenizer, eos="<eos>", workers=workers, part_bytes=900
    )
    write_parquet(tmp_path / "data" / "c.parquet", c)
    tokenize_files(
        [str(tmp_path / "data" / "c.parquet")],
        tmp_path / "parquet",
        tokenizer,
        text_field="body",
        eos="<eos>",
        workers=workers,
        part_bytes=900,
    )
    assert done["files"] == 2 and done["dtype"] == "uint16" and done["documents"] == 300 + 150
    got = documents(str(tmp_path / "out" / "*.idx"))
    assert got == {"a.bin": expected(tokenizer, a, 1), "b.bin": expected(tokenizer, b, 1)}
    assert documents(str(tmp_path / "parquet" / "*.idx")) == {"c.bin": expected(tokenizer, c, 1)}
    assert not (tmp_path / "out" / ".partial").exists()


def test_without_eos_a_document_of_no_token_is_left_out(tmp_path: Path, tokenizer: Path) -> None:
    from lightning_sharding.tokens.text import tokenize_files

    docs = texts(40)
    write_jsonl(tmp_path / "a.jsonl", docs)
    done = tokenize_files(str(tmp_path / "a.jsonl"), tmp_path / "out", str(tokenizer))
    assert documents(str(tmp_path / "out" / "*.idx")) == {"a.bin": expected(tokenizer, docs, None)}
    assert done["documents"] == 39
    with pytest.raises(ValueError, match=r"eos='</s>': the tokenizer has no such token"):
        tokenize_files(str(tmp_path / "a.jsonl"), tmp_path / "other", str(tokenizer), eos="</s>")


def test_a_run_stopped_after_some_parts_continues_and_writes_the_same_files(
    tmp_path: Path, tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_sharding.tokens import text

    for k in range(3):
        write_jsonl(tmp_path / f"d{k}.jsonl", texts(120, k))
    whole = text.tokenize_files(str(tmp_path / "d*.jsonl"), tmp_path / "whole", tokenizer, eos=1, part_bytes=1500)

    joined: list[str] = []
    real_join = text._join

    def stop_after_one(parts: list[Any], prefix: str, dtype: Any) -> tuple[int, int]:
        if joined:
            raise KeyboardInterrupt  # the run is stopped while the second file's parts are on disk
        joined.append(prefix)
        return real_join(parts, prefix, dtype)

    monkeypatch.setattr(text, "_join", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        text.tokenize_files(str(tmp_path / "d*.jsonl"), tmp_path / "out", tokenizer, eos=1, part_bytes=1500)
    monkeypatch.setattr(text, "_join", real_join)
    partial = list((tmp_path / "out" / ".partial").rglob("*.lengths.npy"))
    assert partial, "the stopped run kept the parts it finished"
    # a part half-written by a killed worker is left under a temporary name: never taken for done
    next((tmp_path / "out" / ".partial").iterdir()).joinpath("99.bin.tmp123").write_bytes(b"\x01\x02")
    calls: list[Any] = []
    real_part = text._tokenize_part
    monkeypatch.setattr(text, "_tokenize_part", lambda part: calls.append(part) or real_part(part))
    again = text.tokenize_files(str(tmp_path / "d*.jsonl"), tmp_path / "out", tokenizer, eos=1, part_bytes=1500)
    assert again["kept"] == 1 and again["written"] == 2
    assert calls and {Path(part.url).name for part in calls} == {"d2.jsonl"}, (
        "d1's parts were kept, not tokenized again"
    )
    for name in ("d0", "d1", "d2"):
        for ext in ("bin", "idx"):
            assert (tmp_path / "out" / f"{name}.{ext}").read_bytes() == (
                tmp_path / "whole" / f"{name}.{ext}"
            ).read_bytes()
    assert again["tokens"] == whole["tokens"]
    assert not (tmp_path / "out" / ".partial").exists()
    # other settings into the same directory are refused, named
    with pytest.raises(ValueError, match=r"other settings \(eos_id differ"):
        text.tokenize_files(str(tmp_path / "d*.jsonl"), tmp_path / "out", tokenizer, part_bytes=1500)


def test_a_run_stopped_while_it_joins_a_files_one_part_continues(
    tmp_path: Path, tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after a file of one part has its ``.bin`` in place and before its ``.idx`` is: the
    part is still whole, so the next run joins it again (it was moved away, and the run failed)."""
    from lightning_sharding.tokens import text

    write_jsonl(tmp_path / "d.jsonl", texts(60))
    whole = text.tokenize_files(str(tmp_path / "d.jsonl"), tmp_path / "whole", tokenizer, eos=1)
    real_replace = os.replace

    def stop_at_the_idx(src: Any, dst: Any) -> None:
        if str(dst).endswith(".idx"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", stop_at_the_idx)
    with pytest.raises(KeyboardInterrupt):
        text.tokenize_files(str(tmp_path / "d.jsonl"), tmp_path / "out", tokenizer, eos=1)
    monkeypatch.setattr(os, "replace", real_replace)
    again = text.tokenize_files(str(tmp_path / "d.jsonl"), tmp_path / "out", tokenizer, eos=1)
    assert again["tokens"] == whole["tokens"]
    for ext in ("bin", "idx"):
        assert (tmp_path / "out" / f"d.{ext}").read_bytes() == (tmp_path / "whole" / f"d.{ext}").read_bytes()


KILLED = """
import os, signal, sys
from lightning_sharding.tokens import text
real, joined = text._join, []
def join_then_die(parts, prefix, dtype):
    done = real(parts, prefix, dtype)
    joined.append(prefix)
    if len(joined) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return done
text._join = join_then_die
text.tokenize_files(sys.argv[1], sys.argv[2], sys.argv[3], eos="<eos>", workers=2, part_bytes=1500)
"""


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_sigkilled_run_continues_from_the_files_it_wrote(tmp_path: Path, tokenizer: Path) -> None:
    from lightning_sharding.tokens.text import tokenize_files

    for k in range(4):
        write_jsonl(tmp_path / f"d{k}.jsonl", texts(100, k))
    pattern = str(tmp_path / "d*.jsonl")
    proc = subprocess.run(
        [sys.executable, "-c", KILLED, pattern, str(tmp_path / "out"), str(tokenizer)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    recorded = json.loads((tmp_path / "out" / "tokenize.json").read_text())["files"]
    # killed as the second file's .bin and .idx were renamed into place, before the record said so:
    # the first is kept, the second tokenized again
    assert len(recorded) == 1 and len(list((tmp_path / "out").glob("*.idx"))) == 2
    again = tokenize_files(pattern, tmp_path / "out", tokenizer, eos="<eos>", workers=2, part_bytes=1500)
    assert (again["kept"], again["written"]) == (1, 3)
    got = documents(str(tmp_path / "out" / "*.idx"))
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(tokenizer)).token_to_id("<eos>")
    assert got == {f"d{k}.bin": expected(tokenizer, texts(100, k), eos) for k in range(4)}
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        [f"d{k}.{e}" for k in range(4) for e in ("bin", "idx")] + ["tokenize.json"]
    )


@pytest.mark.needs("pyarrow")
def test_bad_input_is_named(tmp_path: Path, tokenizer: Path) -> None:
    from lightning_sharding.tokens.text import tokenize_files

    write_jsonl(tmp_path / "a.jsonl", texts(30), field="body")
    with pytest.raises(ValueError, match=r"a\.jsonl, line 1: has no field 'text' \(its fields: id, body\)"):
        tokenize_files(str(tmp_path / "a.jsonl"), tmp_path / "out", tokenizer)
    # a bad line deep in a part that is not the file's first: its number counted from the file's start
    lines = [json.dumps({"text": t}) for t in texts(30)]
    lines[24] = json.dumps({"text": 12})
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"b\.jsonl, line 25: field 'text' is a int, not a string"):
        tokenize_files(str(tmp_path / "b.jsonl"), tmp_path / "out", tokenizer, part_bytes=300)
    write_parquet(tmp_path / "c.parquet", texts(30))
    with pytest.raises(ValueError, match=r"c\.parquet: has no column 'text' \(its columns: id, body\)"):
        tokenize_files(str(tmp_path / "c.parquet"), tmp_path / "out", tokenizer)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a dog", None, "the fox"]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d\.parquet, row 1: column 'body' is null"):
        tokenize_files(str(tmp_path / "d.parquet"), tmp_path / "out", tokenizer, text_field="body")
    with pytest.raises(FileNotFoundError, match=r"tokenizer 'missing/tokenizer\.json': no such file"):
        tokenize_files(str(tmp_path / "a.jsonl"), tmp_path / "out", "missing/tokenizer.json")
    (tmp_path / "e.txt").write_text("hello\n")
    with pytest.raises(ValueError, match=r"e\.txt: tokenize reads JSONL \(\.jsonl\) and Parquet"):
        tokenize_files(str(tmp_path / "e.txt"), tmp_path / "out", tokenizer)


def test_the_command_tokenizes_and_says_how_to_read_the_files(
    tmp_path: Path, tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = texts(50)
    write_jsonl(tmp_path / "a.jsonl", docs)
    out = tmp_path / "tokens"
    argv = [
        "tokenize",
        str(tmp_path / "a.jsonl"),
        "--tokenizer",
        str(tokenizer),
        "--output",
        str(out),
        "--eos",
        "<eos>",
    ]
    assert cli_main(argv) == 0
    printed = capsys.readouterr()
    assert "wrote 50 documents" in printed.out and f"IndexedTokens('{out}/*.idx')" in printed.out
    assert "tokens/s" in printed.err  # the progress line
    assert documents(str(out / "*.idx")) == {"a.bin": expected(tokenizer, docs, 1)}
    assert cli_main([*argv, "--quiet"]) == 0
    assert "1 kept from an earlier run" in capsys.readouterr().out
    assert cli_main(["tokenize", str(tmp_path / "a.jsonl"), "--tokenizer", "nope.json", "--output", str(out)]) == 2
    assert "tokenize: error: tokenizer 'nope.json': no such file" in capsys.readouterr().err


def test_text_in_an_object_store_is_read_through_the_storage_layer(tmp_path: Path, tokenizer: Path) -> None:
    """memory:// (fsspec's in-process store) stands in for s3://: the files are listed and read by URL."""
    import fsspec

    from lightning_sharding.tokens import tokenize_files

    store = fsspec.filesystem("memory")
    docs = texts(80, 4)
    store.pipe("/bucket/text/a.jsonl", write_jsonl(tmp_path / "a.jsonl", docs).read_bytes())
    try:
        done = tokenize_files("memory://bucket/text/*.jsonl", tmp_path / "out", tokenizer, eos=1, part_bytes=700)
    finally:
        store.rm("/bucket", recursive=True)
    assert done["written"] == 1
    assert documents(str(tmp_path / "out" / "*.idx")) == {"a.bin": expected(tokenizer, docs, 1)}
