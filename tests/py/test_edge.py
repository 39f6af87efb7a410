"""What only the SQLite shim has: its migrations, ledgers and exact readiness, its
immutability triggers, its pragmas and busy timeout, its in-process relay and cache.
(Everything both stores share is in test_conformance.py.)"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from ql3 import errors
from ql3.edge import EdgeRelay, EdgeRevisionCache, EdgeStore
from ql3.edge.db import Database
from ql3.edge.schema import EDGE_SQL_ROOT, migrate_edge, owned_tables, ready_report
from ql3.invocations import (
    Usage,
    admission_command,
    completion_command,
    request_digest,
    resolution_command,
)
from ql3.relay import event_message

FAMILY = "policy_routing"
CORE_TABLES = {
    "schema_history", "contract_families", "contract_revisions", "revision_revocations",
    "active_revisions", "contract_outbox", "runs", "step_runs", "run_events",
    "step_run_mutations",
}  # fmt: skip
AI_TABLES = {
    "ql3_ai_feature_history", "model_invocation_starts", "model_invocation_completions",
    "model_invocation_resolutions", "usage_ledger",
}  # fmt: skip


def rows(path: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [tuple(r) for r in conn.execute(sql, params).fetchall()]


def tables(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return set(owned_tables(conn))


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "edge.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[EdgeStore]:
    with EdgeStore(db_path) as opened:
        yield opened


# -- migrations, ledgers, readiness -----------------------------------------------------------


def test_ai_off_creates_no_ai_table_and_no_ai_ledger_row(db_path: Path) -> None:
    with EdgeStore(db_path, ai=False) as store:
        assert store.ready().ok
        with pytest.raises(errors.DatabaseError, match="ai=False"):
            store.admit_invocation({})
    assert tables(db_path) == CORE_TABLES
    assert rows(db_path, "SELECT version, name FROM schema_history ORDER BY version") == [
        (1, "canonical"), (2, "contracts"), (3, "runs"), (4, "test_clock"),
        (5, "prune_far_cutoff"), (6, "step_checks_in_functions"), (7, "validate_step_checks"),
    ]  # fmt: skip


def test_ai_on_later_adds_its_tables_with_its_own_ledger(db_path: Path) -> None:
    EdgeStore(db_path, ai=False).close()
    with EdgeStore(db_path, ai=True) as store:
        assert [(a.stream, a.version) for a in store.migrate()] == []
        assert store.ready().ok
    assert tables(db_path) == CORE_TABLES | AI_TABLES
    assert rows(db_path, "SELECT stream, version, name FROM ql3_ai_feature_history") == [
        ("ql3_ai", 1, "invocations"), ("ql3_ai", 2, "checks_in_functions"),
        ("ql3_ai", 3, "validate_completion_check"),
    ]  # fmt: skip
    assert rows(db_path, "SELECT count(*) FROM schema_history") == [(7,)]
    checksums = rows(db_path, "SELECT checksum FROM ql3_ai_feature_history ORDER BY version")
    files = sorted((EDGE_SQL_ROOT / "ql3_ai").glob("*.sql"))
    assert checksums == [(hashlib.sha256(f.read_bytes()).hexdigest(),) for f in files]


def test_a_file_with_the_ai_feature_is_not_ready_with_ai_off(db_path: Path) -> None:
    EdgeStore(db_path, ai=True).close()
    with pytest.raises(errors.MigrationError, match="open it with ai=True"):
        EdgeStore(db_path, ai=False)


def test_an_unknown_table_makes_the_file_unready(db_path: Path) -> None:
    EdgeStore(db_path).close()
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        conn.execute("CREATE TABLE stowaway (id INTEGER)")
        conn.commit()
    with pytest.raises(errors.MigrationError, match="unexpected tables: stowaway"):
        EdgeStore(db_path)


def test_a_missing_table_makes_the_file_unready(db_path: Path) -> None:
    EdgeStore(db_path).close()
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        conn.execute("DROP TABLE usage_ledger")
        conn.commit()
    with pytest.raises(errors.MigrationError, match="missing tables: usage_ledger"):
        EdgeStore(db_path)


def _copy_tree(tmp_path: Path, keep: dict[str, int]) -> Path:
    root = tmp_path / "edge_sql"
    for stream, count in keep.items():
        (root / stream).mkdir(parents=True)
        for source in sorted((EDGE_SQL_ROOT / stream).glob("*.sql"))[:count]:
            shutil.copy(source, root / stream / source.name)
    return root


def test_edited_migrations_and_a_file_ahead_of_the_code_are_refused(
    db_path: Path, tmp_path: Path
) -> None:
    root = _copy_tree(tmp_path, {"core": 4, "ql3_ai": 1})
    db = Database(str(db_path), journal_mode="wal", busy_timeout_ms=1000, clock=None)
    try:
        assert len(migrate_edge(db, ai=True, sql_root=root)) == 5
        edited = root / "core" / "0003_runs.sql"
        edited.write_text(edited.read_text() + "\n-- edited\n")
        with pytest.raises(errors.MigrationError, match="checksum drift in core version 3"):
            migrate_edge(db, ai=True, sql_root=root)
        assert not ready_report(db, ai=True, sql_root=root).ok
        shorter = _copy_tree(tmp_path / "shorter", {"core": 4, "ql3_ai": 0})
        with pytest.raises(errors.MigrationError, match="database is ahead of the code"):
            migrate_edge(db, ai=True, sql_root=shorter)
    finally:
        db.close()


def test_core_and_ai_migrations_apply_across_restarts_in_requirement_order(
    db_path: Path, tmp_path: Path
) -> None:
    # ql3_ai 0001 requires core 0004: with only core 1-3 in the code it must wait.
    db = Database(str(db_path), journal_mode="delete", busy_timeout_ms=1000, clock=None)
    try:
        early = _copy_tree(tmp_path / "early", {"core": 3, "ql3_ai": 1})
        with pytest.raises(errors.MigrationError, match="requires core 0004"):
            migrate_edge(db, ai=True, sql_root=early)
    finally:
        db.close()
    steps = [({"core": 3}, False), ({"core": 4, "ql3_ai": 1}, True)]
    applied: list[tuple[str, int]] = []
    for n, (keep, ai) in enumerate(steps):
        root = _copy_tree(tmp_path / f"r{n}", keep)
        db = Database(str(db_path), journal_mode="delete", busy_timeout_ms=1000, clock=None)
        try:
            applied += [(a.stream, a.version) for a in migrate_edge(db, ai=ai, sql_root=root)]
            assert ready_report(db, ai=ai, sql_root=root).ok
        finally:
            db.close()
    assert applied == [("core", 1), ("core", 2), ("core", 3), ("core", 4), ("ql3_ai", 1)]
    with EdgeStore(db_path, "delete") as store:
        assert store.ready().ok


def test_journal_modes_and_their_synchronous_levels(tmp_path: Path) -> None:
    for mode, journal, synchronous in (("wal", "wal", 2), ("delete", "delete", 3)):
        with EdgeStore(tmp_path / f"{mode}.db", mode) as store:  # type: ignore[arg-type]
            conn = store._db.conn
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == journal
            assert conn.execute("PRAGMA synchronous").fetchone()[0] == synchronous
            assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_a_held_write_lock_ends_in_unavailable_after_the_busy_timeout(db_path: Path) -> None:
    with EdgeStore(db_path, busy_timeout_ms=100) as store:
        with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(errors.Unavailable):
                store.create_run("proj", "trace-1")
            other.execute("ROLLBACK")
        assert store.create_run("proj", "trace-1")


# -- immutability -----------------------------------------------------------------------------


def _admission(run: str, step: str, invocation_id: str) -> dict[str, Any]:
    return admission_command(
        invocation_id=invocation_id,
        request_id=f"req-{invocation_id}",
        project_id="proj",
        run_id=run,
        step_run_id=step,
        trace_id="trace-1",
        expected_step_run_version=1,
        provider="ollama",
        model="m",
        policy=None,
        request_digest=request_digest(b"prompt"),
        input_bytes=6,
        deadline_at=datetime.now(UTC) + timedelta(hours=1),
    )


def _history(store: EdgeStore) -> None:
    """A row in every table: revision, revocation, outbox, run, steps, every receipt."""
    revision = store.put_revision("proj", FAMILY, "router", {"r": 1}, "ops")
    store.activate_revision("proj", FAMILY, "router", revision["revision_id"], "ops")
    store.revoke_revision(revision["revision_id"], "ops", "because")
    run = store.create_run("proj", "trace-1")
    lost_step, paid_step = store.add_step_run(run, "model"), store.add_step_run(run, "model")
    start = store.admit_invocation(_admission(run, lost_step, "i-lost"))
    done = store.complete_invocation(
        completion_command(
            invocation_id="i-lost", start_digest=start["start_digest"], outcome="lost"
        )
    )
    store.resolve_invocation(
        resolution_command(invocation_id="i-lost", completion_digest=done["completion_digest"],
                           decision="fail", user_id="u", expected_step_run_version=3)
    )  # fmt: skip
    paid = store.admit_invocation(_admission(run, paid_step, "i-paid"))
    store.complete_invocation(
        completion_command(invocation_id="i-paid", start_digest=paid["start_digest"],
                           outcome="succeeded", result_code="ok", usage=Usage(input_tokens=3))
    )  # fmt: skip


IMMUTABLE = ["contract_revisions", "revision_revocations", "run_events", "step_run_mutations",
             "model_invocation_starts", "model_invocation_completions",
             "model_invocation_resolutions", "usage_ledger"]  # fmt: skip


@pytest.mark.parametrize("table", IMMUTABLE)
def test_immutable_tables_refuse_update_and_delete(store: EdgeStore, table: str) -> None:
    _history(store)
    conn = store._db.conn
    column = conn.execute(f"SELECT name FROM pragma_table_info('{table}') LIMIT 1").fetchone()[0]
    for statement in (f"UPDATE {table} SET {column} = {column}", f"DELETE FROM {table}"):
        with pytest.raises(sqlite3.IntegrityError, match=r"^QL3_ILLEGAL_TRANSITION: "):
            conn.execute(statement)
    assert conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] >= 1


def test_the_outbox_changes_only_in_its_delivery_columns(store: EdgeStore) -> None:
    _history(store)
    conn = store._db.conn
    with pytest.raises(sqlite3.IntegrityError, match="only the delivery columns"):
        conn.execute("UPDATE contract_outbox SET pointer_version = 99")
    with pytest.raises(sqlite3.IntegrityError, match="undelivered"):
        conn.execute("DELETE FROM contract_outbox")
    assert store.mark_outbox_delivered([1]) == 1
    assert store.mark_outbox_delivered([1]) == 0
    conn.execute("DELETE FROM contract_outbox WHERE seq = 1")
    assert store.outbox_backlog()["undelivered"] == 1


# -- the outbox relay -------------------------------------------------------------------------


def _activate_twice(store: EdgeStore, project: str = "proj") -> list[dict[str, Any]]:
    one = store.put_revision(project, FAMILY, "router", {"r": 1}, "ops")
    two = store.put_revision(project, FAMILY, "router", {"r": 2}, "ops")
    events = [
        store.activate_revision(project, FAMILY, "router", one["revision_id"], "ops"),
        store.activate_revision(project, FAMILY, "router", two["revision_id"], "ops"),
    ]
    return [e for e in events if e is not None]


def test_the_relay_delivers_in_seq_order_with_the_postgresql_json(store: EdgeStore) -> None:
    relay = EdgeRelay(store, redis_url="")
    got: list[tuple[str, dict[str, Any]]] = []
    relay.subscribe(lambda channel, message: got.append((channel, message)))
    events = _activate_twice(store)
    assert relay.drain() == 2
    assert got == [("platform:contract:invalidate:proj", event_message(e)) for e in events]
    assert [m["pointer_version"] for _, m in got] == [1, 2]
    assert store.outbox_backlog()["undelivered"] == 0
    assert relay.drain() == 0
    relay.close()


def test_the_relay_filters_by_project(store: EdgeStore) -> None:
    relay = EdgeRelay(store, redis_url="")
    mine: list[str] = []
    relay.subscribe(lambda _, message: mine.append(message["project_id"]), projects=["b"])
    _activate_twice(store, "a")
    _activate_twice(store, "b")
    relay.drain()
    assert mine == ["b", "b"]
    relay.close()


def test_a_failing_subscriber_keeps_the_rows_for_another_attempt(store: EdgeStore) -> None:
    relay = EdgeRelay(store, redis_url="")
    calls: list[int] = []

    def flaky(_: str, message: dict[str, Any]) -> None:
        calls.append(message["seq"])
        if len(calls) == 1:
            raise RuntimeError("worker busy")

    relay.subscribe(flaky)
    _activate_twice(store)
    with pytest.raises(Exception, match="worker busy"):
        relay.run_once()
    pending = store.claim_outbox(10)
    assert [(r["relay_attempts"], r["last_error"]) for r in pending] == [
        (1, "RuntimeError: worker busy"), (1, "RuntimeError: worker busy"),
    ]  # fmt: skip
    assert relay.drain() == 2
    assert calls == [1, 1, 2]
    relay.close()


def test_a_commit_wakes_the_relay_thread_and_a_rollback_does_not(store: EdgeStore) -> None:
    wakes: list[int] = []
    store.on_outbox_commit(lambda: wakes.append(1))
    delivered = threading.Event()
    with EdgeRelay(store, redis_url="", poll_interval=60) as relay:
        relay.subscribe(lambda _, message: delivered.set())
        revision = store.put_revision("proj", FAMILY, "router", {"r": 1}, "ops")
        with pytest.raises(errors.Conflict):
            store.activate_revision(
                "proj", FAMILY, "router", revision["revision_id"], "ops", revision["revision_id"]
            )
        assert wakes == []
        store.activate_revision("proj", FAMILY, "router", revision["revision_id"], "ops")
        assert delivered.wait(10), "the relay thread was not woken by the COMMIT"
    assert wakes == [1]


def test_the_relay_publishes_to_redis_on_the_postgresql_channels(
    store: EdgeStore, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    pubsub.psubscribe("platform:contract:invalidate:*")
    first = pubsub.get_message(timeout=5)
    assert first is not None and first["type"] == "psubscribe"
    relay = EdgeRelay(store, redis_url=redis_url)
    events = _activate_twice(store, "redis-proj")
    assert relay.drain() == 2
    received: list[tuple[str, Any]] = []
    while len(received) < 2:
        message = pubsub.get_message(timeout=5)
        assert message is not None, "nothing arrived on Redis"
        if message["type"] == "pmessage":
            received.append((message["channel"].decode(), json.loads(message["data"])))
    assert received == [
        ("platform:contract:invalidate:redis-proj", event_message(e)) for e in events
    ]
    relay.close()
    pubsub.close()
    client.close()


# -- the revision cache -----------------------------------------------------------------------


def test_the_cache_reloads_on_a_newer_pointer_and_fires_on_change(store: EdgeStore) -> None:
    relay = EdgeRelay(store, redis_url="")
    cache = EdgeRevisionCache(store, relay)
    changes: list[int] = []
    cache.on_change(FAMILY, "router", lambda revision: changes.append(revision.revision_no))
    one = store.put_revision("proj", FAMILY, "router", {"r": 1}, "ops")
    two = store.put_revision("proj", FAMILY, "router", {"r": 2}, "ops")
    store.activate_revision("proj", FAMILY, "router", one["revision_id"], "ops")
    assert cache.lookup("proj", FAMILY, "router").revision_id == one["revision_id"]
    store.activate_revision("proj", FAMILY, "router", two["revision_id"], "ops")
    relay.drain()
    assert cache.lookup("proj", FAMILY, "router").revision_id == two["revision_id"]
    assert changes == [1, 2]
    store.revoke_revision(two["revision_id"], "ops", "bad")
    relay.drain()
    with pytest.raises(errors.NotFound):
        cache.lookup("proj", FAMILY, "router")
    cache.close()
    relay.close()


def test_without_messages_a_stale_entry_is_verified_before_use(store: EdgeStore) -> None:
    cache = EdgeRevisionCache(store, None, max_staleness={FAMILY: 0.0})
    one = store.put_revision("proj", FAMILY, "router", {"r": 1}, "ops")
    two = store.put_revision("proj", FAMILY, "router", {"r": 2}, "ops")
    store.activate_revision("proj", FAMILY, "router", one["revision_id"], "ops")
    assert cache.lookup("proj", FAMILY, "router").revision_no == 1
    store.activate_revision("proj", FAMILY, "router", two["revision_id"], "ops")
    assert cache.lookup("proj", FAMILY, "router").revision_no == 2
    assert cache.health()["mode"] == "degraded"
