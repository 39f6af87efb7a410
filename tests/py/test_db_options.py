"""ql3's connections add their settings to the caller's connection options, never replace
them: a DSN's ``options`` (``-c role=...``, a search_path) and PGOPTIONS keep working."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from ql3 import db, errors
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


# -- TCP keepalives ------------------------------------------------------------------------


def test_pool_and_connect_carry_tcp_keepalives_unless_the_dsn_sets_its_own(db_dsn: str) -> None:
    own = make_conninfo(db_dsn, keepalives_idle="42", tcp_user_timeout="9000")
    timeouts = db.Timeouts(tcp_user_timeout_s=7.5)
    for dsn, idle, user_timeout in ((db_dsn, "10", "7500"), (own, "42", "9000")):
        with PgStore(dsn, timeouts=timeouts) as store, store.pool.connection() as conn:
            params = conn.info.get_parameters()
        with db.connect(dsn, timeouts=timeouts) as single:
            alone = single.info.get_parameters()
        tcp = ("keepalives", "keepalives_idle", "tcp_user_timeout")
        assert [alone[name] for name in tcp] == [params[name] for name in tcp]
        assert params["keepalives"] == "1"
        assert params["keepalives_idle"] == idle
        assert (params["keepalives_interval"], params["keepalives_count"]) == ("5", "3")
        assert params["tcp_user_timeout"] == user_timeout


# -- malformed input -----------------------------------------------------------------------


@pytest.mark.parametrize("dsn", ["bogus", "host='unterminated", "postgresql://[::1"])
def test_a_malformed_dsn_is_invalid_argument_everywhere(dsn: str) -> None:
    calls: list[Callable[[], object]] = [
        lambda: PgStore(dsn),
        lambda: db.make_pool(dsn),
        lambda: db.make_async_pool(dsn),
        lambda: db.connect(dsn),
        lambda: db.with_options(dsn, "-c a.b=1"),
        lambda: db.tcp_settings(dsn, 30.0),
    ]
    for call in calls:
        with pytest.raises(errors.InvalidArgument, match="malformed connection string"):
            call()


@pytest.mark.parametrize(
    "dsn", ["postgresql://app:s3cr%zzet@h/db", "host=h user=app s3cretpassword", "password s3cret"]
)
def test_a_malformed_dsn_never_repeats_the_password_in_its_error(dsn: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="malformed connection string") as caught:
        db.parse_conninfo(dsn)
    assert "s3cr" not in str(caught.value), caught.value


def test_a_nul_in_a_text_argument_is_invalid_argument(db_dsn: str) -> None:
    # psycopg refuses NUL before sending (a DataError without SQLSTATE), as SQLite refuses it.
    with PgStore(db_dsn) as store:
        calls: list[Callable[[], object]] = [
            lambda: store.put_revision("p\x00", "policy_routing", "c", {}, "ops"),
            lambda: store.active_revision("p", "policy_routing", "c\x00"),
            lambda: store.usage_summary("p\x00"),
        ]
        for call in calls:
            with pytest.raises(errors.InvalidArgument, match="NUL"):
                call()


def test_a_server_sqlstate_keeps_its_mapping(db_dsn: str) -> None:
    with db.connect(db_dsn, autocommit=True) as conn:
        with pytest.raises(errors.DatabaseError, match="SQLSTATE 22012"), db.translated():
            conn.execute("SELECT 1 / 0")
        with pytest.raises(errors.InvalidArgument), db.translated():
            conn.execute("SELECT 'x'::uuid")


@pytest.mark.parametrize(
    ("sql", "sqlstate", "kind"),
    [
        # transient refusals: nothing was written, a retry may succeed
        ("DO $$BEGIN RAISE EXCEPTION USING ERRCODE = '40001'; END$$", "40001", errors.Unavailable),
        ("DO $$BEGIN RAISE EXCEPTION USING ERRCODE = '40P01'; END$$", "40P01", errors.Unavailable),
        ("DO $$BEGIN RAISE EXCEPTION USING ERRCODE = '25006'; END$$", "25006", errors.Unavailable),
        # a real mistake stays a database error
        ("SELECT 1 / 0", "22012", errors.DatabaseError),
    ],
)
def test_server_states_keep_their_sqlstate_and_transient_ones_are_unavailable(
    db_dsn: str, sql: str, sqlstate: str, kind: type[errors.Ql3Error]
) -> None:
    with (
        db.connect(db_dsn, autocommit=True) as conn,
        pytest.raises(kind) as caught,
        db.translated(),
    ):
        conn.execute(sql)
    assert caught.value.sqlstate == sqlstate


def test_a_database_without_ql3_says_to_migrate(base_dsn: str) -> None:
    with PgStore(base_dsn) as store:  # the server's own database: never migrated
        with pytest.raises(errors.DatabaseError, match="ql3 migrate"):
            store.active_revision("p", "policy_routing", "c")
        with pytest.raises(errors.DatabaseError, match="ql3 migrate"):
            store.usage_summary("p")
