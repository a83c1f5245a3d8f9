"""A tar shard's members from its 512-byte headers, without ``tarfile``'s object per member.

Indexing a WebDataset shard needs only each member's name, where its header chain starts, where
its data starts and how long it is. :func:`members` parses exactly that from the headers (ustar
names with their prefix, GNU long names, PAX ``path`` and ``size`` records, base-256 sizes),
checks each header's checksum, and skips the data between headers. A local file is read through a
memory map, a remote one by seeking its file object from header to header.

It gives the same answers as ``tarfile`` for the members an index keeps (regular files); the tests
check the two against each other on shards written by Python's ``tarfile``, GNU ``tar`` and
``webdataset.ShardWriter``.
"""

from __future__ import annotations

import mmap
import os
import re
import warnings
from collections.abc import Callable
from typing import IO, NamedTuple

import numpy as np
import numpy.typing as npt

BLOCK = 512
_REGULAR = (b"0", b"\0", b"7")  # tarfile's REGTYPE, AREGTYPE and CONTTYPE: a file's bytes follow
_LONG_NAME = b"L"  # GNU: the next member's name is this member's data
_LONG_LINK = b"K"
_PAX = (b"x", b"X")  # PAX extended header of the next member (X: Solaris's)
_SPARSE = b"S"  # GNU sparse file: its data is a map of holes
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, FIFOs: no data follows
_PAX_GLOBAL = b"g"
_ZERO_BLOCK = bytes(BLOCK)
READ_WHOLE = 4 << 20  # a shard up to this size is read whole (one request if remote); a larger local one is mapped


class Member(NamedTuple):
    """One regular file of a tar shard: its name, the offset of its first header (a long name's
    header included), the offset of its data, and its size in bytes."""

    name: str
    offset: int
    offset_data: int
    size: int


class TarHeaderError(ValueError):
    """A header that is not a tar header (a bad checksum, a size that is not a number)."""


def members(read: Callable[[int, int], bytes], length: int, where: str = "the shard") -> list[Member]:
    """The regular files of a tar archive of ``length`` bytes, in order; ``read(offset, n)`` gives
    its bytes. As ``tarfile`` reads it: it ends at the end-of-archive block, and at a bad header after
    the first; an empty or truncated file, or a bad first header, raises :class:`TarHeaderError`.
    Every header's checksum is checked, all at once at the end."""
    if length < BLOCK:
        raise TarHeaderError(f"{where}: {'is empty' if length == 0 else f'has {length} bytes'}, not a tar file")
    found: list[Member] = []
    headers: list[bytes] = []
    positions: list[int] = []
    pos = 0
    chain_start = -1  # the first header of the member being assembled (long names, PAX); -1: none
    long_name: str | None = None
    pax: dict[str, str] = {}
    while pos + BLOCK <= length:
        header = read(pos, BLOCK)
        if len(header) < BLOCK or header == _ZERO_BLOCK:
            break  # the end-of-archive marker (tarfile stops at the first zero block too)
        headers.append(header)
        positions.append(pos)
        field = header[124:136]
        if field[0] & 0x80:  # GNU base-256, for sizes of 8 GiB and more
            size = int.from_bytes(field[1:], "big")
        else:
            try:
                size = int(field.split(b"\0", 1)[0].strip() or b"0", 8)
            except ValueError:
                break  # not a header: the checksums below say whether the archive ends here or is bad
        kind = header[156:157]
        data = pos + BLOCK
        # tarfile skips the data of regular files and of types it does not know, not of links or directories.
        following = data if kind in _NO_DATA else data + -(-size // BLOCK) * BLOCK
        if kind == _PAX_GLOBAL:  # defaults for every later member (tarfile starts the next one after it)
            pos = following
            continue
        if chain_start < 0:
            chain_start = pos
        if kind in _REGULAR and long_name is None and not pax:  # the common case: a plain ustar member
            name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if header[345] != 0:
                name = f"{_text(header[345:500])}/{name}"
            if not (kind == b"\0" and name.endswith("/")):  # a V7 "file" ending in "/" is a directory
                found.append(Member(name, chain_start, data, size))
            chain_start = -1
        elif kind == _LONG_NAME:
            long_name = _text(read(data, size))
        elif kind in _PAX:
            pax.update(_pax_records(read(data, size), pos, where))
        elif kind == _SPARSE:
            raise TarHeaderError(f"{where}: member {_ustar_name(header, kind)!r} is a GNU sparse file, not supported")
        elif kind != _LONG_LINK:  # a long link name: nothing an index keeps
            if "size" in pax:  # PAX may carry a size the octal field cannot hold
                size = int(pax["size"])
                following = data if kind in _NO_DATA else data + -(-size // BLOCK) * BLOCK
            name = pax.get("path") or long_name or _ustar_name(header, kind)
            if kind in _REGULAR and not (kind == b"\0" and name.endswith("/")):
                found.append(Member(name, chain_start, data, size))
            chain_start, long_name, pax = -1, None, {}
        pos = following
    bad = check_headers(headers, positions, where)
    if bad is not None:  # tarfile ends the archive at a bad header after the first: said, not silent
        found = [m for m in found if m.offset < positions[bad]]
        warnings.warn(
            f"{where}: the header at byte {positions[bad]} is not a valid tar header (a bad checksum): the shard "
            f"is read up to it, {len(found)} member(s), as tarfile reads it. Rewrite the shard if it is corrupt",
            stacklevel=2,
        )
    if found and found[-1].offset_data + found[-1].size > length:
        last = found[-1]
        raise TarHeaderError(
            f"{where}: is truncated: member {last.name!r} needs {last.offset_data + last.size} bytes, the file has "
            f"{length}"
        )
    return found


def check_headers(headers: list[bytes], positions: list[int], where: str) -> int | None:
    """The index of the first header whose checksum fails (None: none), all checked in one pass of
    array sums; a bad first header raises :class:`TarHeaderError`. A header the fast pass doubts (a
    signed sum, an odd checksum field) is checked again by :func:`check`, as tarfile would."""
    if not headers:
        return None
    blocks = np.frombuffer(b"".join(headers), dtype=np.uint8).reshape(len(headers), BLOCK)
    for i in np.flatnonzero(~checksums_hold(blocks)):
        try:
            check(headers[i], positions[i], where)
        except TarHeaderError:
            if i == 0:
                raise
            return int(i)
    return None


def checksums_hold(blocks: npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_]:
    """Per 512-byte header of ``blocks``, whether its octal checksum field holds its unsigned sum (the
    common case; a header that fails it may still hold its signed sum, see :func:`check`)."""
    stored = blocks[:, 148:156].astype(np.int64)
    unsigned = blocks.sum(axis=1, dtype=np.int64) - stored.sum(axis=1) + 8 * 32
    digits = stored - ord("0")
    octal = (digits >= 0) & (digits <= 7)
    after: npt.NDArray[np.int64] = np.cumsum(octal[:, ::-1], axis=1)[:, ::-1] - octal  # digits after each
    value = (np.where(octal, digits, 0) * 8 ** np.minimum(after, 20)).sum(axis=1)
    return np.asarray(value == unsigned)


class MemberTable(NamedTuple):
    """The regular files of tar archives as arrays, one row a member: its file (the archive's number
    in the batch), name bytes (NUL-padded rows of 100) and length, and, from its archive's start, its
    first header's offset, its data's offset, and its size. What :func:`plain_batch` gives."""

    file: npt.NDArray[np.int64]
    names: npt.NDArray[np.uint8]
    lengths: npt.NDArray[np.int64]
    offset: npt.NDArray[np.int64]
    offset_data: npt.NDArray[np.int64]
    size: npt.NDArray[np.int64]

    def members(self, file: int = 0) -> list[Member]:
        """The members of archive ``file``, as :class:`Member` tuples."""
        rows = np.flatnonzero(self.file == file)
        names = [bytes(self.names[r, : self.lengths[r]]).decode("utf-8", "surrogateescape") for r in rows.tolist()]
        return [
            Member(*m)
            for m in zip(
                names,
                self.offset[rows].tolist(),
                self.offset_data[rows].tolist(),
                self.size[rows].tolist(),
                strict=False,
            )
        ]


_USTAR = np.frombuffer(b"ustar", dtype=np.uint8)
_PLAIN_KINDS = np.array([0, ord("0"), ord("7"), ord("5")], dtype=np.uint8)  # files and directories
_OCTAL_PLACES = 8 ** np.arange(10, -1, -1, dtype=np.int64)
# PAX records that change what an index keeps (a member's name or size, sparse data, how names decode):
# an archive with one of these words anywhere is walked header by header.
_PAX_CHANGES = (b" path=", b" size=", b"GNU.sparse", b" hdrcharset=")
_PAX_CHANGING = re.compile(b"|".join(re.escape(word) for word in _PAX_CHANGES))


def plain_batch(data: bytes | bytearray, spans: list[tuple[int, int]]) -> tuple[MemberTable, npt.NDArray[np.bool_]]:
    """The members of many whole tar archives at once, with array operations: archive ``j`` is
    ``data[start:start + length]`` for ``spans[j] = (start, length)``, each ``start`` a multiple of
    512. Returns the members of the archives it could read this way, and per archive whether it could.

    It can read an archive whose headers are all plain ustar ones (a regular file or a directory, a
    name of at most 100 bytes, an 11-digit octal size, a valid checksum), maybe after PAX records
    that change neither name nor size (webdataset's float mtime), ending at an end-of-archive block:
    what ``tarfile``, GNU ``tar`` and ``webdataset`` write for short names. Any other (long names, a
    ustar prefix, links, a bad header, a tar inside a member...) is left to :func:`members`.

    The headers are found without walking: every block with the ustar magic and an octal size is a
    candidate, and an archive is read only if its candidates chain exactly, the first at its start,
    each one's size leading to the next, and the last to a zero block. Following the chain from the
    start visits exactly the candidates then, as a walk header by header would."""
    n = len(data) // BLOCK
    k = len(spans)
    first = np.array([start // BLOCK for start, _ in spans], dtype=np.int64)
    last = first + np.array([length // BLOCK for _, length in spans], dtype=np.int64)  # whole blocks only
    blocks = np.frombuffer(data, dtype=np.uint8, count=n * BLOCK).reshape(n, BLOCK)
    heads = np.flatnonzero((blocks[:, 257:262] == _USTAR).all(axis=1))
    digits = blocks[heads, 124:135].astype(np.int64) - ord("0")
    simple = ((digits >= 0) & (digits <= 7)).all(axis=1) & np.isin(blocks[heads, 135], (0, 32))
    heads, digits = heads[simple], digits[simple]
    file = np.searchsorted(first, heads, side="right") - 1
    heads_in = (file >= 0) & (heads < last[np.maximum(file, 0)])
    heads, digits, file = heads[heads_in], digits[heads_in], file[heads_in]
    if not len(heads):
        nothing = np.zeros(0, dtype=np.int64)
        return MemberTable(nothing, np.zeros((0, 100), dtype=np.uint8), nothing, nothing, nothing, nothing), np.zeros(
            k, bool
        )
    sizes = digits @ _OCTAL_PLACES
    following = heads + 1 + (sizes + BLOCK - 1) // BLOCK
    headers = blocks[heads]
    kinds = headers[:, 156]
    pax = (kinds == ord("x")) | (kinds == ord("X"))

    ok = np.zeros(k, dtype=bool)
    same = file[1:] == file[:-1]  # a header and the next of the same archive
    opens = np.append(True, ~same)
    ok[file[opens]] = heads[opens] == first[file[opens]]  # an archive's first header is at its start
    closes = np.append(~same, True)
    end = following[closes]
    ok[file[closes][(end >= last[file[closes]]) | blocks[np.minimum(end, n - 1)].any(axis=1)]] = False
    bad = np.append(~same | (following[:-1] != heads[1:]), False) & ~closes  # a link that misses the next header
    bad |= pax & (closes | np.append(pax[1:], False))  # a PAX header must precede a member of its archive
    bad |= ~pax & (~np.isin(kinds, _PLAIN_KINDS) | (headers[:, 345] != 0))  # links, long names, a ustar prefix
    bad |= ~checksums_hold(headers)  # a signed checksum, or a bad header: the full walk decides
    ok[file[bad]] = False
    for i in np.flatnonzero(pax & ok[file]).tolist():  # each PAX header's records (webdataset writes one a member)
        lo = (int(heads[i]) + 1) * BLOCK
        hi = min(lo + int(sizes[i]), int(last[file[i]]) * BLOCK)
        if _PAX_CHANGING.search(data, lo, hi):
            ok[file[i]] = False  # a PAX path or size, maybe: walked header by header

    starts = np.where(np.append(False, pax[:-1]), np.append(heads[:1], heads[:-1]), heads)  # the PAX header's
    names = headers[:, :100]
    nul = names == 0
    lengths = np.where(nul.any(axis=1), nul.argmax(axis=1), 100).astype(np.int64)
    tail = names[np.arange(len(names)), np.maximum(lengths - 1, 0)]
    directory = (kinds == ord("5")) | ((kinds == 0) & (tail == ord("/")))  # a V7 "file" ending in "/" is one
    keep = ok[file] & ~pax & ~directory
    base = first[file] * BLOCK
    table = MemberTable(
        file[keep],
        names[keep],
        lengths[keep],
        (starts * BLOCK - base)[keep],
        ((heads + 1) * BLOCK - base)[keep],
        sizes[keep],
    )
    return table, ok


def plain_members(data: bytes) -> MemberTable | None:
    """:func:`plain_batch` of one archive: its members, or ``None`` when it needs :func:`members`."""
    table, ok = plain_batch(data, [(0, len(data))])
    return table if ok[0] else None


def check(header: bytes, pos: int, where: str) -> None:
    """Raise :class:`TarHeaderError` unless ``header``'s checksum holds (signed or unsigned, as tarfile accepts)."""
    stored = header[148:156].split(b"\0", 1)[0].strip()
    try:
        expected = int(stored, 8)
    except ValueError:
        raise TarHeaderError(f"{where}: the header at byte {pos} is not a tar header (checksum {stored!r})") from None
    unsigned = sum(header) - sum(header[148:156]) + 8 * 32
    if expected != unsigned:
        signed = unsigned - 2 * sum(b for b in header if b > 127) + 2 * sum(b for b in header[148:156] if b > 127)
        if expected != signed:
            raise TarHeaderError(f"{where}: the header at byte {pos} has a bad checksum (truncated or not a tar file)")


def _size(header: bytes, pos: int, where: str) -> int:
    field = header[124:136]
    if field[0] & 0x80:  # GNU base-256, for sizes of 8 GiB and more
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * 11)) if field[0] & 0x40 else value
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarHeaderError(f"{where}: the header at byte {pos} has a size that is not a number: {text!r}") from None


def _ustar_name(header: bytes, kind: bytes) -> str:
    """The name field, after the ustar prefix field when that holds one (as tarfile reads any header)."""
    name = _text(header[:100])
    prefix = _text(header[345:500])
    return f"{prefix}/{name}" if prefix and kind not in (_LONG_NAME, _LONG_LINK, b"S") else name


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax_records(raw: bytes, pos: int, where: str) -> dict[str, str]:
    """``"<length> <key>=<value>\\n"`` records of a PAX header."""
    records: dict[str, str] = {}
    i = 0
    while i < len(raw) and raw[i : i + 1] not in (b"\0", b""):
        space = raw.find(b" ", i)
        if space < 0:
            break
        try:
            length = int(raw[i:space])
        except ValueError:
            raise TarHeaderError(f"{where}: the PAX header at byte {pos} has a bad record") from None
        record = raw[space + 1 : i + length - 1]  # without the trailing newline
        key, _, value = record.partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        i += length
    return records


def local_members(path: str, where: str | None = None) -> list[Member]:
    """The members of a local tar file (read whole when small, else through a memory map)."""
    table, _ = local_table(path, where)
    return table.members() if isinstance(table, MemberTable) else table


def local_table(path: str, where: str | None = None) -> tuple[MemberTable | list[Member], bytes | None]:
    """The members of a local tar file, as a table when :func:`plain_members` reads it, and its
    bytes when it was read whole (up to :data:`READ_WHOLE`; a larger one is mapped, not kept)."""
    with open(path, "rb") as f:
        length = os.fstat(f.fileno()).st_size
        if length <= READ_WHOLE:  # one read, then slices of bytes (cheaper than a map's)
            data = f.read()
            table = plain_members(data)
            if table is not None:
                return table, data
            return members(lambda pos, n: data[pos : pos + n], len(data), where or path), data
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return members(lambda pos, n: mm[pos : pos + n], length, where or path), None


def file_members(f: IO[bytes], length: int, where: str) -> list[Member]:
    """The members of a tar file read from the seekable file object ``f`` (a remote file)."""

    def read(pos: int, n: int) -> bytes:
        f.seek(pos)
        return f.read(n)

    return list(members(read, length, where))
