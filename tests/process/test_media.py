"""Images, audio and video in WebDataset shards, decoded by extension inside real DataLoader workers.

The shards are written by third-party writers, as a user's would be: ``webdataset.ShardWriter``
packs the files; Pillow encodes the images, soundfile the audio and PyAV the video.
"""

from __future__ import annotations

import io
import re
import tarfile
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch

from lightning_sharding import TarReader
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import BatchContext, SampleContext, WorkerContext, World
from lightning_sharding.readers.decoding import IMAGE_SPECS, AudioDecoder, ImageDecoder, VideoDecoder, decoders
from lightning_sharding.recipes.images import DecodeCropBatch, RandomResizedCrop, striped_image, write_image_shards
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import ShardedLoader

pytestmark = pytest.mark.needs("PIL", "simplejpeg", "soundfile", "av", "webdataset")

H, W = 24, 32  # every image and video frame
RATE, FRAMES = 8000, 800  # audio: 0.1 s
CLIP = 12  # video frames


def image_of(i: int) -> np.ndarray:
    """A smooth picture (JPEG keeps it close) that differs per sample."""
    y, x = np.mgrid[0:H, 0:W]
    return np.stack([(x * 8 + i) % 256, (y * 10 + 3 * i) % 256, np.full_like(x, (40 * i) % 256)], -1).astype(np.uint8)


def sound_of(i: int) -> np.ndarray:
    """Two channels of 16-bit samples (FLAC is lossless for them)."""
    t = np.arange(FRAMES)
    wave = np.stack([np.sin(t * (i + 1) / 50), np.cos(t / (i + 2))], -1) * 0.5
    return (wave * 32767).astype(np.int16)


def encode(array: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt, **({"lossless": True} if fmt == "WEBP" else {"quality": 95}))
    return out.getvalue()


def encode_flac(samples: np.ndarray) -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, samples, RATE, format="FLAC", subtype="PCM_16")
    return out.getvalue()


def encode_mp4(i: int) -> bytes:
    """CLIP gray frames; frame f is all ``(20 * f + i) % 200`` (flat frames survive the codec)."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for f in range(CLIP):
            frame = av.VideoFrame.from_ndarray(np.full((H, W, 3), (20 * f + i) % 200, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def write_shards(root: Path, n: int, per_shard: int) -> list[str]:
    import webdataset

    root.mkdir(parents=True, exist_ok=True)
    with webdataset.ShardWriter(str(root / "media-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            image = image_of(i)
            sink.write(
                {
                    "__key__": f"clip{i:05d}",
                    "jpg": encode(image, "JPEG"),
                    "png": encode(image, "PNG"),
                    "webp": encode(image, "WEBP"),
                    "flac": encode_flac(sound_of(i)),
                    "mp4": encode_mp4(i),
                    "cls": i,
                }
            )
    return sorted(str(p) for p in root.glob("media-*.tar"))


def add_worker(sample: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Runs in the worker, after the reader decoded the sample there."""
    assert isinstance(sample["jpg"], torch.Tensor), type(sample["jpg"])
    return {**sample, "worker": ctx.worker.worker_id}


def media() -> dict[str, Any]:
    """Images as uint8 CHW tensors, audio as tensors and 3 frames of each video (built in the test:
    a decoder checks its library is installed, and the module imports without the extras)."""
    return decoders(image="torchrgb8", audio="torch", video=VideoDecoder(frames=3))


def serve(reader: TarReader, **options: Any) -> list[tuple[dict[str, Any], Any]]:
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=5, total=manifest.total, manifest=manifest.summary())
    loader = ShardedLoader.build(
        reader, manifest.items, ledger, world=World(0, 1), track=True, options=LoaderOptions(**options)
    )
    return [(batch, loader.pop_delivered()) for batch in loader]


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_spawned_workers_decode_every_kind_of_file_of_shards_a_third_party_wrote(tmp_path: Path) -> None:
    from PIL import Image

    urls = write_shards(tmp_path / "shards", n=20, per_shard=6)
    assert len(urls) == 4
    reader = TarReader(urls, decode=media(), cache_dir=tmp_path / "cache")
    delivered = serve(reader, batch_size=4, num_workers=2, transform=add_worker, shuffle=True)
    seen = []
    for batch, _ in delivered:
        real = ~batch["is_padding"]
        assert batch["jpg"].dtype == torch.uint8 and batch["jpg"].shape[1:] == (3, H, W)
        waves, rates = batch["flac"]
        assert waves.shape[1:] == (2, FRAMES) and set(rates.tolist()) == {RATE}
        assert batch["mp4"].dtype == torch.uint8 and batch["mp4"].shape[1:] == (3, 3, H, W)
        for row in np.flatnonzero(real.numpy()):
            i = int(batch["cls"][row])
            assert batch["__key__"][row] == f"clip{i:05d}"
            seen.append(i)
            image = torch.from_numpy(image_of(i).transpose(2, 0, 1))
            assert torch.equal(batch["png"][row], image) and torch.equal(batch["webp"][row], image)
            # simplejpeg (libjpeg-turbo) decodes the JPEG as Pillow does, to within rounding
            by_pillow = torch.from_numpy(np.asarray(Image.open(io.BytesIO(encode(image_of(i), "JPEG")))).copy())
            assert (batch["jpg"][row].int() - by_pillow.permute(2, 0, 1).int()).abs().max() <= 2
            assert (batch["jpg"][row].int() - image.int()).abs().float().mean() < 10
            np.testing.assert_array_equal(waves[row].numpy(), sound_of(i).T / 32768)
            # frames 0, 6 and 11 of the clip (3 evenly spaced), each flat at its gray level
            levels = batch["mp4"][row].float().mean(dim=(1, 2, 3))
            expected = torch.tensor([(20 * f + i) % 200 for f in (0, 6, 11)], dtype=torch.float32)
            assert (levels - expected).abs().max() < 6, (levels, expected)
    assert sorted(seen) == list(range(20))
    assert {int(w) for b, _ in delivered for w in b["worker"]} == {0, 1}


def corrupt(url: str, member: str) -> None:
    """Overwrite the middle of a member's data (its tar header stays valid)."""
    with tarfile.open(url) as tar:
        info = tar.getmember(member)
    with open(url, "r+b") as f:
        f.seek(info.offset_data + info.size // 4)
        f.write(b"\x00" * (info.size // 2))


@pytest.mark.parametrize("field", ["jpg", "png", "webp", "flac", "mp4"])
def test_a_corrupt_file_names_its_shard_key_and_field_and_on_error_skip_counts_it(tmp_path: Path, field: str) -> None:
    urls = write_shards(tmp_path / "shards", n=8, per_shard=4)
    corrupt(urls[1], f"clip00005.{field}")
    only = decoders(image="torchrgb8", audio="torch", video=VideoDecoder(frames=3), base={"cls": int})
    reader = TarReader(urls, decode=only, fields=[field, "cls"], cache_dir=tmp_path / "cache")
    named = re.escape(f"{urls[1]}: sample 1 (key 'clip00005') is corrupt: field {field!r}")
    with pytest.raises(Exception, match=named):
        serve(reader, batch_size=4, shuffle=False)
    delivered = serve(reader, batch_size=4, shuffle=False, on_error="skip")
    served = sorted(int(c) for b, _ in delivered for c, pad in zip(b["cls"], b["is_padding"], strict=True) if not pad)
    assert served == [0, 1, 2, 3, 4, 6, 7]
    assert sum(len(p.skipped) for _, p in delivered) == 1


def test_every_image_spec_gives_webdatasets_container_type_and_layout() -> None:
    from PIL import Image

    image = image_of(3)
    data = encode(image, "PNG")
    for spec, (container, etype, mode) in IMAGE_SPECS.items():
        out = ImageDecoder(spec)(data)
        channels = len(mode)
        if container == "pil":
            assert isinstance(out, Image.Image) and out.mode == mode and out.size == (W, H)
            continue
        shape = (H, W) if channels == 1 else (H, W, channels)
        if container == "torch":
            assert isinstance(out, torch.Tensor)
            shape = (channels, H, W)
            dtype = torch.uint8 if etype == "uint8" else torch.float32
        else:
            assert isinstance(out, np.ndarray) and out.flags.writeable
            dtype = np.uint8 if etype == "uint8" else np.float32
        assert tuple(out.shape) == shape and out.dtype == dtype, spec
        if mode == "RGB":
            values = out if container == "numpy" else out.numpy().transpose(1, 2, 0)
            np.testing.assert_allclose(values, image if etype == "uint8" else image / 255.0, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"unknown image spec 'rgb16': use one of l8, rgb8"):
        ImageDecoder("rgb16")
    # TarReader(decode="pil") is decoders(image="pil"): images decoded, the basic fields too.
    assert set(decoders(image="pil")) >= {"jpg", "png", "webp", "npy", "json", "cls"}


def test_audio_formats_and_video_frame_choices() -> None:
    import soundfile

    samples = sound_of(1)
    for fmt in ("WAV", "FLAC", "OGG", "MP3"):
        out = io.BytesIO()
        soundfile.write(out, samples, RATE, format=fmt)
        waveform, rate = AudioDecoder()(out.getvalue())
        assert rate == RATE and waveform.dtype == torch.float32 and waveform.shape[0] == 2, fmt
        expected = samples.T / 32768
        if fmt in ("WAV", "FLAC"):  # lossless: the very samples
            np.testing.assert_allclose(waveform.numpy(), expected, atol=1e-6, err_msg=fmt)
        else:  # lossy, with the codec's delay and padding: about as long, about as loud
            assert abs(waveform.shape[1] - FRAMES) < FRAMES, (fmt, waveform.shape)
            loudness = waveform.square().mean(dim=1).sqrt().numpy()
            np.testing.assert_allclose(loudness, np.sqrt((expected**2).mean(axis=1)), rtol=0.25, err_msg=fmt)
    clip = encode_mp4(0)
    assert VideoDecoder()(clip).shape == (CLIP, 3, H, W)
    assert VideoDecoder(frames=[11, 0], output="numpy")(clip).shape == (2, H, W, 3)
    first, last = VideoDecoder(frames=[0, 11])(clip).float().mean(dim=(1, 2, 3)).tolist()
    assert abs(first - 0) < 6 and abs(last - 220 % 200) < 6
    with pytest.raises(ValueError, match=r"the video has 12 frames; frame 12 was asked for"):
        VideoDecoder(frames=[3, 12])(clip)


def crops_by_key(reader: TarReader, world_size: int, **loader_options: Any) -> dict[str, bytes]:
    """Every image of one epoch (cropped to 20 by the options' transform or batch_transform), by
    key, over all ranks."""
    manifest = Manifest.from_items(reader.items())
    out: dict[str, bytes] = {}
    for rank in range(world_size):
        ledger = Ledger(seed=9, total=manifest.total, manifest=manifest.summary())
        options = LoaderOptions(batch_size=4, **loader_options)
        loader = ShardedLoader.build(reader, manifest.items, ledger, world=World(rank, world_size), options=options)
        for batch in loader:
            assert batch["image"].dtype == torch.uint8 and batch["image"].shape[1:] == (3, 20, 20)
            for key, image, pad in zip(batch["__key__"], batch["image"], batch["is_padding"], strict=True):
                if not pad:
                    assert key not in out, f"{key} served twice"
                    out[key] = image.numpy().tobytes()
    return out


def keep_key(crop: Any, sample: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {**crop(sample, ctx), "__key__": sample["__key__"]}


@pytest.mark.processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("decode", [True, "rgb8"], ids=["bytes", "decoded"])
def test_the_images_recipes_crops_are_the_same_on_any_topology(tmp_path: Path, decode: bool | str) -> None:
    """recipe=images draws each crop and flip from the sample's seed: one rank with two spawned
    workers and two ranks without workers crop every image alike, so a resumed epoch on another
    topology trains the images an uninterrupted one would; from the JPEG bytes (as the recipe reads
    them) or from images the reader decoded."""
    (tmp_path / "shards").mkdir()
    write_image_shards(tmp_path / "shards", shards=3, per_shard=10, size=32, classes=4)
    reader = TarReader(str(tmp_path / "shards" / "*.tar"), decode=decode, cache_dir=tmp_path / "cache")
    crop = partial(keep_key, RandomResizedCrop(20))
    workers = crops_by_key(reader, 1, transform=crop, num_workers=2)
    ranks = crops_by_key(reader, 2, transform=crop, num_workers=0)
    assert len(workers) == 30 and workers == ranks
    assert len(set(workers.values())) == 30  # the crops differ from image to image


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_the_batch_path_decodes_into_one_array_with_the_same_crops_on_any_topology(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    write_image_shards(tmp_path / "shards", shards=3, per_shard=10, size=64, classes=4)
    reader = TarReader(str(tmp_path / "shards" / "*.tar"), cache_dir=tmp_path / "cache")  # images stay bytes
    crop = DecodeCropBatch(20)
    workers = crops_by_key(reader, 1, batch_transform=crop, num_workers=2)
    ranks = crops_by_key(reader, 2, batch_transform=crop, num_workers=0)
    assert len(workers) == 30 and workers == ranks
    assert len(set(workers.values())) == 30


def test_the_per_sample_crop_of_an_images_bytes_is_the_batch_paths_row_for_the_same_seed() -> None:
    """RandomResizedCrop given a file's bytes decodes it as DecodeCropBatch does (a JPEG, gray ones
    too, at the scale its crop allows, a PNG whole by Pillow): for the same seed, the same pixels."""
    from PIL import Image

    rng = np.random.default_rng(1)
    pictures = [striped_image(i % 4, 4, side, rng) for i, side in enumerate((256, 96, 40, 256, 64))]
    gray = io.BytesIO()
    Image.fromarray(pictures[4]).convert("L").save(gray, format="JPEG", quality=95)
    files = [encode(p, "JPEG") for p in pictures[:4]] + [gray.getvalue(), encode(pictures[0], "PNG")]
    batch = {"jpg": files, "cls": torch.arange(len(files)), "__key__": [f"k{i}" for i in range(len(files))]}
    worker = WorkerContext(data_rank=0, data_size=1, worker_id=0, num_workers=1, epoch=2, seed=5)
    ctx = BatchContext(worker, positions=np.arange(len(files), dtype=np.int64), num_padding=0)
    rows = DecodeCropBatch(16)(batch, ctx)["image"]
    crop = RandomResizedCrop(16)
    for row, seed in enumerate(ctx.sample_seeds.tolist()):
        sample = {"jpg": files[row], "cls": row, "__key__": f"k{row}"}
        out = crop(sample, cast(SampleContext, SimpleNamespace(sample_seed=seed)))
        assert out["image"].dtype == torch.uint8 and out["image"].shape == (3, 16, 16) and out["label"] == row
        assert torch.equal(out["image"], rows[row]), row
    with pytest.raises(ValueError, match=r"sample 'bad', field 'jpg': UnidentifiedImageError"):
        crop(
            {"jpg": b"\xff\xd8\xff not a jpeg", "cls": 0, "__key__": "bad"},
            cast(SampleContext, SimpleNamespace(sample_seed=1)),
        )


def test_the_batch_path_decodes_at_the_scale_a_crop_allows_and_matches_a_full_decode() -> None:
    """A crop of a large JPEG is decoded at libjpeg-turbo's smaller scale; the result is the full
    decode's crop to within the filters' differences, and a PNG takes Pillow's whole decode."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pictures = [striped_image(i % 4, 4, 256, rng) for i in range(6)]
    batch = {
        "jpg": [encode(p, "JPEG") for p in pictures[:5]] + [encode(pictures[5], "PNG")],
        "__key__": [f"k{i}" for i in range(6)],
        "cls": torch.arange(6) % 4,
    }
    worker = WorkerContext(data_rank=0, data_size=1, worker_id=0, num_workers=1, epoch=0, seed=3)
    ctx = BatchContext(worker, positions=np.arange(6, dtype=np.int64), num_padding=0)
    decoded = DecodeCropBatch(16, scale=(0.5, 1.0))(batch, ctx)
    assert torch.equal(decoded["label"], batch["cls"]) and decoded["__key__"] == batch["__key__"]
    out = decoded["image"]
    assert out.shape == (6, 3, 16, 16) and out.dtype == torch.uint8 and out.is_contiguous()
    crop = RandomResizedCrop(16, scale=(0.5, 1.0))
    for row, seed in enumerate(ctx.sample_seeds.tolist()):
        row_rng = np.random.default_rng(seed)
        full = Image.open(io.BytesIO(batch["jpg"][row])).convert("RGB")
        box = crop.box(*full.size, row_rng)
        expected = np.asarray(full.resize((16, 16), Image.Resampling.BILINEAR, box=box, reducing_gap=2.0))
        if row_rng.random() < crop.flip:
            expected = expected[:, ::-1]
        diff = np.abs(out[row].numpy().transpose(1, 2, 0).astype(int) - expected.astype(int)).mean()
        assert diff < 12, (row, diff)
    with pytest.raises(ValueError, match=r"row 2 \(key 'k2'\), field 'jpg'"):
        DecodeCropBatch(16)({**batch, "jpg": [*batch["jpg"][:2], b"\xff\xd8\xff not a jpeg", *batch["jpg"][3:]]}, ctx)
