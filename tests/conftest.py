"""Test-wide settings: one OpenMP thread per process (2-core machine, many processes per test)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The S3-protocol server fixture (moto on loopback) for the remote-storage tests.
pytest_plugins = ["tests.s3"]
