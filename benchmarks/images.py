"""JPEG training input, side by side: ``python -m benchmarks.images [--quick] [--repeats R]``.

Generated 256x256 photo-like JPEGs with labels (``benchmarks.decode.photos``, 20,000; 2,000 with
``--quick``) in WebDataset tar shards of 1,000 written by ``webdataset.ShardWriter``. Every system
does the same per-sample work: decode to RGB, random-resized-crop to 224 and flip, with the same
crop rule and the same resize kernel (``lightning_sharding.recipes.images.resize_crop``: torch's
``uint8`` antialiased bilinear, what torchvision's v2 transforms run on tensors), then batches of
64 as a ``uint8`` tensor ``(64, 3, 224, 224)`` and labels; one rank, 0, 1 and 2 workers. The
peers decode with Pillow, as their ``decode("pil")`` / image columns do; ours with simplejpeg:

- ours: the ``images`` recipe's per-sample path: the JPEGs stay bytes through ``TarReader``, and
  the crop (``RandomResizedCrop`` as ``transform``, strategy shard) decodes each with simplejpeg at
  the smallest scale its crop allows;
- ours, batch path: the same decode and crop by ``DecodeCropBatch``, straight into the batch array;
- ours, the reader decodes: ``TarReader(decode="rgb8")`` decodes each JPEG whole, then the crop;
- ``webdataset.WebLoader``: ``WebDataset`` with its own ``split_by_node`` / ``split_by_worker``,
  ``shuffle(1000)``, ``decode("pil")`` and the same crop;
- Hugging Face ``datasets``: the images in Parquet (an ``Image`` column), ``to_iterable_dataset``
  with a shard per file and ``split_dataset_by_node``, shuffled with a buffer of 1,000, the same
  crop in a ``map``; a ``DataLoader`` batches it;
- LitData: the same JPEG bytes and labels in chunks written by its ``optimize``, read by its
  ``StreamingDataset`` (shuffled) and ``StreamingDataLoader``, Pillow decode and the same crop;
- MosaicML Streaming: the same in MDS shards (``bytes`` and ``int`` columns) written by its
  ``MDSWriter``, read by its ``StreamingDataset`` (shuffled) through a ``DataLoader``, the same.

The limit: as many bare processes as workers (one at 0 workers), each reading its share of the
shards' JPEGs into memory and then decoding and cropping them as ours does per sample, into a batch
array: no loader, no collate, no batch moved to a training process.

Figures are images/s over one epoch after each worker's first batch (start-up excluded; for the
limit, from a barrier after the reads to the slowest process's end), the median of R rounds; the
systems run alternately, round by round, and each ratio is the median of the per-round ratios.
Beside each figure, the CPU an image took over the same span in all the system's processes (the
training process and its workers, read from ``/proc``): work on the machine beside the benchmark
moves it far less than images/s, and on busy cores images/s follow it.
``--profile`` then trains the ``images`` recipe's CNN on the same shards at 2 workers with a
Lightning ``Trainer`` under pyinstrument, and prints the share of the training process's time spent
waiting for batches (Lightning's data fetcher) and where the rest goes. The targets of issue 37, at
2 workers: ours at least 1.0x webdataset and ``datasets``, at least 1.3x LitData and Streaming (the
table's column); issue 54's, printed under the table with the ratio to the limit: ours per sample
at least 1.5x LitData. Only ours resumes mid-epoch exactly once on any topology: see
:data:`RESUME` for what each peer does.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import peers  # noqa: E402
from benchmarks.decode import photos  # noqa: E402
from benchmarks.throughput import cpu_seconds  # noqa: E402
from lightning_sharding import TarReader  # noqa: E402
from lightning_sharding.core.ledger import Ledger  # noqa: E402
from lightning_sharding.core.manifest import Manifest  # noqa: E402
from lightning_sharding.core.world import World  # noqa: E402
from lightning_sharding.recipes.images import DecodeCropBatch, RandomResizedCrop, resize_crop  # noqa: E402
from lightning_sharding.strategies.options import LoaderOptions  # noqa: E402
from lightning_sharding.strategies.shard import ShardedLoader  # noqa: E402

BATCH, CROP, PER_SHARD, CLASSES = 64, 224, 1000, 10
CROPPER = RandomResizedCrop(CROP)
HF, WDS, LITDATA, STREAMING = "HF datasets (streaming Parquet)", "webdataset.WebLoader", "LitData", "MosaicML Streaming"
TARGETS = {WDS: 1.0, HF: 1.0, LITDATA: 1.3, STREAMING: 1.3}  # ours / it, at 2 workers (issue 37)
TARGET_54 = 1.5  # issue 54: ours per sample / LitData at 2 workers
RESUME = {  # what each peer keeps to resume mid-epoch (read in their sources and docs; not measured here)
    WDS: "none: WebDataset and WebLoader keep no state; a restart begins the epoch's shards again",
    HF: "IterableDataset.state_dict: the shard and example per worker; the shuffle buffer's content is "
    "not kept (datasets warns and refills it), so a resumed shuffled epoch is not the uninterrupted one",
    LITDATA: "StreamingDataLoader.state_dict: samples served, replanned from the first run's ranks and workers",
    STREAMING: "StreamingDataset.state_dict(num_samples): samples served; other node counts through "
    "num_canonical_nodes",
}


@dataclass
class Data:
    """The same images in each system's format (a peer's format only when it is installed)."""

    tars: list[str]
    parquets: list[str]
    peer_dirs: dict[str, Path] = field(default_factory=dict)


def write_data(root: Path, n: int) -> Data:
    """The same images as tar shards (webdataset's writer), as Parquet files (an image column), and
    in LitData's and Streaming's formats, written by their own writers from the tars."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset

    (root / "tar").mkdir(parents=True)
    (root / "parquet").mkdir()
    images = photos(min(n, 500))  # 500 distinct pictures, repeated: decoding cost is per image, not per picture
    with webdataset.ShardWriter(str(root / "tar" / "part-%05d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for i in range(n):
            sink.write({"__key__": f"img{i:07d}", "jpg": images[i % len(images)], "cls": i % CLASSES})
    for s in range(-(-n // PER_SHARD)):
        rows = range(s * PER_SHARD, min(n, (s + 1) * PER_SHARD))
        table = pa.table(
            {
                "image": [{"bytes": images[i % len(images)], "path": None} for i in rows],
                "label": [i % CLASSES for i in rows],
            }
        )
        pq.write_table(table, root / "parquet" / f"part-{s:05d}.parquet")
    data = Data(sorted(map(str, (root / "tar").glob("*.tar"))), sorted(map(str, (root / "parquet").glob("*"))))
    for name in (LITDATA, STREAMING):
        module, _ = peers.load(name)
        if module is not None:
            data.peer_dirs[name] = root / name.split()[-1].lower()
            module.prepare_tars(data.tars, data.peer_dirs[name])
    return data


def crop_pil(image: Any, rng: random.Random) -> torch.Tensor:
    """The crop and flip of :data:`CROPPER` on a Pillow image, drawn from a Python RNG (the peers
    have no sample seed), resized by the same kernel as ours (torch's ``uint8`` antialiased bilinear,
    which torchvision's v2 transforms use on tensors)."""
    generator = np.random.default_rng(rng.getrandbits(64))
    pixels = np.asarray(image.convert("RGB"))
    box = CROPPER.box(pixels.shape[1], pixels.shape[0], generator)
    return resize_crop(pixels, box, CROP, flip=generator.random() < CROPPER.flip)  # type: ignore[no-any-return]


class PilCrop:
    """``{"jpg": bytes, "cls": int}`` -> ``{"image", "label"}``: Pillow decode and the crop, as the
    streaming peers' per-sample work (picklable: module level)."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        from PIL import Image

        return {"image": crop_pil(Image.open(BytesIO(sample["jpg"])), self.rng), "label": int(sample["cls"])}


# -- ours ---------------------------------------------------------------------------------------


def _ours(tars: list[str], workers: int, batch_path: bool, decode: bool | str = True) -> Iterable[Any]:
    cache = Path(tars[0]).parent.parent / "cache"
    reader = TarReader(tars, decode=decode, fields=["jpg", "cls"], cache_dir=cache)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=0, total=manifest.total, manifest=manifest.summary())
    work: dict[str, Any] = {"batch_transform": DecodeCropBatch(CROP)} if batch_path else {"transform": CROPPER}
    options = LoaderOptions(
        batch_size=BATCH, num_workers=workers, multiprocessing_context="spawn" if workers else None, **work
    )
    return ShardedLoader.build(reader, manifest.items, ledger, world=World(), options=options)


def ours(data: Data, workers: int) -> Iterable[Any]:
    """Per sample: the JPEGs stay bytes through the reader, and the crop (``transform``) decodes each
    at its crop's scale, as the ``images`` recipe does."""
    return _ours(data.tars, workers, batch_path=False)


def ours_decoded(data: Data, workers: int) -> Iterable[Any]:
    """Per sample, the reader decoding each JPEG whole (``decode="rgb8"``), then the crop."""
    return _ours(data.tars, workers, batch_path=False, decode="rgb8")


def ours_batch(data: Data, workers: int) -> Iterable[Any]:
    """The batch path: JPEGs stay bytes, ``DecodeCropBatch`` decodes each at its crop's scale into the batch."""
    return _ours(data.tars, workers, batch_path=True)


# -- the limit: bare processes, no loader --------------------------------------------------------


def _bare(tars: list[str], start: Any, results: Any) -> None:
    """One bare process: the JPEGs of ``tars`` read into memory first (not timed), then each decoded
    at its crop's scale, cropped, resized and flipped by :data:`CROPPER` into a batch array, as ours
    does per sample; it puts the images and the seconds they took."""
    torch.set_num_threads(1)  # as a DataLoader worker
    jpegs = [sample["jpg"] for tar in tars for sample in peers.tar_samples(tar)]
    out = torch.empty((BATCH, 3, CROP, CROP), dtype=torch.uint8)
    start.wait()
    began, cpu = time.perf_counter(), time.process_time()
    for i, data in enumerate(jpegs):
        out[i % BATCH] = CROPPER.decode_crop(data, np.random.default_rng(i))
    results.put((len(jpegs), time.perf_counter() - began, time.process_time() - cpu))


def limit(data: Data, processes: int) -> tuple[float, float]:
    """Images/s of ``processes`` bare processes sharing the shards (each its own), the slowest's time,
    and their CPU milliseconds an image: decode + crop on as many cores as the loader has workers,
    without reading, collating or moving batches (a loader's work) or a training process."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(processes), context.Queue()
    shares = [data.tars[p::processes] for p in range(processes)]
    workers = [context.Process(target=_bare, args=(share, start, results)) for share in shares]
    for process in workers:
        process.start()
    done = [results.get() for _ in workers]
    for process in workers:
        process.join()
    images = sum(n for n, _, _ in done)
    return images / max(seconds for _, seconds, _ in done), 1000 * sum(cpu for _, _, cpu in done) / images


# -- webdataset ---------------------------------------------------------------------------------


class WdsCrop:
    """``(pil image, label)`` -> ``{"image", "label"}`` (picklable: module level)."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __call__(self, sample: tuple[Any, int]) -> dict[str, Any]:
        image, label = sample
        return {"image": crop_pil(image, self.rng), "label": label}


def webdataset_loader(data: Data, workers: int) -> Iterable[Any]:
    import webdataset as wds

    dataset = (
        wds.WebDataset(
            data.tars, shardshuffle=len(data.tars), nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker
        )
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map(WdsCrop())
        .batched(BATCH, partial=True)
    )
    return wds.WebLoader(
        dataset, batch_size=None, num_workers=workers, multiprocessing_context="spawn" if workers else None
    )


# -- Hugging Face datasets ----------------------------------------------------------------------


_HF_RNG = random.Random(0)


def hf_crop(example: dict[str, Any]) -> dict[str, Any]:
    # A NumPy view of the crop: datasets' torch formatter copies it into a tensor either way, and a
    # tensor handed to it warns once a sample (torch.tensor of a tensor), 160,000 lines a run.
    return {"image": crop_pil(example["image"], _HF_RNG).numpy(), "label": example["label"]}


def hf_loader(data: Data, workers: int) -> Iterable[Any]:
    from datasets import Image, load_dataset
    from datasets.distributed import split_dataset_by_node

    stream = load_dataset("parquet", data_files=data.parquets, split="train", streaming=True)
    stream = stream.cast_column("image", Image())  # decoded to PIL when read (pyarrow wrote no HF metadata)
    stream = split_dataset_by_node(stream, rank=0, world_size=1).shuffle(seed=0, buffer_size=1000)
    stream = stream.map(hf_crop).with_format("torch")
    return torch.utils.data.DataLoader(
        stream, batch_size=BATCH, num_workers=workers, multiprocessing_context="spawn" if workers else None
    )


# -- LitData and MosaicML Streaming -------------------------------------------------------------


def streaming_peer(name: str) -> Callable[[Data, int], Iterable[Any]]:
    def build(data: Data, workers: int) -> Iterable[Any]:
        module, reason = peers.load(name)
        assert module is not None, reason
        return module.loader(data.peer_dirs[name], workers, PilCrop(), BATCH, field=None)  # type: ignore[no-any-return]

    return build


OURS, OURS_BATCH = "lightning_sharding", "lightning_sharding, batch path"
OURS_DECODED = "lightning_sharding, the reader decodes (rgb8)"
OURS_ROWS = (OURS, OURS_BATCH, OURS_DECODED)
LIMIT = "the limit: {processes} bare process(es), decode at scale + crop, no loader"
SYSTEMS: dict[str, Callable[[Data, int], Iterable[Any]]] = {
    OURS: ours,
    OURS_BATCH: ours_batch,
    OURS_DECODED: ours_decoded,
    WDS: webdataset_loader,
    HF: hf_loader,
    LITDATA: streaming_peer(LITDATA),
    STREAMING: streaming_peer(STREAMING),
}
NEEDS = {WDS: "webdataset", HF: "datasets"}


def unavailable(name: str) -> str | None:
    """Why peer ``name`` cannot run here (a missing one is a row saying so, never a figure)."""
    if name in peers.PEERS:
        return peers.load(name)[1]
    try:
        __import__(NEEDS.get(name, "lightning_sharding"))
    except ImportError as err:
        return f"not installed ({err.name}; see benchmarks/requirements.txt)"
    return None


def images_in(batch: dict[str, Any]) -> int:
    """The batch's images, not counting ours' padding rows (the epoch's last batch is padded)."""
    assert batch["image"].shape[1:] == (3, CROP, CROP), batch["image"].shape
    padding = batch.get("is_padding")
    return len(batch["label"]) - (int(padding.sum()) if padding is not None else 0)


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (its workers, theirs...), from ``/proc`` (none where there is none)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *descendants(kid)]
    return out


def rate(loader: Iterable[Any], workers: int) -> tuple[float, int, float]:
    """Images/s after each worker's first batch, the images of the whole epoch, and the CPU an image
    took over the same span in every process (the training process and the ones under it, read from
    ``/proc`` at each batch while they live; ``nan`` where there is no ``/proc``), in milliseconds."""
    it = iter(loader)
    seen = sum(images_in(next(it)) for _ in range(max(1, workers)))
    pids = descendants(os.getpid())
    before = [cpu_seconds(p) for p in pids]
    n = counted = 0
    cpu = float("nan")
    start, main = time.perf_counter(), time.process_time()
    for batch in it:
        n += images_in(batch)
        now = [cpu_seconds(p) for p in pids]
        if None not in now and None not in before:  # a worker that has exited keeps the last reading
            counted = n
            cpu = time.process_time() - main + sum(a - b for a, b in zip(now, before, strict=True))  # type: ignore[operator]
    wall = time.perf_counter() - start
    return n / wall, seen + n, 1000 * cpu / counted if counted else float("nan")


def _inclusive(frame: Any, match: Callable[[Any], bool]) -> float:
    """Seconds under the outermost frames that ``match`` (not counted twice when they nest)."""
    if match(frame):
        return float(frame.time)
    return sum(_inclusive(child, match) for child in frame.children)


def profile(tars: list[str], steps: int) -> None:
    """Train the recipe's CNN at 2 workers; profile ``steps`` steps after the workers' first batches."""
    import lightning.pytorch as pl
    from pyinstrument import Profiler

    from lightning_sharding import ShardedDataModule
    from lightning_sharding.recipes.models import ImageClassifier

    profiler = Profiler(interval=0.001)

    class Window(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 2:  # each worker has delivered once: start-up is behind
                profiler.start()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            profiler.stop()

    reader = TarReader(tars, fields=["jpg", "cls"], cache_dir=Path(tars[0]).parent.parent / "cache")  # as the recipe
    data = ShardedDataModule(
        reader, batch_size=BATCH, num_workers=2, multiprocessing_context="spawn", transform=CROPPER, seed=0
    )
    trainer = pl.Trainer(
        max_steps=steps + 2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Window()],
    )
    trainer.fit(ImageClassifier(classes=CLASSES, width=16, learning_rate=0.01), datamodule=data)
    root = profiler.last_session.root_frame()
    total = float(root.time)
    waiting = _inclusive(root, lambda f: f.function == "__next__" and "fetchers" in (f.file_path or ""))
    forward = _inclusive(root, lambda f: f.function == "training_step")
    backward = _inclusive(root, lambda f: f.function == "backward")
    print(f"\nThe training process over {steps} steps of {BATCH} at 2 workers (pyinstrument, {total:.1f} s):\n")
    print("| where | seconds | share |")
    print("|---|---:|---:|")
    for name, seconds in (
        ("waiting for the next batch (Lightning's data fetcher)", waiting),
        ("training_step (forward and loss)", forward),
        ("backward", backward),
        ("the rest (optimizer, Lightning's loop and hooks)", total - waiting - forward - backward),
    ):
        print(f"| {name} | {seconds:.2f} | {seconds / total:.0%} |")


def ratios(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """Ours / theirs: the median of the rounds' ratios, and their least and greatest."""
    each = [a / b for a, b in zip(ours, theirs, strict=True)]
    return statistics.median(each), min(each), max(each)


def issue_54(
    rounds: dict[str, list[float]], cpus: dict[str, list[float]], bare: str, litdata_missing: str | None
) -> list[str]:
    """Issue 54's lines at 2 workers: ours per sample at least 1.5x LitData, and ours / the limit;
    each with the CPU an image took (theirs / ours: what the same busy cores give, whatever else runs)."""

    def cpu(ours: str, theirs: str, label: str) -> str:
        each = statistics.median(b / a for a, b in zip(cpus[ours], cpus[theirs], strict=True))
        mine, other = statistics.median(cpus[ours]), statistics.median(cpus[theirs])
        return f"CPU an image: {mine:.2f} ms, {label} {other:.2f} ms ({each:.2f}x)"

    lines = []
    if litdata_missing:
        lines.append(f"- ours (per sample) at least {TARGET_54}x LitData: not measured ({litdata_missing})")
    else:
        ratio, low, high = ratios(rounds[OURS], rounds[LITDATA])
        status = "met" if ratio >= TARGET_54 else "MISSED"
        lines.append(
            f"- ours (per sample) at least {TARGET_54}x LitData: {ratio:.2f}x (rounds {low:.2f}-{high:.2f}): "
            f"{status}; {cpu(OURS, LITDATA, 'LitData')}"
        )
    for name in (OURS, OURS_BATCH):
        ratio, low, high = ratios(rounds[name], rounds[bare])
        lines.append(
            f"- {name} / the limit ({bare}): {ratio:.2f}x (rounds {low:.2f}-{high:.2f}); "
            f"{cpu(name, bare, 'the limit')}; no target"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 images, not 20,000")
    parser.add_argument("--images", type=int, default=0, help="this many images (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS", help="then profile STEPS training steps")
    parser.add_argument("--no-compare", action="store_true", help="only the profile")
    args = parser.parse_args()
    n = args.images or (2000 if args.quick else 20000)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_data(Path(tmp), n)
        if args.no_compare:
            profile(data.tars, args.profile or 30)
            return
        print(f"{n} JPEGs 256x256, decode + random-resized-crop {CROP} + flip, batch {BATCH}, 1 rank; images/s")
        print(f"(median of {args.repeats} rounds; ratio: ours / theirs, median of the per-round ratios)\n")
        print("CPU: milliseconds an image in every process of the system (training process and workers)\n")
        print("| workers | system | images/s | CPU ms | ours / it | ours, batch path / it | target (ours / it) | met |")
        print("|---:|---|---:|---:|---:|---:|---:|---|")
        missing = {name: why for name in SYSTEMS if (why := unavailable(name))}
        here = {name: build for name, build in SYSTEMS.items() if name not in missing}
        verdicts: list[str] = []
        for workers in args.workers:
            bare = LIMIT.format(processes=max(1, workers))
            rounds: dict[str, list[float]] = {name: [] for name in [*here, bare]}
            cpus: dict[str, list[float]] = {name: [] for name in rounds}
            for _ in range(args.repeats):
                for name, build in here.items():
                    value, total, cpu = rate(build(data, workers), workers)
                    assert total == n, f"{name} served {total} of {n} images in an epoch"
                    rounds[name].append(value)
                    cpus[name].append(cpu)
                value, cpu = limit(data, max(1, workers))
                rounds[bare].append(value)
                cpus[bare].append(cpu)
            for name, values in rounds.items():
                figure = (
                    f"| {workers} | {name} | {statistics.median(values):.0f} | {statistics.median(cpus[name]):.2f} |"
                )
                if name in OURS_ROWS:
                    print(f"{figure} | | | |")
                    continue
                ratio, batch_ratio = (ratios(rounds[ours], values)[0] for ours in (OURS, OURS_BATCH))
                target, met = "", ""
                if workers == 2 and name in TARGETS:
                    target = f"{TARGETS[name]:.1f}"
                    met = "yes" if ratio >= TARGETS[name] else ("batch path" if batch_ratio >= TARGETS[name] else "no")
                print(f"{figure} {ratio:.2f} | {batch_ratio:.2f} | {target} | {met} |")
            for name, why in missing.items():
                print(f"| {workers} | {name} | {why} | | | | | |")
            if workers == 2:
                verdicts += issue_54(rounds, cpus, bare, missing.get(LITDATA))
        if verdicts:
            print("\ntargets (issue 54), at 2 workers:")
            print("\n".join(verdicts))
        print("\nMid-epoch resume: ours, exactly once on any number of ranks and workers.")
        for name, how in RESUME.items():
            print(f"- {name}: {how}")
        if args.profile:
            profile(data.tars, args.profile)


if __name__ == "__main__":
    main()
