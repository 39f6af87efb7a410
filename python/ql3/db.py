"""Connections to PostgreSQL, with the timeouts that bound every ql3 call, and the one
place where psycopg errors become ql3 errors (upper layers never import psycopg)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from ql3 import errors

# SQLSTATE classes that mean "the database did not answer": connection exceptions,
# operator intervention (shutdown), query canceled (statement timeout), lock timeout.
_UNAVAILABLE_PREFIXES = ("08", "57", "55P03", "53")
# Input PostgreSQL itself rejected before ql3 saw it (bad JSON text, bad uuid, NUL).
_BAD_INPUT_STATES = {"22P02", "22P05", "22007", "22008", "22023", "22003"}


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Bounds on one database call; admission is bounded only by these (SPEC section 9)."""

    statement_ms: int = 5000
    lock_ms: int = 2000
    connect_s: int = 5

    def options(self) -> str:
        return f"-c statement_timeout={self.statement_ms} -c lock_timeout={self.lock_ms}"


def dsn_from_env(dsn: str | None) -> str:
    """The DSN given, else QL3_DSN; raises InvalidArgument when neither is set."""
    value = dsn or os.environ.get("QL3_DSN")
    if not value:
        raise errors.InvalidArgument("no database: pass --dsn or set QL3_DSN")
    return value


def translate(exc: psycopg.Error) -> errors.Ql3Error:
    """The ql3 error for a psycopg error (custom SQLSTATEs keep their stable code)."""
    diag = exc.diag
    message = diag.message_primary or str(exc).strip() or type(exc).__name__
    mapped = errors.from_sqlstate(exc.sqlstate, message, diag.message_detail)
    if mapped is not None:
        return mapped
    state = exc.sqlstate or ""
    if isinstance(exc, psycopg.OperationalError) and not state:
        return errors.Unavailable(message)
    if state.startswith(_UNAVAILABLE_PREFIXES):
        return errors.Unavailable(f"{message} (SQLSTATE {state})")
    if state == "42501":
        return errors.PermissionDenied(message)
    if state in _BAD_INPUT_STATES:
        return errors.InvalidArgument(f"QL3_INVALID_ARGUMENT: {message}")
    return errors.DatabaseError(f"{message} (SQLSTATE {state or 'none'})")


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Re-raises psycopg errors raised in the block as ql3 errors."""
    try:
        yield
    except psycopg.Error as exc:
        raise translate(exc) from exc


def with_options(conninfo: str, options: str) -> str:
    """``options`` after the conninfo's own (or PGOPTIONS'): passing ``options`` to
    psycopg replaces both, which would drop a caller's ``-c role=...`` or search_path."""
    given = conninfo_to_dict(conninfo).get("options") or os.environ.get("PGOPTIONS")
    return f"{given} {options}" if given else options


def connect(
    conninfo: str, *, timeouts: Timeouts | None = None, autocommit: bool = False
) -> psycopg.Connection[tuple[object, ...]]:
    """One connection with ql3's timeouts set at startup."""
    t = timeouts or Timeouts()
    with translated():
        return psycopg.connect(
            conninfo,
            autocommit=autocommit,
            connect_timeout=t.connect_s,
            options=with_options(conninfo, t.options()),
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
    caller's options, and defer outbox NOTIFYs (D17)."""
    t = timeouts or Timeouts()
    return {
        "min_size": min_size,
        "max_size": max_size,
        "timeout": float(t.connect_s),
        "kwargs": {
            "autocommit": True,
            "connect_timeout": t.connect_s,
            "options": with_options(conninfo, f"{t.options()} {DEFERRED_NOTIFY_OPTION}"),
        },
    }


def make_pool(
    conninfo: str, *, timeouts: Timeouts | None = None, min_size: int = 1, max_size: int = 8
) -> ConnectionPool:
    """ql3's connection pool (``_pool_args``), open."""
    return ConnectionPool(conninfo, open=True, **_pool_args(conninfo, timeouts, min_size, max_size))


def make_async_pool(
    conninfo: str, *, timeouts: Timeouts | None = None, min_size: int = 1, max_size: int = 8
) -> AsyncConnectionPool:
    """The asyncio twin of ``make_pool``, not opened yet (``await pool.open()`` in a loop)."""
    return AsyncConnectionPool(
        conninfo, open=False, **_pool_args(conninfo, timeouts, min_size, max_size)
    )
