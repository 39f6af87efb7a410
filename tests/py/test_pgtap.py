"""The pgTAP suites (tests/sql) through pg_prove, against the session's PostgreSQL.

One pytest case per file: tests/sql/*.sql run on a database migrated with both streams and
the pgtap and dblink extensions (dblink lets a file drive a second session, for NOTIFY and
SKIP LOCKED); tests/sql/core_only/*.sql on one migrated with the core stream alone.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from ql3.migrate import migrate

ROOT = Path(__file__).resolve().parents[2]
FULL = sorted((ROOT / "tests" / "sql").glob("*.sql"))
CORE_ONLY = sorted((ROOT / "tests" / "sql" / "core_only").glob("*.sql"))


def tap_database(base_dsn: str, name: str, *, with_ai: bool) -> str:
    """A new database migrated for pgTAP, as a URI (pg_prove splits --dbname on '=')."""
    params = conninfo_to_dict(base_dsn)
    dsn = "postgresql://{}@{}:{}/{}".format(
        params.get("user", "postgres"), params.get("host", "127.0.0.1"),
        params.get("port", "5432"), name,
    )  # fmt: skip
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    migrate(dsn, with_ai=with_ai)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgtap")
        conn.execute("CREATE EXTENSION IF NOT EXISTS dblink")
        conn.execute("CREATE SCHEMA IF NOT EXISTS tests")
    return dsn


@pytest.fixture(scope="module")
def tap_databases(base_dsn: str) -> dict[str, str]:
    return {
        "full": tap_database(base_dsn, "ql3_tap", with_ai=True),
        "core": tap_database(base_dsn, "ql3_tap_core", with_ai=False),
    }


def run_pg_prove(dsn: str, path: Path) -> None:
    pg_prove = shutil.which("pg_prove")
    assert pg_prove, "no pg_prove: make test installs libtap-parser-sourcehandler-pgtap-perl"
    # psql's backquoted \set commands in the files run from the repository root.
    done = subprocess.run(
        [pg_prove, "--failures", "--dbname", dsn, str(path.relative_to(ROOT))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{path.name} failed:\n{done.stdout}\n{done.stderr}"
    assert "All tests successful." in done.stdout, done.stdout


@pytest.mark.parametrize("path", FULL, ids=[p.name for p in FULL])
def test_pgtap_file(tap_databases: dict[str, str], path: Path) -> None:
    run_pg_prove(tap_databases["full"], path)


@pytest.mark.parametrize("path", CORE_ONLY, ids=[p.name for p in CORE_ONLY])
def test_pgtap_core_only_file(tap_databases: dict[str, str], path: Path) -> None:
    run_pg_prove(tap_databases["core"], path)


def test_every_pgtap_file_is_collected() -> None:
    # A suite that found no files would pass vacuously.
    assert len(FULL) >= 10 and CORE_ONLY
