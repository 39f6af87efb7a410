"""The SQLite side of the edge shim: connections, transactions, errors, value spellings.

Why it is built this way:

- **One procedure, one ``BEGIN IMMEDIATE`` transaction.** The write lock is taken before
  the first read, so everything a procedure reads is what it writes against (the role
  PostgreSQL's ``FOR UPDATE`` on the step row plays); concurrent writers, in this process
  or another, wait up to the busy timeout and then fail with ``Unavailable``. The clock is
  read once, after the lock: it is the transaction's ``now()``.
- **Crash points.** A test hook, called by name at every statement boundary inside a
  procedure and once after COMMIT, lets a child process SIGKILL itself exactly there.
- **The same errors.** Procedures raise ``ql3.errors`` classes with the message prefixes
  of the SQL functions; trigger refusals carry the stable name in their message
  (``RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: ...')``) and are mapped back by it.
- **The same values.** uuids are lowercase hyphenated TEXT, timestamps are TEXT in the
  record spelling (fixed width, so text order is time order), JSON is canonical TEXT.
  Rows come back as dicts shaped like ``PgStore``'s: datetimes, parsed JSON, booleans.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Final, Literal

from ql3 import errors
from ql3.invocations import format_timestamp

Row = dict[str, Any]
JournalMode = Literal["wal", "delete"]
Clock = Callable[[], datetime]
CrashHook = Callable[[str], None]

MIN_SQLITE: Final = (3, 37, 0)
"""STRICT tables (3.37) and RETURNING (3.35)."""

TIMESTAMP_FORMAT: Final = "%Y-%m-%dT%H:%M:%S.%fZ"
TIMESTAMP_COLUMNS: Final = frozenset(
    {
        "created_at",
        "updated_at",
        "revoked_at",
        "delivered_at",
        "admitted_at",
        "completed_at",
        "resolved_at",
        "recorded_at",
        "deadline_at",
        "applied_at",
    }
)
JSON_COLUMNS: Final = frozenset({"body", "record", "payload"})
BOOLEAN_COLUMNS: Final = frozenset({"recovered"})

_SYNCHRONOUS: Final = {"wal": "FULL", "delete": "EXTRA"}


def utc_text(moment: datetime) -> str:
    """The record spelling of an aware datetime (``2026-12-02T12:00:00.000000Z``)."""
    return format_timestamp(moment)


def parse_utc(text: str) -> datetime:
    """The aware UTC datetime of a stored timestamp."""
    return datetime.strptime(text, TIMESTAMP_FORMAT).replace(tzinfo=UTC)


def system_clock() -> datetime:
    return datetime.now(UTC)


def new_uuid() -> str:
    return str(uuid.uuid4())


def uuid_v7() -> str:
    """``ql3._uuid_v7()``: Unix milliseconds, version 7, variant 10, random bits (RFC 9562)."""
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    value = value & ~(0xF << 76) | 0x7 << 76
    value = value & ~(0x3 << 62) | 0x2 << 62
    return str(uuid.UUID(int=value))


_PG_UUID: Final = re.compile(r"(\{)?[0-9a-fA-F]{4}(?:-?[0-9a-fA-F]{4}){7}(?(1)\})")
"""What PostgreSQL's uuid input takes: 32 hex digits, either case, a hyphen allowed after
any group of four but the last, optionally in braces; no spaces, no ``urn:uuid:``."""


def parse_uuid(value: object) -> str | None:
    """The canonical spelling of a uuid argument (None stays None).

    PostgreSQL casts these arguments (``%s::uuid``) before a function runs, so a malformed
    one is refused first and as bad input, which ``ql3.db.translate`` makes
    ``QL3_INVALID_ARGUMENT``; this mirrors that.
    """
    if value is None:
        return None
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, str) and _PG_UUID.fullmatch(value):
        return str(uuid.UUID(value))
    raise errors.InvalidArgument(
        f'QL3_INVALID_ARGUMENT: invalid input syntax for type uuid: "{str(value)[:64]}"'
    )


def plain(row: sqlite3.Row | None) -> Row | None:
    """A stored row as ``PgStore`` returns it: datetimes, parsed JSON and booleans."""
    if row is None:
        return None
    out: Row = {}
    for key, value in zip(row.keys(), tuple(row), strict=True):
        if value is not None:
            if key in TIMESTAMP_COLUMNS:
                value = parse_utc(value)
            elif key in JSON_COLUMNS:
                value = json.loads(value)
            elif key in BOOLEAN_COLUMNS:
                value = bool(value)
        out[key] = value
    return out


def translate(exc: sqlite3.Error) -> errors.Ql3Error:
    """The ql3 error for an SQLite error: trigger refusals keep their stable code."""
    message = str(exc)
    code = message.split(":", 1)[0]
    cls = errors.BY_CODE.get(code)
    if cls is not None:
        return cls(message)
    if isinstance(exc, sqlite3.OperationalError) and (
        "locked" in message or "busy" in message or "unable to open" in message
    ):
        return errors.Unavailable(f"QL3_UNAVAILABLE: {message}")
    name = getattr(exc, "sqlite_errorname", type(exc).__name__)
    return errors.DatabaseError(f"{message} (SQLite {name})")


def not_unicode(exc: UnicodeEncodeError) -> errors.InvalidArgument:
    """Text SQLite cannot store (a lone surrogate): the caller's input, as on PostgreSQL."""
    return errors.InvalidArgument(f"QL3_INVALID_ARGUMENT: an argument cannot be sent: {exc}")


def open_connection(
    path: str, journal_mode: JournalMode, busy_timeout_ms: int
) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit) with ql3's pragmas."""
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        raise errors.DatabaseError(
            f"ql3.edge needs SQLite {'.'.join(map(str, MIN_SQLITE))} or newer, "
            f"this Python has {sqlite3.sqlite_version}"
        )
    if journal_mode not in _SYNCHRONOUS:
        raise errors.InvalidArgument(
            f"QL3_INVALID_ARGUMENT: journal_mode must be wal or delete, not {journal_mode!r}"
        )
    try:
        conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_ms / 1000
        )
    except sqlite3.Error as exc:
        raise translate(exc) from exc
    try:
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        mode = _set_journal_mode(conn, journal_mode, busy_timeout_ms / 1000)
        if str(mode).lower() != journal_mode:
            raise errors.DatabaseError(
                f"could not put {path} in journal_mode {journal_mode} (it stays {mode})"
            )
        # WAL + FULL is durable on power loss; DELETE needs EXTRA for that (SPEC section 10).
        conn.execute(f"PRAGMA synchronous = {_SYNCHRONOUS[journal_mode]}")
        conn.execute("PRAGMA foreign_keys = ON")
    except sqlite3.Error as exc:
        conn.close()
        raise translate(exc) from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _set_journal_mode(conn: sqlite3.Connection, journal_mode: str, timeout: float) -> str:
    """The file's journal mode after asking for ``journal_mode``.

    Reading the mode takes no lock, so a file already in it (every open but the first)
    changes nothing. Changing it does, and SQLite answers "busy" at once instead of
    waiting the busy timeout (two processes opening a new file together): retried until
    the busy timeout has passed.
    """
    mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0])
    if mode.lower() == journal_mode:
        return mode
    deadline = time.monotonic() + timeout
    while True:
        try:
            return str(conn.execute(f"PRAGMA journal_mode = {journal_mode.upper()}").fetchone()[0])
        except sqlite3.OperationalError as exc:
            busy = "locked" in str(exc) or "busy" in str(exc)
            if not busy or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class Tx:
    """One procedure's transaction: statements, its clock reading and its crash points."""

    def __init__(
        self, conn: sqlite3.Connection, procedure: str, now: datetime, hook: CrashHook | None
    ) -> None:
        self.conn = conn
        self.procedure = procedure
        self.now = now
        self.now_text = utc_text(now)
        self.outbox_rows = 0
        self._hook = hook

    def point(self, name: str) -> None:
        """A statement boundary: the crash hook, when one is installed, may end us here."""
        if self._hook is not None:
            self._hook(f"{self.procedure}:{name}")

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        rows: list[sqlite3.Row] = self.conn.execute(sql, params).fetchall()
        return rows

    def one(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        rows = self.all(sql, params)
        return rows[0] if rows else None

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self.conn.execute(sql, params).rowcount


class Database:
    """One SQLite connection shared by a store's threads, one transaction at a time."""

    def __init__(
        self,
        path: str,
        *,
        journal_mode: JournalMode,
        busy_timeout_ms: int,
        clock: Clock | None,
    ) -> None:
        self.path = path
        self.journal_mode = journal_mode
        self.conn = open_connection(path, journal_mode, busy_timeout_ms)
        self.clock: Clock = clock or system_clock
        self.crash_point: CrashHook | None = None
        self.lock = threading.RLock()
        self.busy_timeout = busy_timeout_ms / 1000
        self._outbox_listeners: list[Callable[[], None]] = []

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    def now(self) -> datetime:
        moment = self.clock()
        if moment.tzinfo is None or moment.utcoffset() is None:
            raise errors.InvalidArgument("QL3_INVALID_ARGUMENT: the store clock must be aware")
        return moment.astimezone(UTC)

    def on_outbox_commit(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` after every COMMIT that wrote outbox rows (NOTIFY's twin)."""
        self._outbox_listeners.append(listener)

        def remove() -> None:
            if listener in self._outbox_listeners:
                self._outbox_listeners.remove(listener)

        return remove

    @contextmanager
    def locked(self) -> Iterator[None]:
        """This store's lock, waited for at most the busy timeout: a thread queued behind
        another that waits on a busy file must not wait longer than the file would make
        it (``Unavailable``, as a busy file is)."""
        if not self.lock.acquire(timeout=self.busy_timeout):
            raise errors.Unavailable(
                f"QL3_UNAVAILABLE: {self.path} is in use by this process's other threads "
                f"for longer than the busy timeout ({self.busy_timeout:g} s)"
            )
        try:
            yield
        finally:
            self.lock.release()

    @contextmanager
    def write(self, procedure: str) -> Iterator[Tx]:
        """``BEGIN IMMEDIATE`` ... COMMIT, rolled back whole on any exception."""
        with self.locked():
            conn = self.conn
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise translate(exc) from exc
            try:
                tx = Tx(conn, procedure, self.now(), self.crash_point)
                tx.point("after_begin")
                yield tx
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                _rollback(conn)
                raise translate(exc) from exc
            except UnicodeEncodeError as exc:
                _rollback(conn)
                raise not_unicode(exc) from exc
            except BaseException:
                _rollback(conn)
                raise
            if self.crash_point is not None:
                self.crash_point(f"{procedure}:after_commit")
            if tx.outbox_rows:
                for listener in list(self._outbox_listeners):
                    listener()

    @contextmanager
    def read(self) -> Iterator[Tx]:
        """A read transaction: one snapshot for several statements."""
        with self.locked():
            conn = self.conn
            try:
                conn.execute("BEGIN")
                yield Tx(conn, "read", self.now(), None)
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                _rollback(conn)
                raise translate(exc) from exc
            except UnicodeEncodeError as exc:
                _rollback(conn)
                raise not_unicode(exc) from exc
            except BaseException:
                _rollback(conn)
                raise


def _rollback(conn: sqlite3.Connection) -> None:
    # The error that brought us here is the one to report, not a failed rollback.
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
