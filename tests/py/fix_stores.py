"""The ``store`` fixture: one test body, run against every store implementation.

Each parameter yields a fresh, fully migrated store (AI on): ``pg`` is ``PgStore`` on a
clone of the migrated template database, ``edge-wal`` and ``edge-delete`` are
``EdgeStore`` on a new SQLite file in each journal mode. PgStore connects as the superuser
here because one test drives both runtime work (admission) and operator work
(resolution); the role split is proven by the privilege tests, not here.

``pin_clock(store, at)`` pins a store's database clock (test-only: on PostgreSQL it
replaces the body of ``ql3._now()``, which only the owner or a superuser can do).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ql3.edge import EdgeStore
from ql3.edge.db import JournalMode, system_clock
from ql3.store import PgStore

STORE_KINDS = ["pg", "edge-wal", "edge-delete"]
EDGE_JOURNAL_MODES: dict[str, JournalMode] = {"edge-wal": "wal", "edge-delete": "delete"}

Store = PgStore | EdgeStore


def make_edge_store(kind: str, directory: Path, **options: Any) -> EdgeStore:
    """A fresh EdgeStore of ``kind`` (edge-wal or edge-delete) in ``directory``."""
    mode = EDGE_JOURNAL_MODES[kind]
    return EdgeStore(directory / f"ql3-{mode}.db", mode, **options)


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A fresh store of each kind in STORE_KINDS."""
    kind = request.param
    if kind == "pg":
        dsn: str = request.getfixturevalue("db_dsn")
        with PgStore(dsn) as s:
            yield s
        return
    if kind in EDGE_JOURNAL_MODES:
        with make_edge_store(kind, tmp_path) as edge:
            yield edge
        return
    raise AssertionError(f"unknown store kind {kind}")


@pytest.fixture
def every_store(db_dsn: str, tmp_path: Path) -> Iterator[dict[str, Store]]:
    """A fresh store of each kind in STORE_KINDS at once, by kind."""
    stores: dict[str, Store] = {"pg": PgStore(db_dsn)}
    try:
        for kind in EDGE_JOURNAL_MODES:
            stores[kind] = make_edge_store(kind, tmp_path)
        yield stores
    finally:
        for opened in stores.values():
            opened.close()


def pin_clock(store: Store, at: datetime | None) -> None:
    """Pin the store's database clock to ``at`` (None: back to the real clock).

    PostgreSQL: replaces the body of ``ql3._now()`` (core 0004) in this test database, as
    the superuser the test connects as; no ql3 role can. SQLite: the store's test clock.
    """
    if isinstance(store, EdgeStore):
        if at is None:
            store.clock = system_clock
        else:
            pinned = at
            store.clock = lambda: pinned
        return
    body = "SELECT pg_catalog.now()"
    if at is not None:
        if at.tzinfo is None:
            raise ValueError("pin the clock to an aware datetime")
        body = f"SELECT '{at.isoformat()}'::timestamptz"
    with store.pool.connection() as conn:
        conn.execute(
            "CREATE OR REPLACE FUNCTION ql3._now() RETURNS timestamptz"
            f" LANGUAGE sql STABLE PARALLEL SAFE SECURITY INVOKER AS $fn$ {body} $fn$"
        )
