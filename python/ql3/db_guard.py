"""Two guards around every store call: a live connection before it, a time limit during it.

- **No dead connection is handed out.** A connection idle in a pool may have been ended by
  the server meanwhile (a restart, a failover, ``pg_terminate_backend``,
  ``idle_session_timeout``): the server sent its error and closed the socket, and nobody
  read it. ``checked_out`` polls the socket without waiting (no round trip: D20 stays one
  round trip per call); a readable idle socket is read, and a connection found closed is
  discarded and another taken, so the first calls after a restart do not fail for
  connections the pool could have replaced. psycopg_pool's own ``check`` hook is not used:
  after a failed check it sleeps a second or more before trying the next connection.
- **No call waits forever.** ``statement_timeout`` stops a statement, not a COMMIT that
  waits for a synchronous standby or a backend that has stopped answering while the
  kernel still acknowledges its packets. A call that has not ended ``Timeouts.call_limit()``
  seconds after it was sent is ``OutcomeUnknown`` (``QL3_UNAVAILABLE``, D49; as for a lost
  COMMIT reply: the gateway withholds the call, recovery settles a start left behind). On
  asyncio the call is cancelled: psycopg then sends a cancel request and waits for the
  server at most 5 s more before it closes the connection (psycopg >= 3.3). A thread has
  no such cancel, so ``CallWatchdog`` shuts the connection's socket down under it, which
  ends the blocked read at once, and the pool discards the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

import psycopg

from ql3 import errors

# Connections tried before giving up on finding a live one: more than any pool holds idle
# after a restart would be pointless, since each is discarded and replaced in the background.
_LIVE_TRIES = 64


def is_dead(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """True when an idle connection is already closed (by us or by the server).

    An idle connection's socket is readable only when the server sent something unasked:
    a notification, a parameter change, or (the case looked for) its last error before it
    closed the socket. Whatever it is, it is read into libpq's buffer; only a connection
    that this leaves broken counts as dead.
    """
    if conn.closed or conn.broken:
        return True
    pgconn = conn.pgconn
    try:
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN)
        # libpq reads once per call: the server's last error first, its end of file next.
        for _ in range(4):
            if not poller.poll(0):
                break
            pgconn.consume_input()
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                return True
    except (OSError, psycopg.Error):
        return True
    return pgconn.status != psycopg.pq.ConnStatus.OK


def _discard(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Close a dead connection so that its pool drops it when it comes back."""
    with contextlib.suppress(Exception):
        conn.pgconn.finish()


@contextlib.contextmanager
def checked_out(
    connection: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
) -> Iterator[psycopg.Connection[Any]]:
    """``with checked_out(pool.connection) as conn``: a connection that is not dead."""
    for _ in range(_LIVE_TRIES):
        with connection() as conn:
            if is_dead(conn):
                _discard(conn)
                continue
            yield conn
            return
    raise _all_closed()


@contextlib.asynccontextmanager
async def checked_out_async(
    connection: Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]],
) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """The asyncio twin of ``checked_out``."""
    for _ in range(_LIVE_TRIES):
        async with connection() as conn:
            if is_dead(conn):
                _discard(conn)
                continue
            yield conn
            return
    raise _all_closed()


def _all_closed() -> errors.NotSent:
    """No call was sent: every connection tried was found dead before it (D49)."""
    return errors.NotSent("QL3_UNAVAILABLE: every pooled connection was closed by the server")


def overdue(seconds: float) -> errors.OutcomeUnknown:
    """The call was sent and given up: it may still commit (D49)."""
    return errors.OutcomeUnknown(
        f"QL3_UNAVAILABLE: PostgreSQL did not answer the call within {seconds:g} s "
        "(the connection was given up; the call's outcome is unknown)"
    )


def cut(conn: psycopg.Connection[Any]) -> None:
    """Shut the connection's socket down under whoever is blocked on it.

    ``shutdown`` acts on the socket, not on a descriptor, so it goes through a duplicate
    descriptor that is closed at once; libpq's own descriptor is left for libpq to close.
    """
    try:
        fd = conn.pgconn.socket
    except psycopg.Error:
        return
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as duplicate:
        duplicate.shutdown(socket.SHUT_RDWR)


class CallWatchdog:
    """Cuts the connection of a call still running past its limit (threads only).

    One daemon thread per process, started on first use, looks at the armed calls every
    ``tick`` seconds; arming and disarming take a lock and touch a dict, nothing else, so a
    call that ends in time pays no system call for it.
    """

    def __init__(self, tick: float = 0.25) -> None:
        self._tick = tick
        self._tokens = itertools.count()
        self._reset()

    def _reset(self) -> None:
        """A fresh state: at start, and in a forked child, which inherits the parent's
        calls (not its own), a lock perhaps held, and no watchdog thread."""
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, psycopg.Connection[Any]]] = {}
        self._fired: set[int] = set()
        self._thread: threading.Thread | None = None

    def arm(self, conn: psycopg.Connection[Any], seconds: float) -> int:
        token = next(self._tokens)
        with self._lock:
            self._armed[token] = (time.monotonic() + seconds, conn)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="ql3-call-watchdog", daemon=True
                )
                self._thread.start()
        return token

    def disarm(self, token: int) -> bool:
        """Stop watching; True when the connection was cut meanwhile."""
        with self._lock:
            self._armed.pop(token, None)
            if token in self._fired:
                self._fired.discard(token)
                return True
            return False

    def _watch(self) -> None:
        while True:
            time.sleep(self._tick)
            now = time.monotonic()
            with self._lock:  # a disarm waits for a cut in progress, never the reverse
                for token, (deadline, conn) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[token]
                        self._fired.add(token)
                        cut(conn)


WATCHDOG = CallWatchdog()
os.register_at_fork(after_in_child=WATCHDOG._reset)


@contextlib.contextmanager
def bounded(conn: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
    """Run a call on ``conn`` within ``seconds``, or raise ``overdue`` (connection cut)."""
    token = WATCHDOG.arm(conn, seconds)
    try:
        yield
    except psycopg.Error:
        if WATCHDOG.disarm(token):
            raise overdue(seconds) from None
        raise
    except Exception as exc:
        if WATCHDOG.disarm(token):
            _discard(conn)
            raise overdue(seconds) from exc
        raise
    except BaseException:
        if WATCHDOG.disarm(token):
            _discard(conn)
        raise
    if WATCHDOG.disarm(token):
        _discard(conn)  # cut just as the call ended: its answer stands, the socket does not


@contextlib.asynccontextmanager
async def bounded_async(seconds: float) -> AsyncIterator[None]:
    """The asyncio twin of ``bounded``: the call is cancelled when it runs past ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise overdue(seconds) from None
