"""The throwaway servers' helpers (ql3.devservers) that every fixture relies on."""

from __future__ import annotations

import socket

import pytest

from ql3 import devservers


def test_a_probe_connected_to_itself_is_not_a_listening_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing listens on the port, but the probe is given that port as its own source
    port, and TCP's simultaneous open connects it to itself: still not ready."""
    port = devservers.free_port()

    def connected_to_itself(address: tuple[str, int], timeout: float) -> socket.socket:
        probe = socket.socket()
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the last probe
            probe.bind(address)
            probe.connect(address)
        except OSError:
            probe.close()
            raise
        return probe

    monkeypatch.setattr(socket, "create_connection", connected_to_itself)
    with pytest.raises(RuntimeError, match=f"nothing listens on 127.0.0.1:{port}"):
        devservers.wait_port(port, 0.3)


def test_a_listening_server_is_ready() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        devservers.wait_port(server.getsockname()[1], 2.0)
