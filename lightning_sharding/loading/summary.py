"""What a fit served: one :class:`EpochReport` per epoch, and the table printed when fitting ends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_sharding.core.world import World
from lightning_sharding.strategies.options import LoaderOptions


@dataclass
class EpochReport:
    """What one epoch (or the part of it this run trained) served, summed over all model replicas."""

    epoch: int
    samples: int
    consumed: int
    served_this_run: int
    padding: int
    dropped: int
    batches_per_rank: int
    skipped: int
    seconds: float
    skipped_on_resume: int = 0  # left out by a resume with skip= (a loss spike's data)

    @property
    def samples_per_second(self) -> float:
        """Real samples trained per second of this run's part of the epoch, all ranks together."""
        return self.served_this_run / self.seconds if self.seconds > 0 else 0.0


def format_summary(
    reports: list[EpochReport],
    options: LoaderOptions,
    seed: int,
    worlds: list[World],
    packing: Mapping[str, Any] | None = None,
    packed_streams: Sequence[Mapping[str, Any]] = (),
    skips: Sequence[Mapping[str, Any]] = (),
) -> str:
    """A one-screen table of what every epoch served, and where every rank ran; with ``packing``
    (a packed manifest's summary of it), the tokens an epoch's sequences hold; with
    ``packed_streams`` (a mixture's packed streams' summaries), each stream's share of sequences; with
    ``skips`` (the ledger's record of resumes with ``skip=``), what each left out."""
    replicas = ""
    if worlds and worlds[0].data_size != len(worlds):
        replicas = f" in {worlds[0].data_size} data-parallel replicas of {worlds[0].replica_size}"
    head = (
        f"lightning_sharding summary: world {len(worlds)} rank(s){replicas} x {options.num_workers} worker(s), "
        f"batch {options.batch_size}, seed {seed}, even batches '{options.even_batches}'"
    )
    ranks = "ranks: " + " | ".join(x.describe() for x in sorted(worlds, key=lambda x: x.rank))
    cols = f"{'epoch':>5} {'samples':>9} {'consumed':>9} {'padding':>7} {'dropped':>7} {'skipped':>7} "
    cols += f"{'batches/rank':>12} "
    cols += f"{'seconds':>8} {'samples/s':>10}"
    rows = [
        f"{r.epoch:>5} {r.samples:>9} {r.consumed:>9} {r.padding:>7} {r.dropped:>7} {r.skipped:>7} "
        f"{r.batches_per_rank:>12} "
        f"{r.seconds:>8.2f} {r.samples_per_second:>10.0f}"
        for r in reports
    ]
    if not rows:
        rows = ["  (no training epoch ended in this run)"]
    shown = {r.epoch for r in reports}
    for skip in skips:  # what resumes with skip= left out of the epochs above: never trained, not in consumed
        counts = "; ".join(f"{n} of epoch {e}" for e, n in skip.get("counts", []) if not shown or e in shown)
        if counts:
            rows.append(f"skip= {skip.get('asked')} at the resume from step {skip.get('at_step')}: left out {counts}")
    if packing is not None:
        sequences = int(packing["tokens"] + packing["padding"]) // int(packing["seq_len"])
        share = 100 * packing["padding"] / max(1, packing["tokens"] + packing["padding"])
        ranks += (
            f"\npacking {packing['mode']!r}, seq_len {packing['seq_len']}: {packing['tokens']:,} tokens of "
            f"{packing['documents']:,} documents in {sequences:,} sequences an epoch (padding {packing['padding']:,} "
            f"tokens, {share:.1f} %); samples below are sequences"
        )
    if packed_streams:
        first = packed_streams[0]["packing"]
        shares = ", ".join(
            f"{s['name']} {s['draws']:,} sequences ({s['share']}; it holds {s['samples']:,} sequences, "
            f"{s['packing']['tokens']:,} tokens)"
            for s in packed_streams
        )
        ranks += (
            f"\npacked streams, {first['mode']!r}, seq_len {first['seq_len']}, an epoch: {shares}; "
            "samples below are sequences"
        )
    return "\n".join([head, ranks, cols, *rows])
