"""Text tokenized once: a text column of JSONL or Parquet files into Megatron ``.bin`` + ``.idx`` files.

:func:`tokenize_files` (the ``lightning-sharding tokenize`` command) reads the files through the
readers' storage layer (paths, globs or URLs), tokenizes each document with a Hugging Face
``tokenizers`` tokenizer in worker processes, each taking one part of a file (a byte range of a
JSONL file, row groups of a Parquet file), and writes one ``NAME.bin`` + ``NAME.idx`` per input
file into a local directory, for :class:`~lightning_sharding.tokens.IndexedTokens` to read.

A killed run continues: every finished part is kept (written under a temporary name, then
renamed) and every finished file is recorded in the directory's ``tokenize.json`` with its source's
fingerprint and the settings, so a second run with the same settings tokenizes only what is left.
Settings that differ from those recorded are refused rather than mixed into one directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from lightning_sharding.readers.storage import FileInfo, filesystem, list_files
from lightning_sharding.tokens.stores import MEGATRON_DTYPES, MEGATRON_MAGIC

#: What the output directory records: the settings and every finished file.
MANIFEST = "tokenize.json"
#: The finished parts of files not yet joined, kept across a killed run.
PARTIAL = ".partial"
#: The text formats read, by file extension.
TEXT_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}


def need_tokenizers() -> Any:
    """The ``tokenizers`` package, or an ImportError naming the extra that installs it."""
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError("tokenizing text needs tokenizers: pip install 'lightning-sharding[text]'") from err
    return tokenizers


def load_tokenizer(name: str) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` path, else from the Hugging Face Hub by name."""
    tokenizers = need_tokenizers()
    if os.path.exists(name):
        if os.path.isdir(name):
            name = os.path.join(name, "tokenizer.json")
        try:
            return tokenizers.Tokenizer.from_file(name)
        except Exception as err:
            raise ValueError(f"tokenizer {name!r}: not a tokenizer.json that tokenizers reads ({err})") from None
    if name.endswith(".json") or os.sep in name.strip("/").split("/", 1)[-1]:
        raise FileNotFoundError(f"tokenizer {name!r}: no such file (give a tokenizer.json path or a Hub model name)")
    try:
        return tokenizers.Tokenizer.from_pretrained(name)
    except Exception as err:
        raise ValueError(
            f"tokenizer {name!r}: no such file, and the Hugging Face Hub gave no tokenizer.json for it ({err})"
        ) from None


@dataclass(frozen=True)
class Part:
    """One worker's task: the bytes ``[start, stop)`` of a JSONL file, or row groups ``[start, stop)`` of a Parquet."""

    url: str
    format: str
    index: int
    start: int
    stop: int
    weight: int  # its bytes, for the progress bar
    directory: str  # where its piece is written


def _output_name(info: FileInfo) -> str:
    """The output prefix of an input file: its name under the inputs' common root, without its
    extension, a subdirectory's ``/`` as ``__``."""
    name = info.name or info.url.rstrip("/").rsplit("/", 1)[-1]
    name = name.split("?", 1)[0].strip("/")
    stem = name.rsplit(".", 1)[0] if "." in name.rsplit("/", 1)[-1] else name
    return stem.replace("/", "__")


def _format_of(info: FileInfo) -> str:
    suffix = "." + info.url.split("?", 1)[0].rsplit(".", 1)[-1].lower()
    if suffix not in TEXT_FORMATS:
        raise ValueError(f"{info.url}: tokenize reads JSONL (.jsonl) and Parquet (.parquet) files, not {suffix} files")
    return TEXT_FORMATS[suffix]


def _parquet_groups(url: str, storage_options: dict[str, Any], text_field: str) -> list[tuple[int, int]]:
    """Each row group's rows and bytes; a file without ``text_field`` is an error naming both."""
    from lightning_sharding.readers.parquet import _pyarrow

    fs, path = filesystem(url, storage_options)
    with fs.open(path, "rb") as f:
        meta = _pyarrow().ParquetFile(f).metadata
    names = meta.schema.to_arrow_schema().names
    if text_field not in names:
        raise ValueError(f"{url}: has no column {text_field!r} (its columns: {', '.join(names)}): give --text-field")
    return [(meta.row_group(i).num_rows, meta.row_group(i).total_byte_size) for i in range(meta.num_row_groups)]


def _parts(
    info: FileInfo, fmt: str, directory: str, part_bytes: int, storage_options: dict[str, Any], text_field: str
) -> list[Part]:
    if fmt == "jsonl":
        n = max(1, math.ceil(info.size / part_bytes))
        cuts = [info.size * k // n for k in range(n + 1)]
        return [Part(info.url, fmt, k, cuts[k], cuts[k + 1], cuts[k + 1] - cuts[k], directory) for k in range(n)]
    groups = _parquet_groups(info.url, storage_options, text_field)
    parts: list[Part] = []
    first, weight = 0, 0
    for g, (_, size) in enumerate(groups):
        weight += size
        if weight >= part_bytes or g == len(groups) - 1:
            parts.append(Part(info.url, fmt, len(parts), first, g + 1, weight, directory))
            first, weight = g + 1, 0
    total = sum(p.weight for p in parts) or 1
    # the progress bar counts a Parquet file's size, spread over its parts by their row groups' bytes
    return [Part(p.url, p.format, p.index, p.start, p.stop, info.size * p.weight // total, p.directory) for p in parts]


# --- reading texts ---------------------------------------------------------------------------------------------


def _jsonl_texts(
    part: Part, storage_options: dict[str, Any], field: str, batch: int
) -> Iterator[tuple[list[str], int]]:
    """Batches of the texts of the lines starting in ``[part.start, part.stop)``, with their bytes."""
    fs, path = filesystem(part.url, storage_options)
    with fs.open(path, "rb") as f:
        position = 0
        if part.start:  # the line under way at the start belongs to the part before
            f.seek(part.start - 1)
            position = part.start - 1 + len(f.readline())
        texts: list[str] = []
        counted = part.start
        while position < part.stop:
            line = f.readline()
            if not line:
                break
            at, position = position, position + len(line)
            if line.strip():
                texts.append(_jsonl_text(line, field, part, at, storage_options))
            if len(texts) >= batch:
                yield texts, min(position, part.stop) - counted
                texts, counted = [], min(position, part.stop)
        yield texts, part.stop - counted


def _jsonl_text(line: bytes, field: str, part: Part, at: int, storage_options: dict[str, Any]) -> str:
    try:
        value = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{part.url}, line {_line_number(part, at, storage_options)}: not JSON ({err})") from None
    text = value.get(field) if isinstance(value, dict) else None
    if not isinstance(text, str):
        where = f"{part.url}, line {_line_number(part, at, storage_options)}"
        if not isinstance(value, dict) or field not in value:
            keys = f" (its fields: {', '.join(value)})" if isinstance(value, dict) else ""
            raise ValueError(f"{where}: has no field {field!r}{keys}: give --text-field")
        raise ValueError(f"{where}: field {field!r} is a {type(text).__name__}, not a string")
    return text


def _line_number(part: Part, at: int, storage_options: dict[str, Any]) -> int:
    """The 1-based number of the line starting at byte ``at`` (read only to name a bad line)."""
    fs, path = filesystem(part.url, storage_options)
    with fs.open(path, "rb") as f:
        return int(f.read(at).count(b"\n")) + 1


def _parquet_texts(
    part: Part, storage_options: dict[str, Any], field: str, batch: int
) -> Iterator[tuple[list[str], int]]:
    """Batches of the text column of row groups ``[part.start, part.stop)``, with their share of bytes."""
    from lightning_sharding.readers.parquet import _pyarrow

    fs, path = filesystem(part.url, storage_options)
    with fs.open(path, "rb") as f:
        pf = _pyarrow().ParquetFile(f)
        row = sum(pf.metadata.row_group(g).num_rows for g in range(part.start))
        rows = sum(pf.metadata.row_group(g).num_rows for g in range(part.start, part.stop)) or 1
        for record in pf.iter_batches(batch_size=batch, row_groups=range(part.start, part.stop), columns=[field]):
            texts = record.column(0).to_pylist()
            for k, text in enumerate(texts):
                if not isinstance(text, str):
                    what = "null" if text is None else f"a {type(text).__name__}, not a string"
                    raise ValueError(f"{part.url}, row {row + k}: column {field!r} is {what}")
            row += len(texts)
            yield texts, part.weight * len(texts) // rows


# --- the workers -----------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _start_worker(tokenizer_json: str, settings: dict[str, Any], queue: Any, serial: bool) -> None:
    if serial:  # a worker process: one per core already, no tokenizers threads on top
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    tokenizer = need_tokenizers().Tokenizer.from_str(tokenizer_json)
    _WORKER.update(tokenizer=tokenizer, settings=settings, queue=queue)


def _exit_with_parent(parent: int) -> None:
    """End this worker once the run that started it is gone (killed: nothing else would end it)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _encode(tokenizer: Any, texts: list[str], eos: int | None, dtype: Any) -> tuple[npt.NDArray[Any], list[int]]:
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    ids = [e.ids for e in encode(texts)]
    if eos is not None:
        for one in ids:
            one.append(eos)
    lengths = [len(one) for one in ids]
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(lengths))
    return flat, lengths


def _tokenize_part(part: Part) -> tuple[int, int]:
    """Tokenize one part into ``{index}.bin`` + ``{index}.lengths.npy`` (the marker, written last)."""
    tokenizer, settings, queue = _WORKER["tokenizer"], _WORKER["settings"], _WORKER["queue"]
    dtype = np.dtype(settings["dtype"])
    storage = settings["storage_options"]
    field = settings["text_field"]
    batch = settings["batch_size"]
    if part.format == "jsonl":
        batches = _jsonl_texts(part, storage, field, batch)
    else:
        batches = _parquet_texts(part, storage, field, batch)
    bin_path = os.path.join(part.directory, f"{part.index}.bin")
    all_lengths: list[int] = []
    pending: list[str] = []
    pending_bytes = 0
    with open(bin_path + f".tmp{os.getpid()}", "wb") as out:

        def flush() -> None:
            flat, lengths = _encode(tokenizer, pending, settings["eos_id"], dtype)
            out.write(flat.tobytes())
            all_lengths.extend(lengths)
            if queue is not None:
                queue.put((len(lengths), int(flat.size), pending_bytes))

        for texts, size in batches:
            pending.extend(texts)
            pending_bytes += size
            if len(pending) >= batch:
                flush()
                pending, pending_bytes = [], 0
        if pending or pending_bytes:
            flush()
    os.replace(bin_path + f".tmp{os.getpid()}", bin_path)
    lengths_path = os.path.join(part.directory, f"{part.index}.lengths.npy")
    np.save(lengths_path + f".tmp{os.getpid()}.npy", np.asarray(all_lengths, dtype="<i8"))
    os.replace(lengths_path + f".tmp{os.getpid()}.npy", lengths_path)
    return len(all_lengths), int(sum(all_lengths))


# --- joining parts ---------------------------------------------------------------------------------------------


def _part_done(part: Part) -> bool:
    return os.path.exists(os.path.join(part.directory, f"{part.index}.lengths.npy"))


def _join(parts: list[Part], prefix: str, dtype: Any) -> tuple[int, int]:
    """Join a file's parts into ``prefix.bin`` + ``prefix.idx`` (documents without tokens dropped);
    each written under a temporary name and renamed, the ``.idx`` last."""
    lengths = np.concatenate([np.load(os.path.join(p.directory, f"{p.index}.lengths.npy")) for p in parts])
    kept = lengths[lengths > 0]
    if len(kept) == 0:
        raise ValueError(f"{parts[0].url}: holds no document with a token: nothing to write")
    tmp = f".tmp{os.getpid()}"
    bins = [os.path.join(p.directory, f"{p.index}.bin") for p in parts]
    if len(bins) == 1:  # linked, not moved: a run killed before the .idx is renamed finds its part whole
        with contextlib.suppress(FileNotFoundError):
            os.remove(prefix + ".bin" + tmp)
        try:
            os.link(bins[0], prefix + ".bin" + tmp)
        except OSError:
            shutil.copyfile(bins[0], prefix + ".bin" + tmp)
    else:
        with open(prefix + ".bin" + tmp, "wb") as out:
            for name in bins:
                with open(name, "rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)
    itemsize = np.dtype(dtype).itemsize
    pointers = (np.concatenate(([0], np.cumsum(kept, dtype=np.int64)[:-1])) * itemsize).astype("<i8")
    code = next(c for c, t in MEGATRON_DTYPES.items() if np.dtype(t) == np.dtype(dtype))
    with open(prefix + ".idx" + tmp, "wb") as f:
        f.write(MEGATRON_MAGIC + (1).to_bytes(8, "little") + bytes([code]))
        f.write(len(kept).to_bytes(8, "little") + (len(kept) + 1).to_bytes(8, "little"))
        f.write(kept.astype("<i4").tobytes() + pointers.tobytes() + np.arange(len(kept) + 1, dtype="<i8").tobytes())
    os.replace(prefix + ".bin" + tmp, prefix + ".bin")
    os.replace(prefix + ".idx" + tmp, prefix + ".idx")
    shutil.rmtree(parts[0].directory, ignore_errors=True)
    return len(kept), int(kept.sum())


# --- the progress bar ------------------------------------------------------------------------------------------


class Progress:
    """A progress line on ``stream``: files, documents, tokens, tokens/s and the share of bytes done;
    redrawn in place on a terminal, else a line every ``every`` seconds."""

    def __init__(self, total_bytes: int, files: int, stream: TextIO | None, every: float = 10.0) -> None:
        self.total_bytes, self.files, self.stream = max(total_bytes, 1), files, stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.every = 0.2 if self.tty else every
        self.documents = self.tokens = self.bytes = self.files_done = 0
        self.started = self.shown = time.perf_counter()

    def add(self, documents: int, tokens: int, size: int) -> None:
        """Count what a worker reported."""
        self.documents += documents
        self.tokens += tokens
        self.bytes += size

    def line(self) -> str:
        """The progress as one line."""
        seconds = time.perf_counter() - self.started
        share = min(1.0, self.bytes / self.total_bytes)
        bar = "#" * int(share * 20) + "-" * (20 - int(share * 20))
        return (
            f"tokenize [{bar}] {share:4.0%} {self.files_done}/{self.files} files, {self.documents:,} documents, "
            f"{self.tokens:,} tokens, {self.tokens / max(seconds, 1e-9):,.0f} tokens/s, {seconds:.0f} s"
        )

    def show(self, final: bool = False) -> None:
        """Draw the line when it is time (always when ``final``)."""
        now = time.perf_counter()
        if self.stream is None or (not final and now - self.shown < self.every):
            return
        self.shown = now
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + self.line() + end)
        self.stream.flush()


# --- the whole run ---------------------------------------------------------------------------------------------


def _settings_digest(settings: dict[str, Any]) -> str:
    shown = {k: v for k, v in settings.items() if k != "storage_options"}
    return hashlib.blake2b(json.dumps(shown, sort_keys=True).encode(), digest_size=8).hexdigest()


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _pool_context() -> Any:
    """fork where nothing but the main thread runs (a worker starts at once), else forkserver (spawn)."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1 and sys.platform == "linux":
        return multiprocessing.get_context("fork")
    if "forkserver" not in methods:
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # imported once by the server, not once a worker
    return context


def tokenize_files(
    data: str | Sequence[str],
    output: str | os.PathLike[str],
    tokenizer: str | Any,
    *,
    text_field: str = "text",
    eos: str | int | None = None,
    workers: int = 1,
    batch_size: int = 1000,
    part_bytes: int = 64 << 20,
    storage_options: dict[str, Any] | None = None,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Tokenize the ``text_field`` of every document of JSONL or Parquet files into Megatron files.

    Args:
        data: the files: paths, globs or URLs (as the file readers take them), ``.jsonl`` or ``.parquet``.
        output: a local directory; it gets ``NAME.bin`` + ``NAME.idx`` per input file ``NAME.jsonl``
            (a file in a subdirectory ``sub/NAME`` gives ``sub__NAME``), read by
            ``IndexedTokens("DIR/*.idx")``, and ``tokenize.json``, the record of what is done.
        tokenizer: a ``tokenizer.json`` path, a Hugging Face Hub model name (``"gpt2"``), or a
            ``tokenizers.Tokenizer``.
        text_field: the JSON field or Parquet column holding each document's text.
        eos: a token (its text, such as ``"<|endoftext|>"``, or its id) appended to each document.
        workers: processes tokenizing parts of files at once (1: in this process).
        batch_size: documents per ``encode_batch`` call.
        part_bytes: a JSONL file is cut into parts of about this many bytes, a Parquet file into runs
            of row groups, each one worker's task and the unit a killed run keeps.
        storage_options: fsspec options of the input files' store.
        progress: where the progress line is written (``sys.stderr`` for the command; ``None``: nowhere).

    Returns:
        ``files``, ``written`` (tokenized now), ``kept`` (done by an earlier run), ``documents``,
        ``tokens``, ``seconds``, ``tokens_per_s`` (of what was tokenized now), ``dtype`` and ``output``.

    Documents are appended with ``eos``; one without any token is left out. Token ids are
    ``uint16`` when the vocabulary fits, else ``int32``.
    """
    started = time.perf_counter()
    if workers < 1:
        raise ValueError(f"workers={workers}: give 1 or more")
    tokenizers = need_tokenizers()
    loaded = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else load_tokenizer(str(tokenizer))
    eos_id = _eos_id(loaded, eos)
    vocab = loaded.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab <= 1 << 16 else "int32"
    tokenizer_json = loaded.to_str()
    storage = dict(storage_options or {})
    settings = {
        "tokenizer": hashlib.blake2b(tokenizer_json.encode(), digest_size=16).hexdigest(),
        "text_field": text_field,
        "eos_id": eos_id,
        "dtype": dtype,
        "batch_size": batch_size,
        "storage_options": storage,
    }
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    recorded: dict[str, Any] = {"settings": {k: v for k, v in settings.items() if k != "storage_options"}, "files": {}}
    if manifest_path.exists():
        before = json.loads(manifest_path.read_text())
        if before.get("settings") != recorded["settings"] and before.get("files"):
            differ = sorted(k for k, v in recorded["settings"].items() if before.get("settings", {}).get(k) != v)
            raise ValueError(
                f"{out} holds tokens written with other settings ({', '.join(differ)} differ, "
                f"see {manifest_path}): give another output directory, or delete it to start over"
            )
        recorded["files"] = dict(before.get("files", {}))

    infos = list_files(data, storage)
    names: dict[str, str] = {}
    todo: dict[str, tuple[FileInfo, list[Part]]] = {}
    kept = 0
    for info in infos:
        fmt = _format_of(info)
        name = _output_name(info)
        if name in names:
            raise ValueError(f"{info.url} and {names[name]} would both write {out / name}.bin: rename one")
        names[name] = info.url
        entry = recorded["files"].get(name)
        done = entry is not None and entry.get("fingerprint") == info.fingerprint and entry.get("source") == info.url
        if done and (out / f"{name}.idx").exists() and (out / f"{name}.bin").exists():
            kept += 1
            continue
        key = hashlib.blake2b(
            f"{_settings_digest(settings)};{info.url};{info.fingerprint};{part_bytes}".encode(), digest_size=6
        ).hexdigest()
        directory = out / PARTIAL / f"{name}-{key}"
        directory.mkdir(parents=True, exist_ok=True)
        todo[name] = (info, _parts(info, fmt, str(directory), part_bytes, storage, text_field))

    _clean_partial(out, {Path(parts[0].directory).name for _, parts in todo.values() if parts})
    bar = Progress(sum(info.size for info, _ in todo.values()), len(todo), progress)
    new_documents = new_tokens = 0
    left = {name: [p for p in parts if not _part_done(p)] for name, (_, parts) in todo.items()}
    for _, parts in todo.values():  # parts kept by a killed run count as done
        bar.bytes += sum(p.weight for p in parts if _part_done(p))

    def finished(name: str) -> None:
        nonlocal new_documents, new_tokens
        info, parts = todo[name]
        if not parts:
            raise ValueError(f"{info.url}: holds no row group: nothing to write")
        documents, tokens = _join(parts, str(out / name), dtype)
        recorded["files"][name] = {
            "source": info.url,
            "fingerprint": info.fingerprint,
            "documents": documents,
            "tokens": tokens,
        }
        _write_manifest(manifest_path, recorded)
        new_documents += documents
        new_tokens += tokens
        bar.files_done += 1
        bar.show()

    for name in [n for n, parts in left.items() if not parts]:
        finished(name)
    pending = [(name, part) for name, parts in left.items() for part in parts]
    if pending:
        _run_parts(pending, tokenizer_json, settings, workers, bar, finished)
    if todo:
        bar.show(final=True)
    if not manifest_path.exists():
        _write_manifest(manifest_path, recorded)
    if (out / PARTIAL).is_dir() and not any((out / PARTIAL).iterdir()):
        (out / PARTIAL).rmdir()
    seconds = time.perf_counter() - started
    return {
        "files": len(infos),
        "written": len(todo),
        "kept": kept,
        "documents": sum(f["documents"] for n, f in recorded["files"].items() if n in names),
        "tokens": sum(f["tokens"] for n, f in recorded["files"].items() if n in names),
        "tokens_now": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds else 0.0,
        "dtype": dtype,
        "output": str(out),
    }


def _eos_id(tokenizer: Any, eos: str | int | None) -> int | None:
    if eos is None:
        return None
    if isinstance(eos, int):
        if not 0 <= eos < tokenizer.get_vocab_size(with_added_tokens=True):
            raise ValueError(
                f"eos={eos}: not a token id of the tokenizer (its vocabulary has ids below "
                f"{tokenizer.get_vocab_size(with_added_tokens=True)})"
            )
        return eos
    found = tokenizer.token_to_id(eos)
    if found is None:
        raise ValueError(f"eos={eos!r}: the tokenizer has no such token; give one of its special tokens or an id")
    return int(found)


def _clean_partial(out: Path, keep: set[str]) -> None:
    """Remove the parts of runs with other settings or of files changed since (never used again)."""
    root = out / PARTIAL
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)


def _run_parts(
    pending: list[tuple[str, Part]],
    tokenizer_json: str,
    settings: dict[str, Any],
    workers: int,
    bar: Progress,
    finished: Callable[[str], None],
) -> None:
    """Tokenize the parts (in ``workers`` processes), joining each file once its last part is done."""
    waiting: dict[str, int] = {}
    for name, _ in pending:
        waiting[name] = waiting.get(name, 0) + 1
    if workers == 1:
        _start_worker(tokenizer_json, settings, _Shown(bar), serial=False)
        try:
            for name, part in pending:
                _tokenize_part(part)
                waiting[name] -= 1
                if not waiting[name]:
                    finished(name)
        finally:
            _WORKER.clear()
        return
    context = _pool_context()
    queue = context.Queue()
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=context,
        initializer=_start_worker,
        initargs=(tokenizer_json, settings, queue, True),
    ) as pool:
        futures: dict[Future[tuple[int, int]], str] = {
            pool.submit(_tokenize_part, part): name for name, part in pending
        }
        try:
            while futures:
                done, _ = wait(futures, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(queue, bar)
                for future in done:
                    name = futures.pop(future)
                    future.result()
                    waiting[name] -= 1
                    if not waiting[name]:
                        _drain(queue, bar)
                        finished(name)
                bar.show()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    _drain(queue, bar)


class _Shown:
    """The queue of a run in this process: what the part reports goes to the bar at once."""

    def __init__(self, bar: Progress) -> None:
        self.bar = bar

    def put(self, report: tuple[int, int, int]) -> None:
        self.bar.add(*report)
        self.bar.show()


def _drain(queue: Any, bar: Progress) -> None:
    import queue as queues

    while True:
        try:
            bar.add(*queue.get_nowait())
        except queues.Empty:
            return
