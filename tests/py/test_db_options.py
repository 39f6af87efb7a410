"""ql3's connections add their settings to the caller's connection options, never replace
them: a DSN's ``options`` (``-c role=...``, a search_path) and PGOPTIONS keep working."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from ql3 import db
from ql3.store import PgStore


def _settings(conn: psycopg.Connection[Any], *names: str) -> list[str]:
    rows = [conn.execute(f"SHOW {name}").fetchone() for name in names]
    return [str(row[0]) for row in rows if row is not None]


def test_store_pool_keeps_the_dsn_options_and_adds_its_own(db_dsn: str) -> None:
    dsn = make_conninfo(db_dsn, options="-c work_mem=7MB -c role=ql3_reader")
    timeouts = db.Timeouts(statement_ms=1234, lock_ms=567)
    with PgStore(dsn, timeouts=timeouts) as store, store.pool.connection() as conn:
        assert _settings(
            conn, "work_mem", "role", "statement_timeout", "lock_timeout", "ql3.outbox_notify"
        ) == ["7MB", "ql3_reader", "1234ms", "567ms", "deferred"]
        assert conn.autocommit


def test_connect_keeps_pgoptions_when_the_dsn_has_none(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGOPTIONS", "-c work_mem=9MB")
    with db.connect(db_dsn, timeouts=db.Timeouts(statement_ms=4321)) as conn:
        assert _settings(conn, "work_mem", "statement_timeout") == ["9MB", "4321ms"]


def test_the_dsn_options_win_over_pgoptions_as_libpq_does(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGOPTIONS", "-c work_mem=9MB")
    dsn = make_conninfo(db_dsn, options="-c work_mem=5MB")
    with db.connect(dsn) as conn:
        assert _settings(conn, "work_mem", "statement_timeout") == ["5MB", "5s"]


def test_with_options_without_any_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGOPTIONS", raising=False)
    assert db.with_options("host=h dbname=d", "-c a.b=1") == "-c a.b=1"
    assert db.with_options("host=h options='-c x.y=2'", "-c a.b=1") == "-c x.y=2 -c a.b=1"
    url = "postgresql://u@h/d?options=-c%20x.y%3D3"
    assert db.with_options(url, "-c a.b=1") == "-c x.y=3 -c a.b=1"
