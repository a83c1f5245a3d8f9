"""Test-wide settings: one OpenMP thread per process (2-core machine, many processes per test), and
``@pytest.mark.needs(module, ...)`` for tests of optional extras (see tests/extras.py)."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# gcsfs would ask every bucket's type over gRPC, which the loopback GCS server does not speak (tests/gcs.py).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

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
