"""A real S3-protocol server (moto) on 127.0.0.1 for the remote-storage tests.

The server runs in the test process on a free port; DataLoader workers and training processes
reach it over loopback through s3fs, exactly as they would reach a real object store.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    @property
    def storage_options(self) -> dict[str, Any]:
        """What a reader needs to talk to this server (fixed test credentials)."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` (boto3: s3fs's mkdir sends a location constraint moto rejects)."""
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    from tests.support.extras import require

    require("moto", "boto3", "s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[Any]:
    """The counting, faultable proxy of tests/support/fault_proxy.py in front of the S3 server (no faults
    unless a test sets them; a test module may define its own)."""
    from tests.support.fault_proxy import FaultProxy

    p = FaultProxy(s3_server.endpoint)
    yield p
    p.close()
