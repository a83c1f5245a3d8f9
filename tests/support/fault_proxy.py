"""A fault-injecting HTTP proxy on 127.0.0.1 in front of the S3-protocol test server.

It forwards every request to the real server (moto) and, for a seeded fraction of them, answers
``503 ServiceUnavailable`` instead or drops the connection without an answer, the way a flaky
object store or load balancer does. ``down()`` closes the listening socket and every open
connection, so new connections are refused: the server is gone. Nothing in the code under test
is patched; readers reach the proxy over loopback through s3fs like any endpoint.
"""

from __future__ import annotations

import http.client
import random
import socket
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade", "trailer"}
_UNAVAILABLE = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable</Code>'
    b"<Message>injected by the test proxy</Message></Error>"
)


class FaultProxy:
    """Forward to ``upstream`` (``http://host:port``); fail ``fault_rate`` of the requests.

    A failed request gets a 503 or (one time in ``drop_share``) a dropped connection. Only
    requests whose method is in ``methods`` may fail, so a test can keep listings reliable and
    fault only the data reads. ``counts`` says what happened: ``forwarded``, ``503``, ``dropped``,
    ``refused`` (requests that arrived while down), and ``retried`` (a request identical to one
    that was failed, seen again: someone retried it); ``requests`` counts the forwarded ones by
    method and path. ``delay`` adds latency to every request, ``trickle`` slows every body down.
    """

    def __init__(
        self,
        upstream: str,
        *,
        fault_rate: float = 0.0,
        drop_share: float = 0.3,
        seed: int = 0,
        methods: tuple[str, ...] = ("GET", "HEAD"),
        delay: float = 0.0,
        trickle: float = 0.0,
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.fault_rate, self.drop_share, self.methods = fault_rate, drop_share, methods
        self.counts: Counter[str] = Counter()
        self.requests: Counter[tuple[str, str]] = Counter()  # (method, path without the query) forwarded
        self.log: list[tuple[str, str]] = []  # the same, in the order they arrived
        self.delay = delay  # seconds added before forwarding each request
        self.trickle = trickle  # seconds between 1 KiB pieces of a body: a slow download
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._failed: set[tuple[str, str, str]] = set()
        self._down = False
        self._server: ThreadingHTTPServer | None = None
        self._connections: set[socket.socket] = set()
        self.port = 0
        self._start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, **client: Any) -> dict[str, Any]:
        """s3fs options for reaching the server through this proxy (test credentials).

        botocore's own retries are off, so every injected fault reaches lightning_sharding's
        ``RetryPolicy``: what the test shows is that *our* retries recover, not botocore's.
        """
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1", **client},
            "config_kwargs": {"retries": {"total_max_attempts": 1}},
        }

    def _start(self) -> None:
        proxy = self

        class Handler(_Forwarder):
            owner = proxy

        server = _Server(("127.0.0.1", self.port), Handler)
        self.port = int(server.server_address[1])
        self._server = server
        threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True).start()

    def decide(self, method: str, path: str, range_header: str) -> str:
        """``"forward"``, ``"503"`` or ``"drop"`` for one request, from the seeded generator."""
        key = (method, path, range_header)
        with self._lock:
            if key in self._failed:
                self.counts["retried"] += 1
                self._failed.discard(key)
            verdict = "forward"
            if method in self.methods and self._rng.random() < self.fault_rate:
                verdict = "drop" if self._rng.random() < self.drop_share else "503"
                self._failed.add(key)
            self.counts["forwarded" if verdict == "forward" else ("dropped" if verdict == "drop" else "503")] += 1
            if verdict == "forward":
                self.requests[(method, path.split("?", 1)[0])] += 1
                self.log.append((method, path.split("?", 1)[0]))
            return verdict

    def track(self, conn: socket.socket, alive: bool) -> None:
        with self._lock:
            (self._connections.add if alive else self._connections.discard)(conn)

    @property
    def is_down(self) -> bool:
        return self._down

    def down(self) -> None:
        """Stop listening and cut every open connection: connections are refused from now on."""
        self._down = True
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            for conn in list(self._connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def up(self) -> None:
        """Listen again on the same port."""
        self._down = False
        if self._server is None:
            self._start()

    def close(self) -> None:
        self.down()


class _Server(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5: 32 connections opened at once (2 workers reading 16
    # shards each) overflow it, and each dropped connection waits out TCP's 1-second retransmission,
    # which no object store or load balancer makes its clients do.
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up mid-answer (a benchmark stops its peers' workers, and their curl,
        # after the first batch) is no error of the proxy's: only other errors are printed.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class _Forwarder(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as s3fs's connection pool expects

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def setup(self) -> None:
        super().setup()
        self.owner.track(self.connection, True)

    def finish(self) -> None:
        self.owner.track(self.connection, False)
        try:
            super().finish()
        except OSError:
            pass

    def _handle(self) -> None:
        if self.owner.is_down:
            self.owner.counts["refused"] += 1
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        verdict = self.owner.decide(self.command, self.path, self.headers.get("Range", ""))
        if verdict == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if verdict == "503":
            self._answer(503, [("Content-Type", "application/xml")], _UNAVAILABLE)
            return
        if self.owner.delay:
            time.sleep(self.owner.delay)
        upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            # A HEAD's Content-Length is the object's size, not this (empty) body's: pass it on.
            dropped = _HOP_BY_HOP if self.command == "HEAD" else _HOP_BY_HOP | {"content-length"}
            kept = [(k, v) for k, v in response.getheaders() if k.lower() not in dropped]
            self._answer(response.status, kept, data)
        finally:
            upstream.close()

    def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        if self.command != "HEAD" or not any(k.lower() == "content-length" for k, _ in headers):
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        step = 1024 if self.owner.trickle else max(1, len(data))
        for start in range(0, len(data), step):
            self.wfile.write(data[start : start + step])
            if self.owner.trickle:
                self.wfile.flush()
                time.sleep(self.owner.trickle)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle
