"""The migration runner against real PostgreSQL: temporary SQL trees, and the repository's."""

from __future__ import annotations

import argparse
import hashlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from fix_servers import LOGIN_ROLES, role_dsn
from ql3 import cli
from ql3 import migrate as migrate_module
from ql3.errors import InvalidArgument, MigrationError, Unavailable
from ql3.migrate import (
    AI_STREAM,
    CORE_STREAM,
    GROUP_ROLES,
    MIGRATION_LOCK_KEY,
    OWNED_TABLES,
    Applied,
    Durability,
    expected_tables,
    load_stream,
    migrate,
    ready,
    register,
    status,
    tables_created_by_migrations,
)

FreshDb = Callable[[], str]

CORE_TWO = {
    "core/0001_widgets.sql": "CREATE TABLE widgets (id int PRIMARY KEY);\n",
    "core/0002_gadgets.sql": "CREATE TABLE ql3.gadgets (id int PRIMARY KEY);\n",
}
AI_TWO = {
    "ql3_ai/0001_prompts.sql": (
        "-- Prompts refer to widgets.\n-- requires: core 0001\n"
        "CREATE TABLE prompts (widget_id int REFERENCES ql3.widgets);\n"
    ),
    "ql3_ai/0002_replies.sql": (
        "-- requires: core 0002\nCREATE TABLE replies (gadget_id int REFERENCES ql3.gadgets);\n"
    ),
}


def write_tree(root: Path, files: Mapping[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def fetch(dsn: str, query: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def run(dsn: str, query: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(query)


def ledger(dsn: str, stream: str = "core") -> list[tuple[int, str, str]]:
    table = "ql3.schema_history" if stream == "core" else "ql3_ai.feature_history"
    rows = fetch(dsn, f"SELECT version, name, checksum FROM {table} ORDER BY version")
    return [(version, name, checksum) for version, name, checksum in rows]


def versions(dsn: str, stream: str = "core") -> list[int]:
    return [version for version, _, _ in ledger(dsn, stream)]


def schema_exists(dsn: str, schema: str) -> bool:
    return bool(fetch(dsn, "SELECT 1 FROM pg_namespace WHERE nspname = %s", [schema]))


def table_exists(dsn: str, qualified: str) -> bool:
    return fetch(dsn, "SELECT to_regclass(%s) IS NOT NULL", [qualified])[0][0] is True


def with_user(dsn: str, user: str) -> str:
    return make_conninfo(dsn, user=user)


def with_dbname(dsn: str, dbname: str) -> str:
    return make_conninfo(dsn, dbname=dbname)


def drop_database(base_dsn: str, dsn: str) -> None:
    run(base_dsn, f'DROP DATABASE IF EXISTS "{conninfo_to_dict(dsn)["dbname"]}" WITH (FORCE)')


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="ql3")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


@pytest.fixture
def dsn(fresh_db: FreshDb) -> str:
    return fresh_db()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "sql", {**CORE_TWO, **AI_TWO})


# --------------------------------------------------------------------------- applying


def test_fresh_database_gets_every_core_migration_in_order(dsn: str, root: Path) -> None:
    applied = migrate(dsn, sql_root=root)

    assert applied == [Applied("core", 1, "widgets"), Applied("core", 2, "gadgets")]
    assert ledger(dsn) == [
        (1, "widgets", sha256(root / "core/0001_widgets.sql")),
        (2, "gadgets", sha256(root / "core/0002_gadgets.sql")),
    ]


def test_migrating_an_up_to_date_database_applies_nothing(dsn: str, root: Path) -> None:
    migrate(dsn, with_ai=True, sql_root=root)

    assert migrate(dsn, with_ai=True, sql_root=root) == []
    assert versions(dsn) == [1, 2]
    assert versions(dsn, "ql3_ai") == [1, 2]


def test_unqualified_tables_land_in_the_stream_schema(dsn: str, root: Path) -> None:
    migrate(dsn, with_ai=True, sql_root=root)

    assert table_exists(dsn, "ql3.widgets")
    assert table_exists(dsn, "ql3_ai.prompts")
    assert not table_exists(dsn, "public.widgets")


def test_migration_objects_are_owned_by_ql3_owner(dsn: str, root: Path) -> None:
    migrate(dsn, with_ai=True, sql_root=root)

    owners = fetch(
        dsn,
        "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname IN ('ql3', 'ql3_ai')",
    )
    schema_owners = fetch(
        dsn, "SELECT DISTINCT nspowner::regrole::text FROM pg_namespace WHERE nspname LIKE 'ql3%'"
    )
    assert owners == [("ql3_owner",)]
    assert schema_owners == [("ql3_owner",)]


def test_group_roles_exist_as_nologin_after_migrate(dsn: str, root: Path) -> None:
    migrate(dsn, sql_root=root)

    roles = fetch(
        dsn,
        "SELECT rolname, rolcanlogin FROM pg_roles WHERE rolname = ANY(%s) ORDER BY rolname",
        [list(GROUP_ROLES)],
    )
    assert roles == [(role, False) for role in sorted(GROUP_ROLES)]


def test_ledgers_are_readable_by_every_group_role_and_writable_by_none(
    dsn: str, root: Path
) -> None:
    migrate(dsn, with_ai=True, sql_root=root)

    grants = fetch(
        dsn,
        """
        SELECT table_schema, grantee, privilege_type FROM information_schema.table_privileges
         WHERE table_name IN ('schema_history', 'feature_history') AND grantee <> 'ql3_owner'
         ORDER BY table_schema, grantee
        """,
    )
    readers = sorted(f"ql3_{role}" for role in LOGIN_ROLES)
    assert grants == [(schema, role, "SELECT") for schema in ("ql3", "ql3_ai") for role in readers]


def test_schemas_are_usable_by_every_group_role(dsn: str, root: Path) -> None:
    migrate(dsn, with_ai=True, sql_root=root)

    for schema in ("ql3", "ql3_ai"):
        for role in GROUP_ROLES:
            usable = fetch(dsn, "SELECT has_schema_privilege(%s, %s, 'USAGE')", [role, schema])
            assert usable == [(True,)], (role, schema)


def test_a_non_superuser_with_createrole_can_migrate(
    base_dsn: str, fresh_db: FreshDb, root: Path
) -> None:
    migrator = f"migrator_{uuid.uuid4().hex[:8]}"
    run(base_dsn, f"CREATE ROLE {migrator} LOGIN CREATEROLE")
    dsn = fresh_db()
    try:
        run(dsn, f"GRANT CREATE ON DATABASE {fetch(dsn, 'SELECT current_database()')[0][0]} "
                 f"TO {migrator}")  # fmt: skip
        applied = migrate(with_user(dsn, migrator), with_ai=True, sql_root=root)

        assert len(applied) == 4
        assert ready(with_user(dsn, migrator), with_ai=True, sql_root=root).ok
    finally:
        drop_database(base_dsn, dsn)
        run(base_dsn, f"DROP ROLE {migrator}")


# --------------------------------------------------------------------------- refusals


def test_edited_migration_is_refused_naming_both_checksums(dsn: str, root: Path) -> None:
    migrate(dsn, sql_root=root)
    edited = root / "core/0001_widgets.sql"
    stored = sha256(edited)
    edited.write_text("CREATE TABLE widgets (id bigint PRIMARY KEY);\n")

    with pytest.raises(MigrationError) as refused:
        migrate(dsn, sql_root=root)

    message = str(refused.value)
    assert "checksum drift in core version 1" in message
    assert "0001_widgets.sql" in message
    assert stored in message
    assert sha256(edited) in message


def test_database_ahead_of_the_code_is_refused(dsn: str, root: Path) -> None:
    migrate(dsn, sql_root=root)
    (root / "core/0002_gadgets.sql").unlink()

    with pytest.raises(MigrationError, match="database is ahead of the code: core version 2 is "
                       "applied but this ql3 only knows up to 1"):  # fmt: skip
        migrate(dsn, sql_root=root)


def test_refusal_applies_nothing_from_any_stream(dsn: str, root: Path) -> None:
    migrate(dsn, with_ai=True, targets={"core": 1, "ql3_ai": 1}, sql_root=root)
    (root / "ql3_ai/0001_prompts.sql").write_text("-- requires: core 0001\nSELECT 1;\n")

    with pytest.raises(MigrationError, match="checksum drift in ql3_ai version 1"):
        migrate(dsn, with_ai=True, sql_root=root)

    assert versions(dsn) == [1]


def test_badly_named_file_is_refused_before_touching_the_database(dsn: str, tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"core/0001_Widgets-table.sql": "SELECT 1;"})

    with pytest.raises(MigrationError, match=r"0001_Widgets-table.sql is badly named"):
        migrate(dsn, sql_root=root)

    assert not schema_exists(dsn, "ql3")


def test_gap_in_numbering_is_refused(dsn: str, tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"core/0001_a.sql": "SELECT 1;", "core/0003_c.sql": "SELECT 1;"})

    with pytest.raises(MigrationError, match=r"expected 0002 but found 0003_c.sql"):
        migrate(dsn, sql_root=root)


def test_two_files_with_one_version_are_refused(dsn: str, tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"core/0001_a.sql": "SELECT 1;", "core/0001_b.sql": "SELECT 1;"})

    with pytest.raises(
        MigrationError, match=r"two migrations numbered 0001: 0001_a.sql and 0001_b"
    ):
        migrate(dsn, sql_root=root)


def test_non_sql_files_in_a_stream_directory_are_ignored(dsn: str, tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"core/README.md": "notes", "core/0001_a.sql": "SELECT 1;"})

    assert migrate(dsn, sql_root=root) == [Applied("core", 1, "a")]


def test_target_beyond_the_newest_file_is_refused(dsn: str, root: Path) -> None:
    with pytest.raises(MigrationError, match="core has no version 3"):
        migrate(dsn, targets={"core": 3}, sql_root=root)


def test_target_naming_ql3_ai_without_with_ai_is_refused(dsn: str, root: Path) -> None:
    with pytest.raises(MigrationError, match="with_ai is off"):
        migrate(dsn, targets={"ql3_ai": 1}, sql_root=root)

    assert not schema_exists(dsn, "ql3_ai")


# --------------------------------------------------------------------------- failures


def test_failing_migration_leaves_no_ledger_row_and_no_table(dsn: str, tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {
            "core/0001_widgets.sql": "CREATE TABLE widgets (id int);\n",
            "core/0002_broken.sql": "CREATE TABLE gadgets (id int);\nSELECT 1 / 0;\n",
        },
    )

    with pytest.raises(MigrationError) as failed:
        migrate(dsn, sql_root=root)

    assert "core migration 0002_broken.sql failed" in str(failed.value)
    assert "division by zero" in str(failed.value)
    assert versions(dsn) == [1]
    assert not table_exists(dsn, "ql3.gadgets")


def test_failure_message_names_the_line_of_a_syntax_error(dsn: str, tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"core/0001_typo.sql": "SELECT 1;\n\nSELEKT 2;\n"})

    with pytest.raises(MigrationError, match=r"0001_typo.sql failed at line 3"):
        migrate(dsn, sql_root=root)


def test_migration_that_changes_its_role_is_rolled_back(dsn: str, tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"core/0001_escape.sql": "RESET ROLE;\nCREATE TABLE t (a int);\n"})

    with pytest.raises(MigrationError, match="changed the role it runs as"):
        migrate(dsn, sql_root=root)

    assert versions(dsn) == []
    assert not table_exists(dsn, "ql3.t")


@pytest.mark.parametrize(
    "control", ["COMMIT", "ROLLBACK", "END", "abort", "BEGIN", "start transaction"]
)
def test_transaction_control_in_a_file_is_refused_before_anything_runs(
    dsn: str, tmp_path: Path, control: str
) -> None:
    root = write_tree(
        tmp_path,
        {
            "core/0001_widgets.sql": "CREATE TABLE widgets (id int);\n",
            "core/0002_commit.sql": (
                f"CREATE TABLE t1 (x int);\n{control};\nCREATE TABLE t2 (x int);\nSELECT 1 / 0;\n"
            ),
        },
    )

    for _ in range(2):  # refused again: never "up to date"
        with pytest.raises(MigrationError, match=r"0002_commit\.sql contains transaction control"):
            migrate(dsn, sql_root=root)

    assert not table_exists(dsn, "ql3.schema_history")  # not even the ledger was created
    for table in ("widgets", "t1", "t2"):
        assert not table_exists(dsn, f"ql3.{table}") and not table_exists(dsn, f"public.{table}")


def test_transaction_words_in_comments_strings_bodies_and_names_are_not_control(
    dsn: str, tmp_path: Path
) -> None:
    text = """-- COMMIT;
/* ROLLBACK; /* END; */ */
SELECT 'COMMIT;', E'\\'; END;', $tag$ ROLLBACK; $tag$;
CREATE TABLE "end" ("commit" int);
DO $$ BEGIN PERFORM 1; END $$;
CREATE FUNCTION plain() RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN 1; END $$;
CREATE FUNCTION atomic() RETURNS int LANGUAGE sql
BEGIN ATOMIC
  SELECT CASE WHEN true THEN 1 END;
END;
"""
    root = write_tree(tmp_path, {"core/0001_words.sql": text})

    assert migrate(dsn, sql_root=root) == [Applied("core", 1, "words")]
    assert fetch(dsn, "SELECT ql3.atomic(), ql3.plain()") == [(1, 1)]


def test_migration_that_commits_by_itself_is_reported(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file the up-front check missed: the runner still notices after the fact.
    monkeypatch.setattr(migrate_module, "refuse_transaction_control", lambda migration: None)
    root = write_tree(tmp_path, {"core/0001_commit.sql": "COMMIT;\nBEGIN;\n"})

    with pytest.raises(MigrationError, match="ended the runner's transaction"):
        migrate(dsn, sql_root=root)


@pytest.mark.parametrize(
    "text",
    [
        "CREATE TABLE t1 (x int);\nCOMMIT;\nCREATE TABLE t2 (x int);\nSELECT 1 / 0;\n",
        "CREATE TABLE t1 (x int);\nCOMMIT;\nBEGIN;\nSELECT 1 / 0;\n",
    ],
)
def test_a_file_that_ended_the_runners_transaction_then_failed_is_not_called_rolled_back(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setattr(migrate_module, "refuse_transaction_control", lambda migration: None)
    root = write_tree(tmp_path, {"core/0001_commit.sql": text})

    with pytest.raises(MigrationError, match="ended the runner's transaction") as failed:
        migrate(dsn, sql_root=root)

    assert "rolled back" not in str(failed.value)
    assert versions(dsn) == [1]  # what the message warns of: the COMMIT kept the ledger row


def test_empty_migration_is_recorded(dsn: str, tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"core/0001_placeholder.sql": "-- intentionally empty\n"})

    assert migrate(dsn, sql_root=root) == [Applied("core", 1, "placeholder")]


# --------------------------------------------------------------------------- streams


def test_streams_apply_interleaved_across_restarts(dsn: str, root: Path) -> None:
    steps = [
        ({"core": 1}, False, [Applied("core", 1, "widgets")]),
        ({"core": 1, "ql3_ai": 1}, True, [Applied("ql3_ai", 1, "prompts")]),
        ({"core": 2, "ql3_ai": 1}, True, [Applied("core", 2, "gadgets")]),
        ({"core": 2, "ql3_ai": 2}, True, [Applied("ql3_ai", 2, "replies")]),
    ]
    for targets, with_ai, expected in steps:
        assert migrate(dsn, with_ai=with_ai, targets=targets, sql_root=root) == expected

    assert versions(dsn) == [1, 2]
    assert versions(dsn, "ql3_ai") == [1, 2]
    assert ready(dsn, with_ai=True, sql_root=root).ok


def test_ai_migration_is_refused_while_core_is_below_its_requirement(dsn: str, root: Path) -> None:
    migrate(dsn, targets={"core": 1}, sql_root=root)

    with pytest.raises(MigrationError, match=r"0002_replies.sql requires core 0002"):
        migrate(dsn, with_ai=True, targets={"core": 1}, sql_root=root)

    assert not schema_exists(dsn, "ql3_ai")
    assert versions(dsn) == [1]


def test_requirement_on_an_unknown_core_version_is_refused(dsn: str, tmp_path: Path) -> None:
    root = write_tree(
        tmp_path, {"core/0001_a.sql": "SELECT 1;", "ql3_ai/0001_b.sql": "-- requires: core 0002\n"}
    )

    with pytest.raises(MigrationError, match="only knows core up to 0001"):
        migrate(dsn, with_ai=True, sql_root=root)


def test_without_ai_nothing_of_ql3_ai_exists(dsn: str, root: Path) -> None:
    migrate(dsn, sql_root=root)

    assert not schema_exists(dsn, "ql3_ai")
    assert [name for _, name, _ in ledger(dsn)] == ["widgets", "gadgets"]


def test_ai_stream_never_writes_the_core_ledger(dsn: str, root: Path) -> None:
    migrate(dsn, sql_root=root)
    core_rows = ledger(dsn)

    migrate(dsn, with_ai=True, sql_root=root)

    assert ledger(dsn) == core_rows
    assert fetch(dsn, "SELECT DISTINCT stream FROM ql3_ai.feature_history") == [("ql3_ai",)]


def test_concurrent_migrators_apply_each_version_exactly_once(dsn: str, root: Path) -> None:
    migrators = 6
    start = threading.Barrier(migrators)
    results: list[list[Applied]] = []
    errors: list[BaseException] = []

    def migrator() -> None:
        start.wait()
        try:
            results.append(migrate(dsn, with_ai=True, sql_root=root))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=migrator) for _ in range(migrators)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    applied = sorted((a.stream, a.version) for result in results for a in result)
    assert applied == [("core", 1), ("core", 2), ("ql3_ai", 1), ("ql3_ai", 2)]
    assert versions(dsn) == [1, 2]
    assert versions(dsn, "ql3_ai") == [1, 2]


# --------------------------------------------------------------------------- the lock


@pytest.fixture
def lock_holder(base_dsn: str, migrated_template: str, dsn: str) -> Iterator[psycopg.Connection]:
    """A session of an ordinary login (ql3_test_reader: any login may take an advisory
    lock) holding the migration lock of ``dsn`` until the test ends."""
    conn = psycopg.connect(
        role_dsn(dsn, "reader"), autocommit=True, application_name="forgotten-psql"
    )
    with conn:
        conn.execute("SELECT pg_advisory_lock(%s)", [MIGRATION_LOCK_KEY])
        yield conn


def test_migrate_gives_up_on_a_held_lock_naming_the_lock_and_its_holder(
    dsn: str,
    cli_root: Path,
    lock_holder: psycopg.Connection,
    capsys: pytest.CaptureFixture[str],
) -> None:
    started = time.monotonic()
    assert run_cli("migrate", "--dsn", dsn, "--lock-timeout", "0.5") == 1
    waited = time.monotonic() - started

    assert 0.5 <= waited < 5.0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ql3 migrate: QL3_UNAVAILABLE: "), err
    assert f"advisory lock {MIGRATION_LOCK_KEY}" in err, err
    holder = (
        f"pid {lock_holder.info.backend_pid} (user ql3_test_reader, application forgotten-psql)"
    )
    assert holder in err, err
    assert not schema_exists(dsn, "ql3")  # nothing ran


def test_the_lock_timeout_comes_from_the_environment_and_bounds_every_wait(
    dsn: str,
    root: Path,
    cli_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    migrate(dsn, sql_root=root, targets={"core": 1})
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", [MIGRATION_LOCK_KEY])
        monkeypatch.setenv("QL3_MIGRATE_LOCK_TIMEOUT", "0.3")
        started = time.monotonic()
        assert run_cli("migrate", "--dsn", dsn) == 1
        assert time.monotonic() - started < 5.0
        assert f"pid {holder.info.backend_pid} (user postgres" in capsys.readouterr().err
        with pytest.raises(Unavailable, match=f"advisory lock {MIGRATION_LOCK_KEY}"):
            migrate(dsn, sql_root=root, lock_timeout=0.2)
    assert versions(dsn) == [1]


def test_a_lock_released_in_time_is_taken_and_the_files_keep_the_sessions_lock_timeout(
    dsn: str, tmp_path: Path
) -> None:
    root = write_tree(
        tmp_path / "sql",
        {
            "core/0001_check.sql": (
                "DO $$ BEGIN IF current_setting('lock_timeout') <> '1234ms' THEN "
                "RAISE EXCEPTION 'lock_timeout is %', current_setting('lock_timeout'); "
                "END IF; END $$;\n"
            )
        },
    )
    session = make_conninfo(dsn, options="-c lock_timeout=1234")
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", [MIGRATION_LOCK_KEY])
        timer = threading.Timer(
            0.5, lambda: holder.execute("SELECT pg_advisory_unlock(%s)", [MIGRATION_LOCK_KEY])
        )
        timer.start()
        try:
            applied = migrate(session, sql_root=root, lock_timeout=30)
        finally:
            timer.join()

    assert [a.file_name for a in applied] == ["0001_check.sql"]


@pytest.mark.parametrize(
    ("flag", "variable", "named"),
    [
        ("0", None, "--lock-timeout must be a number of seconds > 0"),
        ("nan", None, "--lock-timeout must be a number of seconds"),
        ("86401", None, "at most 86400"),
        (None, "abc", "QL3_MIGRATE_LOCK_TIMEOUT='abc' is not a number of seconds"),
        (None, "-1", "QL3_MIGRATE_LOCK_TIMEOUT must be a number of seconds"),
    ],
)
def test_a_bad_lock_timeout_is_exit_2_naming_where_it_came_from(
    cli_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flag: str | None,
    variable: str | None,
    named: str,
) -> None:
    if variable is not None:
        monkeypatch.setenv("QL3_MIGRATE_LOCK_TIMEOUT", variable)
    argv = ["migrate", "--dsn", "dbname=never_reached"]
    assert run_cli(*argv, *(["--lock-timeout", flag] if flag else [])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ql3 migrate: QL3_INVALID_ARGUMENT: ") and named in err, err


# --------------------------------------------------------------------------- status, ready


def test_status_lists_applied_and_pending_per_stream(dsn: str, root: Path) -> None:
    migrate(dsn, targets={"core": 1}, sql_root=root)

    current = status(dsn, sql_root=root)

    assert current["core"].applied == ("0001_widgets.sql",)
    assert current["core"].pending == ("0002_gadgets.sql",)
    assert not current["ql3_ai"].installed
    assert current["ql3_ai"].pending == ("0001_prompts.sql", "0002_replies.sql")


def test_ready_after_migrate(dsn: str, root: Path) -> None:
    migrate(dsn, with_ai=True, sql_root=root)

    report = ready(dsn, with_ai=True, sql_root=root)

    assert report.ok, report.describe()
    assert report.describe() == "ready"


def test_ready_reports_pending_migrations(dsn: str, root: Path) -> None:
    migrate(dsn, targets={"core": 1}, sql_root=root)

    report = ready(dsn, with_ai=False, sql_root=root)

    assert not report.ok
    assert report.pending["core"] == ("0002_gadgets.sql",)
    assert "core: pending migrations: 0002_gadgets.sql" in report.describe()


def test_ready_reports_a_stray_table_as_unexpected(dsn: str, root: Path) -> None:
    migrate(dsn, sql_root=root)
    run(dsn, "CREATE TABLE ql3.stray (id int)")

    report = ready(dsn, with_ai=False, sql_root=root)

    assert not report.ok
    assert report.unexpected["core"] == {"stray"}
    assert "core: unexpected tables: ql3.stray" in report.describe()


def test_ready_reports_a_dropped_table_as_missing(dsn: str, root: Path) -> None:
    migrate(dsn, sql_root=root)
    run(dsn, "DROP TABLE ql3.gadgets")

    report = ready(dsn, with_ai=False, sql_root=root)

    assert report.missing["core"] == {"gadgets"}
    assert "core: missing tables: ql3.gadgets" in report.describe()


def test_ready_reports_checksum_drift(dsn: str, root: Path) -> None:
    migrate(dsn, sql_root=root)
    (root / "core/0002_gadgets.sql").write_text("CREATE TABLE ql3.gadgets (id bigint);\n")

    report = ready(dsn, with_ai=False, sql_root=root)

    assert not report.ok
    assert "checksum drift in core version 2" in report.describe()


def test_ready_without_ai_ignores_the_ai_stream(dsn: str, root: Path) -> None:
    migrate(dsn, sql_root=root)

    assert ready(dsn, with_ai=False, sql_root=root).ok
    assert ready(dsn, with_ai=True, sql_root=root).pending["ql3_ai"] == (
        "0001_prompts.sql",
        "0002_replies.sql",
    )


def test_ready_follows_drops_and_renames_in_later_migrations(dsn: str, tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {
            "core/0001_tables.sql": "CREATE TABLE a (x int); CREATE TABLE b (x int);\n",
            "core/0002_reshape.sql": "DROP TABLE IF EXISTS ql3.a;\nALTER TABLE b RENAME TO c;\n",
        },
    )
    migrate(dsn, sql_root=root)

    assert ready(dsn, with_ai=False, sql_root=root).ok


def test_expected_tables_skip_comments_strings_and_function_bodies_but_read_do_blocks(
    tmp_path: Path,
) -> None:
    text = """
    -- CREATE TABLE commented (x int);
    /* CREATE TABLE /* nested */ block_commented (x int); */
    COMMENT ON SCHEMA ql3 IS 'CREATE TABLE in_a_string (x int)';
    CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $body$ CREATE TABLE in_body (x int) $body$;
    DO $$ BEGIN CREATE TABLE IF NOT EXISTS "Made_In_Do" (x int); END $$;
    CREATE UNLOGGED TABLE ql3.unlogged (x int);
    CREATE TEMP TABLE scratch (x int);
    CREATE TABLE other_schema.elsewhere (x int);
    CREATE TABLE IF NOT EXISTS Plain (x int);
    """
    root = write_tree(tmp_path, {"core/0001_mixed.sql": text})

    tables = expected_tables(CORE_STREAM, load_stream(root, CORE_STREAM))

    assert tables == {"schema_history", "Made_In_Do", "unlogged", "plain"}


def test_expected_tables_of_the_ai_stream_include_its_ledger(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"ql3_ai/0001_a.sql": "CREATE TABLE ql3_ai.prompts (x int);"})

    assert expected_tables(AI_STREAM, load_stream(root, AI_STREAM)) == {
        "feature_history",
        "prompts",
    }


# --------------------------------------------------------------------------- the repository


def test_repository_migrations_applied_twice_change_nothing(dsn: str) -> None:
    migrate(dsn, with_ai=True)

    assert migrate(dsn, with_ai=True) == []


def test_repository_migrations_leave_a_ready_database(dsn: str) -> None:
    migrate(dsn, with_ai=True)

    report = ready(dsn, with_ai=True)

    assert report.ok, report.describe()


def test_repository_core_migrations_create_nothing_of_ql3_ai(dsn: str) -> None:
    migrate(dsn)

    assert not schema_exists(dsn, "ql3_ai")
    assert ready(dsn, with_ai=False).ok
    core_files = sorted(p.name for p in (migrate_module.default_sql_root() / "core").glob("*.sql"))
    assert [f"{v:04d}_{name}.sql" for v, name, _ in ledger(dsn)] == core_files
    ai_relations = fetch(
        dsn,
        "SELECT relname FROM pg_class WHERE relname IN ('feature_history', 'usage_ledger')"
        " OR relname LIKE 'model_invocation%'",
    )
    assert ai_relations == []


def test_every_table_the_repository_migrations_create_is_declared_in_owned_tables() -> None:
    for stream, tables in tables_created_by_migrations().items():
        assert tables <= OWNED_TABLES[stream], (stream, sorted(tables - OWNED_TABLES[stream]))


# --------------------------------------------------------------------------- CLI


@pytest.fixture
def cli_root(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(migrate_module, "default_sql_root", lambda: root)
    return root


def test_cli_migrate_prints_each_applied_migration(
    dsn: str, cli_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("migrate", "--dsn", dsn, "--target", "core=1") == 0

    assert capsys.readouterr().out == "applied core 0001_widgets.sql\n"


def test_cli_migrate_says_up_to_date_when_nothing_is_pending(
    dsn: str, cli_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_cli("migrate", "--dsn", dsn)
    capsys.readouterr()

    assert run_cli("migrate", "--dsn", dsn) == 0
    assert capsys.readouterr().out == "up to date\n"


def test_cli_target_naming_ql3_ai_migrates_the_ai_stream(
    dsn: str, cli_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("migrate", "--dsn", dsn, "--target", "core=1", "ql3_ai=1") == 0

    assert capsys.readouterr().out.splitlines() == [
        "applied core 0001_widgets.sql",
        "applied ql3_ai 0001_prompts.sql",
    ]


def test_cli_migrate_reads_ql3_dsn_from_the_environment(
    dsn: str, cli_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QL3_DSN", dsn)

    assert run_cli("migrate", "--with-ai") == 0
    assert versions(dsn, "ql3_ai") == [1, 2]


def test_cli_without_a_database_exits_2(
    cli_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("QL3_DSN", raising=False)

    assert run_cli("migrate") == 2
    assert run_cli("ready") == 2
    assert "pass --dsn or set QL3_DSN" in capsys.readouterr().err


def test_a_malformed_dsn_is_invalid_argument_without_a_traceback(
    cli_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidArgument, match="malformed connection string"):
        migrate("bogus", sql_root=cli_root)
    with pytest.raises(InvalidArgument, match="malformed connection string"):
        ready("host='unterminated", with_ai=False, sql_root=cli_root)

    assert run_cli("migrate", "--dsn", "bogus") == 2
    monkeypatch.setenv("QL3_DSN", "postgresql://[::1")
    assert run_cli("ready") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(
        line.startswith(f"error: ql3 {command}: QL3_INVALID_ARGUMENT: malformed connection")
        for line, command in zip(err, ("migrate", "ready"), strict=True)
    )


def test_cli_rejects_a_malformed_target(cli_root: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        run_cli("migrate", "--dsn", "dbname=x", "--target", "core:1")

    assert exited.value.code == 2


def test_cli_migrate_refusal_exits_1(
    dsn: str, cli_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_cli("migrate", "--dsn", dsn)
    (cli_root / "core/0002_gadgets.sql").unlink()

    assert run_cli("migrate", "--dsn", dsn) == 1
    assert "database is ahead of the code" in capsys.readouterr().err


def test_cli_ready_exits_0_and_says_ready(
    dsn: str, cli_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_cli("migrate", "--dsn", dsn, "--with-ai")
    capsys.readouterr()

    assert run_cli("ready", "--dsn", dsn, "--with-ai") == 0
    first, durability_line, end = capsys.readouterr().out.split("\n")
    assert (first, end) == ("ready", "")
    assert durability_line.startswith("durability: synchronous_commit=")


def test_cli_ready_reports_that_no_synchronous_standby_is_connected(
    dsn: str, cli_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The test server has no standby: ready says what that costs and, only when asked to
    require one, fails (D49)."""
    run_cli("migrate", "--dsn", dsn, "--with-ai")
    capsys.readouterr()
    assert run_cli("ready", "--dsn", dsn, "--with-ai") == 0
    out = capsys.readouterr().out
    assert "sync_standbys=0" in out and "synchronous_standby_names=(none)" in out
    assert "no synchronous standby is connected" in out and "can be lost" in out

    assert run_cli("ready", "--dsn", dsn, "--with-ai", "--require-sync-standby") == 1
    err = capsys.readouterr().err
    assert err == (
        "error: ql3 ready: no synchronous standby is connected (--require-sync-standby)\n"
    )


def test_the_require_sync_standby_variable_fails_ready_as_the_flag_does(
    dsn: str, cli_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_cli("migrate", "--dsn", dsn, "--with-ai")
    monkeypatch.setenv("QL3_REQUIRE_SYNC_STANDBY", "1")
    assert run_cli("ready", "--dsn", dsn, "--with-ai") == 1
    monkeypatch.setenv("QL3_REQUIRE_SYNC_STANDBY", "0")
    assert run_cli("ready", "--dsn", dsn, "--with-ai") == 0


def test_durability_counts_only_what_makes_commits_wait() -> None:
    waiting = Durability(
        synchronous_commit="on", synchronous_standby_names="FIRST 1 (s1)", sync_standbys=1
    )
    assert waiting.problem() is None and waiting.commits_wait
    assert "on a synchronous standby too" in waiting.describe()
    local = replace(waiting, synchronous_commit="local")
    assert local.problem() == "synchronous_commit is local: commits do not wait"
    hidden = replace(waiting, sync_standbys=None)
    assert "pg_monitor" in str(hidden.problem()) and "sync_standbys=unknown" in hidden.describe()


def test_cli_ready_exits_1_and_prints_the_differences(
    dsn: str, cli_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_cli("migrate", "--dsn", dsn)
    run(dsn, "CREATE TABLE ql3.stray (id int)")
    capsys.readouterr()

    assert run_cli("ready", "--dsn", dsn, "--with-ai") == 1
    out = capsys.readouterr().out
    assert "core: unexpected tables: ql3.stray" in out
    assert "ql3_ai: pending migrations: 0001_prompts.sql, 0002_replies.sql" in out
    assert "ql3_ai: missing tables: ql3_ai.feature_history" in out


@pytest.mark.parametrize("role", LOGIN_ROLES)
def test_ql3_ready_works_for_a_login_in_each_group_role(
    db_dsn: str, role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for with_ai in ([], ["--with-ai"]):
        assert cli.main(["ready", "--dsn", role_dsn(db_dsn, role), *with_ai]) == 0
        out, err = capsys.readouterr()
        assert (out.split("\n")[0], err) == ("ready", "")
        assert "sync_standbys=0" in out  # every group role sees the walsenders (D49)


def test_cli_ready_escapes_control_characters_in_table_names(
    dsn: str, cli_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_cli("migrate", "--dsn", dsn)
    run(dsn, 'CREATE TABLE ql3."stray\x1b[2J\x9b31m" (id int)')
    capsys.readouterr()

    assert run_cli("ready", "--dsn", dsn) == 1
    out = capsys.readouterr().out
    assert "core: unexpected tables: ql3.stray\\x1b[2J\\x9b31m" in out, out
    assert "\x1b" not in out and "\x9b" not in out


def test_cli_reports_an_unreachable_database_and_exits_1(
    base_dsn: str, cli_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = with_dbname(base_dsn, f"no_such_db_{uuid.uuid4().hex[:8]}")

    assert run_cli("ready", "--dsn", missing) == 1
    assert "cannot connect to the database" in capsys.readouterr().err
