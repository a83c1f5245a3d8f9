"""Storages other than S3 through fsspec: gs:// and gcs://, az:// and abfs://, hf://.

What runs without the cloud: each URL opens the filesystem of its package with the path inside it;
a glob's matches keep the user's spelling (scheme, account, chain) and a file named twice is
refused; each store's listing fingerprints a file by its content tag; a URL whose package is
missing fails naming the URL and the extra to install (checked in a fresh interpreter where the
package cannot be imported); an unknown scheme and an Azure URL without an account say what to
pass; the storages' own transient errors are retried and their permanent ones are not. Reading
from a GCS server on loopback is in tests/process/test_gcs.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

from lightning_sharding.readers.storage import (
    RetryPolicy,
    filesystem,
    fingerprint_of,
    is_transient,
    list_files,
    spelled_like,
    with_retries,
)

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
    ],
)
def test_each_storage_url_opens_its_filesystem_at_the_path_inside_it(
    url: str, options: dict[str, Any], module: str, cls: str, path: str
) -> None:
    from tests.support.extras import require

    require(module)
    fs, inside = filesystem(url, options)
    assert (type(fs).__name__, inside) == (cls, path)


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
        f"ImportError: {url!r}: {url.split('://')[0]}:// URLs need {package}, which could not be imported "
        f"(import of {package} halted; None in sys.modules): pip install 'lightning-sharding[{extra}]'"
    )


def test_an_unknown_scheme_names_the_url_and_the_schemes_that_work() -> None:
    with pytest.raises(
        ValueError, match=r"'s4://bkt/x.tar': no filesystem reads s4:// URLs; use a path or one of s3://"
    ):
        list_files("s4://bkt/x.tar")
    with pytest.raises(
        ValueError, match=r"'GS://bkt/x.tar': no filesystem reads GS:// URLs \(schemes are lower case\)"
    ):
        list_files("GS://bkt/x.tar")
    with pytest.raises(ValueError, match=r"'cache::memory://bkt/x.tar': no filesystem reads cache:// URLs; use"):
        list_files("cache::memory://bkt/x.tar")  # memory://: fsspec's own, so this runs without any extra


@pytest.mark.parametrize(
    ("url", "pattern", "match", "spelled"),
    [
        ("az://cont/train/part-*.tar", "cont/train/part-*.tar", "cont/train/part-0.tar", "az://cont/train/part-0.tar"),
        (
            "abfss://cont@acct.dfs.core.windows.net/train/part-*.tar",
            "cont/train/part-*.tar",
            "cont/train/part-0.tar",
            "abfss://cont@acct.dfs.core.windows.net/train/part-0.tar",
        ),
        ("gcs://bkt/a/*/x.tar", "bkt/a/*/x.tar", "bkt/a/b/x.tar", "gcs://bkt/a/b/x.tar"),
        ("s3://bkt-*/x.tar", "bkt-*/x.tar", "bkt-1/x.tar", "s3://bkt-1/x.tar"),
        (
            "hf://datasets/org/name@v1/t/*.tar",
            "datasets/org/name@v1/t/*.tar",
            "datasets/org/name@v1/t/0.tar",
            "hf://datasets/org/name@v1/t/0.tar",
        ),
        ("data/*.tar", "/abs/data/*.tar", "/abs/data/0.tar", "/abs/data/0.tar"),
    ],
)
def test_a_glob_match_keeps_the_users_spelling(url: str, pattern: str, match: str, spelled: str) -> None:
    """The scheme, an account in the host, a revision: a match is reopened from its URL alone in the
    workers, so what the user's URL says of where the files are must stay in it."""
    assert spelled_like(url, pattern, match) == spelled


def test_globs_keep_their_chain_and_a_file_named_twice_is_refused() -> None:
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe("/spell/t/a.bin", b"123")
    memory.pipe("/spell/t/b.bin", b"45")
    chained = list_files("simplecache::memory://spell/t/*.bin")
    assert [f.url for f in chained] == ["simplecache::memory://spell/t/a.bin", "simplecache::memory://spell/t/b.bin"]
    assert [f.size for f in chained] == [3, 2]
    with pytest.raises(ValueError, match=r"'memory://spell/t/a.bin' is named twice in the URLs: name each file once"):
        list_files(["memory://spell/t/a.bin", "memory://spell/t/*.bin"])
    twice = r"'memory:///spell/t/b.bin' is named twice in the URLs \(also as 'memory://spell/t/b.bin'\)"
    with pytest.raises(ValueError, match=twice):
        list_files(["memory://spell/t/*.bin", "memory:///spell/t/b.bin"])


@pytest.mark.parametrize(
    ("info", "tag"),
    [
        (
            {"size": 5, "ETag": '"9b2cf535f27731c974343645a3985328"', "LastModified": "x"},
            "9b2cf535f27731c974343645a3985328",
        ),
        ({"size": 5, "etag": "CJ+Q2Z8=", "generation": "17955", "mtime": "x"}, "CJ+Q2Z8="),
        ({"size": 5, "etag": "0x8DC1", "last_modified": "2026-01-01"}, "0x8DC1"),
        (
            {"size": 5, "blob_id": "a94a8fe5ccb19ba61c4c0873d391e987982fbbd3", "lfs": None},
            "a94a8fe5ccb19ba61c4c0873d391e987982fbbd3",
        ),
        ({"size": 5, "mtime": 1795558361.5}, "1795558361.5"),
    ],
    ids=["s3", "gcs", "azure", "hf", "local"],
)
def test_each_store_fingerprints_a_file_by_its_content_tag(info: dict[str, Any], tag: str) -> None:
    """A changed object of the same size gets a new fingerprint: an ETag, the Hub's git blob hash
    (the Hub lists no ETag and no modification time), a local file's mtime."""
    assert fingerprint_of(info) == f"size=5;tag={tag}"


def test_an_azure_url_without_an_account_says_what_to_pass() -> None:
    from tests.support.extras import require

    require("adlfs")
    with pytest.raises(
        ValueError, match=r"'az://cont/x.tar': could not open its storage .*pass storage_options=\{'account_name'"
    ):
        list_files("az://cont/x.tar")


def storage_errors() -> list[tuple[BaseException, bool]]:
    """The storages' own error classes, each with whether a retry may fix it."""
    from tests.support.extras import require

    require("gcsfs", "adlfs", "huggingface_hub")
    import aiohttp
    import httpx2
    import requests
    from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError
    from gcsfs.retry import HttpError
    from huggingface_hub.errors import HfHubHTTPError

    def hub(status: int) -> HfHubHTTPError:
        return HfHubHTTPError(
            f"status {status}", response=httpx2.Response(status, request=httpx2.Request("GET", "https://hf.co/x"))
        )

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
        (requests.exceptions.ProxyError("502 from the proxy"), True),  # what gcsfs raises for a 502
        (requests.exceptions.ConnectTimeout("connect timed out"), True),
        (aiohttp.ClientPayloadError("response payload is not completed"), True),
        (hub(503), True),
        (hub(404), False),
        (httpx2.ReadError("connection reset"), True),
        (httpx2.PoolTimeout("no connection free"), True),
        (httpx2.UnsupportedProtocol("ftp"), False),
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


def test_data_endpoint_url_goes_where_the_urls_store_takes_it() -> None:
    from lightning_sharding.recipes.data import endpoint_options

    given = {"client_kwargs": {"region_name": "eu-west-1"}}
    assert endpoint_options("http://h:9000", given, ["s3://b/x.tar"]) == {
        "client_kwargs": {"region_name": "eu-west-1", "endpoint_url": "http://h:9000"}
    }
    assert endpoint_options("http://h:4443", {}, ["gs://b/x.tar", "gcs://b/y.tar"]) == {"endpoint_url": "http://h:4443"}
    with pytest.raises(ValueError, match=r"does not reach inside a chained URL \('simplecache::s3://b/x.tar'"):
        endpoint_options("http://h", {}, ["simplecache::s3://b/x.tar"])
    with pytest.raises(ValueError, match=r"sets the endpoint of s3:// or gs:// URLs, and data.urls has az://, s3://"):
        endpoint_options("http://h", {}, ["s3://b/x.tar", "az://c/y.tar"])


def test_a_local_glob_lists_what_fsspec_lists(tmp_path: Any) -> None:
    """The one-``scandir`` listing of a local glob gives fsspec's matches: dot files, a directory
    that matches (left out), character classes; a glob with a directory pattern or ``**`` is left to
    fsspec. A link to a file is that file (fsspec's glob calls it "other", and a listing used to
    drop it: its samples were silently missing), whichever way the glob is expanded."""
    import os

    import fsspec

    from lightning_sharding.readers.storage import _local_glob, list_files

    for name in ("a.tar", ".hidden.tar", "b.TAR", "c1.tar", "c2.tar", "notes.txt"):
        (tmp_path / name).write_bytes(b"x" * len(name))
    (tmp_path / "folder.tar").mkdir()
    os.symlink(tmp_path / "a.tar", tmp_path / "link.tar")
    fs = fsspec.filesystem("file")
    for pattern in ("*.tar", "c[12].tar", "?.tar", "*", "[!c]*.tar"):
        ours = _local_glob(fs, f"{tmp_path}/{pattern}")
        theirs = fs.glob(f"{tmp_path}/{pattern}", detail=True)
        assert ours is not None and sorted(ours) == sorted(theirs), pattern
        for path, info in ours.items():
            if path.endswith("link.tar"):
                target = (tmp_path / "a.tar").stat()
                assert (info["type"], info["size"], info["mtime"]) == ("file", 5, target.st_mtime)
                continue
            assert {k: info[k] for k in ("size", "mtime", "type")} == {
                k: theirs[path][k] for k in ("size", "mtime", "type")
            }
    assert _local_glob(fs, f"{tmp_path}/*/x.tar") is None and _local_glob(fs, f"{tmp_path}/**") is None
    expected = sorted(str(tmp_path / n) for n in (".hidden.tar", "a.tar", "c1.tar", "c2.tar", "link.tar"))
    assert [f.url for f in list_files(f"{tmp_path}/*.tar")] == expected
    assert [f.url for f in list_files(f"{tmp_path}/**/*.tar")] == expected  # through fsspec's glob
    os.mkfifo(tmp_path / "pipe.tar")  # not a file: left out (reading it would wait forever)
    assert [f.url for f in list_files(f"{tmp_path}/*.tar")] == expected
    os.symlink(tmp_path / "gone.tar", tmp_path / "broken.tar")
    for pattern in ("*.tar", "**/*.tar"):
        with pytest.raises(FileNotFoundError, match=r"broken\.tar is a broken symbolic link"):
            list_files(f"{tmp_path}/{pattern}")
