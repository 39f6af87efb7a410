"""Connections to PostgreSQL, with the timeouts that bound every ql3 call, and the one
place where psycopg errors become ql3 errors (upper layers never import psycopg)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from ql3 import arguments, errors, pooler

# SQLSTATEs that mean "not now, try again": the database did not answer (connection
# exceptions, operator intervention such as a shutdown, query canceled by the statement
# timeout, lock timeout, insufficient resources), or it rolled the call back for a
# transient reason (serialization failure, deadlock, statement completion unknown), or
# the connection reached a read-only standby (after a failover, before DNS follows).
_UNAVAILABLE_PREFIXES = ("08", "57", "55P03", "53", "40001", "40P01", "40003", "25006")
# Input PostgreSQL itself rejected before ql3 saw it (bad JSON text, bad uuid, NUL, a
# value of a type that cannot be cast to the parameter's, such as a number for a uuid).
# A ql3 function called with arguments of types it does not take (42883: its schema
# exists, or the state would be 3F000) is the caller's input too.
_BAD_INPUT_STATES = {"22P02", "22P05", "22007", "22008", "22023", "22003", "42846", "42883"}


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Bounds on one database call; admission is bounded only by these (SPEC section 9)."""

    statement_ms: int = 5000
    lock_ms: int = 2000
    connect_s: int = 5
    # How long data sent may go unacknowledged before the kernel drops the connection
    # (libpq's tcp_user_timeout); a silent peer is otherwise noticed by the keepalives.
    tcp_user_timeout_s: float = 30.0
    # How long a store call may go unanswered before it is given up (its outcome unknown,
    # ql3.db_guard); None = the statement timeout plus CALL_MARGIN_S. statement_timeout
    # does not stop a COMMIT waiting for a synchronous standby, nor a backend that has
    # stopped answering while its host still acknowledges packets.
    call_s: float | None = None

    def __post_init__(self) -> None:
        arguments.check_count("statement_ms", self.statement_ms, 0)  # 0: no limit, as in PostgreSQL
        arguments.check_count("lock_ms", self.lock_ms, 0)
        arguments.check_count("connect_s", self.connect_s, 1)  # libpq's 0 would wait for ever
        arguments.check_seconds("tcp_user_timeout_s", self.tcp_user_timeout_s, zero=True)
        if self.call_s is not None:
            arguments.check_seconds("call_s", self.call_s)

    def options(self) -> str:
        return f"-c statement_timeout={self.statement_ms} -c lock_timeout={self.lock_ms}"

    def call_limit(self) -> float:
        return self.call_s if self.call_s is not None else self.statement_ms / 1000 + CALL_MARGIN_S


# What a call gets beyond its statement timeout before it is given up: a COMMIT's flush,
# the round trip, a busy machine.
CALL_MARGIN_S = 5.0


def dsn_from_env(dsn: str | None) -> str:
    """The DSN given, else QL3_DSN; ``Misconfigured`` when neither is set or it is
    malformed."""
    value = dsn or os.environ.get("QL3_DSN")
    if not value:
        raise errors.Misconfigured("QL3_INVALID_ARGUMENT: no database: pass --dsn or set QL3_DSN")
    try:
        parse_conninfo(value)
    except errors.InvalidArgument as exc:
        raise errors.Misconfigured(exc.message) from None
    return value


AnyPool = ConnectionPool | AsyncConnectionPool


def translate(exc: psycopg.Error, pool: AnyPool | None = None) -> errors.Ql3Error:
    """The ql3 error for a psycopg error (custom SQLSTATEs keep their stable code). When
    ``pool`` handed out no connection in time, the message says what it was doing."""
    diag = exc.diag
    message = diag.message_primary or str(exc).strip() or type(exc).__name__
    mapped = errors.from_sqlstate(exc.sqlstate, message, diag.message_detail)
    if mapped is not None:
        return mapped
    state = exc.sqlstate or ""
    if isinstance(exc, PoolTimeout) and pool is not None:
        message = f"{message} ({pool_state(pool)})"
    result = _translate_other(exc, state, message)
    if state:
        result.sqlstate = state  # PostgreSQL's own state, for callers that tell them apart
    return result


def _translate_other(exc: psycopg.Error, state: str, message: str) -> errors.Ql3Error:
    if isinstance(exc, psycopg.OperationalError) and not state:
        if _never_sent(exc, message):
            return errors.NotSent(f"QL3_UNAVAILABLE: nothing was sent: {message}")
        # The connection failed with the call on it (or we cannot tell when): it may have
        # committed (D49).
        return errors.OutcomeUnknown(f"QL3_UNAVAILABLE: the call's outcome is unknown: {message}")
    if (
        isinstance(exc, psycopg.ProgrammingError)
        and not state
        and message.startswith("cannot adapt")
    ):
        # A Python value psycopg has no SQL type for (an object where text or a uuid goes).
        return errors.InvalidArgument(f"QL3_INVALID_ARGUMENT: {message}")
    if isinstance(exc, psycopg.DataError) and not state:
        # Refused by psycopg before sending (a NUL in a text argument): the caller's input,
        # as the SQLite store and the server's own 22xxx states say.
        return errors.InvalidArgument(f"QL3_INVALID_ARGUMENT: {message}")
    if state.startswith(_OUTCOME_UNKNOWN_PREFIXES):
        return errors.OutcomeUnknown(f"{message} (SQLSTATE {state}; the call's outcome is unknown)")
    if state.startswith(_UNAVAILABLE_PREFIXES):
        return errors.Unavailable(f"{message} (SQLSTATE {state})")  # rolled back
    if state == "42501":
        return errors.PermissionDenied(message)
    if state in _BAD_INPUT_STATES:
        return errors.InvalidArgument(f"QL3_INVALID_ARGUMENT: {message}")
    if state in _MISSING_OBJECT_STATES and "ql3" in message:
        return errors.DatabaseError(
            f"{message} (SQLSTATE {state}): is ql3 installed in this database? "
            "Run ql3 migrate (with --with-ai for model invocations)"
        )
    return errors.DatabaseError(f"{message} (SQLSTATE {state or 'none'})")


# A ql3 table or schema that does not exist: the database was never migrated, or not
# with the AI stream.
_MISSING_OBJECT_STATES = {"42P01", "3F000"}

# Transient states in which the server may have ended the session after the call's COMMIT
# (a connection exception, a terminated backend or shut-down server, statement completion
# unknown): OutcomeUnknown. Every other transient state is an error answer to the call, whose
# transaction was rolled back: plain Unavailable (D49).
_OUTCOME_UNKNOWN_PREFIXES = ("08", "57P01", "57P02", "57P04", "57P05", "40003")


def _never_sent(exc: psycopg.Error, message: str) -> bool:
    """Whether a client-side failure happened before any call was sent: no connection from
    the pool in time, or a connection that could not be opened (D49)."""
    if isinstance(exc, PoolTimeout | psycopg.errors.ConnectionTimeout):
        return True
    return message.startswith("connection failed:")


def pool_state(pool: AnyPool) -> str:
    """What a pool that handed out no connection in time was doing, and why its last
    attempt to open one failed (its own attempts only, in the last minute): psycopg_pool's
    timeout says neither, and a full pool and an unreachable server need different fixes."""
    stats = pool.get_stats()
    state = (
        f"pool {pool.name}: {stats['pool_size']} of at most {pool.max_size} connections, "
        f"{stats['pool_available']} idle, {stats.get('requests_waiting', 0)} requests waiting"
    )
    # ql3's connection classes record their failures by conninfo; a pool of the caller's
    # own (another class, or a conninfo callable) is not followed, so nothing is claimed.
    if not isinstance(pool.conninfo, str) or not issubclass(
        pool.connection_class, (pooler.Connection, pooler.AsyncConnection)
    ):
        return f"{state}; ql3 does not follow this pool's connection attempts (a pool of your own)"
    why = pooler.recent_connect_failure(pool.conninfo, 60.0)
    if why is None:
        return f"{state}; no connection attempt failed in the last minute"
    return f"{state}; the last connection attempt failed: {why}"


@contextlib.contextmanager
def translated(pool: AnyPool | None = None) -> Iterator[None]:
    """Re-raises psycopg errors raised in the block as ql3 errors, and the TypeError or
    ValueError of an argument psycopg cannot send (a value JSON cannot hold, text that is
    not valid Unicode) as InvalidArgument. ``pool``: the pool the block takes its
    connection from, named in the error when it hands none out in time."""
    try:
        yield
    except psycopg.Error as exc:
        raise translate(exc, pool) from exc
    except errors.Ql3Error:
        raise
    except (TypeError, ValueError) as exc:
        raise errors.InvalidArgument(
            f"QL3_INVALID_ARGUMENT: an argument cannot be sent: {exc}"
        ) from exc


def parse_conninfo(conninfo: str) -> dict[str, Any]:
    """The conninfo's parameters; a malformed one is InvalidArgument (the caller's input).

    libpq's message quotes the piece it could not parse, which may be a password (an
    invalid percent-encoding in a URL's password, a password without its "="): quoted
    pieces are left out, since the message ends up in logs."""
    try:
        return conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        message = _QUOTED.sub(_hide_quoted, str(exc).strip() or type(exc).__name__)
        raise errors.InvalidArgument(
            f"QL3_INVALID_ARGUMENT: malformed connection string: {message}"
        ) from None


_QUOTED = re.compile(r'"([^"]*)"')


def _hide_quoted(match: re.Match[str]) -> str:
    """A quoted piece of libpq's message, kept only when it is one character ("=")."""
    return match.group(0) if len(match.group(1)) < 2 else '"..."'


def with_options(conninfo: str, options: str) -> str:
    """``options`` after the conninfo's own (or PGOPTIONS'): passing ``options`` to
    psycopg replaces both, which would drop a caller's ``-c role=...`` or search_path."""
    given = parse_conninfo(conninfo).get("options") or os.environ.get("PGOPTIONS")
    return f"{given} {options}" if given else options


# TCP keepalives on ql3's connections (unless the conninfo sets them), so a peer gone
# silently (no FIN, no RST) is noticed by the kernel within about idle + interval * count
# seconds, whatever the host's defaults (often two hours).
KEEPALIVES = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
}


def tcp_settings(conninfo: str, user_timeout_s: float) -> dict[str, str]:
    """The keepalive settings and ``tcp_user_timeout`` (``user_timeout_s``) that the
    conninfo does not make itself: connection keywords to add to it."""
    given = parse_conninfo(conninfo)
    tcp = dict(KEEPALIVES)
    if psycopg.pq.version() >= 120000:  # libpq knows tcp_user_timeout since 12
        tcp["tcp_user_timeout"] = str(round(user_timeout_s * 1000))
    return {name: value for name, value in tcp.items() if name not in given}


def connect(
    conninfo: str, *, timeouts: Timeouts | None = None, autocommit: bool = False
) -> psycopg.Connection[tuple[object, ...]]:
    """One connection with ql3's timeouts and TCP keepalives set at startup (or, behind a
    transaction pooler, per transaction: ql3.pooler), preparing no statements."""
    t = timeouts or Timeouts()
    options = with_options(conninfo, t.options())
    with translated():
        return pooler.Connection.connect(
            make_conninfo(conninfo, **tcp_settings(conninfo, t.tcp_user_timeout_s)),
            autocommit=autocommit,
            connect_timeout=t.connect_s,
            options=options,
            prepare_threshold=pooler.prepare_threshold(),
        )


# Outbox writes on ql3's own connections skip the in-transaction NOTIFY; the caller wakes
# the relays after COMMIT with ql3.wake_relays() (D17, PgStore._outbox_write).
DEFERRED_NOTIFY_OPTION = "-c ql3.outbox_notify=deferred"


def _pool_args(
    conninfo: str, timeouts: Timeouts | None, min_size: int, max_size: int
) -> dict[str, Any]:
    """The arguments of ql3's pools, sync and asyncio alike. Connections are autocommit
    (every ql3 call is one statement calling one SQL function, its own transaction: one
    round trip instead of BEGIN, the call and COMMIT, D20), carry ql3's timeouts after the
    caller's options, defer outbox NOTIFYs (D17) and have TCP keepalives and
    tcp_user_timeout unless the conninfo sets its own. They prepare no statements and,
    where the server did not apply their startup options (a transaction pooler), carry
    them into each transaction (ql3.pooler). A malformed conninfo is InvalidArgument here,
    before any pool exists."""
    t = timeouts or Timeouts()
    return {
        "min_size": min_size,
        "max_size": max_size,
        "timeout": float(t.connect_s),
        "kwargs": {
            "autocommit": True,
            "prepare_threshold": pooler.prepare_threshold(),
            "connect_timeout": t.connect_s,
            "options": with_options(conninfo, f"{t.options()} {DEFERRED_NOTIFY_OPTION}"),
            **tcp_settings(conninfo, t.tcp_user_timeout_s),
        },
    }


def make_pool(
    conninfo: str, *, timeouts: Timeouts | None = None, min_size: int = 1, max_size: int = 8
) -> ConnectionPool:
    """ql3's connection pool (``_pool_args``), open."""
    return ConnectionPool(
        conninfo,
        connection_class=pooler.Connection,
        open=True,
        **_pool_args(conninfo, timeouts, min_size, max_size),
    )


def make_async_pool(
    conninfo: str, *, timeouts: Timeouts | None = None, min_size: int = 1, max_size: int = 8
) -> AsyncConnectionPool:
    """The asyncio twin of ``make_pool``, not opened yet (``await pool.open()`` in a loop)."""
    return AsyncConnectionPool(
        conninfo,
        connection_class=pooler.AsyncConnection,
        open=False,
        **_pool_args(conninfo, timeouts, min_size, max_size),
    )
