"""A real Google Cloud Storage JSON-API server (gcp-storage-emulator) on 127.0.0.1 for the gs:// tests.

The server runs in the test process on a free port; readers, DataLoader workers and training
processes reach it over loopback through gcsfs with ``endpoint_url``, as they would reach GCS.
gcsfs's experimental zonal/hierarchical-bucket support asks each bucket's type over gRPC, which
the emulator does not speak (every first request would wait 60 s for it); conftest turns it off
with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` before gcsfs is imported anywhere.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class GCSServer:
    endpoint: str
    server: Any

    @property
    def storage_options(self) -> dict[str, Any]:
        """What a reader needs to talk to this server (anonymous, a fixed project)."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    def bucket(self, name: str) -> str:
        from gcp_storage_emulator.handlers import buckets

        buckets.create_bucket(name, self.server._storage)
        return f"gs://{name}"


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    from tests.support.extras import require

    require("gcsfs", "gcp_storage_emulator")
    from gcp_storage_emulator.server import create_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    try:
        yield GCSServer(f"http://127.0.0.1:{port}", server)
    finally:
        server.stop()
