"""ql3's connections behind a transaction pooler such as PgBouncer in transaction mode (D54).

A pooler that lends each transaction to whichever server connection is free breaks two
things a direct connection keeps:

- **Prepared statements.** psycopg prepares a statement it has run a few times, under a
  name local to its connection (``_pg3_0``, ...). Behind the pooler that name lives on a
  server connection other clients share: one client's name then runs another client's
  statement with its own parameters (``add_step_run`` executed as ``create_run``). ql3's
  connections prepare nothing unless ``QL3_PREPARED_STATEMENTS=on``, which is for direct
  connections only (``make bench`` measures what it buys).
- **Startup options.** ql3's statement and lock timeouts and ``ql3.outbox_notify`` travel
  in the startup packet's ``options``. PgBouncer refuses that parameter (its default) or
  drops it (``ignore_startup_parameters``); either way no server connection applies it.
  So a ql3 connection sends a marker setting with its options and reads it back at
  connect. When the server did not apply the options, or refused them, the connection
  carries them into each call instead (``execute``, ``execute_async``): the settings
  (``set_config(name, value, true)``, SET LOCAL) and the call go as one simple-protocol
  Query message, its parameters bound client-side. PostgreSQL runs the statements of one
  Query as one transaction and starts the statement timeout afresh for each, so the call
  runs under the settings; the pooler sees one message and one ReadyForQuery, and no
  round trip is added.
- **Pipelines.** Not a pipeline for that (D64): psycopg ends a pipeline with a Sync and
  then a Flush. When the Flush reaches PgBouncer after the server's ReadyForQuery has
  released the server connection, PgBouncer lends the client a server connection for it,
  and as nothing answers a Flush, that server connection stays with the client, idle or
  not, until the client's next transaction ends. A few idle clients then hold the whole
  server pool and every other client waits.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any, cast

import psycopg
from psycopg.rows import Row

from ql3 import errors

_log = logging.getLogger("ql3.db")

PREPARED_STATEMENTS_VAR = "QL3_PREPARED_STATEMENTS"
# psycopg's own default: a statement is prepared the fifth time it runs on a connection.
_PSYCOPG_PREPARE_THRESHOLD = 5

MARKER_NAME = "ql3.startup_options"
MARKER_OPTION = f"-c {MARKER_NAME}=applied"
_CHECK_SQL = f"SELECT current_setting('{MARKER_NAME}', true)"

# Why a connection carries its settings per transaction, logged once per reason.
_warned: set[str] = set()


def prepare_threshold(environ: Mapping[str, str] | None = None) -> int | None:
    """psycopg's ``prepare_threshold`` for ql3's connections: None (never prepare) unless
    ``QL3_PREPARED_STATEMENTS`` is on. Anything but on/off is ``Misconfigured``."""
    value = (os.environ if environ is None else environ).get(PREPARED_STATEMENTS_VAR, "off")
    word = value.strip().lower()
    if word in ("off", "0", "false", "no", ""):
        return None
    if word in ("on", "1", "true", "yes"):
        return _PSYCOPG_PREPARE_THRESHOLD
    raise errors.Misconfigured(
        f"QL3_INVALID_ARGUMENT: {PREPARED_STATEMENTS_VAR} must be on or off, not {value!r}"
    )


def option_settings(options: str) -> list[tuple[str, str]]:
    """The ``-c name=value`` and ``--name=value`` settings of a libpq ``options`` string,
    split as the server splits it (whitespace separates, a backslash keeps the next
    character); anything else in it (a bare switch) is refused, since it could not be
    carried into a transaction."""
    words: list[str] = []
    word: list[str] = []
    chars = iter(options)
    for ch in chars:
        if ch == "\\":
            word.append(next(chars, ""))
        elif ch.isspace():
            if word:
                words.append("".join(word))
                word = []
        else:
            word.append(ch)
    if word:
        words.append("".join(word))
    settings: list[tuple[str, str]] = []
    pending_c = False
    for w in words:
        if pending_c:
            setting, pending_c = w, False
        elif w == "-c":
            pending_c = True
            continue
        elif w.startswith("--") or w.startswith("-c"):
            setting = w[2:]
        else:
            raise errors.Misconfigured(
                f"QL3_INVALID_ARGUMENT: connection option {w!r} cannot be set per transaction"
            )
        name, sep, value = setting.partition("=")
        if not sep or not _NAME.fullmatch(name):
            raise errors.Misconfigured(
                f"QL3_INVALID_ARGUMENT: connection option {w!r} is not name=value"
            )
        settings.append((name.replace("-", "_"), value))
    return settings


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def local_settings_sql(options: str) -> str | None:
    """One statement that applies ``options``' settings to the current transaction only
    (None when there are none besides the marker)."""
    calls = [
        f"set_config({_literal(name)}, {_literal(value)}, true)"
        for name, value in option_settings(options)
        if name != MARKER_NAME
    ]
    return f"SELECT {', '.join(calls)}" if calls else None


def _refused_options(exc: psycopg.OperationalError) -> bool:
    """The server (a pooler) refused the ``options`` startup parameter itself."""
    text = str(exc)
    return "unsupported startup parameter" in text and "options" in text


def _adopt(options: str, reason: str) -> str | None:
    sql = local_settings_sql(options)
    if reason not in _warned:
        _warned.add(reason)
        _log.warning(
            "ql3 connection settings are set per transaction: %s (a transaction pooler "
            "such as PgBouncer?); see the README's PgBouncer section",
            reason,
        )
    return sql


_NOT_APPLIED = "the server did not apply the startup options"
_REFUSED = "the server refused the options startup parameter"


# Each conninfo's last failure to open a ql3 connection (monotonic time, message). A pool
# retries in the background and its timeout says only that no connection came, so ql3.db
# adds the reason: that pool's own, never another conninfo's (a process has several pools,
# and a refused connection elsewhere says nothing about this one). The newest few are kept.
_FAILURES_KEPT = 64
_failures: dict[str, tuple[float, str]] = {}
_failures_lock = threading.Lock()


def _record_failure(conninfo: str, exc: BaseException) -> None:
    with _failures_lock:
        _failures.pop(conninfo, None)
        _failures[conninfo] = (time.monotonic(), str(exc).strip() or type(exc).__name__)
        while len(_failures) > _FAILURES_KEPT:
            del _failures[next(iter(_failures))]


def _record_success(conninfo: str) -> None:
    """The conninfo's last attempt worked: no failure of it is its last any more."""
    if conninfo in _failures:  # a read without the lock: the common case pays nothing
        with _failures_lock:
            _failures.pop(conninfo, None)


def recent_connect_failure(conninfo: str, within: float) -> str | None:
    """Why the last attempt to open a ql3 connection with ``conninfo`` failed, if it failed
    in the last ``within`` s."""
    with _failures_lock:
        failure = _failures.get(conninfo)
    if failure is None or time.monotonic() - failure[0] > within:
        return None
    return failure[1]


class Connection(psycopg.Connection[Row]):
    """A psycopg connection that checks its startup options took effect (module doc)."""

    # None: the server applied the options (or there were none); otherwise the statement
    # that applies them to one transaction.
    local_settings: str | None = None

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Connection[Any]:
        try:
            conn = cls._connect_checked(conninfo, kwargs)
        except psycopg.OperationalError as exc:
            _record_failure(conninfo, exc)
            raise
        _record_success(conninfo)
        return conn

    @classmethod
    def _connect_checked(cls, conninfo: str, kwargs: dict[str, Any]) -> Connection[Any]:
        options = kwargs.get("options")
        if not options:
            return super().connect(conninfo, **kwargs)
        try:
            conn = super().connect(conninfo, **{**kwargs, "options": f"{options} {MARKER_OPTION}"})
        except psycopg.OperationalError as exc:
            if not _refused_options(exc):
                raise
            kwargs = {k: v for k, v in kwargs.items() if k != "options"}
            conn = super().connect(conninfo, **kwargs)
            conn.local_settings = _adopt(options, _REFUSED)
            return conn
        try:
            row = cast(tuple[Any, ...] | None, conn.execute(_CHECK_SQL).fetchone())
            if not conn.autocommit:
                conn.rollback()
        except BaseException:
            conn.close()
            raise
        if row is None or row[0] != "applied":
            conn.local_settings = _adopt(options, _NOT_APPLIED)
        return conn


class AsyncConnection(psycopg.AsyncConnection[Row]):
    """The asyncio twin of ``Connection``."""

    local_settings: str | None = None

    @classmethod
    async def connect(cls, conninfo: str = "", **kwargs: Any) -> AsyncConnection[Any]:
        try:
            conn = await cls._connect_checked(conninfo, kwargs)
        except psycopg.OperationalError as exc:
            _record_failure(conninfo, exc)
            raise
        _record_success(conninfo)
        return conn

    @classmethod
    async def _connect_checked(cls, conninfo: str, kwargs: dict[str, Any]) -> AsyncConnection[Any]:
        options = kwargs.get("options")
        if not options:
            return await super().connect(conninfo, **kwargs)
        try:
            conn = await super().connect(
                conninfo, **{**kwargs, "options": f"{options} {MARKER_OPTION}"}
            )
        except psycopg.OperationalError as exc:
            if not _refused_options(exc):
                raise
            kwargs = {k: v for k, v in kwargs.items() if k != "options"}
            conn = await super().connect(conninfo, **kwargs)
            conn.local_settings = _adopt(options, _REFUSED)
            return conn
        try:
            cur = await conn.execute(_CHECK_SQL)
            row = cast(tuple[Any, ...] | None, await cur.fetchone())
            if not conn.autocommit:
                await conn.rollback()
        except BaseException:
            await conn.close()
            raise
        if row is None or row[0] != "applied":
            conn.local_settings = _adopt(options, _NOT_APPLIED)
        return conn


def local_settings(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str | None:
    """The statement each transaction on ``conn`` must begin with, or None: on a
    connection that is not ql3's (a pool passed in), or not autocommit, nothing is added."""
    if not conn.autocommit:
        return None
    return getattr(conn, "local_settings", None)


def _one_message(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], sql: str, params: Any
) -> str | None:
    """The settings and the call as one Query message on a connection that carries its
    settings per transaction (module doc); None on any other."""
    settings = local_settings(conn)
    if settings is None:
        return None
    if isinstance(conn, psycopg.AsyncConnection):
        call = psycopg.AsyncClientCursor(conn).mogrify(sql, params)
    else:
        call = psycopg.ClientCursor(conn).mogrify(sql, params)
    return f"{settings}; {call}"


def execute(
    conn: psycopg.Connection[Any], cur: psycopg.Cursor[Any], sql: str, params: Any = ()
) -> None:
    """``cur.execute(sql, params)``; on a connection that carries its settings per
    transaction, the settings and the call in one Query message, the cursor on the call's
    result."""
    message = _one_message(conn, sql, params)
    if message is None:
        cur.execute(sql, params)
        return
    cur.execute(message)
    cur.nextset()


async def execute_async(
    conn: psycopg.AsyncConnection[Any], cur: psycopg.AsyncCursor[Any], sql: str, params: Any = ()
) -> None:
    """The asyncio twin of ``execute``."""
    message = _one_message(conn, sql, params)
    if message is None:
        await cur.execute(sql, params)
        return
    await cur.execute(message)
    cur.nextset()
