"""What every rank must agree on before it reads: the data, the plan's inputs, and who shares a replica.

Each rank plans every other rank's share on its own (see :mod:`lightning_sharding.core.plan`), so they
must all start from the same manifest, seed, batch size and policies, and the data-parallel view
must cut the world into equal replicas. One gather at ``setup("fit")`` checks all of it, before
any sample is read, and names the rank and the value at fault.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_sharding.core.manifest import Epochs, Manifest, describe_change
from lightning_sharding.core.world import World
from lightning_sharding.distributed.collectives import gather_objects
from lightning_sharding.strategies.options import LoaderOptions

# The inputs of the plan every rank computes; a rank with another value would plan other shares.
PLAN_INPUTS = ("seed", "batch_size", "even_batches", "shuffle", "data_size")


def agree(world: World, manifest: Manifest, seed: int, options: LoaderOptions) -> World:
    """Check that every rank of ``world`` plans alike (a collective call); ``world`` with its
    ``replica_rank`` set (its place among the ranks that share its data-parallel rank)."""
    mine = {
        "manifest": manifest.summary(),
        "seed": seed,
        "batch_size": options.batch_size,
        "even_batches": options.even_batches,
        "shuffle": options.shuffle,
        "data_rank": world.data_rank,
        "data_size": world.data_size,
    }
    views = gather_objects(mine, world.world_size)
    check_views(views, manifest.epochs)
    replica = [rank for rank, view in enumerate(views) if view["data_rank"] == world.data_rank]
    return replace(world, replica_rank=replica.index(world.rank))


def check_views(views: list[dict[str, Any]], epochs: Epochs | None = None) -> None:
    """Raise a ValueError naming the first rank (in rank order) whose view differs from rank 0's,
    or a data-parallel layout whose replicas are not all the same size; ``epochs`` (this rank's
    manifest's) explains a difference in what they add to the manifest's summary (a mixture's streams)."""
    first = views[0]
    for rank, view in enumerate(views):
        if view["manifest"]["fingerprint"] != first["manifest"]["fingerprint"]:
            # A rank whose listing differs (glob order, object-store listing lag) would plan over
            # other positions: shares would overlap or leave gaps.
            change = describe_change(first["manifest"], view["manifest"], epochs)
            raise ValueError(
                f"rank {rank} lists other data than rank 0: {change}. "
                "Every rank must list the same items in the same order: sort globbed or listed paths, "
                "and do not change the data while the job starts."
            )
        for key in PLAN_INPUTS:
            if view[key] != first[key]:
                raise ValueError(
                    f"rank {rank} has {key}={view[key]!r} but rank 0 has {key}={first[key]!r}: every rank plans "
                    "every rank's share, so all must use the same value (pass it to every rank alike, "
                    "not per rank)"
                )
    size = first["data_size"]
    members: dict[int, list[int]] = {}
    for rank, view in enumerate(views):
        members.setdefault(view["data_rank"], []).append(rank)
    expected = len(views) // size
    uneven = {d: ranks for d, ranks in sorted(members.items()) if len(ranks) != expected}
    if uneven or len(members) != size:
        raise ValueError(
            f"the data-parallel layout does not cut the {len(views)} ranks into {size} replicas of {expected}: "
            f"ranks per data-parallel rank are {dict(sorted(members.items()))}. Each data-parallel rank "
            f"0..{size - 1} must be held by {expected} rank(s); check the strategy's distributed_sampler_kwargs "
            "or ShardedDataModule(data_parallel=...)"
        )
