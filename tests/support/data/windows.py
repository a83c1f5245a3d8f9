"""Climate-like test data for the broadcast strategy: one ``.npy`` file per month, light to import.

Step ``t`` of the continuous series holds the value ``t`` in every feature, so a window's content
tells where it starts. Workers unpickle ``MonthWindows``; this module imports no Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import get_worker_info

from lightning_sharding.readers.windows import NpyWindows

FEATURES = 2


def write_months(directory: Path, lengths: Sequence[int], features: int = FEATURES) -> list[str]:
    """Write one month per length, named ``month-NN.npy``; step t holds t. Returns the paths in order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, t0 = [], 0
    for i, n in enumerate(lengths):
        steps = np.arange(t0, t0 + n, dtype=np.float32)
        path = directory / f"month-{i:02d}.npy"
        np.save(path, np.repeat(steps[:, None], features, axis=1))
        paths.append(str(path))
        t0 += n
    return paths


class MonthWindows(NpyWindows):
    """Windows as the tests' model wants them: ``x`` (B, 8), ``y`` (B,), plus ``id``, ``start`` and
    ``worker`` (the DataLoader worker that cropped the window, -1 in the main process)."""

    def make_batch(self, windows: npt.NDArray[Any], ids: npt.NDArray[np.int64], starts: npt.NDArray[np.int64]) -> Any:
        flat = windows.reshape(len(windows), -1)
        x = np.zeros((len(windows), 8), dtype=np.float32)
        x[:, : min(8, flat.shape[1])] = flat[:, :8] / 1000.0
        info = get_worker_info()
        return {
            "x": torch.from_numpy(x),
            "y": torch.from_numpy(flat.mean(axis=1).astype(np.float32) / 1000.0),
            "id": torch.from_numpy(ids),
            "start": torch.from_numpy(starts),
            "first": torch.from_numpy(np.ascontiguousarray(windows[:, :, 0])),
            "worker": torch.full((len(windows),), info.id if info is not None else -1),
        }
