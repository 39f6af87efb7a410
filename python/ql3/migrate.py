"""Forward-only, checksummed migrations for the two ql3 streams, ``core`` and ``ql3_ai``.

Why the runner is built this way:

- **Two independent streams** (River's migration *lines*). ``core`` owns schema ``ql3`` and
  its ledger ``ql3.schema_history``; ``ql3_ai`` owns schema ``ql3_ai`` and its own ledger
  ``ql3_ai.feature_history``. The AI feature can be installed later, or never, without
  touching the core ledger: with it off nothing of ``ql3_ai`` exists. The streams may
  advance interleaved across restarts; an AI file names the core version it builds on in a
  ``-- requires: core NNNN`` header, checked before anything is applied.
- **Forward-only and checksummed** (Graphile Worker). A released file is never edited, so a
  changed checksum, a ledger version without a file (a database ahead of the code), a bad
  file name or a gap in the numbering is refused before any migration runs.
- **One transaction per migration, under one advisory lock shared by both streams.** The
  ledger is re-read under the lock and its row is inserted *before* the file runs, so
  migrators started together (replicas booting at once) apply each version exactly once,
  and a runner that forgot the lock still collides on the ledger's primary key. A failing
  file rolls back whole, ledger row included.
- **The wait for that lock is bounded** (``lock_timeout``, 60 s by default): any login
  may take an advisory lock, so a forgotten ``psql`` session holding it would otherwise
  hang a deploy in silence. When the time is up the error names the lock and the session
  holding it (pid, user, application), from ``pg_locks``.
- **Files run as ``ql3_owner``** (``SET LOCAL ROLE``) with the stream's schema first on the
  search path: every object is owned by the owner role whatever login ran the migration,
  and unqualified names land in the stream's schema, never in ``public``.
- **The group roles of SPEC section 5 are created first**, idempotently and outside the
  ledgers, because roles belong to the cluster while ledgers belong to one database.
- **Readiness is an exact comparison**: the tables a stream's schema holds against the
  tables its applied migration files create (see :func:`expected_tables`), plus "nothing
  pending" and "ledger agrees with the files".

The SQL is package data: ``ql3/_sql`` in a wheel, the repository's ``sql/`` otherwise. What
needs no database (files, streams, ledger checks, expected tables) is
``ql3.migration_files``, re-exported here; the SQLite edge shim uses it without psycopg.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import psycopg
from psycopg import sql

from ql3.arguments import check_seconds
from ql3.db import parse_conninfo
from ql3.errors import InvalidArgument, MigrationError, Ql3Error, Unavailable
from ql3.migration_files import (
    AI,
    AI_STREAM,
    CORE,
    CORE_STREAM,
    MIGRATION_FILE_NAME,
    OWNED_TABLES,
    REQUIRES_HEADER,
    STREAMS,
    Applied,
    LedgerRow,
    Migration,
    ReadyReport,
    Stream,
    StreamStatus,
    TableDdl,
    executed_sql,
    expected_tables,
    identifier,
    ledger_problems,
    load_migrations,
    load_stream,
    migration_file_name,
    read_migration,
    refuse_ledger_problems,
    refuse_numbering_gaps,
    refuse_unknown_core_requirement,
    required_core_version,
    split_name,
    table_ddl,
)
from ql3.pooler import prepare_threshold
from ql3.safe_text import command_secrets, error_text, escape_controls

Connection: TypeAlias = "psycopg.Connection[tuple[Any, ...]]"


#: The advisory lock every ql3 migration transaction holds: the ASCII bytes of "ql3_migr".
MIGRATION_LOCK_KEY = int.from_bytes(b"ql3_migr", "big")
#: How long one migration transaction waits for that lock by default (``--lock-timeout``,
#: ``QL3_MIGRATE_LOCK_TIMEOUT``), and at most (a day: longer is a typo, not a plan).
DEFAULT_LOCK_TIMEOUT_SECONDS = 60.0
MAX_LOCK_TIMEOUT_SECONDS = 86400.0

OWNER_ROLE = "ql3_owner"
GROUP_ROLES = ("ql3_owner", "ql3_runtime", "ql3_relay", "ql3_operator", "ql3_reader")


CREATE_GROUP_ROLES_SQL = """
DO $roles$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY
        ARRAY['ql3_owner', 'ql3_runtime', 'ql3_relay', 'ql3_operator', 'ql3_reader']
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- a concurrent migrator created it first
            END;
        END IF;
    END LOOP;
    -- SET ROLE ql3_owner needs membership; a superuser is a member of every role already.
    IF NOT pg_catalog.pg_has_role(current_user, 'ql3_owner', 'MEMBER') THEN
        BEGIN
            EXECUTE format('GRANT ql3_owner TO %I', current_user);
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$roles$;
"""


# --------------------------------------------------------------------------- files, ledger
# The files, streams and ledger checks are ql3.migration_files (no driver needed there).


def default_sql_root() -> Path:
    """``ql3/_sql`` when installed from a wheel, else the repository's ``sql/``."""
    packaged = Path(__file__).resolve().parent / "_sql"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "sql"


def read_ledger(conn: Connection, stream: Stream) -> dict[int, LedgerRow] | None:
    """The stream's ledger rows by version, or None when the stream is not installed."""
    if not ledger_exists(conn, stream):
        return None
    rows = conn.execute(stream.select_ledger_sql).fetchall()
    return {version: LedgerRow(version, name, checksum) for version, name, checksum in rows}


def ledger_exists(conn: Connection, stream: Stream) -> bool:
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", [f"{stream.schema}.{stream.ledger}"]
    ).fetchone()
    return bool(row and row[0])


def applied_version(conn: Connection, stream: Stream) -> int:
    return max(read_ledger(conn, stream) or {}, default=0)


# --------------------------------------------------------------------------- migrate


def migrate(
    conninfo: str,
    *,
    with_ai: bool = False,
    targets: Mapping[str, int] | None = None,
    sql_root: Path | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_SECONDS,
) -> list[Applied]:
    """Apply pending migrations, core first, then ql3_ai when ``with_ai``.

    ``targets`` caps streams by version (``{"core": 3}``); a stream it does not name goes
    to its newest file. Naming ``ql3_ai`` there requires ``with_ai=True``. Each wait for
    the migration lock lasts at most ``lock_timeout`` seconds (``Unavailable`` naming the
    holder after that). Returns what this call applied, in order: an empty list when the
    database was up to date.
    """
    check_lock_timeout(lock_timeout)
    streams = [CORE, AI] if with_ai else [CORE]
    migrations = load_migrations(sql_root or default_sql_root(), streams)
    limits = resolve_targets(migrations, targets or {})
    applied: list[Applied] = []
    with connect(conninfo) as conn:
        create_group_roles(conn)
        prepare_streams(conn, migrations, limits, lock_timeout=lock_timeout)
        for stream in streams:
            for migration in migrations[stream][: limits[stream]]:
                if apply_migration(conn, migration, migrations[stream], lock_timeout=lock_timeout):
                    applied.append(Applied(stream, migration.version, migration.name))
    return applied


def check_lock_timeout(seconds: object, name: str = "lock_timeout") -> float:
    """A lock timeout: seconds above 0 and at most ``MAX_LOCK_TIMEOUT_SECONDS`` (0 would
    be PostgreSQL's "no limit", the silent hang this bound is for); ``name`` is what the
    error calls the setting."""
    return check_seconds(name, seconds, most=MAX_LOCK_TIMEOUT_SECONDS)


def resolve_targets(
    migrations: Mapping[str, Sequence[Migration]], targets: Mapping[str, int]
) -> dict[str, int]:
    """How many files of each selected stream this call may apply."""
    limits = {stream: len(files) for stream, files in migrations.items()}
    for stream, target in targets.items():
        if stream not in STREAMS:
            raise MigrationError(f"unknown migration stream {stream!r}: expected core or ql3_ai")
        if stream not in limits:
            raise MigrationError(f"target names stream {stream!r} but with_ai is off")
        if not 0 <= target <= limits[stream]:
            raise MigrationError(
                f"{stream} has no version {target}: its migrations are 1..{limits[stream]}"
            )
        limits[stream] = target
    return limits


@contextmanager
def connect(conninfo: str) -> Iterator[Connection]:
    """An autocommit connection whose database errors surface as ql3 errors (a malformed
    conninfo is InvalidArgument)."""
    parse_conninfo(conninfo)
    try:
        conn = psycopg.connect(
            conninfo,
            autocommit=True,
            prepare_threshold=prepare_threshold(),  # safe behind a transaction pooler
            client_encoding="UTF8",
            fallback_application_name="ql3-migrate",
        )
    except psycopg.OperationalError as exc:
        raise Unavailable(f"cannot connect to the database: {exc}") from exc
    with conn:
        try:
            yield conn
        except psycopg.Error as exc:
            raise MigrationError(f"migration database error: {exc}") from exc


def create_group_roles(conn: Connection) -> None:
    conn.execute(CREATE_GROUP_ROLES_SQL)


def take_migration_lock(conn: Connection, *, timeout: float = DEFAULT_LOCK_TIMEOUT_SECONDS) -> None:
    """Take the migration lock for the transaction, waiting at most ``timeout`` seconds.

    Any login may hold this advisory lock (the pg_advisory_lock functions are PUBLIC's),
    so the wait is bounded: ``Unavailable`` naming the lock and its holder when the time
    is up. The wait runs in a savepoint, so the transaction can still read ``pg_locks``
    after it; ``lock_timeout`` is the session's own again for the files that follow.
    """
    row = conn.execute("SELECT current_setting('lock_timeout')").fetchone()
    previous = "0" if row is None else str(row[0])
    set_lock_timeout(conn, f"{max(1, round(timeout * 1000))}ms")
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [MIGRATION_LOCK_KEY])
    except psycopg.errors.LockNotAvailable:
        raise Unavailable(lock_timeout_message(conn, timeout)) from None
    set_lock_timeout(conn, previous)


def set_lock_timeout(conn: Connection, value: str) -> None:
    conn.execute("SELECT set_config('lock_timeout', %s, true)", [value])


def migration_lock_holders(conn: Connection) -> list[tuple[int, str | None, str | None]]:
    """(pid, user, application) of each session holding the migration lock in this
    database (a bigint advisory key is classid = high 32 bits, objid = low, objsubid 1)."""
    rows = conn.execute(
        """
        SELECT l.pid, a.usename::text, a.application_name
          FROM pg_catalog.pg_locks AS l
          LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
           AND l.classid = %s::oid AND l.objid = %s::oid
           AND l.database = (SELECT oid FROM pg_catalog.pg_database
                              WHERE datname = pg_catalog.current_database())
         ORDER BY l.pid
        """,
        [MIGRATION_LOCK_KEY >> 32, MIGRATION_LOCK_KEY & 0xFFFFFFFF],
    ).fetchall()
    return [(int(pid), user, application) for pid, user, application in rows]


def lock_timeout_message(conn: Connection, timeout: float) -> str:
    """What a migrator that waited ``timeout`` seconds for the lock says: the lock, then
    who holds it (or that it was released meanwhile), then what to do."""
    holders = [
        f"pid {pid} (user {user or '?'}, application {application or '?'})"
        for pid, user, application in migration_lock_holders(conn)
    ]
    held = f"held by {', '.join(holders)}" if holders else "held by a session that has let go since"
    return (
        f"waited {timeout:g} s for the migration lock, advisory lock {MIGRATION_LOCK_KEY} "
        f"(pg_locks: classid {MIGRATION_LOCK_KEY >> 32}, objid "
        f"{MIGRATION_LOCK_KEY & 0xFFFFFFFF}, objsubid 1), {held}: another migration may be "
        f"running; wait for it or end that session, then migrate again (or give "
        f"--lock-timeout more seconds)"
    )


def prepare_streams(
    conn: Connection,
    migrations: Mapping[str, Sequence[Migration]],
    limits: Mapping[str, int],
    *,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_SECONDS,
) -> None:
    """Under the lock: refuse a ledger that disagrees with the files, an impossible
    ``requires`` or a pending file with transaction control, then create the schemas and
    ledgers that do not exist yet."""
    with conn.transaction():
        take_migration_lock(conn, timeout=lock_timeout)
        ledgers = {name: read_ledger(conn, STREAMS[name]) for name in migrations}
        refuse_ledger_problems(
            [
                problem
                for name, files in migrations.items()
                for problem in ledger_problems(STREAMS[name], ledgers[name] or {}, files)
            ]
        )
        if AI in migrations:
            core_after = max(max(ledgers[CORE] or {}, default=0), limits[CORE])
            ai_applied = ledgers[AI] or {}
            for migration in migrations[AI][: limits[AI]]:
                if migration.version not in ai_applied:
                    refuse_unmet_requirement(migration, core_after)
        for name, files in migrations.items():
            for migration in files[: limits[name]]:
                if migration.version not in (ledgers[name] or {}):
                    refuse_transaction_control(migration)
        for name in migrations:
            if ledgers[name] is None:
                conn.execute(STREAMS[name].bootstrap_sql)


def refuse_unmet_requirement(migration: Migration, core_version: int) -> None:
    if migration.requires_core > core_version:
        raise MigrationError(
            f"{migration.stream} migration {migration.file_name} requires core "
            f"{migration.requires_core:04d} but core stops at {core_version:04d} in this run; "
            f"migrate core to {migration.requires_core:04d} first"
        )


def apply_migration(
    conn: Connection,
    migration: Migration,
    stream_files: Sequence[Migration],
    *,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_SECONDS,
) -> bool:
    """Apply one file in its own transaction; False when another migrator already did."""
    stream = STREAMS[migration.stream]
    with conn.transaction():
        take_migration_lock(conn, timeout=lock_timeout)
        ledger = read_ledger(conn, stream) or {}
        refuse_ledger_problems(ledger_problems(stream, ledger, stream_files))
        if migration.version in ledger:
            return False
        if migration.version != len(ledger) + 1:
            raise MigrationError(
                f"{stream.name} migration {migration.file_name} is out of order: "
                f"the ledger is at version {len(ledger)}"
            )
        if migration.requires_core:
            refuse_unmet_requirement(migration, applied_version(conn, CORE_STREAM))
        conn.execute(
            stream.insert_ledger_sql, [migration.version, migration.name, migration.checksum]
        )
        run_as_owner(conn, stream, migration)
    return True


def run_as_owner(conn: Connection, stream: Stream, migration: Migration) -> None:
    """Execute the file as ``ql3_owner`` with the stream's schema first on the search path."""
    conn.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(OWNER_ROLE)))
    conn.execute(
        sql.SQL("SET LOCAL search_path TO {}").format(
            sql.SQL(", ").join(sql.Identifier(schema) for schema in stream.search_path)
        )
    )
    transaction_id = current_transaction_id(conn)
    # Rolling back to this savepoint after a failure works only while the runner's
    # transaction is still open: how a file that ended it is told from one that failed.
    conn.execute(f"SAVEPOINT {_FILE_SAVEPOINT}")
    try:
        with conn.cursor() as cursor:
            # No parameters: psycopg sends the simple protocol, which runs many statements.
            cursor.execute(migration.text)
    except psycopg.Error as exc:
        if not still_in_runner_transaction(conn, transaction_id):
            raise MigrationError(escaped_transaction_message(migration)) from exc
        raise MigrationError(migration_failure_message(migration, exc)) from exc
    refuse_escaped_transaction_or_role(conn, migration, transaction_id)
    conn.execute("RESET ROLE")


_FILE_SAVEPOINT = "ql3_migration_file"


def still_in_runner_transaction(conn: Connection, transaction_id: str | None) -> bool:
    """After a failed file: whether the runner's transaction is the one still open (then
    rolled back to before the file) rather than ended by the file's own transaction
    control. A lost connection counts as still open: the server rolls it back."""
    state = conn.info.transaction_status
    if state == psycopg.pq.TransactionStatus.UNKNOWN:
        return True
    if state != psycopg.pq.TransactionStatus.INERROR:
        return False  # idle: the file's COMMIT or ROLLBACK ended it
    try:
        conn.execute(f"ROLLBACK TO SAVEPOINT {_FILE_SAVEPOINT}")
    except psycopg.Error:
        return False  # a transaction the file began after ending the runner's
    return current_transaction_id(conn) == transaction_id


def current_transaction_id(conn: Connection) -> str | None:
    row = conn.execute("SELECT pg_current_xact_id_if_assigned()::text").fetchone()
    return None if row is None else row[0]


def refuse_escaped_transaction_or_role(
    conn: Connection, migration: Migration, transaction_id: str | None
) -> None:
    """A file must neither end the runner's transaction nor change the role it runs as."""
    row = conn.execute("SELECT pg_current_xact_id_if_assigned()::text, current_user").fetchone()
    now_id, role = (None, None) if row is None else row
    if now_id != transaction_id:
        raise MigrationError(escaped_transaction_message(migration))
    if role != OWNER_ROLE:
        raise MigrationError(
            f"{migration.stream} migration {migration.file_name} changed the role it runs as "
            f"(now {role}); it was rolled back: migrations must run as {OWNER_ROLE}"
        )


def escaped_transaction_message(migration: Migration) -> str:
    return (
        f"{migration.stream} migration {migration.file_name} ended the runner's transaction "
        f"(COMMIT or ROLLBACK in the file); part of it, its ledger row included, may be "
        f"committed: check the database by hand and remove transaction control from the file"
    )


_TRANSACTION_CONTROL = frozenset({"abort", "begin", "commit", "end", "rollback"})
_ROUTINE_KINDS = frozenset({"function", "procedure"})
_TOKEN_RE = re.compile(r'"(?:[^"]|"")*"|[A-Za-z_][A-Za-z0-9_$]*|[();]')


def refuse_transaction_control(migration: Migration) -> None:
    """Refuse, before anything runs, a file with a top-level transaction-control
    statement: a COMMIT or ROLLBACK would end the runner's transaction (and release the
    migration lock) halfway, leaving the ledger row and part of the file committed."""
    for words in top_level_statements(migration.text):
        first = words[0] if words else ""
        second = words[1] if len(words) > 1 else ""
        if first in _TRANSACTION_CONTROL or (
            first in ("start", "prepare") and second == "transaction"
        ):
            raise MigrationError(
                f"{migration.stream} migration {migration.file_name} contains transaction "
                f"control ({' '.join(words[:2]).upper()}); nothing was run: each migration "
                f"runs in the runner's own transaction, remove it from the file"
            )


def top_level_statements(text: str) -> Iterator[list[str]]:
    """The words of each top-level statement of ``text`` (keywords lower-cased), with
    comments, strings and every dollar-quoted body left out.

    Statements end at a ``;`` outside parentheses and outside the ``BEGIN ATOMIC ... END``
    body of a ``CREATE FUNCTION`` or ``PROCEDURE`` (psql's rule: in such a statement,
    ``BEGIN`` opens a block, ``CASE`` inside one opens another, ``END`` closes one).
    """
    words: list[str] = []
    parens = blocks = 0
    for token in _TOKEN_RE.findall(executed_sql(text, do_bodies=False)):
        if token == "(":
            parens += 1
        elif token == ")":
            parens = max(0, parens - 1)
        elif token == ";":
            if parens == 0 and blocks == 0:
                if words:
                    yield words
                words = []
        else:
            word = token if token.startswith('"') else token.lower()
            words.append(word)
            if parens == 0 and _defines_routine(words):
                if word == "begin" or (word == "case" and blocks):
                    blocks += 1
                elif word == "end" and blocks:
                    blocks -= 1
    if words:
        yield words


def _defines_routine(words: Sequence[str]) -> bool:
    """Whether the statement so far is ``CREATE [OR REPLACE] FUNCTION|PROCEDURE``."""
    if words[0] != "create" or len(words) < 2:
        return False
    if words[1] in _ROUTINE_KINDS:
        return True
    return words[1:3] == ["or", "replace"] and len(words) > 3 and words[3] in _ROUTINE_KINDS


def migration_failure_message(migration: Migration, exc: psycopg.Error) -> str:
    diag = exc.diag
    where = ""
    if diag.statement_position:
        offset = int(diag.statement_position) - 1
        where = f" at line {migration.text.count(chr(10), 0, offset) + 1}"
    error = diag.message_primary or str(exc)
    state = f"{diag.sqlstate} " if diag.sqlstate else ""
    lines = [
        f"{migration.stream} migration {migration.file_name} failed{where} and was rolled "
        f"back: {state}{error}"
    ]
    for label, value in (
        ("DETAIL", diag.message_detail),
        ("HINT", diag.message_hint),
        ("CONTEXT", diag.context),
    ):
        if value:
            lines.append(f"{label}: {value}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- status, ready


def status(conninfo: str, *, sql_root: Path | None = None) -> dict[str, StreamStatus]:
    """Applied and pending migrations of both streams; changes nothing."""
    migrations = load_migrations(sql_root or default_sql_root(), [CORE, AI])
    with connect(conninfo) as conn, read_only_snapshot(conn):
        return {
            name: stream_status(conn, STREAMS[name], files) for name, files in migrations.items()
        }


def stream_status(conn: Connection, stream: Stream, files: Sequence[Migration]) -> StreamStatus:
    ledger = read_ledger(conn, stream)
    rows = ledger or {}
    return StreamStatus(
        stream=stream.name,
        installed=ledger is not None,
        applied=tuple(migration_file_name(row.version, row.name) for row in rows.values()),
        pending=tuple(m.file_name for m in files if m.version not in rows),
        problems=tuple(ledger_problems(stream, rows, files)),
    )


def ready(conninfo: str, *, with_ai: bool, sql_root: Path | None = None) -> ReadyReport:
    """Whether core (and ql3_ai when ``with_ai``) is fully migrated with exactly its tables.

    A stream is ready when its ledger agrees with the files, nothing is pending, and its
    schema holds exactly the tables (kinds r and p) that :func:`expected_tables` derives
    from its applied files. Changes nothing and takes no lock.
    """
    streams = [CORE, AI] if with_ai else [CORE]
    migrations = load_migrations(sql_root or default_sql_root(), streams)
    missing: dict[str, frozenset[str]] = {}
    unexpected: dict[str, frozenset[str]] = {}
    pending: dict[str, tuple[str, ...]] = {}
    problems: dict[str, tuple[str, ...]] = {}
    with connect(conninfo) as conn, read_only_snapshot(conn):
        for name in streams:
            stream, files = STREAMS[name], migrations[name]
            ledger = read_ledger(conn, stream) or {}
            expected = expected_tables(stream, [m for m in files if m.version in ledger])
            present = tables_in_schema(conn, stream.schema)
            missing[name] = expected - present
            unexpected[name] = present - expected
            pending[name] = tuple(m.file_name for m in files if m.version not in ledger)
            problems[name] = tuple(ledger_problems(stream, ledger, files))
    return ReadyReport(missing=missing, unexpected=unexpected, pending=pending, problems=problems)


# What an acknowledged COMMIT survives (D49). pg_stat_replication shows every walsender,
# but its sync_state only to members of pg_read_all_stats (pg_monitor): a hidden row leaves
# the count unknown rather than zero.
_DURABILITY_SQL = """
SELECT pg_catalog.current_setting('synchronous_commit'),
       pg_catalog.current_setting('synchronous_standby_names'),
       count(*) FILTER (WHERE r.sync_state IN ('sync', 'quorum')),
       count(*) FILTER (WHERE r.sync_state IS NULL)
FROM pg_catalog.pg_stat_replication AS r
"""

REQUIRE_SYNC_STANDBY_VARIABLE = "QL3_REQUIRE_SYNC_STANDBY"


@dataclass(frozen=True, kw_only=True)
class Durability:
    """The durability the server offers now: ``sync_standbys`` is the number of connected
    synchronous (or quorum) standbys, None when the role may not see it."""

    synchronous_commit: str
    synchronous_standby_names: str
    sync_standbys: int | None

    @property
    def commits_wait(self) -> bool:
        """Whether a COMMIT waits for a standby before it is acknowledged."""
        return (
            self.synchronous_commit in ("on", "remote_write", "remote_apply")
            and bool(self.synchronous_standby_names.strip())
            and bool(self.sync_standbys)
        )

    def problem(self) -> str | None:
        """Why an acknowledged COMMIT may be lost with this server, or None."""
        if self.sync_standbys is None:
            return (
                "cannot tell whether a synchronous standby is connected: the role may not "
                "read pg_stat_replication.sync_state (grant it pg_monitor)"
            )
        if not self.synchronous_standby_names.strip() or self.sync_standbys == 0:
            return "no synchronous standby is connected"
        if self.synchronous_commit not in ("on", "remote_write", "remote_apply"):
            return f"synchronous_commit is {self.synchronous_commit}: commits do not wait"
        return None

    def describe(self) -> str:
        names = self.synchronous_standby_names or "(none)"
        count = "unknown" if self.sync_standbys is None else str(self.sync_standbys)
        problem = self.problem()
        verdict = (
            "an acknowledged COMMIT is on a synchronous standby too"
            if problem is None
            else f"{problem}: an acknowledged COMMIT can be lost when a standby is promoted"
        )
        return (
            f"durability: synchronous_commit={self.synchronous_commit} "
            f"synchronous_standby_names={names} sync_standbys={count}: {verdict}"
        )


def durability(conninfo: str) -> Durability:
    """Read the server's durability settings and its connected synchronous standbys."""
    with connect(conninfo) as conn:
        row = conn.execute(_DURABILITY_SQL).fetchone()
    assert row is not None
    commit, names, sync, hidden = row
    return Durability(
        synchronous_commit=str(commit),
        synchronous_standby_names=str(names),
        sync_standbys=None if hidden else int(sync),
    )


@contextmanager
def read_only_snapshot(conn: Connection) -> Iterator[None]:
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield


def tables_in_schema(conn: Connection, schema: str) -> frozenset[str]:
    rows = conn.execute(
        """
        SELECT c.relname
          FROM pg_catalog.pg_class c
          JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = %s AND c.relkind IN ('r', 'p')
        """,
        [schema],
    ).fetchall()
    return frozenset(name for (name,) in rows)


def tables_created_by_migrations(sql_root: Path | None = None) -> dict[str, frozenset[str]]:
    """Per stream, the tables its complete set of files creates (ledger included)."""
    migrations = load_migrations(sql_root or default_sql_root(), [CORE, AI])
    return {name: expected_tables(STREAMS[name], files) for name, files in migrations.items()}


# --------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``migrate`` and ``ready`` to a CLI.

    Each sub-command sets ``func``: a function of the parsed namespace that returns the
    process exit code (``sys.exit(args.func(args))``, as ``ql3.cli.main`` does).
    """
    migrate_parser = subparsers.add_parser(
        "migrate",
        help="apply pending migrations (core, and ql3_ai with --with-ai)",
        description="Apply pending ql3 migrations: core first, then ql3_ai with --with-ai.",
    )
    add_dsn_argument(migrate_parser)
    migrate_parser.add_argument(
        "--with-ai", action="store_true", help="also migrate the ql3_ai feature stream"
    )
    migrate_parser.add_argument(
        "--target",
        action="extend",
        nargs="+",
        type=parse_target,
        default=[],
        metavar="STREAM=N",
        help="stop STREAM (core or ql3_ai) at version N; naming ql3_ai implies --with-ai",
    )
    migrate_parser.add_argument(
        "--lock-timeout",
        type=float,
        metavar="SECONDS",
        help="give up after waiting this long for the migration lock that another session "
        f"holds (env {LOCK_TIMEOUT_VARIABLE}; default {DEFAULT_LOCK_TIMEOUT_SECONDS:g})",
    )
    migrate_parser.set_defaults(func=run_migrate_command)

    ready_parser = subparsers.add_parser(
        "ready",
        help="exit 0 when the database is fully migrated with exactly its tables",
        description="Check that no migration is pending and each schema holds exactly "
        "the tables its migrations create.",
    )
    add_dsn_argument(ready_parser)
    ready_parser.add_argument(
        "--with-ai", action="store_true", help="also check the ql3_ai feature stream"
    )
    ready_parser.add_argument(
        "--require-sync-standby",
        action="store_true",
        default=None,
        help="exit 1 unless a synchronous standby is connected and commits wait for it "
        f"(env {REQUIRE_SYNC_STANDBY_VARIABLE}=1)",
    )
    ready_parser.set_defaults(func=run_ready_command)


def add_dsn_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", help="PostgreSQL connection string (default: $QL3_DSN)")


def parse_target(value: str) -> tuple[str, int]:
    stream, sep, version = value.partition("=")
    if not sep or stream not in STREAMS or not version.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected STREAM=N with STREAM core or ql3_ai, got {value!r}"
        )
    return stream, int(version)


LOCK_TIMEOUT_VARIABLE = "QL3_MIGRATE_LOCK_TIMEOUT"


def lock_timeout_from(args: argparse.Namespace, environ: Mapping[str, str]) -> float:
    """--lock-timeout, else QL3_MIGRATE_LOCK_TIMEOUT, else the default; InvalidArgument
    naming the flag or variable when it is not a number of seconds in range."""
    source, value = "--lock-timeout", getattr(args, "lock_timeout", None)
    if value is None:
        source, text = LOCK_TIMEOUT_VARIABLE, environ.get(LOCK_TIMEOUT_VARIABLE)
        if not text:
            return DEFAULT_LOCK_TIMEOUT_SECONDS
        try:
            value = float(text)
        except ValueError:
            raise InvalidArgument(
                f"QL3_INVALID_ARGUMENT: {source}={text!r} is not a number of seconds"
            ) from None
    return check_lock_timeout(value, source)


def dsn_from(args: argparse.Namespace, command: str) -> str | None:
    """The DSN to use; None (after saying why) when there is none or it is malformed."""
    dsn: str | None = args.dsn or os.environ.get("QL3_DSN")
    if not dsn:
        print(
            f"error: ql3 {command}: QL3_INVALID_ARGUMENT: no database: pass --dsn or set QL3_DSN",
            file=sys.stderr,
        )
        return None
    if _reporting_errors(command, lambda: parse_conninfo(dsn), args) is None:
        return None
    return dsn


def run_migrate_command(args: argparse.Namespace) -> int:
    dsn = dsn_from(args, "migrate")
    if dsn is None:
        return 2
    lock_timeout = _reporting_errors("migrate", lambda: lock_timeout_from(args, os.environ), args)
    if lock_timeout is None:
        return 2
    targets = dict(args.target)
    with_ai = bool(args.with_ai) or AI in targets
    outcome = _reporting_errors(
        "migrate",
        lambda: migrate(dsn, with_ai=with_ai, targets=targets, lock_timeout=lock_timeout),
        args,
    )
    if outcome is None:
        return 1
    for applied in outcome:
        print(f"applied {applied.stream} {applied.file_name}")
    if not outcome:
        print("up to date")
    return 0


def run_ready_command(args: argparse.Namespace) -> int:
    dsn = dsn_from(args, "ready")
    if dsn is None:
        return 2
    report = _reporting_errors("ready", lambda: ready(dsn, with_ai=bool(args.with_ai)), args)
    if report is None:
        return 1
    # Table names come from the database: a stray table's name may hold ESC.
    print("\n".join(escape_controls(line) for line in report.describe().splitlines()))
    offered = _reporting_errors("ready", lambda: durability(dsn), args)
    if offered is None:
        return 1
    print(escape_controls(offered.describe()))
    problem = offered.problem()
    if problem is not None and _require_sync_standby(args):
        print(
            f"error: ql3 ready: {escape_controls(problem)} (--require-sync-standby)",
            file=sys.stderr,
        )
        return 1
    return 0 if report.ok else 1


def _require_sync_standby(args: argparse.Namespace) -> bool:
    """``--require-sync-standby``, else ``QL3_REQUIRE_SYNC_STANDBY`` (1, true, yes, on)."""
    if getattr(args, "require_sync_standby", None):
        return True
    value = os.environ.get(REQUIRE_SYNC_STANDBY_VARIABLE, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


_Result = TypeVar("_Result")


def _reporting_errors(
    command: str, action: Callable[[], _Result], args: argparse.Namespace
) -> _Result | None:
    """The action's result, or None after one ``error: ql3 COMMAND: QL3_...`` line (the
    command's passwords redacted, control characters escaped: ``ql3.safe_text``)."""
    try:
        return action()
    except Ql3Error as exc:
        message = error_text(exc.message.removeprefix(f"{exc.code}: "), command_secrets(args))
        print(f"error: ql3 {command}: {exc.code}: {message}", file=sys.stderr)
        return None


__all__ = [
    "AI",
    "AI_STREAM",
    "CORE",
    "CORE_STREAM",
    "CREATE_GROUP_ROLES_SQL",
    "DEFAULT_LOCK_TIMEOUT_SECONDS",
    "GROUP_ROLES",
    "LOCK_TIMEOUT_VARIABLE",
    "MAX_LOCK_TIMEOUT_SECONDS",
    "MIGRATION_FILE_NAME",
    "MIGRATION_LOCK_KEY",
    "OWNED_TABLES",
    "OWNER_ROLE",
    "REQUIRES_HEADER",
    "STREAMS",
    "Applied",
    "LedgerRow",
    "Migration",
    "ReadyReport",
    "Stream",
    "StreamStatus",
    "TableDdl",
    "add_dsn_argument",
    "applied_version",
    "apply_migration",
    "check_lock_timeout",
    "connect",
    "create_group_roles",
    "current_transaction_id",
    "default_sql_root",
    "dsn_from",
    "escaped_transaction_message",
    "executed_sql",
    "expected_tables",
    "identifier",
    "ledger_exists",
    "ledger_problems",
    "load_migrations",
    "load_stream",
    "lock_timeout_from",
    "lock_timeout_message",
    "migrate",
    "migration_failure_message",
    "migration_file_name",
    "migration_lock_holders",
    "parse_target",
    "prepare_streams",
    "read_ledger",
    "read_migration",
    "read_only_snapshot",
    "ready",
    "refuse_escaped_transaction_or_role",
    "refuse_ledger_problems",
    "refuse_numbering_gaps",
    "refuse_transaction_control",
    "refuse_unknown_core_requirement",
    "refuse_unmet_requirement",
    "register",
    "required_core_version",
    "resolve_targets",
    "run_as_owner",
    "run_migrate_command",
    "run_ready_command",
    "set_lock_timeout",
    "split_name",
    "status",
    "still_in_runner_transaction",
    "stream_status",
    "table_ddl",
    "tables_created_by_migrations",
    "tables_in_schema",
    "take_migration_lock",
    "top_level_statements",
]
