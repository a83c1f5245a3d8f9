"""Recipe ``images``: JPEG images with class labels in WebDataset tar shards, decoded in the
workers, cropped and flipped at random from each sample's seed (strategy ``shard``).

With no ``urls``, ``num_items`` shards of ``samples_per_item`` JPEGs are generated once: each
``image_size`` square shows stripes whose angle is its class, with a random phase, colour and
noise, so a small CNN learns it in an epoch. Your own shards need an image field per sample
(``data.image_fields``: by default any image extension the reader decodes, ``jpg``, ``png``,
``webp``, ...) and a class label field (``data.label_field``, default ``cls``), as
``webdataset.ShardWriter`` writes them.

The augmentation, :class:`RandomResizedCrop`, draws from ``SampleContext.sample_seed``: a sample
is cropped the same way whichever rank or worker reads it, so a resumed epoch is the epoch an
uninterrupted run would have trained. The JPEGs stay bytes through the reader, and the crop decodes
each at the smallest scale its crop allows (libjpeg-turbo's, through simplejpeg), in ``uint8``
throughout. :class:`DecodeCropBatch` is the batch path of the same work (``data.batch_path=true``):
one ``batch_transform`` writes each crop straight into one ``uint8`` batch array; for the same seed
its row is the per-sample path's image, pixel for pixel.
"""

from __future__ import annotations

import io
import math
import tarfile
import warnings
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.world import BatchContext, SampleContext
from lightning_sharding.lightning.datamodule import ShardedDataModule
from lightning_sharding.readers.decoding import IMAGE_EXTENSIONS, need
from lightning_sharding.readers.tar import TarReader
from lightning_sharding.recipes.data import cache_root, datamodule, generated

#: The fields a sample's image may be in: the image extensions the reader decodes.
IMAGE_FIELDS = IMAGE_EXTENSIONS


def striped_image(label: int, classes: int, size: int, rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    """A ``size`` square of stripes at angle ``pi * label / classes``, random phase, colour and noise."""
    angle = math.pi * label / classes
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    wave = np.sin((x * math.cos(angle) + y * math.sin(angle)) * (2 * math.pi / 8) + rng.uniform(0, 2 * math.pi))
    colour = rng.uniform(60, 200, 3).astype(np.float32)
    pixels = 128 + wave[..., None] * (colour - 128) + rng.normal(0, 10, (size, size, 3))
    image: npt.NDArray[np.uint8] = np.clip(pixels, 0, 255).astype(np.uint8)
    return image


def write_image_shards(directory: Path, shards: int, per_shard: int, size: int, classes: int, seed: int = 0) -> None:
    """``shards`` WebDataset shards ``part-NNNNN.tar`` of ``per_shard`` samples ``{jpg, cls}``."""
    need("PIL.Image", "image", "the generated images")
    from PIL import Image

    rng = np.random.default_rng(seed)
    for s in range(shards):
        with tarfile.open(directory / f"part-{s:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(per_shard):
                label = int(rng.integers(classes))
                jpeg = io.BytesIO()
                Image.fromarray(striped_image(label, classes, size, rng)).save(jpeg, format="JPEG", quality=90)
                for ext, data in (("jpg", jpeg.getvalue()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"sample{s * per_shard + i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


class RandomResizedCrop:
    """Crop a random area (``scale`` of the image, aspect ``ratio``) and resize it to ``size``,
    then flip left-right with probability ``flip``; the randomness is the sample's seed.

    As torchvision's ``RandomResizedCrop``: ten tries at an area and a log-uniform aspect ratio
    that fit, else the central crop of the nearest allowed ratio. The crop is resized by
    :func:`resize_crop` (antialiased bilinear, as torchvision and Pillow filter).
    A sample ``{<image field>, <label field>}`` becomes ``{"image": uint8 (3, size, size), "label": int}``:
    its image is its first field of ``fields``, its class label the field ``label``.

    The image may be the file's bytes (``TarReader(decode=True)`` leaves images so; the ``images``
    recipe reads them so), decoded here by :meth:`decode_crop` at the scale the crop allows: the
    fastest way, and pixel for pixel :class:`DecodeCropBatch`'s row for the same seed. Or it may be
    decoded already (a ``PIL.Image`` or an ``HWC`` ``uint8`` array, as ``decode="rgb8"`` gives):
    the same box and flip, cut from the whole image.
    """

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
        fields: Sequence[str] = IMAGE_FIELDS,
        label: str = "cls",
    ) -> None:
        if size < 1 or not 0 < scale[0] <= scale[1] <= 1 or not 0 < ratio[0] <= ratio[1] or not 0 <= flip <= 1:
            raise ValueError(
                f"RandomResizedCrop(size={size}, scale={scale}, ratio={ratio}, flip={flip}): need size >= 1, "
                "0 < scale[0] <= scale[1] <= 1, 0 < ratio[0] <= ratio[1] and 0 <= flip <= 1"
            )
        self.size, self.scale, self.ratio, self.flip = size, scale, ratio, flip
        self.fields, self.label = tuple(fields), label

    def box(self, width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """``(left, top, right, bottom)`` of the crop in an image of ``width`` x ``height``."""
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                left = int(rng.integers(0, width - w + 1))
                top = int(rng.integers(0, height - h + 1))
                return left, top, left + w, top + h
        aspect = width / height
        if aspect < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif aspect > self.ratio[1]:
            w, h = round(height * self.ratio[1]), height
        else:
            w, h = width, height
        left, top = (width - w) // 2, (height - h) // 2
        return left, top, left + w, top + h

    def __call__(self, sample: Mapping[str, Any], ctx: SampleContext) -> dict[str, Any]:
        """The cropped, resized and maybe flipped image as a CHW ``uint8`` tensor, and its label."""
        from PIL import Image

        field = next((f for f in self.fields if f in sample), None)
        if field is None:
            raise KeyError(f"sample {sample.get('__key__')!r} has no image field ({', '.join(self.fields)})")
        if self.label not in sample:
            raise KeyError(f"sample {sample.get('__key__')!r} has no label field {self.label!r}")
        pixels = sample[field]
        rng = np.random.default_rng(ctx.sample_seed)
        if isinstance(pixels, (bytes, bytearray, memoryview)):
            try:
                image = self.decode_crop(bytes(pixels), rng)
            except Exception as err:
                key = sample.get("__key__")
                raise ValueError(f"sample {key!r}, field {field!r}: {type(err).__name__}: {err}") from err
        else:
            array = np.asarray(pixels.convert("RGB") if isinstance(pixels, Image.Image) else pixels)
            box = self.box(array.shape[1], array.shape[0], rng)
            image = resize_crop(array, box, self.size, flip=rng.random() < self.flip)
        return {"image": image, "label": int(sample[self.label])}

    def decode_crop(self, data: bytes, rng: np.random.Generator) -> Any:
        """An encoded image, cropped, resized and maybe flipped from ``rng``: a CHW ``uint8`` tensor.

        A JPEG is decoded by simplejpeg at the smallest of the scales 1, 1/2, 1/4 and 1/8 that still
        gives the crop at least ``size`` pixels a side: the box is drawn from the size in the JPEG's
        header, then scaled to the decoded pixels, and the pixels stay ``uint8`` throughout. These
        are the scales libjpeg-turbo decodes with its vector code; the others (7/8 to 3/8) take
        longer than the whole image (224 crops of 500 x 375 JPEGs, with the resize, on this project's
        machine: 1.71 ms an image at the scales from 5/8 to 7/8 the crops allowed, 1.44 ms whole).
        Other formats, and JPEGs simplejpeg does not take (or all, where it is not installed), are
        decoded whole by Pillow (which names a corrupt file's fault). The draws from ``rng``
        (the box, then the flip) are those of a decoded image of the same size.
        """
        jpeg: Any = _simplejpeg() if data[:3] == b"\xff\xd8\xff" else None
        try:
            height, width, _, _ = jpeg.decode_jpeg_header(data) if jpeg is not None else (0, 0, "", "")
        except ValueError:  # a header simplejpeg does not read: Pillow decides below
            height = width = 0
        box: tuple[float, float, float, float]
        if not width:
            pixels = _pillow_rgb(data)
            box = self.box(pixels.shape[1], pixels.shape[0], rng)
        else:
            left, top, right, bottom = box = self.box(width, height, rng)
            side, factor = min(right - left, bottom - top), 1
            while factor < 8 and side >= 2 * factor * self.size:  # 1/2, 1/4, 1/8 still give `size` a side
                factor *= 2
            least = {"min_width": math.ceil(width / factor), "min_height": math.ceil(height / factor)}
            try:
                pixels = jpeg.decode_jpeg(data, colorspace="RGB", **least)
            except ValueError:  # one simplejpeg does not take, or a corrupt one: Pillow, with the same box
                pixels = _pillow_rgb(data)
            else:
                sx, sy = pixels.shape[1] / width, pixels.shape[0] / height
                box = (left * sx, top * sy, right * sx, bottom * sy)
        return resize_crop(pixels, box, self.size, flip=rng.random() < self.flip)


def _simplejpeg() -> Any:
    """The ``simplejpeg`` module, or ``None`` where it is not installed."""
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def _pillow_rgb(data: bytes) -> npt.NDArray[np.uint8]:
    """The image file ``data`` decoded whole by Pillow, as RGB (Pillow names a corrupt file's fault)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as opened:
        return np.asarray(opened.convert("RGB"))


def resize_crop(pixels: npt.NDArray[np.uint8], box: Sequence[float], size: int, flip: bool) -> Any:
    """``pixels`` (``uint8`` HWC) cropped to ``box`` (left, top, right, bottom; rounded to whole
    pixels), resized to ``size`` x ``size`` with antialiased bilinear filtering (Pillow's ``BILINEAR``
    rule) and maybe flipped, as a CHW ``uint8`` tensor. Torch's ``uint8`` kernel does it without
    converting the pixels to floats: about twice as fast as Pillow's ``resize`` on this machine."""
    import torch

    left, top, right, bottom = (round(v) for v in box)
    region = pixels[top : max(bottom, top + 1), left : max(right, left + 1)]
    with warnings.catch_warnings():  # Pillow's and simplejpeg's arrays are read-only: nothing writes here
        warnings.simplefilter("ignore", UserWarning)
        crop = torch.from_numpy(region)
    out = torch.nn.functional.interpolate(
        crop.permute(2, 0, 1).unsqueeze(0), size=(size, size), mode="bilinear", antialias=True, align_corners=False
    )[0]
    return out.flip(-1) if flip else out.contiguous()


class DecodeCropBatch:
    """A ``batch_transform``: the batch's JPEG bytes (field ``field``, or the first of the fields
    ``field`` lists that the batch holds) -> ``"image"``, one ``uint8``
    tensor ``(B, 3, size, size)`` cropped, resized and flipped as :class:`RandomResizedCrop` does, and
    the ``label`` field as ``"label"``. It draws from ``BatchContext.sample_seeds``, so a row's crop
    depends only on the seed, epoch and position, on any rank, worker or topology.

    Each image is decoded by :meth:`RandomResizedCrop.decode_crop`, the per-sample path's own: a
    JPEG by simplejpeg at the smallest of the scales 1, 1/2, 1/4 and 1/8 that still gives the crop
    at least ``size`` pixels a side, so a small crop of a large image decodes a fraction of its
    pixels; other formats whole by Pillow. The rows go straight into the batch array: nothing is
    collated. Needs the ``[image]`` extra and ``TarReader(decode=True)``
    (images stay ``bytes``). A file that does not decode fails the batch, naming the row's key.
    """

    def __init__(
        self, size: int, field: str | Sequence[str] = "jpg", label: str = "cls", flip: float = 0.5, **crop: Any
    ) -> None:
        need("simplejpeg", "image", "JPEG batches")  # in the main process, naming the extra, not in a worker
        need("PIL.Image", "image", "images")
        self.crop = RandomResizedCrop(size, flip=flip, **crop)
        self.fields = (field,) if isinstance(field, str) else tuple(field)
        self.label = label

    def __call__(self, batch: Mapping[str, Any], ctx: BatchContext) -> dict[str, Any]:
        """The batch with ``"image"`` and ``"label"`` in place of the encoded field and the label field."""
        import torch

        field = next((f for f in self.fields if f in batch), None)
        if field is None:
            raise KeyError(f"the batch has no image field ({', '.join(self.fields)}); its fields are {sorted(batch)}")
        if self.label not in batch:
            raise KeyError(f"the batch has no label field {self.label!r}; its fields are {sorted(batch)}")
        encoded = batch[field]
        size = self.crop.size
        out = torch.empty((len(encoded), 3, size, size), dtype=torch.uint8)
        for row, (data, seed) in enumerate(zip(encoded, ctx.sample_seeds.tolist(), strict=True)):
            try:
                out[row] = self.crop.decode_crop(bytes(data), np.random.default_rng(seed))
            except Exception as err:
                key = batch["__key__"][row] if "__key__" in batch else row
                raise ValueError(f"row {row} (key {key!r}), field {field!r}: {type(err).__name__}: {err}") from err
        rest = {k: v for k, v in batch.items() if k not in (field, self.label)}
        label = batch[self.label]  # a field no decoder reads (.label) is collated as a list of bytes
        if not isinstance(label, torch.Tensor):
            label = torch.tensor([int(v) for v in label], dtype=torch.int64)
        return {**rest, "image": out, "label": label}


def _write(shards: int, per_shard: int, size: int, classes: int, directory: Path) -> None:
    write_image_shards(directory, shards, per_shard, size, classes)


def image_shards(
    *,
    urls: list[str] | None,
    storage_options: Mapping[str, Any],
    num_items: int,
    samples_per_item: int,
    image_size: int,
    classes: int,
    crop: int,
    batch_path: bool,
    sharding: Mapping[str, Any],
    image_fields: Sequence[str] = IMAGE_FIELDS,
    label_field: str = "cls",
    audit_dir: str | None = None,
    **options: Any,
) -> ShardedDataModule:
    """``data=images``: image tar shards (JPEG ones generated when ``urls`` is empty), cropped to ``crop``
    with a flip. The reader leaves the images as bytes, and each is decoded at the scale its crop
    allows: per sample by :class:`RandomResizedCrop` in the workers, or with ``batch_path`` into the
    batch by :class:`DecodeCropBatch`; the same seed gives both the same pixels. A sample's image is its
    first field of ``image_fields``, its class label the field ``label_field``."""
    unknown = [f for f in image_fields if f not in IMAGE_FIELDS]
    if unknown or not image_fields:
        raise ValueError(
            f"data.image_fields={list(image_fields)}: {', '.join(map(repr, unknown)) or 'none'} is no image "
            f"extension the reader decodes; give one or more of {', '.join(IMAGE_FIELDS)}"
        )
    if not urls:
        name = f"images-{num_items}x{samples_per_item}-s{image_size}-c{classes}"
        where = generated(options["cache_dir"], name, partial(_write, num_items, samples_per_item, image_size, classes))
        urls = [str(where / "part-*.tar")]
    reader = TarReader(  # images stay bytes: either path decodes each at the scale its crop allows
        list(urls),
        decode=True,
        fields=[*image_fields, label_field],
        storage_options=dict(storage_options),
        cache_dir=cache_root(options["cache_dir"]),
    )
    if batch_path:
        per_batch = DecodeCropBatch(crop, field=image_fields, label=label_field)
        return datamodule(options, sharding, reader=reader, batch_transform=per_batch, audit_dir=audit_dir)
    per_sample = RandomResizedCrop(crop, fields=image_fields, label=label_field)
    return datamodule(options, sharding, reader=reader, transform=per_sample, audit_dir=audit_dir)
