"""A large dataset state reaches a new spawn or forkserver worker through a file under /dev/shm, not
through the pipe that starts it: a pickle over the pipe's 64 KiB keeps the training process in its
write until the worker has imported the script again, so the DataLoader's workers started one after
the other (strategies/_shipped.py)."""

from __future__ import annotations

import pickle
import stat
from collections.abc import Iterator
from multiprocessing import reduction
from multiprocessing.context import set_spawning_popen

import pytest

from lightning_sharding import SyntheticReader
from lightning_sharding.core.world import World
from lightning_sharding.strategies._batches import PlannedBatches
from lightning_sharding.strategies._shared_memory import SHM_DIR, process_token
from lightning_sharding.strategies._shipped import INLINE_BYTES
from lightning_sharding.strategies.options import LoaderOptions

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")


def dataset(items: int) -> PlannedBatches:
    reader = SyntheticReader(num_items=items, samples_per_item=2)
    return PlannedBatches(reader, reader.items(), seed=3, world=World(), options=LoaderOptions(num_workers=2))


@pytest.fixture
def launching() -> Iterator[None]:
    """Pickle as multiprocessing does while it starts a worker (a Popen is spawning)."""
    set_spawning_popen(object())
    try:
        yield
    finally:
        set_spawning_popen(None)


def test_a_large_state_travels_as_a_file_that_the_worker_reads_once_and_removes(launching: None) -> None:
    big = dataset(5_000)
    sent = reduction.ForkingPickler.dumps(big)
    assert len(sent) < INLINE_BYTES, f"{len(sent)} bytes go through the pipe"
    assert list(SHM_DIR.glob(f"lsh-*-{process_token()}-d*")), "no file holds the state"
    got = pickle.loads(sent)
    assert got.manifest.fingerprint == big.manifest.fingerprint
    assert not list(SHM_DIR.glob(f"lsh-*-{process_token()}-d*")), "the file was not removed once read"


def test_the_worker_gets_the_same_state(launching: None) -> None:
    big = dataset(5_000)
    state = big.__getstate__()
    assert list(state) == ["_shipped"]
    path = SHM_DIR / state["_shipped"].name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, "other users of the machine must not read it"
    copy = PlannedBatches.__new__(PlannedBatches)
    copy.__setstate__(state)
    assert not path.exists()
    assert copy.manifest.fingerprint == big.manifest.fingerprint
    assert copy.items == big.items and copy.seed == 3


def test_a_small_state_and_a_pickle_outside_a_launch_go_through_the_pipe(launching: None) -> None:
    assert list(dataset(4).__getstate__()) == ["_pickled"], "pickled once, in the launch, through the pipe"
    set_spawning_popen(None)
    assert "_shipped" not in dataset(5_000).__getstate__(), "a copy or a check writes no file"
