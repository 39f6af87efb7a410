"""Migrations and readiness of one SQLite file: the ``core`` and ``ql3_ai`` streams.

The same rules as ``ql3.migrate`` (whose file loading and ledger checks this reuses from
``ql3.migration_files``, which needs no PostgreSQL driver):
forward-only numbered files, sha256 checksums, drift and a file ahead of the code refused
before anything runs, the ledger row inserted first, each file in its own transaction
(``BEGIN IMMEDIATE``: concurrent migrators of one file serialise and re-read the ledger).

SQLite has no schemas, so the two streams share one namespace; they keep separate
ledgers (``schema_history`` for core, ``ql3_ai_feature_history`` for the AI feature, with
a stream column) and the AI stream runs only when the store has AI enabled. Versions
match PostgreSQL's file for file (``python/ql3/edge_sql`` against ``sql/``), so a version
means the same logical schema on both backends.

Readiness is an exact owned-table check: the tables in the file are exactly those the
applied core files create, plus, with AI on, those the applied ``ql3_ai`` files create.
With AI off an installed AI feature is reported, not tolerated: open the file with
``ai=True``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from ql3 import errors
from ql3.edge.db import Database, translate, utc_text
from ql3.migration_files import (
    AI,
    CORE,
    Applied,
    LedgerRow,
    Migration,
    ReadyReport,
    Stream,
    expected_tables,
    ledger_problems,
    load_stream,
    refuse_ledger_problems,
    refuse_unknown_core_requirement,
)

EDGE_SQL_ROOT: Final = Path(__file__).resolve().parent.parent / "edge_sql"

CORE_LEDGER: Final = "schema_history"
AI_LEDGER: Final = "ql3_ai_feature_history"

EDGE_CORE = Stream(
    name=CORE,
    schema="main",
    ledger=CORE_LEDGER,
    search_path=("main",),
    bootstrap_sql=f"""
CREATE TABLE IF NOT EXISTS {CORE_LEDGER} (
    version INTEGER PRIMARY KEY CHECK (version > 0),
    name TEXT NOT NULL,
    checksum TEXT NOT NULL CHECK (length(checksum) = 64),
    applied_at TEXT NOT NULL
) STRICT""",
    select_ledger_sql=f"SELECT version, name, checksum FROM {CORE_LEDGER} ORDER BY version",
    insert_ledger_sql=(
        f"INSERT INTO {CORE_LEDGER} (version, name, checksum, applied_at) VALUES (?, ?, ?, ?)"
    ),
)

EDGE_AI = Stream(
    name=AI,
    schema="main",
    ledger=AI_LEDGER,
    search_path=("main",),
    bootstrap_sql=f"""
CREATE TABLE IF NOT EXISTS {AI_LEDGER} (
    stream TEXT NOT NULL DEFAULT 'ql3_ai' CHECK (stream = 'ql3_ai'),
    version INTEGER NOT NULL CHECK (version > 0),
    name TEXT NOT NULL,
    checksum TEXT NOT NULL CHECK (length(checksum) = 64),
    applied_at TEXT NOT NULL,
    PRIMARY KEY (stream, version)
) STRICT""",
    select_ledger_sql=(
        f"SELECT version, name, checksum FROM {AI_LEDGER} WHERE stream = 'ql3_ai' ORDER BY version"
    ),
    insert_ledger_sql=(
        f"INSERT INTO {AI_LEDGER} (stream, version, name, checksum, applied_at)"
        " VALUES ('ql3_ai', ?, ?, ?, ?)"
    ),
)

EDGE_STREAMS: Final = {CORE: EDGE_CORE, AI: EDGE_AI}


# The PostgreSQL report, naming tables without a schema (SQLite has none).
EdgeReadyReport = ReadyReport


def load_edge_migrations(
    sql_root: Path | None = None, *, ai: bool
) -> dict[str, tuple[Migration, ...]]:
    """The checked SQLite migration files of core (and ql3_ai when ``ai``)."""
    root = sql_root or EDGE_SQL_ROOT
    loaded = {CORE: load_stream(root, EDGE_CORE)}
    if ai:
        loaded[AI] = load_stream(root, EDGE_AI)
        for migration in loaded[AI]:
            refuse_unknown_core_requirement(migration, len(loaded[CORE]))
    return loaded


def statements(text: str) -> list[str]:
    """The SQL statements of a file, split where SQLite itself says one is complete."""
    found: list[str] = []
    start = 0
    position = text.find(";")
    while position >= 0:
        candidate = text[start : position + 1]
        if sqlite3.complete_statement(candidate):
            found.append(candidate)
            start = position + 1
        position = text.find(";", position + 1)
    return found


def table_exists(conn: sqlite3.Connection, name: str) -> bool:
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
    ).fetchone()
    return row is not None


def read_ledger(conn: sqlite3.Connection, stream: Stream) -> dict[int, LedgerRow] | None:
    """The stream's ledger by version, or None when the stream was never installed."""
    if not table_exists(conn, stream.ledger):
        return None
    rows = conn.execute(stream.select_ledger_sql).fetchall()
    return {int(r[0]): LedgerRow(int(r[0]), str(r[1]), str(r[2])) for r in rows}


def owned_tables(conn: sqlite3.Connection) -> frozenset[str]:
    """Every table of the file but SQLite's own (sqlite_sequence, sqlite_stat1...)."""
    rows = conn.execute(
        "SELECT name FROM sqlite_master"
        " WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'"
    ).fetchall()
    return frozenset(str(r[0]) for r in rows)


def migrate_edge(db: Database, *, ai: bool, sql_root: Path | None = None) -> list[Applied]:
    """Apply pending migrations: core first, then ql3_ai when ``ai``; what this call applied."""
    migrations = load_edge_migrations(sql_root, ai=ai)
    applied: list[Applied] = []
    with db.locked():
        conn = db.conn
        ledgers: dict[str, dict[int, LedgerRow]] = {}
        for name, files in migrations.items():
            stream = EDGE_STREAMS[name]
            ledgers[name] = read_ledger(conn, stream) or {}
            refuse_ledger_problems(ledger_problems(stream, ledgers[name], files))
        for name, files in migrations.items():
            for migration in files:
                # Applied already: no write lock (a file in use would make every open wait
                # for it). _apply checks again under the lock, for the files it applies.
                if migration.version in ledgers[name]:
                    continue
                if _apply(db, EDGE_STREAMS[name], migration, files):
                    applied.append(Applied(name, migration.version, migration.name))
    return applied


def _apply(db: Database, stream: Stream, migration: Migration, files: Sequence[Migration]) -> bool:
    conn = db.conn
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(stream.bootstrap_sql)
            ledger = read_ledger(conn, stream) or {}
            refuse_ledger_problems(ledger_problems(stream, ledger, files))
            if migration.version in ledger:
                conn.execute("ROLLBACK")
                return False
            if migration.version != len(ledger) + 1:
                raise errors.MigrationError(
                    f"{stream.name} migration {migration.file_name} is out of order: "
                    f"the ledger is at version {len(ledger)}"
                )
            if migration.requires_core:
                core = max(read_ledger(conn, EDGE_CORE) or {}, default=0)
                if migration.requires_core > core:
                    raise errors.MigrationError(
                        f"{stream.name} migration {migration.file_name} requires core "
                        f"{migration.requires_core:04d} but core is at {core:04d}"
                    )
            conn.execute(
                stream.insert_ledger_sql,
                (migration.version, migration.name, migration.checksum, utc_text(db.now())),
            )
            for statement in statements(migration.text):
                try:
                    conn.execute(statement)
                except sqlite3.Error as exc:
                    raise errors.MigrationError(
                        f"{stream.name} migration {migration.file_name} failed and was rolled "
                        f"back: {exc}\nstatement: {statement.strip()[:200]}"
                    ) from exc
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    except sqlite3.Error as exc:
        translated = translate(exc)
        if isinstance(translated, errors.Unavailable):  # a busy file: not now, not refused
            raise translated from exc
        raise errors.MigrationError(f"migration of {db.path} failed: {exc}") from exc
    return True


def ready_report(db: Database, *, ai: bool, sql_root: Path | None = None) -> EdgeReadyReport:
    """Exact readiness: ledgers agree with the files, nothing pending, exactly the tables.

    The core stream is checked against the tables of its applied files; with AI on the
    ``ql3_ai`` stream likewise, and its tables are allowed beside the core ones. With AI
    off, any table of the AI stream (its ledger included) is unexpected.
    """
    migrations = load_edge_migrations(sql_root, ai=True)
    streams = [CORE, AI] if ai else [CORE]
    missing: dict[str, frozenset[str]] = {}
    unexpected: dict[str, frozenset[str]] = {}
    pending: dict[str, tuple[str, ...]] = {}
    problems: dict[str, tuple[str, ...]] = {}
    with db.read() as tx:
        present = owned_tables(tx.conn)
        expected_by_stream: dict[str, frozenset[str]] = {}
        for name in streams:
            stream, files = EDGE_STREAMS[name], migrations[name]
            ledger = read_ledger(tx.conn, stream) or {}
            expected_by_stream[name] = expected_tables(
                stream, [m for m in files if m.version in ledger]
            )
            pending[name] = tuple(m.file_name for m in files if m.version not in ledger)
            problems[name] = tuple(ledger_problems(stream, ledger, files))
        everything = frozenset().union(*expected_by_stream.values())
        for name in streams:
            missing[name] = expected_by_stream[name] - present
            unexpected[name] = frozenset()
        unexpected[CORE] = present - everything
        if not ai and AI_LEDGER in present:
            problems[CORE] = (
                *problems[CORE],
                "the ql3_ai feature is installed in this file: open it with ai=True",
            )
    return ReadyReport(
        missing=missing, unexpected=unexpected, pending=pending, problems=problems, qualify=False
    )


__all__ = [
    "AI_LEDGER",
    "CORE_LEDGER",
    "EDGE_SQL_ROOT",
    "EdgeReadyReport",
    "load_edge_migrations",
    "migrate_edge",
    "owned_tables",
    "ready_report",
    "statements",
]


def file_journal_mode(path: Path) -> str:
    """The journal mode an existing SQLite file is in (``wal`` persists in the file; any
    other file reads as ``delete``), read without changing or creating anything. A file
    that is not an SQLite database is ``Misconfigured``."""
    uri = f"{path.resolve().as_uri()}?mode=rw"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        raise translate(exc) from exc
    try:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
    except sqlite3.DatabaseError as exc:
        if "not a database" not in str(exc):
            raise translate(exc) from exc
        raise errors.Misconfigured(
            f"QL3_INVALID_ARGUMENT: {path} is not an SQLite database"
        ) from None
    finally:
        conn.close()
