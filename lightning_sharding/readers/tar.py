"""WebDataset tar shards: one item per shard, one sample per key, one field per file extension.

Indexing a shard reads its tar headers once and records where each sample's run of members
starts and ends. Reading a sample then fetches exactly those bytes (one ranged request on S3),
never the shard from its start.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import ShardContext
from lightning_sharding.readers.files import FileReader
from lightning_sharding.readers.index import FileIndex
from lightning_sharding.readers.storage import FileInfo, filesystem

_BLOCK = 512


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


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the file name, the rest the field."""
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), (ext if dot else "")


class TarReader(FileReader):
    """WebDataset tar shards. A sample is ``{"__key__", "__url__", <ext>: value, ...}``.

    Args:
        urls: shards: a path, ``s3://`` URL, glob or list (see :class:`FileReader`).
        decode: decode fields by extension: ``True`` with :data:`DECODERS` (arrays, JSON, text,
            class labels; images, audio and video stay ``bytes``), an image spec such as
            ``"torchrgb8"`` or ``"pil"`` to decode images too (WebDataset's words; extra ``[image]``),
            a map of extension -> decoder (:func:`~lightning_sharding.readers.media.decoders` adds
            audio and video), or ``False`` to keep every field's raw ``bytes``.
        fields: keep only these extensions (``None`` keeps all).
        **options: :class:`FileReader` options (``storage_options``, ``cache_dir``, ...).
    """

    format = "tar"

    def __init__(
        self,
        urls: str | list[str],
        *,
        decode: bool | str | Mapping[str, Callable[[bytes], Any]] = True,
        fields: list[str] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(urls, **options)
        self.decoders: Mapping[str, Callable[[bytes], Any]]
        if isinstance(decode, str):
            from lightning_sharding.readers.media import decoders

            self.decoders = decoders(image=decode)
        else:
            self.decoders = DECODERS if decode is True else (decode if isinstance(decode, Mapping) else {})
        self.fields = None if fields is None else set(fields)

    def scan(self, info: FileInfo) -> FileIndex:
        """Walk the shard's headers: each sample's ``[start, end)`` bytes and its key."""
        fs, path = filesystem(info.url, self.storage_options)
        starts: list[int] = []
        ends: list[int] = []
        keys: list[str] = []
        seen: set[str] = set()
        first_member: list[int] = []  # per sample, into the member lists below
        fields: list[str] = []
        offsets: list[int] = []
        sizes: list[int] = []
        with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_name(member.name)
                end = member.offset_data + -(-member.size // _BLOCK) * _BLOCK
                fields.append(ext)
                offsets.append(member.offset_data)
                sizes.append(member.size)
                if keys and keys[-1] == key:
                    ends[-1] = end
                    continue
                if key in seen:
                    raise ValueError(
                        f"key {key!r} appears again at member {member.name!r} after other keys: a WebDataset "
                        "shard must keep each sample's files together"
                    )
                keys.append(key)
                seen.add(key)
                starts.append(member.offset)
                ends.append(end)
                first_member.append(len(fields) - 1)
        arrays: dict[str, npt.NDArray[Any]] = {
            "start": np.array(starts, dtype=np.int64),
            "end": np.array(ends, dtype=np.int64),
            "key": np.array(keys, dtype=str),
            "first_member": np.array([*first_member, len(fields)], dtype=np.int64),
            "field": np.array(fields, dtype=str),
            "offset": np.array(offsets, dtype=np.int64),
            "size": np.array(sizes, dtype=np.int64),
        }
        return FileIndex([""], [len(keys)], [arrays])

    def read_batch(self, item: Item, indices: npt.NDArray[np.int64], ctx: ShardContext) -> list[Any]:
        """Fetch each sample's byte run (concurrently on object stores) and parse its members."""
        url, _ = self.split_key(item)
        idx = self.index_of(item)
        blobs = self.read_ranges(item, idx["start"][indices], idx["end"][indices])
        return [self._sample(url, idx, int(i), blob) for i, blob in zip(indices, blobs, strict=True)]

    def _sample(self, url: str, idx: Mapping[str, npt.NDArray[Any]], index: int, blob: bytes) -> dict[str, Any]:
        """Cut the sample's members out of its bytes with the offsets the index recorded."""
        key, base = str(idx["key"][index]), int(idx["start"][index])
        sample: dict[str, Any] = {"__key__": key, "__url__": url}
        for m in range(int(idx["first_member"][index]), int(idx["first_member"][index + 1])):
            ext = str(idx["field"][m])
            if self.fields is not None and ext not in self.fields:
                continue
            lo = int(idx["offset"][m]) - base
            raw = blob[lo : lo + int(idx["size"][m])]
            try:
                if len(raw) != int(idx["size"][m]):
                    raise ValueError(f"{len(raw)} of its {int(idx['size'][m])} bytes were read")
                decoder = self.decoders.get(ext.rsplit(".", 1)[-1].lower())
                sample[ext] = decoder(raw) if decoder is not None else raw
            except Exception as err:
                raise ValueError(
                    f"{url}: sample {index} (key {key!r}) is corrupt: field {ext!r}: {type(err).__name__}: {err}"
                ) from err
        return sample
