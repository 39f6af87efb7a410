"""Session-wide PostgreSQL and Redis for pytest: the configured ones or throwaway ones.

PostgreSQL comes from pytest-postgresql: its process fixture starts a throwaway cluster
(through tests/bin/pg_ctl, which runs pg_ctl as the ``postgres`` user when pytest runs as
root), or, when ``QL3_TEST_DSN`` names a superuser DSN, its no-process fixture uses that
server. Redis is a throwaway ``redis-server`` unless ``QL3_TEST_REDIS_URL`` names one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pytest_postgresql import factories
from pytest_postgresql.executors import NoopExecutor, PostgreSQLExecutor

from ql3 import devservers as servers

_counter = itertools.count()

PG_CTL = Path(__file__).resolve().parents[1] / "bin" / "pg_ctl"
BASE_DBNAME = "ql3_test"
# The tests trade durability for speed (pytest-postgresql already passes -F, fsync off).
_SERVER_OPTIONS = (
    "-c synchronous_commit=off -c full_page_writes=off -c max_connections=300 "
    "-c shared_buffers=256MB -c log_min_messages=fatal"
)


def _postgresql_server_factory() -> Callable[..., Iterator[PostgreSQLExecutor | NoopExecutor]]:
    configured = os.environ.get("QL3_TEST_DSN")
    if configured:
        params = conninfo_to_dict(configured)
        return factories.postgresql_noproc(
            host=str(params.get("host", "127.0.0.1")),
            port=str(params.get("port", "5432")),
            user=str(params.get("user", "postgres")),
            password=params.get("password"),  # type: ignore[arg-type]
            dbname=str(params.get("dbname", BASE_DBNAME)),
        )
    return factories.postgresql_proc(
        executable=str(PG_CTL),
        host="127.0.0.1",
        port=None,
        user="postgres",
        dbname=BASE_DBNAME,
        postgres_options=_SERVER_OPTIONS,
    )


postgresql_server = _postgresql_server_factory()


@pytest.fixture(scope="session")
def base_dsn(postgresql_server: PostgreSQLExecutor | NoopExecutor) -> str:
    """A superuser DSN: QL3_TEST_DSN as given, or database ql3_test of the throwaway cluster."""
    configured = os.environ.get("QL3_TEST_DSN")
    if configured:
        return configured
    server = postgresql_server
    admin = make_conninfo(
        host=server.host, port=server.port, user=server.user, dbname=server.maintenance_dbname
    )
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(BASE_DBNAME)))
    return f"postgresql://{server.user}@{server.host}:{server.port}/{BASE_DBNAME}"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """QL3_TEST_REDIS_URL, or a throwaway redis-server removed after the session."""
    configured = os.environ.get("QL3_TEST_REDIS_URL")
    if configured:
        yield configured
        return
    root = Path(tempfile.mkdtemp(prefix="ql3-test-redis-"))
    server = servers.start_redis(root)
    try:
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def with_dbname(dsn: str, dbname: str) -> str:
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)  # type: ignore[arg-type]


def create_database(base: str, *, template: str | None = None, prefix: str = "t") -> str:
    name = f"{prefix}_{os.getpid()}_{next(_counter)}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(base, autocommit=True) as conn:
        tmpl = f" TEMPLATE {template}" if template else ""
        conn.execute(f'CREATE DATABASE "{name}"{tmpl}')
    return with_dbname(base, name)


def drop_database(base: str, dsn: str) -> None:
    name = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(base, autocommit=True) as conn, contextlib.suppress(psycopg.Error):
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def fresh_db(base_dsn: str) -> Iterator[Callable[[], str]]:
    """Factory of empty databases (superuser DSNs), dropped after the test."""
    made: list[str] = []

    def make() -> str:
        dsn = create_database(base_dsn)
        made.append(dsn)
        return dsn

    yield make
    for dsn in made:
        drop_database(base_dsn, dsn)


LOGIN_ROLES = ("runtime", "relay", "operator", "reader")


def role_dsn(dsn: str, role: str) -> str:
    """The DSN of the same database as the LOGIN test user that is a member of ql3_<role>."""
    params = conninfo_to_dict(dsn)
    params["user"] = f"ql3_test_{role}"
    params.pop("password", None)
    return make_conninfo(**params)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def migrated_template(base_dsn: str) -> str:
    """Name of a database migrated with both streams, cloned by ``db_dsn`` for each test.

    Also creates one LOGIN user per group role (ql3_test_runtime, ...), cluster-wide.
    """
    from ql3.migrate import migrate

    dsn = create_database(base_dsn, prefix="tmpl")
    migrate(dsn, with_ai=True)
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        for role in LOGIN_ROLES:
            exists = conn.execute(
                "SELECT 1 FROM pg_roles WHERE rolname = %s", (f"ql3_test_{role}",)
            ).fetchone()
            if not exists:
                conn.execute(f"CREATE ROLE ql3_test_{role} LOGIN IN ROLE ql3_{role}")
    return str(conninfo_to_dict(dsn)["dbname"])


@pytest.fixture
def db_dsn(base_dsn: str, migrated_template: str) -> Iterator[str]:
    """A superuser DSN of a fresh, fully migrated database (a clone of the template)."""
    dsn = create_database(base_dsn, template=migrated_template, prefix="db")
    yield dsn
    drop_database(base_dsn, dsn)
