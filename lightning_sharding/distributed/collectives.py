"""The one place that talks to ``torch.distributed`` directly (object gathers for the ledger)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather_objects(obj: Any, world_size: int, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order; a collective call when the world has several ranks (over
    ``group``, default the whole world's)."""
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
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def cpu_group(world_size: int) -> Any:
    """A gloo group over all ranks (for small CPU tensors whatever the training backend); ``None``
    for a single rank. A collective call: every rank must create it at the same point."""
    if world_size <= 1:
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"lightning_sharding needs torch.distributed to agree on batches across {world_size} ranks, "
            "but no process group is initialised; use a Lightning strategy built on torch.distributed"
        )
    return dist.new_group(backend="gloo")


def all_true(flag: bool, group: Any) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (one 1-element all_reduce; ``group=None``: this rank)."""
    if group is None:
        return flag
    import torch

    value = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def gather_counts(count: int, group: Any) -> list[int]:
    """Every rank's ``count`` over ``group``, in rank order (``group=None``: this rank's only)."""
    if group is None:
        return [count]
    import torch

    values = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(values, torch.tensor([count], dtype=torch.int64), group=group)
    return [int(v.item()) for v in values]


def broadcast_object(obj: Any, world_size: int) -> Any:
    """Rank 0's ``obj`` on every rank (a collective call; ``obj`` is ignored on the other ranks)."""
    if world_size <= 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
