"""The database-free half of ``ql3.migrate``: migration files, streams, ledger checks and
the tables a set of files creates.

Nothing here talks to a database or imports a driver, so the SQLite edge shim
(``ql3.edge.schema``) applies the same rules as the PostgreSQL runner without loading
psycopg: file names, sha256 checksums, contiguous numbering, ``-- requires: core NNNN``
headers, drift and a ledger ahead of the code, and readiness reports. ``ql3.migrate``
re-exports every name, which is where the PostgreSQL runner and the CLI live.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from ql3.errors import MigrationError

CORE = "core"
AI = "ql3_ai"


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
            "project_grants",
        }
    ),
    AI: frozenset(
        {
            "feature_history",
            "model_invocation_starts",
            "model_invocation_completions",
            "model_invocation_resolutions",
            "usage_ledger",
            "resolver_identities",
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
-- Every ql3 role may read the ledgers: `ql3 ready` works for any of them.
GRANT SELECT ON ql3.schema_history TO ql3_runtime, ql3_relay, ql3_operator, ql3_reader;
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
GRANT SELECT ON ql3_ai.feature_history TO ql3_runtime, ql3_relay, ql3_operator, ql3_reader;
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


__all__ = [
    "AI",
    "AI_STREAM",
    "CORE",
    "CORE_STREAM",
    "MIGRATION_FILE_NAME",
    "OWNED_TABLES",
    "REQUIRES_HEADER",
    "STREAMS",
    "Applied",
    "LedgerRow",
    "Migration",
    "ReadyReport",
    "Stream",
    "StreamStatus",
    "TableDdl",
    "executed_sql",
    "expected_tables",
    "identifier",
    "ledger_problems",
    "load_migrations",
    "load_stream",
    "migration_file_name",
    "read_migration",
    "refuse_ledger_problems",
    "refuse_numbering_gaps",
    "refuse_unknown_core_requirement",
    "required_core_version",
    "split_name",
    "table_ddl",
]
