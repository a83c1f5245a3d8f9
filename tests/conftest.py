"""Test-wide settings: one OpenMP thread per process (2-core machine, many processes per test),
``@pytest.mark.needs(module, ...)`` for tests of optional extras (see tests/support/extras.py), the ``quick``
inner loop (every unit test and the ``chain`` tests: ``pytest -m quick``), and the suite's CPU-seconds
printed at its end (the budget: docs/development.md#the-test-budget)."""

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from tests.support.harness import JOB_PRELOAD

os.environ.setdefault("OMP_NUM_THREADS", "1")
# gcsfs would ask every bucket's type over gRPC, which the loopback GCS server does not speak (tests/support/gcs.py).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# A job forked from this process's forkserver (tests/support/harness.py::launch, launcher "fork") finds these
# imported; the package adds its own to the list when its loaders start the server first.
multiprocessing.set_forkserver_preload(list(JOB_PRELOAD))

# The object-store servers on loopback for the remote-storage tests: S3 (moto) and GCS.
pytest_plugins = ["tests.support.s3", "tests.support.gcs"]


def pytest_runtest_setup(item: pytest.Item) -> None:
    from tests.support.extras import require

    for marker in item.iter_markers("needs"):
        require(*marker.args)
    # A parametrized case of the Parquet format (a `fmt`, a recipe, a bad-input case) needs pyarrow.
    params = getattr(getattr(item, "callspec", None), "params", {})
    if any(getattr(value, "reader", value) == "parquet" for value in params.values() if not hasattr(value, "shape")):
        require("pyarrow")
    # The images recipe and data option (JPEG shards written with Pillow, decoded with simplejpeg) need [image].
    if "images" in {value for value in params.values() if isinstance(value, str)}:
        require("PIL", "simplejpeg")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``LSH_SKIPPED_TO=FILE``, append the id of every skipped test to FILE (one a line): CI
    runs the README's test command without the extras, then exactly these tests with every extra
    (.ci/run). Under pytest-xdist the controller writes the list, once for each test."""
    path = os.environ.get("LSH_SKIPPED_TO")
    if path and report.skipped and os.environ.get("PYTEST_XDIST_WORKER") is None:
        with open(path, "a") as out:
            out.write(report.nodeid + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``quick`` marks every unit test and every ``chain`` test (one exactly-once chain a strategy)."""
    unit = Path(__file__).parent / "unit"
    for item in items:
        if item.get_closest_marker("chain") is not None or unit in item.path.parents:
            item.add_marker(pytest.mark.quick)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n logical``: a test process per core this process may run on, and at most one per 3 GiB of
    memory (a process test's ranks, workers and servers take up to about that)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        total_kib = int(Path("/proc/meminfo").read_text().split("MemTotal:", 1)[1].split()[0])
    except (OSError, IndexError, ValueError):
        return cores
    return max(1, min(cores, total_kib // (3 * 2**20)))


def _busy_cpu_seconds() -> float | None:
    """CPU-seconds this machine has been busy (user, nice, system) since boot, from /proc/stat: every
    process the suite starts counts, whoever reaps it (a worker's forkserver reaps its workers)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    return (int(fields[1]) + int(fields[2]) + int(fields[3])) / os.sysconf("SC_CLK_TCK")


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        session.config.stash[_STARTED] = (_busy_cpu_seconds(), time.monotonic())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The suite's CPU-seconds and wall time, beside the budget in docs/development.md."""
    started = config.stash.get(_STARTED, None)
    busy = _busy_cpu_seconds()
    if started is None or started[0] is None or busy is None:
        return
    cpu, wall = busy - started[0], time.monotonic() - started[1]
    terminalreporter.write_line(
        f"CPU: the machine was busy {cpu:,.0f} CPU-seconds in {wall:,.0f} s of this run "
        f"({cpu / max(wall, 1e-9):.2f} of {os.cpu_count()} cores on average; "
        "the budget: docs/development.md#the-test-budget)"
    )


_STARTED = pytest.StashKey[tuple[float | None, float]]()
