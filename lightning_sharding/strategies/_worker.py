"""What runs at the start of every worker's task: its :class:`WorkerContext`, seeded once per epoch."""

from __future__ import annotations

import os
import pickle
import random
import sys
import types
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from lightning_sharding.core.spelling import option
from lightning_sharding.core.world import WorkerContext, World


def seed_rngs(seed: int) -> None:
    """Seed torch, NumPy and ``random`` of this process (a worker) with one derived seed."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


class WorkerContexts:
    """The :class:`WorkerContext` of the process a dataset runs in, one per epoch.

    The worker id is the DataLoader's (or ``worker_id``, for a worker of another pool, such as a DALI
    source's). A worker's RNGs are seeded with its context's ``worker_seed`` when its epoch starts;
    the training process itself (``num_workers=0``) is never reseeded.
    """

    def __init__(self, world: World, num_workers: int, seed: int, *, worker_id: int | None = None) -> None:
        self.world = world
        self.num_workers = num_workers
        self.seed = seed
        self.worker_id = worker_id
        self._main_pid = os.getpid()  # pickled with the dataset: a worker process sees another pid
        self._context: WorkerContext | None = None

    def __call__(self, epoch: int) -> WorkerContext:
        if self._context is None or self._context.epoch != epoch:
            info = get_worker_info()
            worker = self.worker_id if self.worker_id is not None else (info.id if info is not None else 0)
            self._context = WorkerContext(
                data_rank=self.world.data_rank,
                data_size=self.world.data_size,
                worker_id=worker,
                num_workers=self.num_workers,
                epoch=epoch,
                seed=self.seed,
            )
            if info is not None or os.getpid() != self._main_pid:
                seed_rngs(self._context.worker_seed)
        return self._context


def pass_through(data: Any) -> Any:
    """The DataLoader's collate for datasets that return whole deliveries."""
    return data


def check_picklable(where: str, hint: str, **objects: Any) -> None:
    """Raise a TypeError naming the object that cannot be pickled into ``where``, or that a new
    process could not import (a class or function of an interactive session's ``__main__``)."""
    main = sys.modules.get("__main__")
    fileless_main = getattr(main, "__file__", None) is None and getattr(main, "__spec__", None) is None
    for name, obj in objects.items():
        try:
            pickle.dumps(obj)
        except Exception as err:  # noqa: BLE001 - any pickling failure means the same thing here
            raise TypeError(
                f"the {name} {obj!r} cannot be pickled into {where} ({err}). Define it at module level "
                f"(not inside a function or as a lambda){hint}, pass {option('multiprocessing_context', 'fork')}, "
                f"or use {option('num_workers', 0)}."
            ) from err
        defined_in = getattr(obj, "__module__", None) if isinstance(obj, (type, types.FunctionType)) else None
        if fileless_main and obj is not None and "__main__" in (defined_in, type(obj).__module__):
            raise TypeError(
                f"the {name} {obj!r} is defined in a notebook, an interactive session or `python -c`, whose "
                f"code {where} cannot import: define it in a .py module, or pass "
                f"{option('multiprocessing_context', 'fork')}"
            )
