"""A sample's files decoded by their extension, in the DataLoader workers: arrays, JSON, text and
class labels (:data:`DECODERS`, what ``TarReader(decode=True)`` uses), and images, audio and video.

:func:`decoders` builds the extension -> decoder map that :class:`~lightning_sharding.TarReader`
takes as ``decode=``; ``decode="torchrgb8"`` (or any other image spec) is short for
``decoders(image="torchrgb8")``. The image specs are WebDataset's words (``"pil"``, ``"rgb8"``,
``"torchrgb8"``, ``"torchrgb"``, ...), so a pipeline written for ``webdataset.decode(...)`` keeps them.

Which library decodes, chosen by measurement (``python -m benchmarks.decode``): JPEG with
``simplejpeg`` (libjpeg-turbo) when it is installed, else Pillow; PNG, WebP and the other image
formats with Pillow; audio with ``soundfile`` (libsndfile: FLAC, WAV, OGG, MP3); video with PyAV
(FFmpeg, shipped in its wheel). Each library is imported when a decoder is built, in the main
process, so a missing one is named there with the extra that installs it, not in a worker.

Every decoder is a small picklable object (the reader is pickled into the workers). A file that
does not decode raises; :class:`TarReader` names the shard, the key and the field, and the
loader's ``on_error`` decides whether the sample is skipped (counted) or training stops.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

_NPY_HEADERS: dict[bytes, tuple[np.dtype[Any], tuple[int, ...], int]] = {}


def _decode_npy(data: bytes) -> Any:
    # Samples of one shard share a handful of .npy headers: parse each once, then view the bytes.
    if data[:8] == b"\x93NUMPY\x01\x00" and len(data) >= 10:
        end = 10 + int.from_bytes(data[8:10], "little")
        known = _NPY_HEADERS.get(data[:end])
        if known is None:
            f = io.BytesIO(data[:end])
            np.lib.format.read_magic(f)
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            if fortran or dtype.hasobject or len(_NPY_HEADERS) > 1024:
                return np.load(io.BytesIO(data), allow_pickle=False)
            known = _NPY_HEADERS[data[:end]] = (dtype, shape, end)
        dtype, shape, offset = known
        count = int(np.prod(shape, dtype=np.int64))
        if len(data) - offset == count * dtype.itemsize:
            return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy()
    return np.load(io.BytesIO(data), allow_pickle=False)


def _decode_text(data: bytes) -> str:
    return data.decode("utf-8")


def _decode_int(data: bytes) -> int:
    return int(data.decode("ascii").strip())


#: How field bytes are decoded, by extension; any other extension stays ``bytes``.
DECODERS: dict[str, Callable[[bytes], Any]] = {
    "npy": _decode_npy,
    "json": json.loads,
    "txt": _decode_text,
    "text": _decode_text,
    "cls": _decode_int,
    "cls2": _decode_int,
    "index": _decode_int,
}


IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "pbm", "tif", "tiff")
AUDIO_EXTENSIONS = ("flac", "wav", "mp3", "ogg")
VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "avi", "mov")

#: WebDataset's image specs: spec -> (container, element type, channels).
IMAGE_SPECS: dict[str, tuple[str, str | None, str]] = {
    "l8": ("numpy", "uint8", "L"),
    "rgb8": ("numpy", "uint8", "RGB"),
    "rgba8": ("numpy", "uint8", "RGBA"),
    "l": ("numpy", "float", "L"),
    "rgb": ("numpy", "float", "RGB"),
    "rgba": ("numpy", "float", "RGBA"),
    "torchl8": ("torch", "uint8", "L"),
    "torchrgb8": ("torch", "uint8", "RGB"),
    "torchrgba8": ("torch", "uint8", "RGBA"),
    "torchl": ("torch", "float", "L"),
    "torchrgb": ("torch", "float", "RGB"),
    "torch": ("torch", "float", "RGB"),
    "torchrgba": ("torch", "float", "RGBA"),
    "pill": ("pil", None, "L"),
    "pil": ("pil", None, "RGB"),
    "pilrgb": ("pil", None, "RGB"),
    "pilrgba": ("pil", None, "RGBA"),
}


def need(module: str, extra: str, what: str) -> Any:
    """Import ``module``, or raise naming the extra that installs it (``what`` needs it)."""
    try:
        return __import__(module)
    except ImportError as err:
        raise ImportError(f"decoding {what} needs {module}: pip install 'lightning-sharding[{extra}]'") from err


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


class ImageDecoder:
    """Bytes of an image file -> the image as ``spec`` says (see :data:`IMAGE_SPECS`).

    Arrays are ``HWC`` (``HW`` for ``"l8"``/``"l"``); tensors are ``CHW`` (a view of the decoded
    ``HWC`` pixels: call ``.contiguous()`` where a kernel needs it), ``uint8`` or ``float32`` in
    ``[0, 1]``; ``"pil"`` gives a loaded ``PIL.Image`` in the spec's mode.
    """

    def __init__(self, spec: str = "torchrgb8") -> None:
        if spec not in IMAGE_SPECS:
            raise ValueError(f"unknown image spec {spec!r}: use one of {', '.join(IMAGE_SPECS)} (WebDataset's names)")
        need("PIL.Image", "image", "images")
        self.spec = spec
        self.container, self.etype, self.mode = IMAGE_SPECS[spec]
        # simplejpeg decodes JPEG to RGB or gray straight into an array, faster than Pillow.
        self.fast_jpeg = self.container != "pil" and self.mode in ("RGB", "L") and _has("simplejpeg")

    def __call__(self, data: bytes) -> Any:
        """The image in the spec's container, type and channels."""
        array = self._jpeg(data) if self.fast_jpeg and data[:3] == b"\xff\xd8\xff" else None
        if array is None:
            from PIL import Image

            with Image.open(io.BytesIO(data)) as image:
                image.load()
                converted = image.convert(self.mode) if image.mode != self.mode else image.copy()
            if self.container == "pil":
                return converted
            array = np.array(converted)  # writable, as a user's in-place augmentation expects
        return self._finish(array)

    def _jpeg(self, data: bytes) -> npt.NDArray[np.uint8] | None:
        import simplejpeg

        try:
            array: npt.NDArray[np.uint8] = simplejpeg.decode_jpeg(
                data, colorspace="RGB" if self.mode == "RGB" else "GRAY"
            )
        except ValueError:
            return None  # a JPEG simplejpeg does not take (or a corrupt one): Pillow decides and names the fault
        return array[:, :, 0] if self.mode == "L" else array

    def _finish(self, array: npt.NDArray[Any]) -> Any:
        out: npt.NDArray[Any] = array if self.etype == "uint8" else array.astype(np.float32) / 255.0
        if self.container == "numpy":
            return out
        import torch

        # A CHW view of the HWC pixels, not a copy: collating the batch copies them once anyway.
        hwc = torch.from_numpy(out)
        return hwc[None] if out.ndim == 2 else hwc.permute(2, 0, 1)


class AudioDecoder:
    """Bytes of an audio file -> ``(waveform, sample_rate)``, the waveform ``float32`` of shape
    ``(channels, frames)``: a tensor (``output="torch"``, as ``webdataset.torch_audio`` gives) or
    an array (``"numpy"``)."""

    def __init__(self, output: str = "torch") -> None:
        if output not in ("torch", "numpy"):
            raise ValueError(f"unknown audio output {output!r}: use 'torch' or 'numpy'")
        need("soundfile", "audio", "audio")
        self.output = output

    def __call__(self, data: bytes) -> tuple[Any, int]:
        """The waveform and its sample rate."""
        import soundfile

        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        waveform = np.ascontiguousarray(samples.T)
        if self.output == "numpy":
            return waveform, int(rate)
        import torch

        return torch.from_numpy(waveform), int(rate)


@dataclass(frozen=True)
class VideoDecoder:
    """Bytes of a video file -> chosen frames of its first video stream, decoded with PyAV.

    Args:
        frames: which frames: ``None`` every frame, an ``int`` n for n frames evenly spaced over the
            clip (first and last included), or a sequence of frame indices. An index past the
            clip's end is an error naming the clip's length.
        output: ``"torch"``: a ``uint8`` tensor ``(T, C, H, W)`` (torchcodec's layout);
            ``"numpy"``: a ``uint8`` array ``(T, H, W, C)``.
    """

    frames: int | Sequence[int] | None = None
    output: str = "torch"

    def __post_init__(self) -> None:
        if self.output not in ("torch", "numpy"):
            raise ValueError(f"unknown video output {self.output!r}: use 'torch' or 'numpy'")
        if isinstance(self.frames, int) and self.frames < 1:
            raise ValueError(f"frames={self.frames}: ask for at least 1 frame, or None for all")
        need("av", "video", "video")

    def __call__(self, data: bytes) -> Any:
        """The chosen frames of the file's first video stream."""
        import av

        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            indices = self._indices(stream.frames)  # None: every frame, or the length is known only at the end
            keep = None if indices is None else set(indices)
            picked: dict[int, npt.NDArray[Any]] = {}
            count = 0
            for frame in container.decode(stream):
                if keep is None or count in keep:
                    picked[count] = frame.to_ndarray(format="rgb24")
                count += 1
                if keep is not None and count > max(keep):
                    break
        if indices is None:
            indices = _spread(self.frames, count) if isinstance(self.frames, int) else list(range(count))
        missing = [i for i in indices if i not in picked]
        if missing or not indices:
            raise ValueError(f"the video has {count} frames; frame {missing[0] if missing else 0} was asked for")
        stacked = np.stack([picked[i] for i in indices])
        if self.output == "numpy":
            return stacked
        import torch

        return torch.from_numpy(np.ascontiguousarray(stacked.transpose(0, 3, 1, 2)))

    def _indices(self, length: int) -> list[int] | None:
        if self.frames is None:
            return None
        if isinstance(self.frames, int):
            return _spread(self.frames, length) if length else None
        return [int(i) for i in self.frames]


def _spread(n: int, length: int) -> list[int]:
    """``n`` frame indices evenly spaced over ``length`` frames, first and last included."""
    return sorted({round(i * (length - 1) / max(n - 1, 1)) for i in range(n)}) if length else []


def decoders(
    image: str | None = "torchrgb8",
    audio: str | None = None,
    video: VideoDecoder | None = None,
    base: dict[str, Callable[[bytes], Any]] | None = None,
) -> dict[str, Callable[[bytes], Any]]:
    """The extension -> decoder map for ``TarReader(decode=...)``: the basic fields (``npy``,
    ``json``, ``txt``, ``cls``, ...; or ``base``), plus images as ``image`` says (an image spec, or
    ``None`` to keep their bytes), audio (``"torch"`` or ``"numpy"``) and ``video`` (a
    :class:`VideoDecoder`) when asked for."""
    table = dict(DECODERS if base is None else base)
    if image is not None:
        table.update(dict.fromkeys(IMAGE_EXTENSIONS, ImageDecoder(image)))
    if audio is not None:
        table.update(dict.fromkeys(AUDIO_EXTENSIONS, AudioDecoder(audio)))
    if video is not None:
        table.update(dict.fromkeys(VIDEO_EXTENSIONS, video))
    return table
