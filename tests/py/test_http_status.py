"""The /metrics and /healthz server shared by the relay and the recovery daemon."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter

from ql3.http_status import StatusServer


class Reported:
    """A health report that a test changes between requests."""

    def __init__(self) -> None:
        self.report: dict[str, Any] = {"status": "ok", "detail": [1, "two", None]}

    def __call__(self) -> dict[str, Any]:
        return self.report


@pytest.fixture
def health() -> Reported:
    return Reported()


@pytest.fixture
def server(health: Reported) -> Iterator[StatusServer]:
    registry = CollectorRegistry()
    Counter("ql3_test_things", "Things counted.", registry=registry).inc(3)
    status = StatusServer("127.0.0.1", 0, registry, health)
    try:
        yield status
    finally:
        status.close()


def get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_metrics_are_the_registry_in_prometheus_text(server: StatusServer) -> None:
    status, headers, body = get(server.port, "/metrics")
    assert status == 200
    assert headers["Content-Type"] == CONTENT_TYPE_LATEST
    assert headers["Connection"] == "close"
    assert int(headers["Content-Length"]) == len(body)
    assert "ql3_test_things_total 3.0" in body.decode()


@pytest.mark.parametrize("path", ["/healthz", "/health", "/healthz?verbose=1"])
def test_health_is_the_report_as_json_200_when_ok(
    server: StatusServer, health: Reported, path: str
) -> None:
    status, headers, body = get(server.port, path)
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == health.report


@pytest.mark.parametrize("state", ["unhealthy", "failing", "starting"])
def test_health_is_503_with_the_report_when_status_is_not_ok(
    server: StatusServer, health: Reported, state: str
) -> None:
    health.report = {"status": state, "postgres": False}
    status, headers, body = get(server.port, "/healthz")
    assert status == 503
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"status": state, "postgres": False}


def test_other_paths_are_404(server: StatusServer) -> None:
    for path in ("/", "/nope", "/metrics/x"):
        status, headers, body = get(server.port, path)
        assert (status, headers["Content-Type"], body) == (404, "text/plain", b"not found\n")


def test_close_releases_the_port(health: Reported) -> None:
    server = StatusServer("127.0.0.1", 0, CollectorRegistry(), health)
    port = server.port
    assert get(port, "/healthz")[0] == 200
    server.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    again = StatusServer("127.0.0.1", port, CollectorRegistry(), health)
    again.close()


def test_an_ipv6_host_is_served(health: Reported) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    server = StatusServer("::1", 0, CollectorRegistry(), health)
    try:
        assert get(server.port, "/healthz", host="::1")[0] == 200
    finally:
        server.close()
