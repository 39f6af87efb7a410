"""Session-wide PostgreSQL and Redis for pytest: the configured ones or throwaway ones."""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ql3 import devservers as servers

_counter = itertools.count()


@pytest.fixture(scope="session")
def test_servers() -> Iterator[tuple[str, str]]:
    with servers.test_servers() as pair:
        yield pair


@pytest.fixture(scope="session")
def base_dsn(test_servers: tuple[str, str]) -> str:
    """A superuser DSN (QL3_TEST_DSN or the throwaway cluster)."""
    return test_servers[0]


@pytest.fixture(scope="session")
def redis_url(test_servers: tuple[str, str]) -> str:
    return test_servers[1]


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
