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
- **Files run as ``ql3_owner``** (``SET LOCAL ROLE``) with the stream's schema first on the
  search path: every object is owned by the owner role whatever login ran the migration,
  and unqualified names land in the stream's schema, never in ``public``.
- **The group roles of SPEC section 5 are created first**, idempotently and outside the
  ledgers, because roles belong to the cluster while ledgers belong to one database.
- **Readiness is an exact comparison**: the tables a stream's schema holds against the
  tables its applied migration files create (see :func:`expected_tables`), plus "nothing
  pending" and "ledger agrees with the files".

The SQL is package data: ``ql3/_sql`` in a wheel, the repository's ``sql/`` otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
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

from ql3.db import parse_conninfo
from ql3.errors import MigrationError, Ql3Error, Unavailable

Connection: TypeAlias = "psycopg.Connection[tuple[Any, ...]]"

CORE = "core"
AI = "ql3_ai"

#: The advisory lock every ql3 migration transaction holds: the ASCII bytes of "ql3_migr".
MIGRATION_LOCK_KEY = int.from_bytes(b"ql3_migr", "big")

OWNER_ROLE = "ql3_owner"
GROUP_ROLES = ("ql3_owner", "ql3_runtime", "ql3_relay", "ql3_operator", "ql3_reader")

#: The tables each stream is designed to own when complete (SPEC sections 3 and 4).
#: Readiness does not check against this list (see :func:`expected_tables` for why); the
#: test suite checks that every table the migration files create is declared here, so a
#: table outside the design cannot slip in unnoticed.
OWNED_TABLES: Mapping[str, frozenset[str]] = {
    CORE: frozenset(
        {
            "schema_history",
            "contract_families",
            "contract_revisions",
            "revision_revocations",
            "active_revisions",
            "contract_outbox",
            "runs",
            "step_runs",
            "run_events",
            "step_run_mutations",
        }
    ),
    AI: frozenset(
        {
            "feature_history",
            "model_invocation_starts",
            "model_invocation_completions",
            "model_invocation_resolutions",
            "usage_ledger",
        }
    ),
}

MIGRATION_FILE_NAME = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")
REQUIRES_HEADER = re.compile(r"^--\s*requires:\s*(?P<stream>\S+)\s+(?P<version>\d+)\s*$")


@dataclass(frozen=True)
class Stream:
    """A migration line: its files' directory, its schema and its ledger."""

    name: str
    schema: str
    ledger: str
    search_path: tuple[str, ...]
    bootstrap_sql: str
    select_ledger_sql: str
    insert_ledger_sql: str


CORE_STREAM = Stream(
    name=CORE,
    schema="ql3",
    ledger="schema_history",
    search_path=("ql3",),
    bootstrap_sql="""
CREATE SCHEMA IF NOT EXISTS ql3 AUTHORIZATION ql3_owner;
ALTER SCHEMA ql3 OWNER TO ql3_owner;
GRANT USAGE ON SCHEMA ql3 TO ql3_runtime, ql3_relay, ql3_operator, ql3_reader;
CREATE TABLE ql3.schema_history (
    version int PRIMARY KEY CHECK (version > 0),
    name text NOT NULL,
    checksum text NOT NULL CHECK (checksum ~ '^[0-9a-f]{64}$'),
    applied_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE ql3.schema_history OWNER TO ql3_owner;
REVOKE ALL ON ql3.schema_history FROM PUBLIC;
GRANT SELECT ON ql3.schema_history TO ql3_reader;
COMMENT ON TABLE ql3.schema_history IS
    'Ledger of the core migration stream: one row per applied sql/core file (ql3 migrate).';
""",
    select_ledger_sql="SELECT version, name, checksum FROM ql3.schema_history ORDER BY version",
    insert_ledger_sql=(
        "INSERT INTO ql3.schema_history (version, name, checksum) VALUES (%s, %s, %s)"
    ),
)

AI_STREAM = Stream(
    name=AI,
    schema="ql3_ai",
    ledger="feature_history",
    search_path=("ql3_ai", "ql3"),
    bootstrap_sql="""
CREATE SCHEMA IF NOT EXISTS ql3_ai AUTHORIZATION ql3_owner;
ALTER SCHEMA ql3_ai OWNER TO ql3_owner;
GRANT USAGE ON SCHEMA ql3_ai TO ql3_runtime, ql3_relay, ql3_operator, ql3_reader;
CREATE TABLE ql3_ai.feature_history (
    stream text NOT NULL DEFAULT 'ql3_ai',
    version int NOT NULL CHECK (version > 0),
    name text NOT NULL,
    checksum text NOT NULL CHECK (checksum ~ '^[0-9a-f]{64}$'),
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, version)
);
ALTER TABLE ql3_ai.feature_history OWNER TO ql3_owner;
REVOKE ALL ON ql3_ai.feature_history FROM PUBLIC;
GRANT SELECT ON ql3_ai.feature_history TO ql3_reader;
COMMENT ON TABLE ql3_ai.feature_history IS
    'Ledger of the ql3_ai migration stream: one row per applied sql/ql3_ai file (ql3 migrate).';
""",
    select_ledger_sql=(
        "SELECT version, name, checksum FROM ql3_ai.feature_history"
        " WHERE stream = 'ql3_ai' ORDER BY version"
    ),
    insert_ledger_sql=(
        "INSERT INTO ql3_ai.feature_history (stream, version, name, checksum)"
        " VALUES ('ql3_ai', %s, %s, %s)"
    ),
)

STREAMS: Mapping[str, Stream] = {CORE: CORE_STREAM, AI: AI_STREAM}

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


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Applied:
    """One migration applied by this call."""

    stream: str
    version: int
    name: str

    @property
    def file_name(self) -> str:
        return migration_file_name(self.version, self.name)


@dataclass(frozen=True)
class StreamStatus:
    """Where one stream stands: ``installed`` is False while its ledger does not exist."""

    stream: str
    installed: bool
    applied: tuple[str, ...]
    pending: tuple[str, ...]
    problems: tuple[str, ...]


@dataclass(frozen=True)
class ReadyReport:
    """Readiness of the checked streams; every mapping is keyed by stream name.

    ``qualify`` names tables ``schema.table`` (PostgreSQL); the SQLite edge store has no
    schemas and reports bare names.
    """

    missing: Mapping[str, frozenset[str]]
    unexpected: Mapping[str, frozenset[str]]
    pending: Mapping[str, tuple[str, ...]]
    problems: Mapping[str, tuple[str, ...]]
    qualify: bool = True

    @property
    def ok(self) -> bool:
        return not any(
            group[stream]
            for group in (self.missing, self.unexpected, self.pending, self.problems)
            for stream in group
        )

    def describe(self) -> str:
        """``ready``, or one line per difference found."""
        if self.ok:
            return "ready"
        lines: list[str] = []
        for stream in self.pending:
            prefix = f"{STREAMS[stream].schema}." if self.qualify else ""
            lines.extend(f"{stream}: {problem}" for problem in self.problems[stream])
            if self.pending[stream]:
                lines.append(f"{stream}: pending migrations: {', '.join(self.pending[stream])}")
            for label, tables in (
                ("missing", self.missing[stream]),
                ("unexpected", self.unexpected[stream]),
            ):
                if tables:
                    names = ", ".join(prefix + table for table in sorted(tables))
                    lines.append(f"{stream}: {label} tables: {names}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class Migration:
    """One migration file: ``requires_core`` is 0 when it names no core version."""

    stream: str
    version: int
    name: str
    path: Path
    checksum: str
    text: str
    requires_core: int

    @property
    def file_name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class LedgerRow:
    version: int
    name: str
    checksum: str


def migration_file_name(version: int, name: str) -> str:
    return f"{version:04d}_{name}.sql"


def default_sql_root() -> Path:
    """``ql3/_sql`` when installed from a wheel, else the repository's ``sql/``."""
    packaged = Path(__file__).resolve().parent / "_sql"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "sql"


def load_migrations(sql_root: Path, streams: Sequence[str]) -> dict[str, tuple[Migration, ...]]:
    """The checked migration files of ``streams`` (core is always loaded with ql3_ai)."""
    names = [CORE, *(stream for stream in streams if stream != CORE)]
    loaded = {name: load_stream(sql_root, STREAMS[name]) for name in names}
    for migration in loaded.get(AI, ()):
        refuse_unknown_core_requirement(migration, len(loaded[CORE]))
    return loaded


def load_stream(sql_root: Path, stream: Stream) -> tuple[Migration, ...]:
    directory = sql_root / stream.name
    if not directory.is_dir():
        return ()
    paths = [p for p in directory.iterdir() if p.is_file() and p.name.lower().endswith(".sql")]
    migrations = sorted((read_migration(stream, path) for path in paths), key=_by_version)
    refuse_numbering_gaps(stream, migrations)
    return tuple(migrations)


def _by_version(migration: Migration) -> tuple[int, str]:
    return migration.version, migration.file_name


def read_migration(stream: Stream, path: Path) -> Migration:
    match = MIGRATION_FILE_NAME.match(path.name)
    if match is None:
        raise MigrationError(
            f"{stream.name} migration file {path} is badly named: "
            f"expected NNNN_lowercase_name.sql (pattern {MIGRATION_FILE_NAME.pattern})"
        )
    content = path.read_bytes()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MigrationError(f"{stream.name} migration file {path} is not UTF-8: {exc}") from exc
    return Migration(
        stream=stream.name,
        version=int(match["version"]),
        name=match["name"],
        path=path,
        checksum=hashlib.sha256(content).hexdigest(),
        text=text,
        requires_core=required_core_version(stream, path, text),
    )


def required_core_version(stream: Stream, path: Path, text: str) -> int:
    """The highest ``-- requires: core NNNN`` in the file's leading comment block, or 0."""
    required = 0
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if not stripped.startswith("--"):
            break
        match = REQUIRES_HEADER.match(stripped)
        if match is None:
            continue
        if stream.name != AI or match["stream"] != CORE:
            raise MigrationError(
                f"{stream.name} migration file {path}: unsupported header {stripped!r}; "
                f"only ql3_ai files may declare '-- requires: core NNNN'"
            )
        required = max(required, int(match["version"]))
    return required


def refuse_numbering_gaps(stream: Stream, migrations: Sequence[Migration]) -> None:
    for expected, migration in enumerate(migrations, start=1):
        if migration.version == expected:
            continue
        if migration.version == expected - 1:
            raise MigrationError(
                f"{stream.name} has two migrations numbered {migration.version:04d}: "
                f"{migrations[expected - 2].file_name} and {migration.file_name}"
            )
        raise MigrationError(
            f"{stream.name} migrations must be numbered contiguously from 0001: "
            f"expected {expected:04d} but found {migration.file_name} in {migration.path.parent}"
        )


def refuse_unknown_core_requirement(migration: Migration, known_core: int) -> None:
    if migration.requires_core > known_core:
        raise MigrationError(
            f"{migration.stream} migration {migration.file_name} requires core "
            f"{migration.requires_core:04d} but this ql3 only knows core up to {known_core:04d}"
        )


# --------------------------------------------------------------------------- ledger checks


def ledger_problems(
    stream: Stream, ledger: Mapping[int, LedgerRow], migrations: Sequence[Migration]
) -> list[str]:
    """Every way the database's ledger disagrees with the files; empty when they agree."""
    problems: list[str] = []
    known = len(migrations)
    newest = max(ledger, default=0)
    if newest > known:
        problems.append(
            f"database is ahead of the code: {stream.name} version {newest} is applied "
            f"but this ql3 only knows up to {known}"
        )
    holes = sorted(set(range(1, newest + 1)) - set(ledger))
    if holes:
        problems.append(
            f"{stream.name} ledger {stream.schema}.{stream.ledger} has no row for version(s) "
            f"{', '.join(map(str, holes))} below applied version {newest}"
        )
    for migration in migrations:
        row = ledger.get(migration.version)
        if row is not None and row.checksum != migration.checksum:
            problems.append(
                f"checksum drift in {stream.name} version {migration.version} "
                f"({migration.path}): the database applied sha256 {row.checksum} but the file "
                f"now has sha256 {migration.checksum}; a released migration must never be "
                f"edited, add a new one instead"
            )
    return problems


def refuse_ledger_problems(problems: Sequence[str]) -> None:
    if problems:
        raise MigrationError("migration refused: " + "\n".join(problems))


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
) -> list[Applied]:
    """Apply pending migrations, core first, then ql3_ai when ``with_ai``.

    ``targets`` caps streams by version (``{"core": 3}``); a stream it does not name goes
    to its newest file. Naming ``ql3_ai`` there requires ``with_ai=True``. Returns what this
    call applied, in order: an empty list when the database was up to date.
    """
    streams = [CORE, AI] if with_ai else [CORE]
    migrations = load_migrations(sql_root or default_sql_root(), streams)
    limits = resolve_targets(migrations, targets or {})
    applied: list[Applied] = []
    with connect(conninfo) as conn:
        create_group_roles(conn)
        prepare_streams(conn, migrations, limits)
        for stream in streams:
            for migration in migrations[stream][: limits[stream]]:
                if apply_migration(conn, migration, migrations[stream]):
                    applied.append(Applied(stream, migration.version, migration.name))
    return applied


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


def take_migration_lock(conn: Connection) -> None:
    conn.execute("SELECT pg_advisory_xact_lock(%s)", [MIGRATION_LOCK_KEY])


def prepare_streams(
    conn: Connection, migrations: Mapping[str, Sequence[Migration]], limits: Mapping[str, int]
) -> None:
    """Under the lock: refuse a ledger that disagrees with the files, an impossible
    ``requires`` or a pending file with transaction control, then create the schemas and
    ledgers that do not exist yet."""
    with conn.transaction():
        take_migration_lock(conn)
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
    conn: Connection, migration: Migration, stream_files: Sequence[Migration]
) -> bool:
    """Apply one file in its own transaction; False when another migrator already did."""
    stream = STREAMS[migration.stream]
    with conn.transaction():
        take_migration_lock(conn)
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


# --------------------------------------------------------------------------- expected tables


def expected_tables(stream: Stream, migrations: Sequence[Migration]) -> frozenset[str]:
    """The tables ``migrations`` leave in the stream's schema, plus the ledger.

    Derived from the files rather than from :data:`OWNED_TABLES`, because the files are
    what actually ran: a hand-kept list is a second source of truth that drifts (it would
    report tables as missing before their migration is written, and could not tell which
    tables a partly migrated database should hold). The files are replayed in order:
    ``CREATE [UNLOGGED] TABLE [IF NOT EXISTS]``, ``DROP TABLE`` and ``ALTER TABLE ...
    RENAME TO``, with comments, string literals and function bodies ignored and ``DO``
    bodies read, since those run during the migration. Unqualified names are the stream's
    schema (the runner puts it first on the search path). Dynamic SQL (``EXECUTE``) is
    not followed: a table made that way shows up as unexpected, loudly, never silently.
    Design drift, a created table outside the declared set, is caught by the test suite
    comparing :func:`tables_created_by_migrations` with :data:`OWNED_TABLES`.
    """
    tables = {stream.ledger}
    for migration in migrations:
        for kind, schema, table, new_name in table_ddl(migration.text):
            if (schema or stream.schema) != stream.schema:
                continue
            if kind == "create":
                tables.add(table)
            elif kind == "drop":
                tables.discard(table)
            elif table in tables:
                tables.discard(table)
                tables.add(new_name)
    return frozenset(tables)


_IDENT = r'(?:"(?:[^"]|"")+"|[A-Za-z_][A-Za-z0-9_$]*)'
_NAME = rf"(?:{_IDENT}\s*\.\s*)?{_IDENT}"
_IDENT_RE = re.compile(_IDENT)
_NAME_RE = re.compile(_NAME)
_TABLE_DDL_RE = re.compile(
    rf"""\b(?:
        CREATE\s+(?:UNLOGGED\s+)?TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(?P<created>{_NAME})
      | DROP\s+TABLE\s+(?:IF\s+EXISTS\s+)?(?P<dropped>{_NAME}(?:\s*,\s*{_NAME})*)
      | ALTER\s+TABLE\s+(?:IF\s+EXISTS\s+)?(?:ONLY\s+)?(?P<renamed>{_NAME})
            \s+RENAME\s+TO\s+(?P<new_name>{_IDENT})
    )""",
    re.IGNORECASE | re.VERBOSE,
)

TableDdl: TypeAlias = tuple[str, "str | None", str, str]


def table_ddl(text: str) -> Iterator[TableDdl]:
    """``(kind, schema or None, table, new name)`` for each table DDL statement, in order."""
    for match in _TABLE_DDL_RE.finditer(executed_sql(text)):
        if match["created"]:
            schema, table = split_name(match["created"])
            yield "create", schema, table, table
        elif match["dropped"]:
            for name in _NAME_RE.finditer(match["dropped"]):
                schema, table = split_name(name[0])
                yield "drop", schema, table, table
        else:
            schema, table = split_name(match["renamed"])
            yield "rename", schema, table, identifier(match["new_name"])


def split_name(raw: str) -> tuple[str | None, str]:
    parts = [identifier(part) for part in _IDENT_RE.findall(raw)]
    return (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])


def identifier(raw: str) -> str:
    if raw.startswith('"'):
        return raw[1:-1].replace('""', '"')
    return raw.lower()


_DOLLAR_TAG_RE = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$")
_DO_BEFORE_RE = re.compile(r"\bDO(?:\s+LANGUAGE\s+\w+)?\s*$", re.IGNORECASE)


def executed_sql(text: str, *, do_bodies: bool = True) -> str:
    """``text`` with comments, string literals and function bodies blanked out.

    Dollar-quoted bodies that follow ``DO`` are kept (recursively cleaned): they run now.
    With ``do_bodies=False`` they are blanked too (only the top-level statements remain).
    """
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("--", i):
            i, kept = _skip_line_comment(text, i), " "
        elif text.startswith("/*", i):
            i, kept = _skip_block_comment(text, i), " "
        elif text[i] == "'":
            i, kept = _skip_string(text, i), "''"
        elif text[i] == '"':
            end = _skip_quoted_identifier(text, i)
            i, kept = end, text[i:end]
        elif (tag := _dollar_tag_at(text, i)) is not None:
            end, body = _dollar_quoted_body(text, i, tag)
            runs_now = do_bodies and _DO_BEFORE_RE.search(text, max(0, i - 64), i) is not None
            i, kept = end, f" {executed_sql(body)} " if runs_now else " "
        else:
            i, kept = i + 1, text[i]
        out.append(kept)
    return "".join(out)


def _skip_line_comment(text: str, i: int) -> int:
    end = text.find("\n", i)
    return len(text) if end < 0 else end


def _skip_block_comment(text: str, i: int) -> int:
    depth, j = 0, i
    while j < len(text):
        if text.startswith("/*", j):
            depth, j = depth + 1, j + 2
        elif text.startswith("*/", j):
            depth, j = depth - 1, j + 2
            if depth == 0:
                return j
        else:
            j += 1
    return len(text)


def _skip_string(text: str, i: int) -> int:
    escapes = i > 0 and text[i - 1] in "eE" and (i < 2 or not _is_word_char(text[i - 2]))
    j = i + 1
    while j < len(text):
        if escapes and text[j] == "\\":
            j += 2
        elif text[j] == "'":
            if text.startswith("''", j):
                j += 2
            else:
                return j + 1
        else:
            j += 1
    return len(text)


def _skip_quoted_identifier(text: str, i: int) -> int:
    j = i + 1
    while j < len(text):
        if text.startswith('""', j):
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return len(text)


def _dollar_tag_at(text: str, i: int) -> str | None:
    if text[i] != "$" or (i > 0 and (_is_word_char(text[i - 1]) or text[i - 1] == "$")):
        return None
    match = _DOLLAR_TAG_RE.match(text, i)
    return None if match is None else match[0]


def _dollar_quoted_body(text: str, i: int, tag: str) -> tuple[int, str]:
    start = i + len(tag)
    close = text.find(tag, start)
    if close < 0:
        return len(text), text[start:]
    return close + len(tag), text[start:close]


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


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


def dsn_from(args: argparse.Namespace, command: str) -> str | None:
    """The DSN to use; None (after saying why) when there is none or it is malformed."""
    dsn: str | None = args.dsn or os.environ.get("QL3_DSN")
    if not dsn:
        print(
            f"error: ql3 {command}: QL3_INVALID_ARGUMENT: no database: pass --dsn or set QL3_DSN",
            file=sys.stderr,
        )
        return None
    if _reporting_errors(command, lambda: parse_conninfo(dsn)) is None:
        return None
    return dsn


def run_migrate_command(args: argparse.Namespace) -> int:
    dsn = dsn_from(args, "migrate")
    if dsn is None:
        return 2
    targets = dict(args.target)
    with_ai = bool(args.with_ai) or AI in targets
    outcome = _reporting_errors("migrate", lambda: migrate(dsn, with_ai=with_ai, targets=targets))
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
    report = _reporting_errors("ready", lambda: ready(dsn, with_ai=bool(args.with_ai)))
    if report is None:
        return 1
    print(report.describe())
    return 0 if report.ok else 1


_Result = TypeVar("_Result")


def _reporting_errors(command: str, action: Callable[[], _Result]) -> _Result | None:
    try:
        return action()
    except Ql3Error as exc:
        message = " ".join(exc.message.removeprefix(f"{exc.code}: ").split())  # one line
        print(f"error: ql3 {command}: {exc.code}: {message}", file=sys.stderr)
        return None
