"""Two recoveries at once settle disjoint batches without deadlocking each other (D33).

Each settlement locks its run. A batch chosen by deadline can hold the steps of two runs
in the opposite order to another batch's; settled in deadline order, the two recoveries
would take the run locks in opposite orders. Here a third session holds one run's lock
until both recoveries wait, so they meet exactly there.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from fix_invocations import admission, model_step
from fix_servers import role_dsn
from ql3.store import PgStore


def _waiting_on_a_lock(watch: psycopg.Connection[Any], pid: int) -> bool:
    row = watch.execute(
        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return row is not None and row[0] == "Lock"


def _wait_until(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_two_recoveries_holding_steps_of_two_runs_in_opposite_orders_both_finish(
    db_dsn: str,
) -> None:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    with PgStore(role_dsn(db_dsn, "runtime")) as runtime:
        r1, _ = model_step(runtime)
        r2, _ = model_step(runtime)
        # By deadline: R1, R2, R2, R1. Batches of 2: {R1, R2} and {R2, R1}.
        for n, run_id in enumerate((r1, r2, r2, r1), start=1):
            step = runtime.add_step_run(run_id, "model")
            runtime.admit_invocation(admission(run_id, step, deadline=epoch + timedelta(seconds=n)))
    operator = role_dsn(db_dsn, "operator")
    results: dict[str, Any] = {}
    with (
        psycopg.connect(db_dsn) as blocker,  # only the owner (or a superuser) may lock a run
        psycopg.connect(operator, autocommit=True) as a,
        psycopg.connect(operator, autocommit=True) as b,
        psycopg.connect(db_dsn, autocommit=True) as watch,
    ):
        blocker.execute("UPDATE ql3.runs SET updated_at = now() WHERE run_id = %s", (r1,))

        def recover(name: str, conn: psycopg.Connection[Any]) -> None:
            try:
                row = conn.execute("SELECT ql3_ai.recover_expired(2, interval '0')").fetchone()
                assert row is not None
                results[name] = row[0]["count"]
            except psycopg.Error as exc:
                results[name] = exc.sqlstate

        first = threading.Thread(target=recover, args=("a", a))
        first.start()
        _wait_until(lambda: _waiting_on_a_lock(watch, a.info.backend_pid), "recovery a to wait")
        second = threading.Thread(target=recover, args=("b", b))
        second.start()
        _wait_until(lambda: _waiting_on_a_lock(watch, b.info.backend_pid), "recovery b to wait")
        blocker.commit()
        first.join(timeout=30)
        second.join(timeout=30)
    assert results == {"a": 2, "b": 2}, "40P01 is a deadlock between the two recoveries"
