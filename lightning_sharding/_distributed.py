"""The one place that talks to ``torch.distributed`` directly (object gathers for the ledger)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order; a collective call when the world has several ranks."""
    if world_size <= 1:
        return [obj]
    if not dist.is_available() or not dist.is_initialized():
        # Falling back to this rank's object alone would checkpoint one rank's ledger: never silently.
        raise RuntimeError(
            f"lightning_sharding needs torch.distributed to gather the data ledgers of {world_size} ranks, "
            "but no process group is initialised; use a Lightning strategy built on torch.distributed "
            "(ddp, ddp_spawn, fsdp, deepspeed)"
        )
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered
