"""A TCP proxy between a client and PostgreSQL that can lose the answer to a COMMIT.

``arm_commit_loss()`` makes the proxy watch the frontend protocol of every connection; at
the next ``COMMIT`` (a simple Query message 'Q', as psycopg sends it, or a Parse message
'P' of the extended protocol) it forwards the message to the server, waits for the
server's reply, drops it, and closes the client side. The transaction is then committed
while the client only sees its connection break: exactly the "COMMIT response lost" case
(SPEC section 11). ``commit_lost`` is set once that happened.

``freeze()`` cuts every open connection silently, as a network partition does: both
directions are swallowed, nothing is closed; connections opened later pass.

``hold_after_sync(seconds)`` holds back whatever a client sends after each Sync or simple
Query for that long, as a busy network can: a message that follows the end of a
transaction then reaches the server after its answer.

``arm_commit_loss(b"admit_invocation")`` does the same at the next statement whose text
contains that marker: on an autocommit connection a statement is its own transaction and
commits as it completes, so losing its reply is losing the answer to its COMMIT.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_BATCH_ENDS = (ord("S"), ord("Q"))  # a Sync, or a simple Query: the server answers now


def _commits(kind: int, payload: bytes, marker: bytes | None) -> bool:
    """Whether this frontend message is the COMMIT (or, with a marker, the statement) whose
    answer is to be lost."""
    if kind == ord("Q"):
        query = payload.rstrip(b"\x00")
    elif kind == ord("P"):
        _, _, rest = payload.partition(b"\x00")  # statement name, then the query
        query = rest.partition(b"\x00")[0]
    else:
        return False
    if marker is not None:
        return marker in query
    return query.strip().rstrip(b";").strip().upper() in (b"COMMIT", b"END")


class _Link:
    """One proxied connection: client <-> server."""

    def __init__(self, proxy: PgProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        self.dropping = threading.Event()
        self.frozen = threading.Event()

    def start(self) -> None:
        for target in (self._client_to_server, self._server_to_client):
            threading.Thread(target=target, daemon=True).start()

    def close(self) -> None:
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _client_to_server(self) -> None:
        buffer = b""
        startup = True
        try:
            while True:
                data = self.client.recv(65536)
                if not data:
                    break
                buffer += data
                while True:
                    if startup:
                        if len(buffer) < 8:
                            break
                        length = int.from_bytes(buffer[:4], "big")
                        if len(buffer) < length:
                            break
                        message, buffer = buffer[:length], buffer[length:]
                        code = int.from_bytes(message[4:8], "big")
                        startup = code in (_SSL_REQUEST, _GSSENC_REQUEST)
                    else:
                        if len(buffer) < 5:
                            break
                        length = int.from_bytes(buffer[1:5], "big")
                        if len(buffer) < 1 + length:
                            break
                        message, buffer = buffer[: 1 + length], buffer[1 + length :]
                        if self.proxy._take_arm(message[0], message[5:]):
                            self.dropping.set()  # before the server can answer
                    if not self.frozen.is_set():
                        self.server.sendall(message)
                    if not startup and message[0] in _BATCH_ENDS and self.proxy.hold_s:
                        time.sleep(self.proxy.hold_s)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                self.server.shutdown(socket.SHUT_WR)

    def _server_to_client(self) -> None:
        try:
            while True:
                data = self.server.recv(65536)
                if not data:
                    break
                if self.dropping.is_set():
                    # The server answered the COMMIT: the transaction is durable. The
                    # client never hears of it.
                    self.proxy.commit_lost.set()
                    break
                if not self.frozen.is_set():
                    self.client.sendall(data)
        except OSError:
            pass
        finally:
            self.close()


class PgProxy:
    """Listens on 127.0.0.1 and forwards to ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.commit_lost = threading.Event()
        self.hold_s = 0.0
        self._armed = False
        self._marker: bytes | None = None
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def dsn(self, dsn: str) -> str:
        """``dsn`` rerouted through the proxy (no TLS or GSS negotiation)."""
        params = conninfo_to_dict(dsn)
        params.update(
            host="127.0.0.1", port=str(self.port), sslmode="disable", gssencmode="disable"
        )
        return make_conninfo(**params)  # type: ignore[arg-type]

    def arm_commit_loss(self, marker: bytes | None = None) -> None:
        """Lose the answer to the next COMMIT that any proxied connection sends, or with a
        marker, to the next statement containing it (autocommit: its own COMMIT)."""
        with self._lock:
            self._armed, self._marker = True, marker
        self.commit_lost.clear()

    def hold_after_sync(self, seconds: float) -> None:
        """Forward what follows each Sync or simple Query ``seconds`` late."""
        self.hold_s = seconds

    def freeze(self) -> None:
        """Swallow everything on the connections open now, without closing them."""
        with self._lock:
            for link in self._links:
                link.frozen.set()

    def _take_arm(self, kind: int, payload: bytes) -> bool:
        """True once: for the first matching message after arming."""
        with self._lock:
            if not self._armed or not _commits(kind, payload, self._marker):
                return False
            self._armed = False
            return True

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            link = _Link(self, client, server)
            with self._lock:
                self._links.append(link)
            link.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()


def proxy_for(dsn: str) -> PgProxy:
    """A proxy in front of the server ``dsn`` names (close it when done)."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "127.0.0.1")
    return PgProxy("127.0.0.1" if host.startswith("/") else host, int(params.get("port") or 5432))


@pytest.fixture
def pg_proxy(db_dsn: str) -> Iterator[PgProxy]:
    """A proxy in front of the test database's server."""
    proxy = proxy_for(db_dsn)
    yield proxy
    proxy.close()
