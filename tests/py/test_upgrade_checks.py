"""Upgrading a database that holds steps and receipts across core 0006-0007 and ql3_ai
0002-0003 (D67): the CHECKs become function calls, added NOT VALID and validated by the
next file; every existing row passes, and the rules hold afterwards as before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from fix_invocations import PAST, admission, completion, model_step
from ql3.invocations import Outcome
from ql3.migrate import migrate
from ql3.store import PgStore

BEFORE_D67 = {"core": 5, "ql3_ai": 1}
STEP_CHECK = ("ql3.step_runs", "step_runs_check")
COMPLETION_CHECK = ("ql3_ai.model_invocation_completions", "model_invocation_completions_check")


def constraint(conn: psycopg.Connection[Any], table: str, name: str) -> tuple[str, bool]:
    row = conn.execute(
        "SELECT pg_get_constraintdef(oid), convalidated FROM pg_constraint"
        " WHERE conrelid = %s::regclass AND conname = %s",
        (table, name),
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def steps_by_status(conn: psycopg.Connection[Any]) -> dict[str, int]:
    rows = conn.execute("SELECT status, count(*) FROM ql3.step_runs GROUP BY status").fetchall()
    return {status: count for status, count in rows}


def test_an_upgraded_database_keeps_its_rows_and_its_rules(fresh_db: Callable[[], str]) -> None:
    dsn = fresh_db()
    migrate(dsn, with_ai=True, targets=BEFORE_D67)
    with PgStore(dsn) as store:
        model_step(store)  # ready
        run_id, step = model_step(store)
        running = store.admit_invocation(admission(run_id, step))
        for outcome in (Outcome.SUCCEEDED, Outcome.FAILED):
            run_id, step = model_step(store)
            admitted = store.admit_invocation(admission(run_id, step))
            store.complete_invocation(completion(admitted, outcome))
        run_id, step = model_step(store)
        store.admit_invocation(admission(run_id, step, deadline=PAST))
        assert store.recover_expired(100, 0)["count"] == 1  # lost, outcome_unknown
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = steps_by_status(conn)
        assert before == {"ready": 1, "running": 1, "succeeded": 1, "failed": 1, "lost": 1}
        assert "CASE" in constraint(conn, *STEP_CHECK)[0]

    applied = migrate(dsn, with_ai=True)

    assert [(a.stream, a.version) for a in applied] == [
        ("core", 6), ("core", 7), ("ql3_ai", 2), ("ql3_ai", 3),
    ]  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert steps_by_status(conn) == before
        assert constraint(conn, *STEP_CHECK) == (
            "CHECK (ql3._step_state_valid(status, (current_invocation_id)::text, output_ref,"
            " (result_code)::text))",
            True,
        )
        assert constraint(conn, *COMPLETION_CHECK) == (
            "CHECK (ql3_ai._completion_valid(outcome, (result_code)::text, recovered))",
            True,
        )
        with pytest.raises(psycopg.Error, match="QL3_ILLEGAL_TRANSITION") as refused:
            conn.execute("UPDATE ql3.step_runs SET status = 'ready' WHERE status = 'succeeded'")
        assert refused.value.sqlstate == "Q3S01"
        with pytest.raises(psycopg.errors.CheckViolation, match="step_runs_check"):
            conn.execute("UPDATE ql3.step_runs SET output_ref = 'x' WHERE status = 'ready'")
    with PgStore(dsn) as store:  # the step admitted before the upgrade completes after it
        done = store.complete_invocation(completion(running, Outcome.SUCCEEDED))
        assert done["status"] == "created"
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert steps_by_status(conn) == {"ready": 1, "succeeded": 2, "failed": 1, "lost": 1}
