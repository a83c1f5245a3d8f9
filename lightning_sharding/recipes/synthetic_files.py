"""Small synthetic data sets in every supported format, for recipes, tests and benchmarks.

Every sample carries its manifest-order ``id`` and the same regression pair ``(x, y)`` as the
built-in :class:`~lightning_sharding.readers.synthetic.SyntheticReader`, whatever the format, so a
run over files can be checked for exactly-once and compared with the synthetic run.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.world import SampleContext
from lightning_sharding.readers.synthetic import regression_arrays

FORMATS = ("tar", "parquet", "npy", "jsonl")  # the keys of readers.FILE_READERS
_SUFFIX = {"tar": "tar", "parquet": "parquet", "npy": "npy", "jsonl": "jsonl"}


def _npy_bytes(array: npt.NDArray[Any]) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _tar_bytes(ids: npt.NDArray[np.int64], x: npt.NDArray[np.float32], y: npt.NDArray[np.float32]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, xi, yi in zip(ids.tolist(), x, y, strict=True):
            for ext, data in (
                ("cls", str(i).encode()),
                ("x.npy", _npy_bytes(xi)),
                ("json", json.dumps({"y": float(yi)}).encode()),
            ):
                info = tarfile.TarInfo(f"sample{i:08d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _parquet_bytes(
    ids: npt.NDArray[np.int64], x: npt.NDArray[np.float32], y: npt.NDArray[np.float32], row_group_size: int
) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": pa.array(ids),
            "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1]),
            "y": pa.array(y),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size)
    return buf.getvalue()


def _jsonl_bytes(ids: npt.NDArray[np.int64], x: npt.NDArray[np.float32], y: npt.NDArray[np.float32]) -> bytes:
    lines = (
        json.dumps({"id": i, "x": xi.tolist(), "y": float(yi)}) for i, xi, yi in zip(ids.tolist(), x, y, strict=True)
    )
    return ("\n".join(lines) + "\n").encode()


def write_regression(
    directory: str,
    fmt: str,
    sizes: Sequence[int],
    *,
    dim: int = 8,
    row_group_size: int = 64,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Write one file per entry of ``sizes`` (samples per file) in format ``fmt`` under ``directory``
    (a path or URL such as ``s3://bucket/prefix``); returns the file URLs in id order.

    Sample ids run from 0 across the files in order. ``.npy`` files hold rows ``[id, x..., y]``.
    """
    from lightning_sharding.readers.storage import filesystem

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    fs, base = filesystem(directory, storage_options)
    fs.makedirs(base, exist_ok=True)
    urls = []
    first = 0  # the first id of the next file
    for n, size in enumerate(sizes):
        ids = np.arange(first, first + size, dtype=np.int64)
        x, y = regression_arrays(ids, dim)
        first += size
        if fmt == "tar":
            data = _tar_bytes(ids, x, y)
        elif fmt == "parquet":
            data = _parquet_bytes(ids, x, y, row_group_size)
        elif fmt == "npy":
            data = _npy_bytes(np.concatenate((ids[:, None].astype(np.float32), x, y[:, None]), axis=1))
        else:
            data = _jsonl_bytes(ids, x, y)
        name = f"part-{n:05d}.{_SUFFIX[fmt]}"
        fs.pipe_file(f"{base.rstrip('/')}/{name}", data)
        urls.append(f"{directory.rstrip('/')}/{name}")
    return urls


def to_regression(sample: Mapping[str, Any], ctx: SampleContext | None = None) -> dict[str, Any]:
    """The ``{"id", "x", "y"}`` sample of any format :func:`write_regression` writes (a transform)."""
    if "cls" in sample:  # WebDataset tar
        return {"id": int(sample["cls"]), "x": np.asarray(sample["x.npy"]), "y": np.float32(sample["json"]["y"])}
    if "id" in sample:  # Parquet, JSONL
        return {
            "id": int(sample["id"]),
            "x": np.asarray(sample["x"], dtype=np.float32),
            "y": np.float32(sample["y"]),
        }
    row = np.asarray(sample["x"])  # NumPy rows [id, x..., y]
    return {"id": int(row[0]), "x": np.ascontiguousarray(row[1:-1], dtype=np.float32), "y": np.float32(row[-1])}
