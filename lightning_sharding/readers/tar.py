"""WebDataset tar shards: one item per shard, one sample per key, one field per file extension.

Indexing a shard reads its tar headers once and records where each sample's run of members
starts and ends. Reading a sample then fetches exactly those bytes (one ranged request on S3),
never the shard from its start.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.manifest import Item
from lightning_sharding.core.world import WorkerContext
from lightning_sharding.readers.decoding import DECODERS, decoders
from lightning_sharding.readers.files import FileReader
from lightning_sharding.readers.index import FileIndex
from lightning_sharding.readers.storage import DIGEST_WHOLE, FileInfo, bytes_digest, filesystem
from lightning_sharding.readers.tar_headers import (
    READ_WHOLE,
    Member,
    MemberTable,
    file_members,
    local_table,
    members,
    plain_batch,
    plain_members,
)

_BLOCK = 512


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the file name, the rest the field."""
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), (ext if dot else "")


def _slicer(data: bytes) -> Callable[[int, int], bytes]:
    """``read(offset, n)`` over ``data``, for :func:`~lightning_sharding.readers.tar_headers.members`."""
    return lambda pos, n: data[pos : pos + n]


def local_path(url: str) -> str | None:
    """The path of a local file's URL (a path or ``file://``), ``None`` for another scheme."""
    if "://" not in url:
        return url
    return url[len("file://") :] if url.startswith("file://") else None


def _read_into(path: str | None, view: memoryview) -> bool:
    """Fill ``view`` with the file at ``path``; False if it has another size now (changed since listed)."""
    try:
        with open(path or "", "rb") as f:
            if os.fstat(f.fileno()).st_size != len(view):
                return False
            return f.readinto(view) == len(view)
    except OSError:
        return False  # gone or unreadable: its own scan names it


def member_samples(found: list[Member]) -> dict[str, npt.NDArray[Any]]:
    """A shard's index arrays from its members, in order: per sample its ``[start, end)`` bytes, key
    and first member; per member its field (extension), data offset and size."""
    starts: list[int] = []
    ends: list[int] = []
    keys: list[str] = []
    seen: set[str] = set()
    first_member: list[int] = []  # per sample, into the member lists below
    fields: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
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
    return {
        "start": np.array(starts, dtype=np.int64),
        "end": np.array(ends, dtype=np.int64),
        "key": np.array(keys, dtype=str),
        "first_member": np.array([*first_member, len(fields)], dtype=np.int64),
        "field": np.array(fields, dtype=str),
        "offset": np.array(offsets, dtype=np.int64),
        "size": np.array(sizes, dtype=np.int64),
    }


def table_samples(table: MemberTable, archives: int = 1) -> list[dict[str, npt.NDArray[Any]] | None]:
    """:func:`member_samples` of each of ``archives`` archives at once, with array operations; ``None``
    for one whose names are not ASCII or whose samples are not each together (the member walk then
    names the fault)."""
    bad = np.bincount(table.file, weights=(table.names >= 128).any(axis=1), minlength=archives) > 0
    if bad.any():  # names that are not ASCII: those archives are left out here, walked member by member
        keep = ~bad[table.file]
        table = MemberTable(*(np.asarray(column)[keep] for column in table))  # type: ignore[arg-type]
    names, lengths, file = table.names, table.lengths, table.file
    if not len(file):
        return [None] * archives
    count = np.bincount(file, minlength=archives)
    columns = np.arange(names.shape[1])
    inside = columns < lengths[:, None]
    slash = np.where((names == ord("/")) & inside, columns, -1).max(axis=1, initial=-1)  # the file name follows
    dots = (names == ord(".")) & inside & (columns > slash[:, None])
    dot = np.where(dots.any(axis=1), dots.argmax(axis=1), lengths)  # WebDataset: the key ends at its first dot
    width = max(1, int(dot.max(initial=0)))
    keys = np.where(columns[:width] < dot[:, None], names[:, :width], np.uint8(0)).view(f"S{width}").ravel()
    ext_lengths = np.maximum(lengths - dot - 1, 0)
    ext_width = max(1, int(ext_lengths.max(initial=0)))
    at = np.minimum(dot[:, None] + 1 + np.arange(ext_width), names.shape[1] - 1)
    ext = np.where(np.arange(ext_width) < ext_lengths[:, None], np.take_along_axis(names, at, axis=1), np.uint8(0))
    new = np.ones(len(keys), dtype=bool)
    new[1:] = (keys[1:] != keys[:-1]) | (file[1:] != file[:-1])
    firsts = np.flatnonzero(new)
    order = np.lexsort((keys[firsts], file[firsts]))  # a key that appears again after other keys
    again = (keys[firsts][order][1:] == keys[firsts][order][:-1]) & (
        file[firsts][order][1:] == file[firsts][order][:-1]
    )
    bad[file[firsts][order][1:][again]] = True
    lasts = np.append(firsts[1:], len(keys)) - 1
    ends = table.offset_data + (table.size + _BLOCK - 1) // _BLOCK * _BLOCK
    start, end, sample_keys = table.offset[firsts], ends[lasts], keys[firsts].astype(f"U{width}")
    fields = ext.view(f"S{ext_width}").ravel().astype(f"U{ext_width}")
    member_bounds = np.concatenate(([0], np.cumsum(count))).tolist()
    sample_bounds = np.concatenate(([0], np.cumsum(np.bincount(file[firsts], minlength=archives)))).tolist()
    found: list[dict[str, npt.NDArray[Any]] | None] = []
    for j in range(archives):
        m0, m1, s0, s1 = member_bounds[j], member_bounds[j + 1], sample_bounds[j], sample_bounds[j + 1]
        if bad[j] or m0 == m1:
            found.append(None)
            continue
        found.append(
            {
                "start": start[s0:s1],
                "end": end[s0:s1],
                "key": sample_keys[s0:s1],
                "first_member": np.append(firsts[s0:s1] - m0, m1 - m0),
                "field": fields[m0:m1],
                "offset": table.offset_data[m0:m1],
                "size": table.size[m0:m1],
            }
        )
    return found


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
        return self._walk(info)[0]

    batch_files = 256

    def scan_batch(self, files: Sequence[FileInfo]) -> list[tuple[FileIndex, str | None] | None]:
        """Index many small local shards at once: read into one buffer, each one's content id hashed
        from it, and one array walk (:func:`~lightning_sharding.readers.tar_headers.plain_batch`) for
        their headers; a shard it cannot read that way is walked header by header from the buffer.
        ``None`` for a shard that is large, changed since it was listed, or faulty (its own scan names
        the fault)."""
        if type(self).scan is not TarReader.scan:  # a subclass's own scan: it indexes every shard
            return [None] * len(files)
        where: list[tuple[int, int]] = []  # per file: its start in the buffer and its size; -1: not read
        total = 0
        for info in files:
            fits = 0 < info.size <= READ_WHOLE and info.size <= DIGEST_WHOLE and local_path(info.url) is not None
            where.append((total, info.size) if fits else (-1, 0))
            total += -(-info.size // _BLOCK) * _BLOCK if fits else 0
        buffer = bytearray(total)
        view = memoryview(buffer)
        for j, (info, (start, size)) in enumerate(zip(files, where, strict=False)):
            if start >= 0 and not _read_into(local_path(info.url), view[start : start + size]):
                where[j] = (-1, 0)
        spans, end = [], 0  # a file not read holds no blocks, where the last one ended (the starts stay sorted)
        for start, size in where:
            spans.append((start, size) if start >= 0 else (end, 0))
            end = start + -(-size // _BLOCK) * _BLOCK if start >= 0 else end
        table, plain = plain_batch(buffer, spans)
        samples = table_samples(table, len(files))
        found: list[tuple[FileIndex, str | None] | None] = []
        for j, (info, (start, size)) in enumerate(zip(files, where, strict=False)):
            if start < 0:
                found.append(None)
                continue
            data = view[start : start + size]
            try:
                if plain[j]:
                    arrays = samples[j] or member_samples(table.members(j))
                else:
                    arrays = member_samples(members(_slicer(bytes(data)), size, self.scrub(info.url)))
            except ValueError:
                found.append(None)  # a duplicate key, a bad header: scan_content names it with the file
                continue
            found.append((FileIndex([""], [len(arrays["key"])], [arrays]), bytes_digest(data)))
        return found

    def scan_content(self, info: FileInfo) -> tuple[FileIndex, str | None]:
        """:meth:`scan`, and a small local shard's content id from the bytes the walk read."""
        if type(self).scan is not TarReader.scan:  # a subclass's own scan
            return self.scan(info), None
        return self._walk(info)

    def _walk(self, info: FileInfo) -> tuple[FileIndex, str | None]:
        fs, path = filesystem(info.url, self.storage_options)
        where = self.scrub(info.url)
        content = None
        if type(fs).__name__ == "LocalFileSystem":  # read whole, or a memory map: no read per header
            found, data = local_table(path, where)
            if data is not None and len(data) <= DIGEST_WHOLE:
                content = bytes_digest(data)
        elif 0 < info.size <= READ_WHOLE:  # a small remote file: one request for all of it, walked in memory
            data = fs.cat_file(path, start=0, end=info.size)  # a range: s3fs asks no size (HEAD) first
            if len(data) != info.size:
                raise OSError(f"{where} has {len(data)} bytes, not the {info.size} listed: it changed since")
            found = plain_members(data) or members(_slicer(data), len(data), where)
        else:  # a remote file: seek from header to header (the file object reads ahead in blocks)
            with fs.open(path, "rb") as f:
                found = file_members(f, info.size, where)
        arrays = (table_samples(found)[0] if isinstance(found, MemberTable) else None) or member_samples(
            found.members() if isinstance(found, MemberTable) else found
        )
        return FileIndex([""], [len(arrays["key"])], [arrays]), content

    def byte_ranges(
        self, item: Item, indices: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Each sample's byte run in its tar, from its first header to its last member's end."""
        idx = self.index_of(item)
        return idx["start"][indices], idx["end"][indices]

    def read_batch(self, item: Item, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> list[Any]:
        """Fetch each sample's byte run (concurrently on object stores) and parse its members."""
        url, _ = self.split_key(item)
        idx = self.index_of(item)
        blobs = self.read_ranges(item, *self.byte_ranges(item, indices))
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
