"""The /metrics and /healthz server of ql3's daemons (``ql3 relay``, ``ql3 recover --loop``).

- ``GET /metrics``: the Prometheus text of the daemon's registry; 501 when it has none
  (``ql3 recover --loop`` on an install without prometheus-client, D58).
- ``GET /healthz`` (or ``/health``): the daemon's health report as JSON; 200 when its
  ``status`` is ``"ok"``, else 503.
- Anything else: 404.

It answers from threads of its own, so the relay's event loop and the recovery loop's
blocking database calls never hold up a scrape; the daemons' ``health`` methods only read
state. Every response closes its connection, and a client that sends nothing for 5
seconds is dropped.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import TYPE_CHECKING, Any

from ql3 import errors

if TYPE_CHECKING:  # imported with a registry only: /healthz needs no prometheus-client
    from prometheus_client import CollectorRegistry

HealthReport = Callable[[], Mapping[str, Any]]
MAX_PORT = 65535

NO_METRICS = (
    b"no /metrics: prometheus-client is not installed (pip install prometheus-client, "
    b"or 'ql3[relay]'); /healthz is served\n"
)
"""The 501 body of /metrics on a server without a registry."""


def serve_status(
    host: str,
    port: int | None,
    registry: CollectorRegistry | None,
    health: HealthReport,
    *,
    name: str,
    log: logging.Logger,
    **log_fields: Any,
) -> StatusServer | None:
    """A ``StatusServer``, or None when ``port`` is None or negative (the server is off).

    Logs ``metrics_listening`` with the bound port on ``log``, with ``log_fields``. A port
    above 65535, or an address it cannot listen on (in use, unknown host), is
    InvalidArgument: it is the operator's setting.
    """
    if port is None or port < 0:
        return None
    if port > MAX_PORT:
        raise errors.Misconfigured(
            f"QL3_INVALID_ARGUMENT: metrics port {port} is not a TCP port (0..{MAX_PORT})"
        )
    try:
        server = StatusServer(host, port, registry, health, name=name)
    except (OSError, OverflowError) as exc:
        raise errors.InvalidArgument(
            f"QL3_INVALID_ARGUMENT: cannot serve /metrics on {host}:{port}: "
            f"{getattr(exc, 'strerror', None) or exc}"
        ) from None
    log.info("metrics_listening", extra={"ql3": {**log_fields, "host": host, "port": server.port}})
    return server


class StatusServer:
    """Serves /metrics and /healthz on ``host:port`` (0 = any free port) until ``close``;
    without a ``registry``, /metrics answers 501 (prometheus-client is not installed)."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry | None,
        health: HealthReport,
        *,
        name: str = "ql3-http",
    ) -> None:
        self._server = _Server((host, port), _handler(registry, health))
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.1,), name=name, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port (blocks for up to 0.1 s)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _Server(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        # IPv4 or IPv6, as the host says (HTTPServer alone is IPv4 only).
        family, *_ = socket.getaddrinfo(
            address[0] or None, address[1], type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.address_family = family
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind also looks up the host's FQDN, which nothing here uses
        # and which can wait on DNS.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)


def _handler(
    registry: CollectorRegistry | None, health: HealthReport
) -> type[BaseHTTPRequestHandler]:
    metrics: Callable[[], tuple[int, str, bytes]]
    if registry is None:

        def metrics() -> tuple[int, str, bytes]:
            return 501, "text/plain; charset=utf-8", NO_METRICS

    else:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        def metrics() -> tuple[int, str, bytes]:
            return 200, CONTENT_TYPE_LATEST, generate_latest(registry)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 5  # seconds a client may take to send its request

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(*metrics())
            elif path in ("/healthz", "/health"):
                report = health()
                status = 200 if report["status"] == "ok" else 503
                self._reply(status, "application/json", json.dumps(report).encode())
            else:
                self._reply(404, "text/plain", b"not found\n")

        def _reply(self, status: int, ctype: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # scrapes every few seconds would drown the JSON log

    return Handler
