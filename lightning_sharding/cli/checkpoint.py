"""``lightning-sharding inspect``: what a checkpoint's data ledger holds, and which step it matches."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from lightning_sharding.cli._common import CliError, _check_plot_path, _draw, _first_line, _plural
from lightning_sharding.core.ledger import CHECKPOINT_KEY, GLOBAL_STEP_KEY, ledger_step_mismatch, loop_state_entry
from lightning_sharding.core.rangeset import RangeSet


def register(sub: Any) -> None:
    """Add the ``inspect`` subcommand to the subparsers ``sub``."""
    inspect = sub.add_parser(
        "inspect",
        help="show the data ledger of a checkpoint",
        description="Print what a checkpoint's lightning_sharding ledger holds: seed, epoch, data fingerprint, "
        "consumed and remaining samples, the topology that wrote it, and Lightning's step and epoch. A checkpoint "
        "of Lightning's Trainer, or one holding a ShardedData state (fabric.save, torch.save, or a "
        "torch.distributed.checkpoint directory).",
    )
    inspect.add_argument(
        "checkpoint", metavar="CKPT", help="a checkpoint file, or a torch.distributed.checkpoint directory"
    )
    inspect.add_argument("--plot", metavar="FILE.png", help="also draw the epoch's progress into this image")
    inspect.add_argument(
        "--data",
        nargs="*",
        metavar="KEY=VALUE",
        help="also compare the checkpoint with the data it would resume on: the train config's data, with these "
        "Hydra overrides (e.g. --data data=files 'data.urls=[/scratch/ds/*.npy]'), and print every difference",
    )
    inspect.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="also name what global step N trained on every rank (the step trained while trainer.global_step was "
        "N), replayed from the checkpoint's training history without reading data: epoch positions, and with "
        "--data the item and index of each sample (of packed sequences: each document's token range)",
    )
    inspect.add_argument(
        "--past",
        action="store_true",
        help="with --step N past the checkpoint's steps: name step N as the run that wrote the checkpoint went on "
        "to train it, on its last topology (what skip= leaves out at a resume from this checkpoint)",
    )
    inspect.add_argument("--config-dir", help="a directory of your own train configs (default: the packaged ones)")
    inspect.add_argument("--config-name", default="train", help="the config to compose (default: train)")
    inspect.set_defaults(func=_inspect)


def _load_checkpoint(path: Path) -> Mapping[str, Any]:
    """``torch.load`` a checkpoint safely (a ``torch.distributed.checkpoint`` directory: into one file
    first); a ``ShardedData`` state in it becomes the entry ``inspect`` reads. Every failure is a
    :class:`CliError` naming the path."""
    if not path.exists():
        raise CliError(f"no such checkpoint file: {path}")
    if path.is_dir() and not (path / ".metadata").is_file():
        raise CliError(f"{path} is a directory, not a checkpoint file or a torch.distributed.checkpoint directory")
    import torch

    try:
        if path.is_dir():
            ckpt = _load_dcp(path)
        else:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to unpickle is the file's fault
        raise CliError(f"{path} is not a readable PyTorch checkpoint: {_first_line(err)}") from None
    if not isinstance(ckpt, Mapping):
        raise CliError(f"{path} holds a {type(ckpt).__name__}, not a Lightning checkpoint")
    if CHECKPOINT_KEY not in ckpt:
        for key, value in ckpt.items():  # {"data": data, ...} saved by fabric.save, DCP or torch.save
            entry = loop_state_entry(value)
            if entry is not None:
                return {CHECKPOINT_KEY: entry, "state key": key}
    return ckpt


def _load_dcp(path: Path) -> Any:
    """A ``torch.distributed.checkpoint`` directory as one state dict (converted in a temporary file)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "state.pt")
        return torch.load(Path(tmp) / "state.pt", map_location="cpu", weights_only=True)


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def format_inspect(path: Path, ckpt: Mapping[str, Any]) -> str:
    """The ``inspect`` report of a checkpoint holding a valid data ledger."""
    from lightning_sharding.core.ledger import Ledger
    from lightning_sharding.mixture import shown_key

    state = ckpt[CHECKPOINT_KEY]
    ledger = Ledger.from_state_dict(state)
    manifest = ledger.manifest
    streams = [str(s.get("name")) for s in manifest.get("streams") or []]
    first, last = (shown_key(str(manifest.get(k, "?")), streams) for k in ("first_key", "last_key"))
    consumed = len(ledger.consumed)
    remaining = ledger.total - consumed - len(ledger.skipped)
    ranges = np.asarray(state["consumed"])
    writer = state.get("writer")
    if isinstance(writer, Mapping):
        world, replicas = writer.get("world_size", "?"), writer.get("data_parallel_size")
        in_replicas = f" in {replicas} data-parallel replicas" if replicas not in (None, world) else ""
        topology = (
            f"world_size {world}{in_replicas} x num_workers {writer.get('num_workers', '?')}, "
            f"batch_size {writer.get('batch_size', '?')}"
        )
    else:
        topology = "not recorded"
    return "\n".join(
        [
            f"checkpoint   {path}",
            f"ledger       version {state['version']}, seed {ledger.seed}, epoch {ledger.epoch}",
            f"data         fingerprint {ledger.fingerprint[:16]}, {manifest.get('num_items', '?')} items, "
            f"{manifest.get('total', ledger.total)} samples, "
            f"first {first}, last {last}",
            f"consumed     {consumed} of {ledger.total} samples ({_percent(consumed, ledger.total)})",
            f"remaining    {remaining} samples ({_percent(remaining, ledger.total)})",
            f"writer       {topology}",
            f"ledger size  {_plural(ledger.consumed.num_ranges, 'range')}, {ranges.nbytes} bytes",
            f"state        ShardedData, under {ckpt['state key']!r}"
            if "state key" in ckpt
            else f"lightning    global_step {ckpt.get('global_step', 'n/a')}, epoch {ckpt.get('epoch', 'n/a')}",
            _step_line(state, ckpt.get("global_step")),
            *_stream_lines(manifest.get("streams"), ledger, manifest),
            *_packing_lines(manifest.get("packing")),
            *_history_lines(ledger.history, "state key" in ckpt),
            *_skip_lines(ledger),
        ]
    )


def _skip_lines(ledger: Any) -> list[str]:
    """What resumes with ``skip=`` left out: never trained, not served again in their epoch."""
    held = [(ledger.epoch, ledger.skipped)] if ledger.skipped else []
    lines = []
    for epoch, ranges in held + sorted(ledger.skip_ahead.items()):
        asked = "; ".join(
            f"skip= {s.get('asked')} at the resume from step {s.get('at_step')}"
            for s in ledger.skips
            if any(e == epoch for e, _ in s.get("counts", []))
        )
        lines.append(f"skipped      {len(ranges)} samples of epoch {epoch}" + (f" ({asked})" if asked else ""))
    return lines


def _history_lines(history: list[dict[str, Any]], own_loop: bool) -> list[str]:
    """The runs that trained into the checkpoint (``inspect --step`` replays them); none from a
    Trainer's checkpoint means an earlier lightning_sharding wrote it."""
    if not history:
        return [] if own_loop else ["history      not recorded (an earlier lightning_sharding): --step names no step"]
    lines = [
        f"history      from step {h['step']} (epoch {h['epoch']}): {h['world_size']} ranks x {h['num_workers']} "
        f"workers, batch_size {h['batch_size']}, accumulate {h['accumulate']}"
        for h in history
    ]
    if int(history[0]["step"]) > 0:
        lines.append(f"history      starts at the resume at step {history[0]['step']}: the runs before recorded none")
    return lines


def _packing_lines(packing: Any) -> list[str]:
    """Packed token sequences: the packing, and the tokens an epoch's sequences hold."""
    if not isinstance(packing, Mapping):
        return []
    return [
        f"packing      {packing.get('mode')!r}, seq_len {packing.get('seq_len')}: {packing.get('tokens', 0):,} tokens "
        f"of {packing.get('documents', 0):,} documents an epoch (padding {packing.get('padding', 0):,}); "
        "samples are sequences"
    ]


def _stream_lines(streams: Any, ledger: Any, manifest: Any) -> list[str]:
    """A mixture's streams: each one's share, and how many of its draws this epoch are consumed."""
    if not streams:
        return []
    from lightning_sharding.mixture import layout_of_summary

    composition, size = manifest.get("composition", "mixed"), manifest.get("batch_size")
    blocked = f" of {size} (resume with batch_size={size})" if composition != "mixed" else ""
    lines = [f"mixture      {len(streams)} streams in {composition} batches{blocked}"]
    if ledger.change is not None:  # resumed with allow_mixture_change: the epoch's counts span both mixtures
        from lightning_sharding.mixture import changed_counts

        before = len(RangeSet.from_state(np.asarray(ledger.change["before"]["consumed"])))
        counts = changed_counts(ledger)
        lines.append(
            f"changed      epoch {ledger.epoch} resumed under new shares: {before} samples consumed before, "
            f"{ledger.total - before} drawn at the new shares"
        )
    else:
        if ledger.decisions is not None:  # under online control: the epoch laid out by the decisions
            manifest = {**manifest, "decisions": ledger.decisions}
        layout = layout_of_summary(streams, manifest, ledger.epoch)
        which, _ = layout.streams(ledger.consumed.to_array())
        draws = getattr(layout, "draws", [int(s["draws"]) for s in streams])
        counts = {s["name"]: (int((which == i).sum()), int(draws[i])) for i, s in enumerate(streams)}
    shares = {s["name"]: f" ({s['share']}, {s['samples']} samples)" for s in streams}
    lines += [
        f"stream       {name!r}{shares.get(name, ' (removed)')}: consumed {done} of {draws} draws, "
        f"remaining {draws - done}"
        for name, (done, draws) in counts.items()
    ]
    schedule = manifest.get("schedule") or []
    if schedule and ledger.change is None:  # each phase: where it starts and how far it is consumed
        names = [s["name"] for s in streams]
        bounds = np.cumsum([0] + [sum(p["draws"]) for p in schedule])
        consumed = ledger.consumed
        for k, phase in enumerate(schedule):
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            done = len(consumed.intersection(RangeSet.interval(lo, hi))) if hi > lo else 0
            draws = ", ".join(f"{n} {d}" for n, d in zip(names, phase["draws"], strict=True) if d)
            lines.append(
                f"phase {k}      from {phase['start']:g} of the epoch (positions {lo}..{hi - 1}: {draws}): "
                f"consumed {done} of {hi - lo}"
            )
    lines += _decision_lines(ledger)
    return lines


def _decision_lines(ledger: Any) -> list[str]:
    """A mixture under online control: every decision recorded, where it holds from."""
    if ledger.decisions is None:
        return []
    lines = [f"controlled   {len(ledger.decisions)} decision(s) of a MixtureController, replayed on resume"]
    for d in ledger.decisions:
        total = sum(d["shares"].values()) or 1
        shares = ", ".join(f"{n} {v / total:.3g}" for n, v in d["shares"].items() if v)
        where = (
            f"from position {d['position']} of epoch {d['epoch']}"
            if d["position"] < ledger.total
            else f"from epoch {d['epoch'] + 1}"
        )
        lines.append(f"decision     step {d['step']}: {shares}, {where}")
    return lines


def _step_line(state: Mapping[str, Any], global_step: Any) -> str:
    """Which optimizer step the ledger matches, or a warning that it may not match the weights."""
    mismatch = ledger_step_mismatch(state, global_step)
    if mismatch:
        return f"WARNING      {mismatch}"
    return f"matches      optimizer step {state[GLOBAL_STEP_KEY]}: the samples whose gradients these weights hold"


def _inspect(args: argparse.Namespace) -> int:
    from lightning_sharding.core.ledger import CheckpointMismatchError, Ledger

    path = Path(args.checkpoint)
    plot = _check_plot_path(args.plot)
    ckpt = _load_checkpoint(path)
    if CHECKPOINT_KEY not in ckpt:
        raise CliError(
            f"{path} holds no lightning_sharding data ledger (it was written without ShardedDataModule or ShardedData)"
        )
    try:
        report = format_inspect(path, ckpt)
    except (CheckpointMismatchError, ValueError) as err:
        raise CliError(f"{path}: {err}") from None
    print(report)
    if args.data is not None:
        print(compare_with_data(ckpt[CHECKPOINT_KEY], args.data, args.config_dir, args.config_name))
    if args.step is not None:
        manifest, shuffle = None, True
        if args.data is not None:
            from lightning_sharding.cli.plan import _compose, _manifest

            batch_size = (ckpt[CHECKPOINT_KEY].get("writer") or {}).get("batch_size")
            cfg = _compose(args.data, args.config_dir, args.config_name)
            manifest, shuffle = _manifest(cfg, batch_size), bool(cfg.data.get("shuffle", True))
        try:
            state, step, held = ckpt[CHECKPOINT_KEY], args.step, ckpt.get("global_step")
            print(format_step(state, step, held, manifest, past=args.past, shuffle=shuffle))
        except ValueError as err:
            raise CliError(f"{path}: {err}") from None
    if plot is not None:
        import lightning_sharding.cli.plots as plots

        ledger = Ledger.from_state_dict(ckpt[CHECKPOINT_KEY])
        _draw(plots.plot_progress, plot, ledger.consumed, ledger.total, ledger.epoch)
        print(f"plot written to {plot}")
    return 0


def compare_with_data(state: Mapping[str, Any], overrides: list[str], config_dir: str | None, config_name: str) -> str:
    """What resuming the checkpoint's ledger ``state`` on the config's data would find: the same data
    (moved or not), a 0.1 checkpoint that matches by path, or every difference, item by item."""
    from lightning_sharding.cli.plan import _compose, _manifest
    from lightning_sharding.core.ledger import Ledger
    from lightning_sharding.mixture import mixture_of, shown_key

    restored = Ledger.from_state_dict(state)
    batch_size = (state.get("writer") or {}).get("batch_size")
    manifest = _manifest(_compose(overrides, config_dir, config_name), batch_size)
    saved = restored.manifest
    spec = mixture_of(manifest)
    names = spec.names if spec is not None else ()
    at = shown_key(manifest.root or manifest.items[0].key, names)
    where = f"data         {_plural(len(manifest.items), 'item')} at {at}"
    if restored.fingerprint == manifest.fingerprint:
        old = saved.get("root", "")
        moved = f"; it moved from {shown_key(old, names)}" if old and manifest.root and old != manifest.root else ""
        lines = [where, f"same data    the same items, sample counts and contents{moved}: it resumes"]
        tokens = getattr(manifest.order(restored.seed, restored.epoch), "tokens", None)
        if tokens is not None:  # packed sequences: the tokens their positions hold
            done = tokens(restored.consumed.to_array())
            planned = int(saved.get("packing", {}).get("tokens", 0))
            lines.append(
                f"tokens       {done:,} consumed of {planned:,} in epoch {restored.epoch}, {planned - done:,} remaining"
            )
        return "\n".join(lines)
    if restored.fingerprint == manifest.fingerprint_by_path():
        return f"{where}\nsame data    (a 0.1 checkpoint: the same paths and fingerprints): it resumes"
    changes = manifest.differences(saved, state.get("items"), shown=None)
    lines = [where, f"other data   it would not resume ({_plural(len(changes), 'difference')}):"]
    return "\n".join(lines + [f"  - {c}" for c in changes])


def format_step(
    state: Mapping[str, Any],
    step: int,
    global_step: Any = None,
    manifest: Any = None,
    *,
    past: bool = False,
    shuffle: bool = True,
) -> str:
    """What global step ``step`` trained on every data-parallel rank, replayed from the ledger ``state``'s
    history (:func:`~lightning_sharding.core.history.replay_step`): each micro-batch's epoch positions,
    and, given the data's ``manifest`` (of the checkpoint's data), each sample's item and index, or of
    packed sequences each document's token range. Raises ``ValueError`` for a step it cannot replay.
    ``past``: a step from the checkpoint's ``global_step`` on is named as its run went on to train it;
    ``shuffle``: the data's setting (``data.shuffle``), which its orders follow."""
    from lightning_sharding.core.history import StepNotInHistoryError, replay_steps, segments_of
    from lightning_sharding.core.ledger import Ledger

    ledger = Ledger.from_state_dict(state)
    if manifest is not None and manifest.fingerprint != ledger.fingerprint:
        raise ValueError("--data is not the checkpoint's data (another fingerprint): its samples cannot be named")
    needs_order = bool(ledger.manifest.get("streams") or ledger.manifest.get("schedule"))
    if needs_order and manifest is None:
        raise ValueError("the checkpoint's data is a mixture: pass --data with its data to replay its steps")
    orders = partial(manifest.order, shuffle=shuffle) if manifest is not None else None
    recorded = global_step if global_step is not None else state.get("global_step")
    held = int(recorded) if recorded is not None else None
    past = past and held is not None and step >= held and bool(segments_of(state))
    try:
        ranks = replay_steps(state, [step], held, orders, beyond=past)[step]
    except StepNotInHistoryError as err:
        if held is not None and step >= held:  # a step after the checkpoint: --past names it
            hint = "--past names it as the run that wrote it went on to train it"
            raise StepNotInHistoryError(f"{err}; {hint}") from None
        raise
    first = int(segments_of(state)[0]["step"])
    lines = [f"step         {step} (epoch {ranks[0].epoch}), {len(ranks)} data-parallel ranks"]
    if past:
        lines.append(
            f"past         the checkpoint holds steps up to {held - 1 if held else 0}: step {step} as the run that "
            "wrote it went on to train it (on its last topology), what skip= would leave out at a resume from it"
        )
    if first > 0:
        lines.append(f"history      starts at step {first}: the checkpoint resumed there from one without a history")
    for got in ranks:
        order = orders(ledger.seed, got.epoch) if orders is not None else None
        for i, positions in enumerate(got.batches):
            where = f"rank {got.rank}" + (f" micro-batch {i}" if len(got.batches) > 1 else "")
            ranges = ", ".join(f"[{a}, {b})" for a, b in RangeSet.from_positions(positions).ranges())
            lines.append(f"{where}: positions {ranges or 'none'}")
            if order is not None:
                lines += ["  " + line for line in _sample_names(order, manifest, positions)]
    return "\n".join(lines)


def _sample_names(order: Any, manifest: Any, positions: np.ndarray) -> list[str]:
    """One line per sample at ``positions``: its item's key and index, or a packed sequence's pieces."""
    pieces = getattr(order, "pieces", None)
    if pieces is not None:
        rows, docs, starts, stops = pieces(positions)
        parts: list[list[str]] = [[] for _ in range(positions.size)]
        for r, d, a, b in zip(rows.tolist(), docs.tolist(), starts.tolist(), stops.tolist(), strict=True):
            parts[r].append(f"document {d} tokens [{a}, {b})")
        return [f"position {p}: " + "; ".join(held) for p, held in zip(positions.tolist(), parts, strict=True)]
    items, index = order.locate(positions)
    return [
        f"position {p}: {manifest.items[i].key} [{j}]"
        for p, i, j in zip(positions.tolist(), items.tolist(), index.tolist(), strict=True)
    ]
