"""WebDataset tar shards: one item per shard, one sample per key, one field per file extension.

Indexing a shard reads its tar headers once and records where each sample's run of members
starts and ends. Reading a sample then fetches exactly those bytes (one ranged request on S3),
never the shard from its start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import ShardContext
from lightning_sharding.readers.decoding import DECODERS, decoders
from lightning_sharding.readers.files import FileReader
from lightning_sharding.readers.index import FileIndex
from lightning_sharding.readers.storage import FileInfo, filesystem
from lightning_sharding.readers.tar_headers import file_members, local_members

_BLOCK = 512


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
            a map of extension -> decoder (:func:`~lightning_sharding.readers.decoding.decoders` adds
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
            self.decoders = decoders(image=decode)
        else:
            self.decoders = DECODERS if decode is True else (decode if isinstance(decode, Mapping) else {})
        self.fields = None if fields is None else set(fields)

    def scan(self, info: FileInfo) -> FileIndex:
        """Walk the shard's headers (:mod:`~lightning_sharding.readers.tar_headers`): each sample's
        ``[start, end)`` bytes and its key."""
        fs, path = filesystem(info.url, self.storage_options)
        starts: list[int] = []
        ends: list[int] = []
        keys: list[str] = []
        seen: set[str] = set()
        first_member: list[int] = []  # per sample, into the member lists below
        fields: list[str] = []
        offsets: list[int] = []
        sizes: list[int] = []
        where = self.scrub(info.url)
        if type(fs).__name__ == "LocalFileSystem":  # a memory map: no read per header
            found = local_members(path, where)
        else:  # a remote file: seek from header to header (the file object reads ahead in blocks)
            with fs.open(path, "rb") as f:
                found = file_members(f, info.size, where)
        for name, offset, offset_data, size in found:
            key, ext = split_name(name)
            end = offset_data + -(-size // _BLOCK) * _BLOCK
            fields.append(ext)
            offsets.append(offset_data)
            sizes.append(size)
            if keys and keys[-1] == key:
                ends[-1] = end
                continue
            if key in seen:
                raise ValueError(
                    f"key {key!r} appears again at member {name!r} after other keys: a WebDataset "
                    "shard must keep each sample's files together"
                )
            keys.append(key)
            seen.add(key)
            starts.append(offset)
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
