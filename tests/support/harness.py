"""Shared helpers for process tests: run a training segment for real and audit what it served.

``check_resume`` is the one save/kill/resume check every strategy and topology reuses: train with
periodic checkpoints, SIGKILL the job a few steps after one, resume from that checkpoint (possibly
on other topologies, several times), and return what every epoch served, counting only the steps
that a checkpoint or the final run kept.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "train_job.py"
SEGMENT_TIMEOUT = 240
# What a job forked from a test process's forkserver finds imported (launcher "fork", :func:`launch`).
JOB_PRELOAD = (
    "torch",
    "lightning.pytorch",
    "lightning_sharding.lightning.datamodule",
    "lightning_sharding.lightning.callbacks",
    "lightning_sharding.strategies.shard",
    "tests.jobs.parts",
)


def cpu_trainer(**overrides: Any) -> Any:
    """A quiet one-process CPU ``lightning.pytorch.Trainer`` (one epoch, no logger or checkpoints)."""
    import lightning.pytorch as pl

    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**options, **overrides})


def free_port() -> int:
    """A TCP port nobody listens on right now, for one test's rendezvous. It is drawn below the
    kernel's ephemeral range, where no outgoing connection takes one: a port of that range, free
    when drawn, can be taken by another job's gloo connection before this job's rank 0 binds it
    (CI saw EADDRINUSE with two runs at once)."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    low = 10000
    for _ in range(200):
        port = low + secrets.randbelow(max(1, first_ephemeral - low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the whole range is busy: any free port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Topology:
    """Where a segment runs: ranks and DataLoader workers, how the ranks start, and model replicas."""

    world_size: int = 2
    num_workers: int = 2
    # How the ranks start. "fork" (the tests not about launchers): Lightning's ddp_fork, in a job forked
    # from the test process's preloaded forkserver (no interpreter starts); "ddp": Lightning's own
    # launcher, from `python job.py` (the job's script runs again for each further rank); "spawn":
    # Lightning's ddp_spawn (a launcher process spawns every rank); "torchrun": one torchrun per node.
    launcher: str = "fork"
    num_nodes: int = 1
    # Model replicas of this many ranks (tensor parallel): by the strategy's distributed_sampler_kwargs
    # (tests/jobs/parts.py::ReplicatedDDP), or with `data_parallel_override` by ShardedDataModule(data_parallel=)
    tensor_parallel: int = 1
    data_parallel_override: bool = False
    model_parallel: bool = False  # Lightning's own ModelParallelStrategy (2-D mesh over gloo), no gradient sync


@dataclass(frozen=True)
class Data:
    """What a segment reads: synthetic items of ``sizes`` unless one of the other kinds is given."""

    sizes: tuple[int, ...] = (37, 41, 29, 53, 40)
    skew_rank1: bool = False  # rank 1 lists one more item than rank 0
    # A file reader: {"format": "tar"|..., "urls": ..., "storage_options": ...} (tests/jobs/parts.py::file_reader);
    # files written by lightning_sharding.recipes.synthetic_files.write_regression (ids 0..N-1 in file order).
    files: dict[str, Any] | None = None
    months: str | None = None  # broadcast: a directory of month-NN.npy files (tests/support/data/windows.py)
    window: int = 4
    stride: int = 1
    halo: bool = False
    source: dict[str, Any] | None = None  # strategy "dispatch": see tests/support/data/sources.py::make_source
    # A mixture (tests/support/data/streams.py): [{"name", "sizes", "weight"|...: v}]
    streams: tuple[dict[str, Any], ...] | None = None
    samples_per_epoch: int | None = None
    batch_composition: str = "mixed"
    schedule: tuple[dict[str, Any], ...] | None = None  # a share schedule: [{"start", "shares"}, ...]
    allow_mixture_change: bool = False  # resume a checkpoint of another mixture at the new shares
    # A MixtureController (tests/jobs/parts.py::controller_of): {"every": steps, "policy": "rotate" | None,
    # "decisions": [...] to replay}; its segment writes the ledger's decisions to <out>/decisions-<segment>.json.
    controller: dict[str, Any] | None = None
    # Packed token sequences (tests/support/data/tokens.py): {"dir", "seq_len", "mode"} ("dir" a URL too, with
    # "options": the file readers' options, storage_options, cache_dir...), or "streams":
    # [dir, ...] for a mixture of token streams (each drawn once an epoch, or at its share of "shares":
    # [{"tokens": 600}, ...]); every token of the corpora is a distinct id, so a
    # token id is the token's identity (ids 1..T, 0 pads).
    tokens: dict[str, Any] | None = None


@dataclass(frozen=True)
class Loading:
    """How the DataModule loads the data: the strategy (and its settings), batches, order, and the
    workers' options."""

    loader: str = "dataloader"  # "dataloader": ShardedDataModule; "dali": DaliDataModule (CPU pipeline)
    sharding: str = "shard"
    batch_size: int = 8
    seed: int | None = 1234
    even_batches: str = "pad"
    on_error: str = "raise"
    persistent_workers: bool = False
    prefetch_items: int = 1  # a setting of strategy broadcast
    transport: str = "torch"  # of strategies shard and broadcast: "torch" or "pool" (strategies/_slots.py)
    # How DataLoader workers (and a dispatch process) start: None is the package's default, a forkserver
    # with the modules preloaded (strategies/_start.py); "spawn" where a test stands for spawn.
    start_method: str | None = None


@dataclass(frozen=True)
class Training:
    """The Trainer's run: how long, how it steps, and the checkpoint it starts from."""

    epochs: int = 1
    accumulate: int = 1
    limit_train_batches: int | None = None
    resume_from: str | None = None
    # Instead of one fit: resume from each of these checkpoints in turn, one fresh Trainer each, in
    # this one process (segment "<segment>-<checkpoint stem>"), each to the end of training.
    resume_each: tuple[str, ...] = ()
    skip: Any = None  # ShardedDataModule(skip=...): what the resume leaves out (a loss spike's steps or samples)


@dataclass(frozen=True)
class Saves:
    """The checkpoints a segment writes, and from where."""

    checkpoint_every: int | None = None  # ModelCheckpoint(every_n_train_steps=...) into <out>/checkpoints
    every_n_epochs: int | None = None  # ModelCheckpoint(every_n_epochs=...) at the train epoch's end
    val_check_interval: int | None = None  # validate every N batches; ModelCheckpoint saves at validation end
    # Checkpoints saved from elsewhere than ModelCheckpoint, into <out>/saves, at batches of the segment
    # (1-based): [{"name": ..., "batches": [...], "hook": "train_batch_end"|"signal_in_step"|
    # "signal_between_steps", "after": bool (placed after ShardingCallback)}] (tests/jobs/parts.py::SaveAt).
    callbacks: tuple[dict[str, Any], ...] = ()
    module_saves: tuple[int, ...] = ()  # batches at which LightningModule.on_train_batch_end saves


@dataclass(frozen=True)
class Faults:
    """How a segment fails on purpose (none by default)."""

    die_at_step: int | None = None  # every rank SIGKILLs itself once this step has completed
    raise_at_step: int | None = None  # raise an exception after this step (instead of dying)
    raise_in_step_at_batch: int | None = None  # raise inside training_step; OnExceptionCheckpoint saves
    # SIGKILL the whole process group: {"step": K, "rank": r, "moment": "before"|"after"} (tests/jobs/parts.py)
    kill_group: dict[str, Any] | None = None
    # SIGKILL one helper process of a rank: {"step": K, "rank": r, "process": "DataLoader worker 1"|"dispatch process"}
    kill_helper: dict[str, Any] | None = None


@dataclass(frozen=True)
class Checks:
    """What a segment notes down for the test besides its per-batch records (tests/jobs/parts.py)."""

    audit: bool = False  # write the audit trail to <out>/audit
    # Weight-level exactly-once (tests/jobs/parts.py::RecordingModel): one weight per sample id counts
    # the applied gradients; rank 0 saves it at every epoch's end as <out>/w-<segment>-epoch<E>.npy.
    count_weights: bool = False
    progress_bar: bool = False  # show Lightning's TQDM bar; records then note its total ("bar") and k
    # Note what the job holds at a step, meeting another run there: {"step": K, "other": <its out dir>}
    snapshot: dict[str, Any] | None = None


@dataclass(frozen=True)
class Job:
    """One training segment, in parts: where it runs, what it reads and how, the Trainer's run, the
    checkpoints it writes, the faults it meets, and what it notes down for the test. Each part is
    replaced with :meth:`but` (``job.but(topology=..., faults=...)``) or, for the topology, :meth:`on`."""

    topology: Topology = Topology()
    data: Data = Data()
    loading: Loading = Loading()
    training: Training = Training()
    saves: Saves = Saves()
    faults: Faults = Faults()
    checks: Checks = Checks()

    def on(self, world_size: int | None = None, num_workers: int | None = None, **topology: Any) -> Job:
        """This job on another topology (the fields not given stay)."""
        changes = dict(world_size=world_size, num_workers=num_workers)
        changes = {k: v for k, v in changes.items() if v is not None}
        return replace(self, topology=replace(self.topology, **changes, **topology))

    def but(self, **parts: Any) -> Job:
        """This job with some of its parts' fields changed: ``but(faults=dict(die_at_step=6))``
        replaces those fields of ``faults`` only; a part given whole replaces the part."""
        changed = {
            name: replace(getattr(self, name), **value) if isinstance(value, dict) else value
            for name, value in parts.items()
        }
        return replace(self, **changed)

    def first_of_replicas(self) -> list[int]:
        """The first rank of each model replica: the ranks whose records count the samples trained."""
        return list(range(0, self.topology.world_size, self.topology.tensor_parallel))


# Every start method of helper processes, for the tests that check a mechanism behaves the same
# under each (dead-worker detection, the slot pool, /dev/shm, the dispatch process): None is the
# package's default, a forkserver with the modules preloaded.
START_METHODS = (None, "spawn", "fork")
START_IDS = ("forkserver", "spawn", "fork")

# The first segment several tests start from (tests/process/conftest.py trains it once a session, as
# check_resume(..., checkpoint_every=3) runs it: a checkpoint at step 3, killed at step 6): 2 ranks x
# 2 workers, one epoch of the default data, with the audit trail and the per-sample weights.
FIRST_2X2 = Job(checks=Checks(audit=True, count_weights=True))
FIRST_2X2_EVERY = 3
# Likewise for a mixture (test_mixture, test_mixture_change): three streams of different shares, 150
# draws an epoch (web 96, code 32, books 22), two epochs, on 2 ranks x 2 workers.
MIXTURE = (
    {"name": "web", "sizes": [37, 41, 29], "weight": 3},  # 107 samples
    {"name": "code", "sizes": [23, 17, 31, 29], "weight": 1},  # 100 samples
    {"name": "books", "sizes": [11], "repeat": 2.0},  # 11 samples, each twice an epoch
)
FIRST_MIXTURE_2X2 = Job(
    data=Data(streams=MIXTURE, samples_per_epoch=150),
    loading=Loading(seed=1234),
    training=Training(epochs=2),
    checks=Checks(audit=True, count_weights=True),
)


@dataclass
class Segment:
    """What one segment did: per-rank batch records, the rank-0 report, and its checkpoints."""

    name: str
    returncode: int
    records: dict[int, list[dict[str, Any]]]
    report: dict[str, Any] | None
    output: str
    checkpoints: list[Path] = field(default_factory=list)


def run_segment(out: Path, name: str, job: Job, *, expect_death: bool = False) -> Segment:
    """Run ``job`` in a fresh process group with a timeout; fail loudly unless it ends as expected."""
    out.mkdir(parents=True, exist_ok=True)
    config = {**asdict(job), "out": str(out), "segment": name}
    path = out / f"config-{name}.json"
    path.write_text(json.dumps(config))
    env = job_env()
    before = _checkpoints(out)
    returncode, output = launch(job.topology, path, env)
    (out / f"returncode-{name}.txt").write_text(str(returncode))
    if expect_death:
        assert returncode != 0, f"segment {name} was meant to die but finished:\n{output[-3000:]}"
    else:
        assert returncode == 0, f"segment {name} failed with {returncode}:\n{output[-5000:]}"
    return _collect(out, name, job, returncode, output, sorted(_checkpoints(out) - before))


def job_env() -> dict[str, str]:
    """The environment of a job's processes: one thread each, a free rendezvous port, this repository importable."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _checkpoints(out: Path) -> set[Path]:
    return set((out / "checkpoints").glob("*.ckpt")) if (out / "checkpoints").exists() else set()


def _collect(out: Path, name: str, job: Job, returncode: int, output: str, checkpoints: list[Path]) -> Segment:
    """What segment ``name`` left in ``out``: its records, its report and the given checkpoints."""
    records = {}
    for rank in range(job.topology.world_size):
        log = out / f"seen-{name}-rank{rank}.jsonl"
        records[rank] = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    result = out / f"result-{name}.json"
    report = json.loads(result.read_text()) if result.exists() else None
    return Segment(name, returncode, records, report, output, checkpoints)


def copy_segment(trained: Path, out: Path, name: str, job: Job) -> Segment:
    """A private copy in ``out`` of the directory where segment ``name`` ran ``job`` (a session
    fixture's, tests/process/conftest.py), read back with :func:`load_segment`."""
    assert not out.exists() or not any(out.iterdir()), f"{out} is not empty: no place for a copy of {trained}"
    shutil.copytree(trained, out, dirs_exist_ok=True)
    return load_segment(out, name, job)


def load_segment(out: Path, name: str, job: Job) -> Segment:
    """Segment ``name`` as ``run_segment`` left it in ``out`` (perhaps copied there since), after
    checking that it ran ``job``: its return code, output, records, report and its checkpoints (those
    of ``<out>/checkpoints`` whose file names it chose)."""
    config = json.loads((out / f"config-{name}.json").read_text())
    ran = {k: v for k, v in config.items() if k not in ("out", "segment")}
    assert ran == json.loads(json.dumps(asdict(job))), f"segment {name} in {out} ran another job: {ran}"
    returncode = int((out / f"returncode-{name}.txt").read_text())
    logs = sorted(out.glob(f"config-{name}.node*.log"))
    output = "\n".join(log.read_text() for log in logs)
    checkpoints = sorted(p for p in _checkpoints(out) if p.name.startswith(f"{name}-"))
    return _collect(out, name, job, returncode, output, checkpoints)


def run_at_once(root: Path, jobs: dict[str, Job]) -> dict[str, Segment]:
    """Run every job at the same time, each as segment ``run`` under ``root / name``."""
    import threading

    results: dict[str, Segment] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            results[name] = run_segment(root / name, "run", jobs[name])
        except BaseException as err:  # noqa: BLE001 - reported by the calling thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def launch(topology: Topology, config: Path, env: dict[str, str], job: Path = JOB) -> tuple[int, str]:
    """Start ``job``'s processes (one, or one torchrun per node), wait with a timeout, kill on expiry.

    Under ``launcher="fork"`` the job's process is forked from this test process's forkserver, which
    imported Lightning and the jobs' modules once (:data:`JOB_PRELOAD`): the job starts in
    milliseconds, then forks its ranks with Lightning's ``ddp_fork``. Every other launcher starts
    ``python job.py`` (or ``torchrun``) as a user does."""
    if topology.launcher == "fork":
        log = config.with_suffix(".node0.log")
        return _run_forked([str(job), str(config)], env, log), log.read_text()
    if topology.launcher in ("spawn", "ddp"):
        commands = [[sys.executable, str(job), str(config)]]
    else:
        per_node = topology.world_size // topology.num_nodes
        commands = [
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={topology.num_nodes}",
                f"--node_rank={node}",
                f"--nproc_per_node={per_node}",
                "--master_addr=127.0.0.1",
                f"--master_port={env['MASTER_PORT']}",
                str(job),
                str(config),
            ]
            for node in range(topology.num_nodes)
        ]
    # Output goes to files, not pipes: a full pipe would stall a rank that another rank waits for.
    logs = [config.with_suffix(f".node{i}.log") for i in range(len(commands))]
    procs = []
    for cmd, log in zip(commands, logs, strict=True):
        with open(log, "w") as sink:
            procs.append(subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True))
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=SEGMENT_TIMEOUT))
    finally:
        for proc in procs:  # also reaps stragglers (workers of a killed rank) in the process group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    outputs = [log.read_text() for log in logs]
    return max(codes, key=abs), "\n".join(outputs)


def _run_forked(argv: list[str], env: dict[str, str], log: Path) -> int:
    """Run script ``argv`` as ``python *argv`` would, in a process forked from the forkserver, in a
    session of its own, output to ``log``; wait with a timeout, then kill what is left of its session."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(JOB_PRELOAD))  # before the server starts; then kept
    proc = context.Process(target=_forked_main, args=(argv, env, str(log), os.getcwd()), daemon=False)
    proc.start()
    try:
        proc.join(SEGMENT_TIMEOUT)
    finally:
        try:  # also reaps stragglers (workers of a killed rank) in the job's session
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.join()
    assert proc.exitcode is not None
    return proc.exitcode


def _forked_main(argv: list[str], env: dict[str, str], log: str, cwd: str) -> None:
    """In the forked job: a session of its own, the job's environment, output to ``log``, then the script."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


def checkpoint_step(path: Path) -> int:
    """The global step in a checkpoint file name written by the job (``...-step=K.ckpt``)."""
    return int(path.stem.rsplit("step=", 1)[1])


def kept_records(segment: Segment, until_step: int | None, ranks: list[int] | None = None) -> list[dict[str, Any]]:
    """Records of ``ranks`` (all when None) up to the checkpoint at ``until_step`` (all when None).

    Each rank keeps its batches up to and including the first one whose step reached the
    checkpoint's step: those are the batches whose effect the checkpoint holds.
    """
    kept: list[dict[str, Any]] = []
    for rank, records in segment.records.items():
        if ranks is not None and rank not in ranks:
            continue
        for record in records:
            if until_step is not None and record["gs"] > until_step:
                break
            kept.append(record)
            if until_step is not None and record["gs"] == until_step:
                break
    return kept


def served_per_epoch(records: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    """How often each sample id was trained on, per epoch."""
    seen: dict[int, Counter[int]] = {}
    for record in records:
        seen.setdefault(record["epoch"], Counter()).update(record["ids"])
    return seen


def assert_exactly_once(seen: dict[int, Counter[int]], total: int, epochs: int, missing_ok: int = 0) -> None:
    """Every epoch served every id in ``range(total)`` once (``missing_ok`` ids may be dropped)."""
    assert sorted(seen) == list(range(epochs)), f"epochs served: {sorted(seen)}, expected 0..{epochs - 1}"
    for epoch, counts in seen.items():
        dup = {i: c for i, c in counts.items() if c > 1}
        missing = set(range(total)) - set(counts)
        foreign = set(counts) - set(range(total))
        assert not dup, f"epoch {epoch}: {len(dup)} ids served more than once, e.g. {list(dup.items())[:5]}"
        assert not foreign, f"epoch {epoch}: unknown ids {sorted(foreign)[:5]}"
        assert len(missing) <= missing_ok, f"epoch {epoch}: {len(missing)} ids never served, e.g. {sorted(missing)[:5]}"


def first_segment(first: Job, *, checkpoint_every: int, die_after: int = 3) -> Job:
    """The first segment ``check_resume(out, first, then, ...)`` runs when ``then`` is not empty:
    ``first`` with its checkpoints, killed ``die_after`` steps after the first one."""
    return _with_resume(first, None, checkpoint_every, die_after, last=False)


def _with_resume(job: Job, resume: Path | None, checkpoint_every: int, die_after: int, *, last: bool) -> Job:
    start_step = checkpoint_step(resume) if resume is not None else 0
    ckpt_at = (start_step // checkpoint_every + 1) * checkpoint_every
    return job.but(
        saves=dict(checkpoint_every=checkpoint_every),
        faults=dict(die_at_step=None if last else ckpt_at + die_after),
        training=dict(resume_from=str(resume) if resume is not None else None),
    )


def check_resume(
    out: Path,
    first: Job,
    then: list[Job],
    *,
    checkpoint_every: int,
    die_after: int = 3,
    after_segment: Callable[[Segment], None] | None = None,
    trained: Path | None = None,
) -> tuple[dict[int, Counter[int]], list[Segment]]:
    """Train ``first`` with checkpoints, kill it ``die_after`` steps after its first checkpoint,
    then resume from the newest checkpoint with each job of ``then`` in turn (every job but the
    last is killed the same way after its own first checkpoint). Returns the per-epoch counts of
    every sample over the kept steps of all segments, and the segments. ``after_segment`` is called
    after each segment ends (to look at what a killed segment left behind).

    ``trained``: a directory where this first segment has already run (a session fixture of
    tests/process/conftest.py); it is copied to ``out`` and the resumes start from the copy's
    checkpoint, as if ``first`` had just run there."""
    jobs = [first, *then]
    segments: list[Segment] = []
    kept: list[dict[str, Any]] = []
    resume: Path | None = None
    for i, job in enumerate(jobs):
        last = i == len(jobs) - 1
        start_step = checkpoint_step(resume) if resume is not None else 0
        ckpt_at = (start_step // checkpoint_every + 1) * checkpoint_every
        job = _with_resume(job, resume, checkpoint_every, die_after, last=last)
        if i == 0 and trained is not None:
            segment = copy_segment(trained, out, "seg0", job)
            assert (segment.returncode != 0) == (not last), f"seg0 in {trained} ended {segment.returncode}"
        else:
            segment = run_segment(out, f"seg{i}", job, expect_death=not last)
        segments.append(segment)
        if after_segment is not None:
            after_segment(segment)
        ranks = job.first_of_replicas()  # the other ranks of a model replica trained on the same batches
        if last:
            kept += kept_records(segment, None, ranks)
            break
        written = [p for p in segment.checkpoints if checkpoint_step(p) == ckpt_at]
        assert written, f"segment {i} wrote no checkpoint at step {ckpt_at}: {segment.checkpoints}"
        resume = written[0]
        kept += kept_records(segment, ckpt_at, ranks)
    return served_per_epoch(kept), segments


def weights_at_epoch_ends(out: Path, segment: str) -> dict[int, Any]:
    """The per-sample weights rank 0 saved at each epoch's end of ``segment`` (``count_weights``)."""
    import numpy as np

    found = {int(p.stem.rsplit("epoch", 1)[1]): np.load(p) for p in out.glob(f"w-{segment}-epoch*.npy")}
    return dict(sorted(found.items()))


def assert_weights_count_once(
    weights: dict[int, Any], total: int, epochs: int, missing_ok: int = 0, first_epoch: int = 0
) -> None:
    """Exactly-once measured in the weights: every epoch added exactly 1 to every sample's weight
    (0 for at most ``missing_ok`` samples the plan reported as dropped). ``weights`` maps each
    epoch to the weights at its end (see :func:`weights_at_epoch_ends`); a run resumed from a
    checkpoint whose earlier epochs were whole ends epochs ``first_epoch`` to ``epochs - 1``."""
    import numpy as np

    expected = list(range(first_epoch, epochs))
    assert sorted(weights) == expected, f"epochs whose end saved weights: {sorted(weights)}, expected {expected}"
    previous = np.full(total, float(first_epoch))
    for epoch, w in weights.items():
        added = w - previous
        twice, never = np.flatnonzero(added > 1), np.flatnonzero(added == 0)
        assert w.shape == (total,), f"epoch {epoch}: {w.shape[0]} weights for {total} samples"
        assert not twice.size, f"epoch {epoch}: {twice.size} samples applied more than once, e.g. ids {twice[:5]}"
        assert np.isin(added, (0.0, 1.0)).all(), f"epoch {epoch}: weights moved by {np.unique(added)}"
        assert never.size <= missing_ok, f"epoch {epoch}: {never.size} samples never applied, e.g. ids {never[:5]}"
        previous = w


def assert_checkpoint_matches_weights(path: Path, sizes: tuple[int, ...]) -> tuple[int, int]:
    """The checkpoint's ledger holds exactly the samples whose gradients its weights hold.

    For a run of synthetic data (``sizes``) with ``count_weights`` and no dropped samples, a
    checkpoint whose ledger is at epoch ``e`` with consumed positions ``C`` must hold
    ``w[i] == e + (i in ids(C))``. Returns ``(epoch, number consumed)``.
    """
    import numpy as np
    import torch

    from lightning_sharding.core.order import EpochOrder
    from lightning_sharding.core.rangeset import RangeSet

    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    state = ckpt["lightning_sharding"]
    w = ckpt["state_dict"]["w"].numpy()
    epoch = int(state["epoch"])
    consumed = RangeSet.from_state(np.asarray(state["consumed"]))
    positions = np.concatenate([np.arange(a, b) for a, b in consumed.ranges()] or [np.zeros(0, np.int64)])
    items, index = EpochOrder(sizes, int(state["seed"]), epoch).locate(positions)
    ids = np.concatenate(([0], np.cumsum(sizes)))[items] + index
    expected = np.full(sum(sizes), float(epoch))
    expected[ids] += 1
    wrong = np.flatnonzero(w != expected)
    assert not wrong.size, (
        f"{path.name}: ledger (epoch {epoch}, {len(consumed)} consumed, global_step {state.get('global_step')}) "
        f"disagrees with the weights (global_step {ckpt['global_step']}) on {wrong.size} samples: "
        f"e.g. ids {wrong[:5].tolist()} have weights {w[wrong[:5]].tolist()}, "
        f"the ledger says {expected[wrong[:5]].tolist()}"
    )
    assert state.get("global_step") == ckpt["global_step"], f"{path.name}: ledger step {state.get('global_step')}"
    return epoch, len(consumed)


def weights_of_run(out: Path, segments: list[Segment]) -> dict[int, Any]:
    """Per epoch, the weights at its end from the last segment that ended it: the line of segments
    a resume keeps (a later segment resumed inside an epoch ends that epoch again)."""
    found: dict[int, Any] = {}
    for segment in segments:
        found.update(weights_at_epoch_ends(out, segment.name))
    return dict(sorted(found.items()))
