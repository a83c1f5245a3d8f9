"""Test-wide settings: one OpenMP thread per process (2-core machine, many processes per test), and
``@pytest.mark.needs(module, ...)`` for tests of optional extras (see tests/extras.py)."""

import multiprocessing
import os

import pytest

from tests.harness import JOB_PRELOAD

os.environ.setdefault("OMP_NUM_THREADS", "1")
# gcsfs would ask every bucket's type over gRPC, which the loopback GCS server does not speak (tests/gcs.py).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# A job forked from this process's forkserver (tests/harness.py::launch, launcher "fork") finds these
# imported; the package adds its own to the list when its loaders start the server first.
multiprocessing.set_forkserver_preload(list(JOB_PRELOAD))

# The object-store servers on loopback for the remote-storage tests: S3 (moto) and GCS.
pytest_plugins = ["tests.s3", "tests.gcs"]


def pytest_runtest_setup(item: pytest.Item) -> None:
    from tests.extras import require

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
