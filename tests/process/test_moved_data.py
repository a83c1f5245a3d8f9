"""A checkpoint follows its data (issue 34), with real processes: a 2-rank x 2-worker DDP job is
SIGKILLed mid-epoch, its data copied elsewhere (another directory; another bucket and prefix on the
loopback S3 server), and the job resumes on 1 rank x 2 workers from the copy, the old place gone:
every sample's gradient is applied exactly once, counted in the weights. A changed byte is refused
naming the file; the same file touched resumes. A job killed with its batch slots in /dev/shm
leaves none of them after a resume without workers. Months under strategy broadcast follow their
copy too."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from lightning_sharding.recipes.synthetic_files import write_regression
from tests.support.data.windows import write_months
from tests.support.harness import (
    Checks,
    Data,
    Job,
    Loading,
    Segment,
    Topology,
    Training,
    assert_exactly_once,
    assert_weights_count_once,
    check_resume,
    run_segment,
    weights_at_epoch_ends,
)
from tests.support.s3 import S3Server
from tests.unit.test_shm_sweep import dead_owner_token

SIZES = [23, 31, 17, 29, 20]
TOTAL = sum(SIZES)


TWO_BY_TWO = Topology(2, 2)


def counted(files: dict[str, Any], topology: Topology = TWO_BY_TWO) -> Job:
    """One epoch over ``files`` in batches of 6, counting each sample's applied gradients in the weights."""
    loading = Loading(batch_size=6)
    return Job(topology, Data(files=files), loading, Training(epochs=1), checks=Checks(count_weights=True))


def resume_elsewhere(out: Path, before: dict[str, Any], after: dict[str, Any], move: Any) -> list[Segment]:
    """2 x 2 over ``before``, killed 3 steps after its checkpoint at step 4; ``move`` then moves the
    data; 1 x 2 over ``after`` resumes: exactly once in the records and in the weights."""

    def moved(segment: Segment) -> None:
        if segment.name == "seg0":
            move()

    first = counted(before)
    seen, segments = check_resume(out, first, [counted(after, Topology(1, 2))], checkpoint_every=4, after_segment=moved)
    assert segments[0].returncode != 0, "the first segment was killed mid-epoch"
    assert_exactly_once(seen, total=TOTAL, epochs=1)
    assert_weights_count_once(weights_at_epoch_ends(out, "seg1"), TOTAL, epochs=1)
    return segments


@pytest.mark.processes
@pytest.mark.timeout(400)
def test_a_killed_job_resumes_from_a_copy_of_its_data_in_another_directory(tmp_path: Path) -> None:
    old, new = tmp_path / "lustre" / "ds", tmp_path / "scratch" / "user" / "ds"
    write_regression(str(old), "npy", SIZES)

    def move() -> None:
        shutil.copytree(old, new, copy_function=shutil.copy)  # new modification times
        shutil.rmtree(old)  # nothing can read the old place

    segments = resume_elsewhere(
        tmp_path / "run", {"format": "npy", "urls": f"{old}/*.npy"}, {"format": "npy", "urls": f"{new}/*.npy"}, move
    )
    assert f"the data moved: {old}/ -> {new}/" in segments[1].output


@pytest.mark.processes
@pytest.mark.timeout(400)
def test_a_killed_job_resumes_from_its_shards_uploaded_again_to_another_bucket(
    tmp_path: Path, s3_server: S3Server
) -> None:
    opts = s3_server.storage_options
    old, new = s3_server.bucket("moved-from"), s3_server.bucket("moved-to")
    write_regression(f"{old}/wds", "tar", SIZES, storage_options=opts)
    client = s3_server.client()

    def move() -> None:  # each object read back and put again (a re-upload), then the old ones deleted
        for entry in client.list_objects_v2(Bucket="moved-from", Prefix="wds/")["Contents"]:
            body = client.get_object(Bucket="moved-from", Key=entry["Key"])["Body"].read()
            client.put_object(Bucket="moved-to", Key="copy/of/" + entry["Key"].split("/")[-1], Body=body)
            client.delete_object(Bucket="moved-from", Key=entry["Key"])

    before = {"format": "tar", "urls": f"{old}/wds/*.tar", "storage_options": opts}
    after = {"format": "tar", "urls": f"{new}/copy/of/*.tar", "storage_options": opts}
    segments = resume_elsewhere(tmp_path / "run", before, after, move)
    assert f"the data moved: {old}/wds/ -> {new}/copy/of/" in segments[1].output


@pytest.mark.processes
@pytest.mark.timeout(400)
def test_a_changed_byte_is_refused_naming_the_file_and_the_file_touched_back_resumes(tmp_path: Path) -> None:
    data = tmp_path / "ds"
    write_regression(str(data), "npy", SIZES)
    files = {"format": "npy", "urls": f"{data}/*.npy"}
    victim = sorted(data.iterdir())[2]
    out = tmp_path / "run"

    def change_then_restore(segment: Segment) -> None:
        if segment.name != "seg0":
            return
        original = victim.read_bytes()
        changed = bytearray(original)
        changed[-5] ^= 0x40
        victim.write_bytes(bytes(changed))
        checkpoint = [p for p in segment.checkpoints if p.stem.endswith("step=4")][0]
        refused = run_segment(
            out,
            "refused",
            counted(files, Topology(1, 0)).but(training=dict(resume_from=str(checkpoint))),
            expect_death=True,
        )
        assert f"'{victim.name}' changed: same size, other content (its digest differs)" in refused.output
        assert "allow_data_change=True" in refused.output
        victim.write_bytes(original)  # the same bytes again, with a new modification time
        os.utime(victim, (1_000_000_000, 1_000_000_000))

    seen, _ = check_resume(
        out,
        counted(files, Topology(1, 1)),
        [counted(files, Topology(1, 2))],
        checkpoint_every=4,
        after_segment=change_then_restore,
    )
    assert_exactly_once(seen, total=TOTAL, epochs=1)
    assert_weights_count_once(weights_at_epoch_ends(out, "seg1"), TOTAL, epochs=1)


@pytest.mark.processes
@pytest.mark.timeout(400)
def test_months_under_broadcast_resume_from_a_copy_elsewhere_with_one_month_touched(tmp_path: Path) -> None:
    """Months (``NpyWindows``, windows across month ends with a halo) under strategy broadcast:
    2 x 2 killed mid-epoch; the months are copied to another directory (new modification times),
    one of them touched once more, the old place removed; 1 x 2 resumes from the copy with every
    window's gradient applied once."""
    lengths = [30, 26, 34]
    total = sum(lengths) - 4 + 1  # every window of 4 steps of the continuous series
    old, new = tmp_path / "lustre" / "era5", tmp_path / "scratch" / "era5"
    write_months(old, lengths)

    def job(months: Path, topology: Topology) -> Job:
        loading = Loading(sharding="broadcast", batch_size=8)
        return Job(topology, Data(months=str(months), halo=True), loading, checks=Checks(count_weights=True))

    def move(segment: Segment) -> None:
        if segment.name == "seg0":
            shutil.copytree(old, new, copy_function=shutil.copy)
            os.utime(new / "month-01.npy", (2_000_000_000, 2_000_000_000))
            shutil.rmtree(old)

    out = tmp_path / "run"
    seen, segments = check_resume(
        out, job(old, TWO_BY_TWO), [job(new, Topology(1, 2))], checkpoint_every=3, after_segment=move
    )
    assert segments[0].returncode != 0, "the first segment was killed mid-epoch"
    assert f"the data moved: {old}/ -> {new}/" in segments[1].output
    assert_exactly_once(seen, total=total, epochs=1)
    assert_weights_count_once(weights_at_epoch_ends(out, "seg1"), total, epochs=1)


def slot_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("lsh-*")}


@pytest.mark.processes
@pytest.mark.timeout(400)
def test_a_resume_without_workers_leaves_no_shared_memory_of_the_killed_job(tmp_path: Path) -> None:
    """A 1 x 2 job with the slot pool is SIGKILLed; a batch slot its workers wrote but its training
    process never mapped stays in /dev/shm (one is made here the way a slot is named, for a dead
    owner: the window in which a kill leaves one is narrow); the resume with 0 workers makes no
    pool, and still nothing of the killed job is left after it. (Any process of this machine that
    sweeps may remove it too; tests/unit/test_shm_sweep.py pins that the fit's own setup does.)"""
    before = slot_files()
    left: set[str] = set()

    def note(segment: Segment) -> None:
        if segment.name == "seg0":
            stale = Path("/dev/shm") / f"lsh-killedrun-{dead_owner_token()}-t0-w0.1-s0-g0"
            stale.write_bytes(b"\0" * 4096)
            # The killed job's files: its rank's pid names them (a test in the other test process
            # may hold slots of its own now).
            owners = {f"-{r['pid']}." for recs in segment.records.values() for r in recs} | {"lsh-killedrun-"}
            left.update(n for n in slot_files() - before if any(o in n for o in owners))

    first = Job(Topology(1, 2), loading=Loading(transport="pool", batch_size=8))
    seen, _ = check_resume(tmp_path, first, [first.on(1, 0)], checkpoint_every=3, after_segment=note)
    assert any(name.startswith("lsh-killedrun-") for name in left)
    assert not left & slot_files(), f"left after the resume with 0 workers: {sorted(left & slot_files())}"
    assert_exactly_once(seen, total=200, epochs=1)
