"""Which library decodes JPEG fastest here: ``python -m benchmarks.decode [--quick] [--repeats R]``.

The choice behind ``lightning_sharding/readers/decoding.py``: generated 256x256 photos-like JPEGs
(quality 90, 4:2:0, written by Pillow), decoded to an RGB ``uint8`` array on one core, by every
decoder that loads on this machine: Pillow, Pillow with ``draft`` (libjpeg's scaled decoding to
half size, what a crop to 128 allows), simplejpeg (full size and scaled), OpenCV headless,
PyTurboJPEG (needs the system's libturbojpeg) and ``torchvision.io`` (when torchvision imports
beside this torch). The decoders run alternately, round by round; each ratio to Pillow is the
median of the per-round ratios. Last, the images through ``ImageDecoder("torchrgb8")``, the
decoder ``TarReader(decode="torchrgb8")`` uses, to show its overhead over the library it calls.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

SIZE = 256
Decode = Callable[[bytes], Any]


def photos(n: int, seed: int = 0) -> list[bytes]:
    """JPEGs of smooth shapes with noise (a photo's mix of flat areas and detail), quality 90."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    out = []
    for _ in range(n):
        cx, cy, f = rng.uniform(0, SIZE, 2).tolist() + [rng.uniform(0.01, 0.05)]
        base = np.stack([np.sin(x * f + cx), np.cos(y * f + cy), np.sin((x + y) * f / 2)], -1) * 100 + 128
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def decoders() -> dict[str, Decode]:
    """Every JPEG decoder that loads here, by name."""
    from PIL import Image

    def pil(data: bytes) -> Any:
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))

    def pil_draft(data: bytes) -> Any:
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (SIZE // 2, SIZE // 2))
        return np.asarray(image.convert("RGB"))

    found: dict[str, Decode] = {"Pillow": pil, "Pillow draft 1/2": pil_draft}
    try:
        import simplejpeg

        found["simplejpeg"] = lambda data: simplejpeg.decode_jpeg(data, colorspace="RGB")
        found["simplejpeg 1/2"] = lambda data: simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_height=SIZE // 2, min_width=SIZE // 2
        )
    except ImportError:
        pass
    try:
        import cv2

        cv2.setNumThreads(1)
        found["OpenCV"] = lambda data: cv2.cvtColor(
            cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB
        )
    except ImportError:
        pass
    try:
        from turbojpeg import TJPF_RGB, TurboJPEG

        jpeg = TurboJPEG()
        found["PyTurboJPEG"] = lambda data: jpeg.decode(data, pixel_format=TJPF_RGB)
    except (ImportError, RuntimeError, OSError):
        pass
    try:
        import torch
        from torchvision.io import decode_jpeg

        found["torchvision.io"] = lambda data: decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    except Exception:  # noqa: BLE001 - the registry's torchvision fails to load beside the CPU torch in many ways
        pass
    from lightning_sharding.readers.decoding import ImageDecoder

    found["ours: ImageDecoder('torchrgb8')"] = ImageDecoder("torchrgb8")
    return found


def rate(decode: Decode, images: list[bytes]) -> float:
    decode(images[0])
    start = time.perf_counter()
    for data in images:
        decode(data)
    return len(images) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 images instead of 1,000")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    images = photos(200 if args.quick else 1000)
    found = decoders()
    rounds: dict[str, list[float]] = {name: [] for name in found}
    for _ in range(args.repeats):
        for name, decode in found.items():
            rounds[name].append(rate(decode, images))
    print(
        f"JPEG decode, {SIZE}x{SIZE} RGB, {len(images)} images of {np.mean([len(d) for d in images]) / 1024:.0f} KiB,"
    )
    print(f"one core, median of {args.repeats} rounds (ratio: median of per-round ratios to Pillow)\n")
    print(f"| {'decoder':34} | images/s | x Pillow |")
    print(f"|{'-' * 36}|---------:|---------:|")
    for name, rates in rounds.items():
        ratio = statistics.median(r / p for r, p in zip(rates, rounds["Pillow"], strict=True))
        print(f"| {name:34} | {statistics.median(rates):8.0f} | {ratio:8.2f} |")


if __name__ == "__main__":
    main()
