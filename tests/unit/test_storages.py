"""Storages other than S3 through fsspec: gs:// and gcs://, az:// and abfs://, hf://.

What runs without the cloud: each URL opens the filesystem of its package with the path inside it
and keeps the user's spelling; a URL whose package is missing fails naming the URL and the extra
to install (checked in a fresh interpreter where the package cannot be imported); an unknown
scheme and an Azure URL without an account say what to pass; the storages' own transient errors
are retried and their permanent ones are not. Reading from a GCS server on loopback is in
tests/process/test_gcs.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

from lightning_sharding.storage import STORAGES, RetryPolicy, filesystem, is_transient, list_files, with_retries

FAST = RetryPolicy(attempts=3, backoff=0.001)


@pytest.mark.parametrize(
    ("url", "options", "module", "cls", "path"),
    [
        ("gs://bkt/wds/part-0.tar", {"token": "anon"}, "gcsfs", "GCSFileSystem", "bkt/wds/part-0.tar"),
        ("gcs://bkt/wds/part-*.tar", {"token": "anon"}, "gcsfs", "GCSFileSystem", "bkt/wds/part-*.tar"),
        (
            "az://cont/wds/part-0.tar",
            {"account_name": "acct", "anon": True},
            "adlfs",
            "AzureBlobFileSystem",
            "cont/wds/part-0.tar",
        ),
        (
            "abfs://cont/wds/part-*.tar",
            {"account_name": "acct", "anon": True},
            "adlfs",
            "AzureBlobFileSystem",
            "cont/wds/part-*.tar",
        ),
        (
            "hf://datasets/org/repo/wds/part-0.tar",
            {},
            "huggingface_hub",
            "HfFileSystem",
            "datasets/org/repo/wds/part-0.tar",
        ),
        (
            "hf://datasets/org/repo@v1.0/wds/part-*.tar",
            {},
            "huggingface_hub",
            "HfFileSystem",
            "datasets/org/repo@v1.0/wds/part-*.tar",
        ),
    ],
)
def test_each_storage_url_opens_its_filesystem_at_the_path_inside_it(
    url: str, options: dict[str, Any], module: str, cls: str, path: str
) -> None:
    from tests.extras import require

    require(module)
    fs, inside = filesystem(url, options)
    assert (type(fs).__name__, inside) == (cls, path)
    assert STORAGES[url.split("://")[0]][0] == module


def missing_package_error(url: str, package: str) -> str:
    """What opening ``url`` raises in a fresh interpreter where ``package`` cannot be imported."""
    code = f"""
        import sys
        sys.modules[{package!r}] = None  # as if it were not installed: `import {package}` raises ImportError
        from lightning_sharding.readers import TarReader
        try:
            TarReader({url!r}).items()
        except ImportError as err:
            print(f"{{type(err).__name__}}: {{err}}")
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("url", "package", "extra"),
    [
        ("gs://bkt/wds/part-*.tar", "gcsfs", "gcs"),
        ("az://cont/wds/part-*.tar", "adlfs", "azure"),
        ("hf://datasets/org/repo/wds/part-*.tar", "huggingface_hub", "hf"),
        ("s3://bkt/wds/part-*.tar", "s3fs", "s3"),
    ],
)
def test_a_url_whose_package_is_missing_names_the_url_and_the_extra_to_install(
    url: str, package: str, extra: str
) -> None:
    message = missing_package_error(url, package)
    assert message == (
        f"ImportError: {url!r}: {url.split('://')[0]}:// URLs need {package}, which is not installed: "
        f"pip install 'lightning-sharding[{extra}]'"
    )


def test_an_unknown_scheme_names_the_url_and_the_schemes_that_work() -> None:
    with pytest.raises(
        ValueError, match=r"'s4://bkt/x.tar': no filesystem reads s4:// URLs; use a path or one of s3://"
    ):
        list_files("s4://bkt/x.tar")


def test_an_azure_url_without_an_account_says_what_to_pass() -> None:
    from tests.extras import require

    require("adlfs")
    with pytest.raises(
        ValueError, match=r"'az://cont/x.tar': could not open its storage .*pass storage_options=\{'account_name'"
    ):
        list_files("az://cont/x.tar")


def storage_errors() -> list[tuple[BaseException, bool]]:
    """The storages' own error classes, each with whether a retry may fix it."""
    from tests.extras import require

    require("gcsfs", "adlfs", "huggingface_hub")
    from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError
    from gcsfs.retry import HttpError

    def azure(status: int) -> HttpResponseError:
        err = HttpResponseError(message=f"status {status}")
        err.status_code = status
        return err

    return [
        (HttpError({"code": 503, "message": "backend unavailable"}), True),
        (HttpError({"code": 429, "message": "rate limit"}), True),
        (HttpError({"code": 400, "message": "bad request"}), False),
        (ServiceRequestError("connection reset"), True),
        (ServiceResponseError("read timed out"), True),
        (azure(500), True),
        (azure(403), False),
    ]


def test_the_storages_transient_errors_are_retried_and_their_permanent_ones_are_not() -> None:
    for err, transient in storage_errors():
        assert is_transient(err) is transient, (type(err).__name__, err)
        calls: list[int] = []

        def fail_twice(err: BaseException = err, calls: list[int] = calls) -> str:
            calls.append(1)
            if len(calls) < 3:
                raise err
            return "ok"

        if transient:
            assert with_retries(fail_twice, "reading x", FAST) == "ok" and len(calls) == 3
        else:
            with pytest.raises(type(err)):
                with_retries(fail_twice, "reading x", FAST)
            assert len(calls) == 1
