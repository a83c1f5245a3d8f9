"""Tests that need an optional package: skipped with the extra to install, or failed under CI.

``pytest.mark.needs("matplotlib")`` on a test (or ``require("pyarrow")`` inside one, for one case of
a parametrized test) skips it with the ``pip install`` that brings the package when it is missing.
CI installs every extra and sets ``LSH_REQUIRE_EXTRAS=1``, which turns those skips into failures:
a test that skips in CI proves nothing.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

# The module a test imports -> the extra of pyproject.toml that installs it.
EXTRA_OF = {
    "nvidia.dali": "dali",
    "matplotlib": "plot",
    "rich": "dev",
    "pyarrow": "files",
    "s3fs": "s3",
    "gcsfs": "gcs",
    "adlfs": "azure",
    "huggingface_hub": "hf",
    "gcp_storage_emulator": "dev",
    "moto": "dev",
    "boto3": "dev",
    "jsonargparse": "dev",
    "webdataset": "dev",
    "PIL": "image",
    "simplejpeg": "image",
    "soundfile": "audio",
    "av": "video",
    "tokenizers": "text",
    "pymdownx": "docs",
}
STRICT_ENV = "LSH_REQUIRE_EXTRAS"


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (``find_spec`` raises, not returns None, when a parent is missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def require(*modules: str) -> None:
    """Skip the running test unless every module is installed (fail instead when CI asks for all)."""
    missing = [m for m in modules if not installed(m)]
    if not missing:
        return
    extras = ",".join(sorted({EXTRA_OF[m] for m in missing}))
    reason = f"needs {', '.join(missing)}: pip install -e '.[{extras}]'"
    if os.environ.get(STRICT_ENV) == "1":
        pytest.fail(f"{reason} ({STRICT_ENV}=1: every extra must be installed, none may be skipped)")
    pytest.skip(reason)
