"""The audit trail, its one format: every rank writes the epoch positions its completed steps
consumed, and ``lightning-sharding audit`` proves (or refutes) exactly-once over a run and the runs
that resumed it. This module writes the files (:class:`AuditWriter`, :func:`run_header`) and reads
them (:func:`audit`).

A run is one ``fit``, from its start or from the checkpoint it resumed. Its files are JSON lines,
one per data-parallel rank, in the run's audit directory (the ranks of one model replica train on
the same batches; the first of them writes for all):

- a run header: the run's id, data-parallel rank and size (``rank``, ``world_size``), the global
  rank that wrote it, workers, seed, total, manifest fingerprint, the global step it started at
  and the checkpoint it resumed from; a mixture's streams and composition, and what links it to
  the run of another mixture it went on from. Its ``kind`` and the key of its id say
  ``"segment"``, the name audit trails have had from the first release, so every trail reads;
- one ``step`` line per completed training step: epoch, global step after the step, the
  positions as ``[start, end)`` ranges, and the number of padding samples;
- one ``epoch_end`` line per finished epoch (every sample served or dropped), with the samples
  the plan dropped; an epoch stopped early has none and is reported in progress.

A run killed after its last checkpoint trained steps that the checkpoint does not hold. The
audit keeps a run's lines only up to the step the next run resumed from (up to and including the
first line at that step), exactly as the resumed run's ledger does.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from lightning_sharding.core.history import flat_ranges, ranges_of_flat
from lightning_sharding.core.private import make_dirs, open_or_create
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.mixture import mixture_of

if TYPE_CHECKING:
    from lightning_sharding.loading.keeper import LedgerKeeper

AUDIT_VERSION = 1
# The header line's ``kind``, and its key for the run's id: on disk a run has always been a "segment".
_RUN = "segment"


def run_header(keeper: LedgerKeeper, *, started: float, start_step: int, resumed_from: str | None) -> dict[str, Any]:
    """What the header of a run's audit file says besides its id and rank (see the module):
    ``started`` is the run's start time (rank 0's), ``start_step`` the global step it starts at."""
    world = keeper.world
    header: dict[str, Any] = {
        "started": started,
        "world_size": world.data_size,  # the audit counts data-parallel ranks: one file per replica
        "global_world_size": world.world_size,
        "global_rank": world.rank,
        "num_workers": keeper.options.num_workers,
        "seed": keeper.ledger.seed,
        "total": keeper.ledger.total,
        "fingerprint": keeper.manifest.fingerprint,
        "start_step": start_step,
        "resumed_from": resumed_from,
    }
    mixture = mixture_of(keeper.manifest)
    if mixture is not None:  # the audit counts each stream's draws
        header["streams"] = [{"name": n, "draws": d} for n, d in zip(mixture.names, mixture.draws, strict=True)]
        header.update(mixture.composition_summary())
    if keeper.controlled:  # the decisions the run starts from (a resume's); it writes the later ones as lines
        header["decisions"] = [dict(d) for d in keeper.ledger.decisions or []]
    ledger = keeper.ledger
    skipped = ([[ledger.epoch, *flat_ranges(ledger.skipped)]] if ledger.skipped else []) + [
        [e, *flat_ranges(r)] for e, r in sorted(ledger.skip_ahead.items())
    ]
    if skipped:  # left out by a resume with skip=: never trained, so not missing
        header["skipped"] = skipped
    if keeper.mixture_from is not None:  # resumed a checkpoint of another mixture: the audit links the two
        header["mixture_from"] = keeper.mixture_from
    # What the epoch's order records beyond the manifest: a changed mixture's rest, linked to the mixture before.
    record = keeper.manifest.order(keeper.ledger.seed, keeper.ledger.epoch).record()
    if record and keeper.ledger.change is not None:
        header["change"] = {**record, "from": keeper.ledger.change["before"]["manifest"]["fingerprint"]}
    return header


class AuditWriter:
    """Appends this rank's audit lines for one run; flushes every line (a crash loses none).

    ``header`` is what :func:`run_header` gives; the file starts with it, the run's id ``run`` and
    this data-parallel ``rank``.
    """

    def __init__(self, directory: str | Path, run: str, rank: int, header: dict[str, Any]) -> None:
        self.path = Path(directory) / f"{run}-rank{rank}.jsonl"
        make_dirs(self.path.parent)  # 0700, 0600: only the user reads which samples trained when
        fd = open_or_create(self.path, os.O_WRONLY | os.O_APPEND)
        self._file: IO[str] | None = os.fdopen(fd, "a", buffering=1)
        self._write({"kind": _RUN, "version": AUDIT_VERSION, _RUN: run, "rank": rank, **header})

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def step(self, epoch: int, global_step: int, positions: np.ndarray, num_padding: int, skipped: int = 0) -> None:
        """Record one completed step's consumed positions (shape ``(n,)``), its padding count, and
        how many of the positions were skipped as unreadable (``on_error="skip"``)."""
        ranges = RangeSet.from_positions(positions).ranges()
        record: dict[str, Any] = {"kind": "step", "epoch": epoch, "gs": global_step, "pos": ranges, "pad": num_padding}
        if skipped:
            record["skip"] = skipped
        self._write(record)

    def decision(self, decision: dict[str, Any]) -> None:
        """Record a mixture decision (a :class:`~lightning_sharding.mixture.Decision`'s state)."""
        self._write({"kind": "decision", "gs": int(decision["step"]), "decision": decision})

    def epoch_end(self, epoch: int, global_step: int, dropped: int) -> None:
        """Record that ``epoch`` finished; ``dropped`` is what its plan left unserved, all ranks."""
        self._write({"kind": "epoch_end", "epoch": epoch, "gs": global_step, "dropped": dropped})

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class _Run:
    run: str
    header: dict[str, Any]
    lines: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> lines in order


@dataclass
class StreamAudit:
    """One stream of a mixture in one epoch: its ``expected`` draws, the distinct draws ``consumed``
    and the ``duplicates`` (extra servings of a draw; a stream's own repeats are separate draws).
    ``phases``: of an epoch in phases (a share schedule, online decisions), the same per phase, as
    ``(phase, expected, consumed, duplicates)``, the phase named by what started it."""

    name: str
    expected: int
    consumed: int
    duplicates: int
    phases: list[tuple[str, int, int, int]] = field(default_factory=list)


@dataclass
class EpochAudit:
    """Per-epoch result: ``expected`` samples, distinct ``consumed``, ``duplicates`` (extra
    servings), ``missing`` (never served and not dropped), ``padding`` and ``dropped``."""

    epoch: int
    expected: int
    consumed: int
    duplicates: int
    missing: int
    padding: int
    dropped: int
    complete: bool
    streams: list[StreamAudit] = field(default_factory=list)
    skipped: int = 0  # left out by a resume with skip= (never trained: not missing)
    skipped_trained: int = 0  # of those, trained all the same: a violation

    @property
    def ok(self) -> bool:
        """Exactly-once holds (an unfinished epoch only needs no duplicates)."""
        return self.duplicates == 0 and self.skipped_trained == 0 and (self.missing == 0 or not self.complete)


def _load(paths: Iterable[Path]) -> list[_Run]:
    """The runs of the audit files ``paths``, in the order they started."""
    runs: dict[str, _Run] = {}
    for path in sorted(paths):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not lines or lines[0].get("kind") != _RUN:
            raise ValueError(f"{path} is not a lightning_sharding audit file (no run header)")
        header = lines[0]
        if header.get("version") != AUDIT_VERSION:
            raise ValueError(f"{path} has audit version {header.get('version')!r}; this reads {AUDIT_VERSION}")
        run = runs.setdefault(header[_RUN], _Run(header[_RUN], header))
        run.lines[int(header["rank"])] = lines[1:]
    return sorted(runs.values(), key=lambda r: (r.header["started"], r.run))


def _audit_files(directories: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for d in map(Path, directories):
        if not d.exists():
            raise FileNotFoundError(f"audit: {d} does not exist")
        base = d / "audit" if (d / "audit").is_dir() else d
        found = sorted(base.glob("*.jsonl"))
        if not found:
            raise FileNotFoundError(
                f"audit: no audit files in {base}; train with auditing on "
                "(ShardedDataModule(audit_dir=...) or the override audit.enabled=true)"
            )
        files += found
    return files


def audit(directories: Sequence[str | Path]) -> list[EpochAudit]:
    """Audit the union of one or more run directories (a run and the runs that resumed it)."""
    runs = _load(_audit_files(directories))
    _check_chain(runs)
    changes = {int(r.header["change"]["epoch"]): r.header for r in runs if r.header.get("change")}
    served: dict[int, Counter[int]] = {}
    before: dict[int, Counter[int]] = {}  # a changed epoch's positions served under the mixture before
    headers: dict[int, dict[str, Any]] = {}
    padding: Counter[int] = Counter()
    dropped: Counter[int] = Counter()
    finished: set[int] = set()
    decided: list[dict[str, Any]] = []  # the decisions the last run started from, and those it made
    for i, run in enumerate(runs):
        # A run holds up to the earliest step a later run resumed from (a rollback to an older checkpoint,
        # as a resume with skip= does, cuts every run after that step, not only the one just before).
        cut = min((int(r.header["start_step"]) for r in runs[i + 1 :]), default=None)
        if run.header.get("decisions") is not None:
            decided = list(run.header["decisions"])
        for rank, lines in run.lines.items():
            for line in _kept(lines, cut):
                if line["kind"] == "decision":
                    if rank == min(run.lines):  # every data-parallel rank writes it
                        decided.append(line["decision"])
                    continue
                epoch = int(line["epoch"])
                changed = changes.get(epoch)
                old = changed is not None and run.header["fingerprint"] != changed["fingerprint"]
                if not old:
                    headers[epoch] = run.header
                if line["kind"] == "step":
                    counts = (before if old else served).setdefault(epoch, Counter())
                    for start, end in line["pos"]:
                        counts.update(range(start, end))
                    padding[epoch] += int(line["pad"])
                elif line["kind"] == "epoch_end":
                    finished.add(epoch)
                    if rank == 0:
                        dropped[epoch] += int(line["dropped"])
    results = []
    for epoch in sorted(set(served) | set(before) | finished):
        counts, old_counts = served.get(epoch, Counter()), before.get(epoch, Counter())
        header = headers.get(epoch, runs[0].header)
        if epoch in changes:  # the rest at the new shares, after what the old mixture consumed
            change = changes[epoch]["change"]
            expected = int(change["before"]) + sum(int(s["draws"]) for s in change["streams"])
            old_header = next(r.header for r in runs if r.header["fingerprint"] == change["from"])
            streams = _merge(
                _per_stream(old_header.get("streams"), old_counts, old_header),
                _per_stream(change["streams"], counts, changes[epoch]),
            )
        else:
            if header.get("decisions") is not None:
                header = {**header, "decisions": decided}
            expected = (
                sum(int(s["draws"]) for s in header["streams"]) if header.get("streams") else int(header["total"])
            )
            streams = _per_stream(header.get("streams"), counts, header, epoch)
        consumed = len(counts) + len(old_counts)
        skipped = _left_out(headers.get(epoch), epoch)
        trained_anyway = sum(1 for p in counts if p in skipped) if skipped else 0
        results.append(
            EpochAudit(
                epoch=epoch,
                expected=expected,
                consumed=consumed,
                duplicates=sum(c - 1 for c in counts.values()) + sum(c - 1 for c in old_counts.values()),
                missing=expected - consumed - dropped[epoch] - (len(skipped) - trained_anyway),
                padding=padding[epoch],
                dropped=dropped[epoch],
                complete=epoch in finished,
                streams=streams,
                skipped=len(skipped),
                skipped_trained=trained_anyway,
            )
        )
    return results


def _left_out(header: dict[str, Any] | None, epoch: int) -> RangeSet:
    """What resumes with ``skip=`` left out of ``epoch``, by the header of the last run that trained in
    it: its ledger held every skip of its line of runs (a run rolled back before a skip holds none)."""
    for at, *flat in (header or {}).get("skipped") or []:
        if int(at) == epoch:
            return ranges_of_flat(flat)
    return RangeSet()


def _check_chain(runs: list[_Run]) -> None:
    """Every run trains the seed, data and order of the one before it, or changed its mixture
    from an earlier run's (``allow_mixture_change``: its header's ``mixture_from``, or its
    ``change``'s ``from``, names that fingerprint; a change retried from the same checkpoint links to
    the same run)."""
    for i, run in enumerate(runs):
        change = run.header.get("change")
        origin = run.header.get("mixture_from") or (change or {}).get("from")
        if origin is not None and all(r.header["fingerprint"] != origin for r in runs[:i]):
            raise ValueError(
                f"audit: run {run.run} resumed a checkpoint of another mixture (fingerprint "
                f"{str(origin)[:16]}), but no audit file of that mixture is here: audit the run directories "
                "of the runs before the change too (lightning-sharding audit DIR_BEFORE DIR_AFTER)"
            )
        if i == 0:
            continue
        prev = runs[i - 1]
        linked = origin is not None and run.header["fingerprint"] != prev.header["fingerprint"]
        keys = (
            ["seed"]
            + ([] if linked else ["fingerprint"])
            + ([] if origin or change or prev.header.get("change") else ["total"])
        )
        for key in (k for k in keys if run.header[k] != prev.header[k]):
            raise ValueError(
                f"audit: run {run.run} has {key}={run.header[key]!r} but run {prev.run} "
                f"has {prev.header[key]!r}; these runs did not train on the same data and order"
            )


def _merge(old: list[StreamAudit], rest: list[StreamAudit]) -> list[StreamAudit]:
    """A changed epoch's streams: what each consumed before the change, plus its rest at the new shares."""
    was = {s.name: s for s in old}
    merged = [
        StreamAudit(
            s.name,
            s.expected + (was[s.name].consumed if s.name in was else 0),
            s.consumed + (was[s.name].consumed if s.name in was else 0),
            s.duplicates + (was[s.name].duplicates if s.name in was else 0),
        )
        for s in rest
    ]
    names = {s.name for s in rest}
    return merged + [StreamAudit(s.name, s.consumed, s.consumed, s.duplicates) for s in old if s.name not in names]


def _per_stream(
    streams: list[dict[str, Any]] | None, counts: Counter[int], header: dict[str, Any], epoch: int = 0
) -> list[StreamAudit]:
    """Each stream's share of an epoch's served positions (a mixture's header names its streams and
    their composition), and of each phase's when the epoch has phases."""
    if not streams:
        return []
    from lightning_sharding.mixture import layout_of_summary

    positions = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    times = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
    layout = layout_of_summary(streams, header, epoch)
    draws = [int(d) for d in getattr(layout, "draws", [s["draws"] for s in streams])]
    which = layout.streams(positions)[0] if positions.size else positions
    phase_of = getattr(layout, "phase_of", None)
    phase = phase_of(positions) if phase_of is not None else None
    names = _phase_names(header, epoch, len(layout.phase_draws)) if phase is not None else []  # type: ignore[attr-defined]
    out = []
    for i, s in enumerate(streams):
        mine = which == i
        audit_row = StreamAudit(s["name"], draws[i], int(mine.sum()), int((times[mine] - 1).sum()))
        for k, label in enumerate(names):
            here = mine & (phase == k)
            expected = int(layout.phase_draws[k][i])  # type: ignore[attr-defined]
            audit_row.phases.append((label, expected, int(here.sum()), int((times[here] - 1).sum())))
        out.append(audit_row)
    return out


def _phase_names(header: dict[str, Any], epoch: int, count: int) -> list[str]:
    """What started each phase of ``epoch``: a share schedule's start, or an online decision's step."""
    if header.get("decisions") is not None or header.get("training_schedule"):
        from lightning_sharding.mixture import Decision, epoch_decisions, static_decisions

        total = int(header["total"])
        decisions = static_decisions(header.get("training_schedule") or [], total)
        decisions += [Decision.from_state(d) for d in header.get("decisions") or []]
        names = ["phase 0 (the shares the epoch started with)"]
        for d in epoch_decisions(decisions, epoch, total):
            sample = epoch * total + d.position
            what = f"decision of step {d.step}" if d.step >= 0 else f"schedule, from sample {sample}"
            if d.position == 0:  # it gives the epoch's first phase its shares
                names[0] = f"phase 0 (the {what})"
            else:
                names.append(f"phase {len(names)} (the {what})")
        return names[:count]
    labels = [
        f"from {p['start']:g} of the epoch" + (f", {p['note']}" if p.get("note") else "")
        for p in header.get("schedule") or []
    ]
    return [f"phase {k} ({label})" for k, label in enumerate(labels)]


def _kept(lines: list[dict[str, Any]], cut: int | None) -> Iterable[dict[str, Any]]:
    """Lines up to the resumed step ``cut``: smaller steps, the first step line at ``cut`` (the one
    whose optimizer step the checkpoint holds; later ones at ``cut`` were still accumulating), and
    an ``epoch_end`` at ``cut``."""
    cut_step_seen = False
    for line in lines:
        if cut is not None and line["gs"] >= cut:
            if line["gs"] > cut or (line["kind"] == "step" and cut_step_seen):
                return
            cut_step_seen = cut_step_seen or line["kind"] == "step"
        yield line


def format_audit(results: list[EpochAudit]) -> str:
    """The audit table, one row per epoch."""
    head = f"{'epoch':>5} {'expected':>9} {'consumed':>9} {'duplicates':>10} {'missing':>8} {'padding':>8} "
    head += f"{'dropped':>8}  status"
    rows = []
    for r in results:
        status = "exactly-once" if r.ok and r.complete else ("in progress" if r.ok else "VIOLATED")
        if r.skipped:
            trained = f", {r.skipped_trained} TRAINED" if r.skipped_trained else ""
            status += f" ({r.skipped} skipped on resume{trained})"
        rows.append(
            f"{r.epoch:>5} {r.expected:>9} {r.consumed:>9} {r.duplicates:>10} {r.missing:>8} {r.padding:>8} "
            f"{r.dropped:>8}  {status}"
        )
        for s in r.streams:
            rows.append(
                f"{'':>5} {s.expected:>9} {s.consumed:>9} {s.duplicates:>10} {'':>8} {'':>8} {'':>8}  stream {s.name!r}"
            )
            wrong = [p for p in s.phases if p[3] or (r.complete and p[1] != p[2])]
            rows += [
                f"{'':>5} {e:>9} {c:>9} {d:>10} {'':>8} {'':>8} {'':>8}  MISMATCH: stream {s.name!r}, {label}"
                for label, e, c, d in wrong
            ]
    return "\n".join([head, *rows])
