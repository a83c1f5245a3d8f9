"""Recipe ``climate``: monthly gridded time series, strategy ``broadcast``, forecast windows.

Each month is one time-major ``.npy`` array ``(steps, variables)``; a sample is a window of
``window`` steps whose first ``window - 1`` steps are the input and whose last step is the target.
"""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_sharding.core.world import WorkerContext
from lightning_sharding.lightning.datamodule import ShardedDataModule
from lightning_sharding.readers.windows import NpyWindows
from lightning_sharding.recipes.data import datamodule, generated


class ForecastWindows(NpyWindows):
    """Windows split into input and target: ``{"x": (B, T - 1, V), "y": (B, V), "id": (B,)}``."""

    def make_batch(self, windows: npt.NDArray[Any], ids: npt.NDArray[np.int64], starts: npt.NDArray[np.int64]) -> Any:
        """The broadcast strategy's batch (windows: ``(B, T, V)``)."""
        import torch

        return {
            "x": torch.from_numpy(np.ascontiguousarray(windows[:, :-1])),
            "y": torch.from_numpy(np.ascontiguousarray(windows[:, -1])),
            "id": torch.from_numpy(ids),
        }

    def read_batch(self, item: Any, indices: npt.NDArray[np.int64], ctx: WorkerContext) -> list[Any]:
        """The per-sample path (strategy ``shard``), shaped like :meth:`make_batch`'s samples."""
        return [{"x": s["x"][:-1], "y": s["x"][-1], "id": s["id"]} for s in super().read_batch(item, indices, ctx)]


def write_months(directory: Path, months: int, steps: int, variables: int, seed: int = 0) -> list[str]:
    """``months`` files ``YYYY-MM.npy`` of ``steps`` hourly steps of ``variables`` float32 values:
    a daily cycle, a seasonal drift and noise, continuous across months."""
    rng = np.random.default_rng(seed)
    paths = []
    for m in range(months):
        hours = np.arange(m * steps, (m + 1) * steps)[:, None]
        phase = np.arange(variables)[None, :]
        daily = np.sin(2 * np.pi * hours / 24 + phase)
        season = 0.5 * np.sin(2 * np.pi * hours / (24 * 365) + phase)
        values = (daily + season + 0.1 * rng.standard_normal((steps, variables))).astype(np.float32)
        paths.append(str(directory / f"{2000 + m // 12}-{m % 12 + 1:02d}.npy"))
        np.save(paths[-1], values)
    return paths


def expand(paths: Sequence[str]) -> list[str]:
    """Every entry as written, or the sorted files of a glob; a glob that matches nothing is an error."""
    found: list[str] = []
    for entry in paths:
        if glob.has_magic(entry):
            matches = sorted(glob.glob(entry))
            if not matches:
                raise FileNotFoundError(f"data.paths: {entry!r} matches no file")
            found.extend(matches)
        else:
            found.append(entry)
    return found


def months(
    *,
    paths: list[str] | None,
    window: int,
    stride: int,
    halo: bool,
    variables: int,
    months: int,
    steps_per_month: int,
    sharding: Mapping[str, Any],
    audit_dir: str | None = None,
    **options: Any,
) -> ShardedDataModule:
    """``data=months``: the month files in time order (generated when ``paths`` is empty)."""
    if not paths:
        name = f"months-{months}x{steps_per_month}x{variables}"
        where = generated(options["cache_dir"], name, lambda d: write_months(d, months, steps_per_month, variables))
        paths = [str(where / "*.npy")]
    files = expand(paths)
    reader = ForecastWindows(files, window=window, stride=stride, halo=halo)
    shape, _ = reader.signature(files[0])
    if shape != (variables,):
        raise ValueError(
            f"data.variables={variables} (the model's model.variables) does not match {files[0]}, whose steps "
            f"have shape {shape}: set data.variables to the values per step (files are (steps, variables))"
        )
    return datamodule(options, sharding, reader=reader, audit_dir=audit_dir)
