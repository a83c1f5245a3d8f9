"""Item identity that survives a move: what a checkpoint keeps of each item, and the differences it names.

An item is known by its *name*, its key relative to the data set's root (``f0.npy`` whether it lives
under ``/lustre/ds/`` or ``s3://bucket/ds/``), its sample count and its *content* id (its size and
what the store gives of its bytes: an ETag, a blob hash, or a digest of a local file), never by
where it lives or when it was touched. A reader that gives no name or content id is known by its
key and fingerprint, as before.

The checkpoint keeps one row per item (:func:`item_table`: a 64-bit hash of the name and of the
content id, the size and the sample count, 32 bytes an item), so a resume against changed data
names the file and what changed (:func:`item_changes`) without storing every key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

# At most this many differences are named in one message; the rest are counted.
SHOWN = 5


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def size_of(content: str) -> int:
    """The size in a content id ``size=N;...`` (-1 when it names none)."""
    head = content.split(";", 1)[0]
    return int(head[5:]) if head.startswith("size=") and head[5:].isdigit() else -1


def item_table(items: Sequence[Any]) -> dict[str, npt.NDArray[Any]]:
    """One row per item of ``items`` (a manifest's): ``name`` and ``content`` (64-bit hashes of its
    name and content id, as int64), ``size`` (bytes, -1 unknown) and ``count`` (samples), each
    int64 of shape ``(num_items,)``."""
    names = [it.identity[0] for it in items]
    contents = [it.identity[1] for it in items]
    return {
        "name": np.fromiter((_hash64(n) for n in names), dtype=np.uint64, count=len(items)).view(np.int64),
        "content": np.fromiter((_hash64(c) for c in contents), dtype=np.uint64, count=len(items)).view(np.int64),
        "size": np.fromiter((size_of(c) for c in contents), dtype=np.int64, count=len(items)),
        "count": np.fromiter((it.num_samples for it in items), dtype=np.int64, count=len(items)),
    }


def item_changes(saved: Mapping[str, Any], items: Sequence[Any], shown: int | None = SHOWN) -> list[str]:
    """What changed between a checkpoint's :func:`item_table` and ``items``, one phrase per item
    (at most ``shown``, then a count; ``None``: all): a changed content (size, or the same size
    with other bytes) or sample count, an item added or gone."""
    now = item_table(items)
    old = {key: np.asarray(saved[key]).tolist() for key in ("name", "content", "size", "count")}
    old_rows = {int(h): i for i, h in enumerate(old["name"])}
    found: list[str] = []
    seen = set()
    for i, h in enumerate(now["name"].tolist()):
        name = items[i].identity[0]
        j = old_rows.get(int(h))
        if j is None:
            found.append(f"{name!r} is new (not in the checkpoint's data)")
            continue
        seen.add(j)
        old_size, new_size = int(old["size"][j]), int(now["size"][i])
        old_count, new_count = int(old["count"][j]), int(now["count"][i])
        if old_count != new_count:
            found.append(f"{name!r} holds {new_count} samples, the checkpoint {old_count}")
        elif int(old["content"][j]) != int(now["content"][i]):
            if old_size != new_size and old_size >= 0 and new_size >= 0:
                found.append(f"{name!r} changed: its size was {old_size} bytes, now {new_size}")
            elif new_size >= 0:
                what = items[i].identity[1].split(";", 1)[-1].split("=", 1)[0] or "content id"
                found.append(f"{name!r} changed: same size, other content (its {what} differs)")
            else:
                found.append(f"{name!r} changed (its fingerprint differs)")
    gone = len(old_rows) - len(seen)
    if gone:
        found.append(f"{gone} item(s) of the checkpoint's data are gone")
    if shown is not None and len(found) > shown:
        found = [*found[:shown], f"and {len(found) - shown} more"]
    return found


def common_root(keys: Sequence[str]) -> str:
    """The longest directory prefix (up to and including a ``/``) all ``keys`` share; ``""`` for none."""
    if not keys:
        return ""
    first, last = min(keys), max(keys)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[: first.rfind("/", 0, n) + 1]
