"""Test-wide settings: one OpenMP thread per process (2-core machine, many processes per test)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
