"""The pooled shared-memory transport (strategies/_slots.py) with real workers: slots are
reused, a batch larger than its slot gets a larger one, a consumer that keeps batches keeps them
intact (the workers go PyTorch's way rather than overwrite), a SIGKILL leaves nothing in /dev/shm
once swept, and exactly-once holds in the weights with every batch carried by the pool."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharding import SyntheticReader, segments
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.world import World
from lightning_sharding.readers.synthetic import regression_arrays
from lightning_sharding.strategies._slots import SlotBatch
from lightning_sharding.strategies.options import LoaderOptions
from lightning_sharding.strategies.shard import ShardedLoader
from tests.support.harness import (
    START_IDS,
    START_METHODS,
    Checks,
    Job,
    Loading,
    Training,
    assert_weights_count_once,
    check_resume,
    weights_of_run,
)

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

DIM = 256  # 1 KiB a sample: a batch of 64 is 66 KiB


def growing(batch: dict[str, torch.Tensor], ctx: Any) -> dict[str, torch.Tensor]:
    """A batch transform whose batches grow through the epoch (module level: spawned workers import it)."""
    width = 64 * (1 + int(ctx.positions.max()) // 200)
    return dict(batch, extra=torch.full((len(ctx.positions), width), 7.0))


def loader(samples: int, batch_size: int = 64, **options: Any) -> tuple[ShardedLoader, list[Any]]:
    """One rank's loader with 2 workers; the list fills with what each delivery carried
    (``SlotBatch``: its slot's name; else ``None``: PyTorch's path)."""
    reader = SyntheticReader(4, samples // 4, dim=DIM)
    manifest = Manifest.from_items(reader.items())
    ledger = Ledger(seed=3, total=manifest.total, manifest=manifest.summary())
    opts = LoaderOptions(batch_size=batch_size, num_workers=2, **options)
    built = ShardedLoader.build(reader, manifest, ledger, world=World(), options=opts, transport="pool")
    carried: list[Any] = []
    pool = built._pool
    assert pool is not None, "transport='pool' with workers makes a pool"
    unpack = pool.unpack

    def noting(batch: Any) -> Any:  # the real unpack; only notes which way each batch came
        carried.append(batch.name if isinstance(batch, SlotBatch) else None)
        return unpack(batch)

    pool.unpack = noting  # type: ignore[method-assign]
    return built, carried


def check(batch: dict[str, torch.Tensor]) -> list[int]:
    """The batch's real ids, after checking every row's features are that id's."""
    ids = batch["id"][~batch["is_padding"]]
    x, y = regression_arrays(ids.numpy(), DIM)
    assert torch.equal(batch["x"][~batch["is_padding"]], torch.from_numpy(x)), "a row's features are another's"
    assert torch.equal(batch["y"][~batch["is_padding"]], torch.from_numpy(y))
    return ids.tolist()


@pytest.mark.parametrize("start", START_METHODS, ids=START_IDS)
def test_slots_are_reused_and_every_batch_is_exact(start: str | None) -> None:
    built, carried = loader(3200, multiprocessing_context=start)  # 50 batches
    served = Counter(i for batch in built for i in check(batch))
    assert served == Counter(range(3200))
    names = [n for n in carried if n is not None]
    assert len(names) >= 45, f"only {len(names)} of {len(carried)} batches came through the pool"
    assert len(set(names)) <= 2 * built._pool.states.per_worker < len(names), "slots are not reused"  # type: ignore[union-attr]
    assert not list(segments.SHM_DIR.glob(f"{built._pool.states.prefix}-*")), "a slot name is left"  # type: ignore[union-attr]


def test_a_batch_larger_than_its_slot_gets_a_larger_one() -> None:
    built, carried = loader(1600, batch_transform=growing)
    served: Counter[int] = Counter()
    for batch in built:
        served.update(check(batch))
        assert batch["extra"].shape[0] == len(batch["id"]) and bool((batch["extra"] == 7.0).all())
    assert served == Counter(range(1600))
    generations = {n.rsplit("-g", 1)[1] for n in carried if n is not None}
    assert len(generations) > 1, f"no slot grew: generations {generations}"


def test_a_consumer_that_keeps_every_batch_finds_them_intact() -> None:
    built, carried = loader(3200)
    kept = list(built)  # every batch held at once: more than the slots
    served = Counter(i for batch in kept for i in check(batch))
    assert served == Counter(range(3200))
    assert None in carried, "with every slot held, the workers must go PyTorch's way"
    assert any(n is not None for n in carried)
    # Dropping them frees the slots: a second epoch comes through the pool again.
    del kept
    built.sampler.set_epoch(1)
    carried.clear()
    assert Counter(i for batch in built for i in check(batch)) == Counter(range(3200))
    assert sum(n is not None for n in carried) >= 45


CHILD = """
import sys, time
from tests.process.test_transport import loader
built, _ = loader(64000, multiprocessing_context={start!r})
print(built._pool.states.prefix, flush=True)
for n, batch in enumerate(built):
    if n == 5:
        print("iterating", flush=True)
    time.sleep(0.01)
"""


def group_members(group: int) -> list[str]:
    """The live processes (not zombies) of process group ``group``: their pids and command lines."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(f"{stat.parent.name} {command}")
    return found


@pytest.mark.parametrize("start", START_METHODS, ids=START_IDS)
def test_a_sigkill_of_the_training_process_leaves_no_process_and_nothing_in_dev_shm_once_swept(
    tmp_path: Path, start: str | None
) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(start=start)],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert child.stdout is not None
    prefix = child.stdout.readline().strip()
    assert prefix.startswith(segments.PREFIX), prefix
    assert child.stdout.readline().strip() == "iterating"
    os.kill(child.pid, signal.SIGKILL)  # the training process alone, as an OOM killer would
    child.wait(timeout=30)
    # Its workers and, under the forkserver, the server notice and end by themselves (PyTorch's
    # watchdog checks every 5 s): nothing of the group is left.
    deadline = time.time() + 20
    while time.time() < deadline and group_members(child.pid):
        time.sleep(0.2)
    left_running = group_members(child.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    assert not left_running, f"still running 20 s after the training process was killed: {left_running}"
    deadline = time.time() + 10
    while time.time() < deadline and any(p.name.startswith(prefix) for p in segments.SHM_DIR.iterdir()):
        segments.sweep_dead()
        time.sleep(0.2)
    left = sorted(p.name for p in segments.SHM_DIR.glob(f"{prefix}-*"))
    assert not left, f"left in /dev/shm after a SIGKILL and a sweep: {left}"


def test_exactly_once_in_the_weights_with_every_batch_through_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_SHARDING_POOL_MIN_BYTES", "0")  # the default; set, in case it changes
    job = Job(loading=Loading(transport="pool"), training=Training(epochs=2), checks=Checks(count_weights=True))
    then = [job.on(world_size=1), job.on(num_workers=1)]
    seen, segments_run = check_resume(tmp_path, job, then, checkpoint_every=3)
    total = sum(job.data.sizes)
    for epoch in (0, 1):
        assert seen[epoch] == Counter(range(total)), f"epoch {epoch}"
    assert_weights_count_once(weights_of_run(tmp_path, segments_run), total, epochs=2)
