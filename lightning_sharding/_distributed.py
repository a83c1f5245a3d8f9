"""The one place that talks to ``torch.distributed`` directly (object gathers for the ledger)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order; a collective call when the world has several ranks."""
    if world_size <= 1 or not dist.is_available() or not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered
