"""The policy fence holds in every isolation level (D46): no admission is made under a
revision that a committed revocation or activation had replaced when it was made.

Each test drives two real sessions: a runtime login that admits (as a client of any
language would, through ``ql3_ai.admit_invocation`` in its own transaction) and an
operator login that revokes or activates. Under READ COMMITTED the admission reads the
pointer with a fresh snapshot: a committed change gives QL3_STALE_REVISION (Q3C02), and a
change still in flight is ordered after the admission. Under REPEATABLE READ and
SERIALIZABLE, whose snapshot may predate the change, the pointer row is read FOR SHARE: a
change committed after the snapshot, or in flight, gives a serialization failure (40001),
and an admission holds a change off until it commits. A refused admission writes nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from fix_invocations import admission
from fix_servers import role_dsn
from ql3.invocations import PolicyBinding
from ql3.store import PgStore

FAMILY, CONTRACT = "policy_routing", "fence-policy"
LEVELS = ("READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE")
SNAPSHOT_LEVELS = ("REPEATABLE READ", "SERIALIZABLE")


class Setup:
    """A project with an active policy revision and a ready model step under it."""

    def __init__(self, dsn: str, project: str) -> None:
        self.dsn = dsn
        self.project = project
        operator = PgStore(role_dsn(dsn, "operator"), max_connections=1)
        runtime = PgStore(role_dsn(dsn, "runtime"), max_connections=1)
        try:
            revision = operator.put_revision(project, FAMILY, CONTRACT, {"route": "a"}, "tester")
            self.revision_id = str(revision["revision_id"])
            operator.activate_revision(project, FAMILY, CONTRACT, self.revision_id, "tester")
            self.run_id = runtime.create_run(project, "trace-fence")
            self.step_id = runtime.add_step_run(self.run_id, "model")
        finally:
            operator.close()
            runtime.close()

    def command(self) -> dict[str, Any]:
        policy = PolicyBinding(
            contract_family=FAMILY, contract_id=CONTRACT, revision_id=self.revision_id
        )
        return admission(
            self.run_id, self.step_id, project=self.project, trace="trace-fence", policy=policy
        )

    def starts(self) -> int:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM ql3_ai.model_invocation_starts WHERE run_id = %s",
                (self.run_id,),
            ).fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture
def setup(db_dsn: str, request: pytest.FixtureRequest) -> Setup:
    return Setup(db_dsn, f"fence-{request.node.name[-40:]}")


@pytest.fixture
def runtime(db_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(role_dsn(db_dsn, "runtime")) as conn:
        yield conn


@pytest.fixture
def operator(db_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(role_dsn(db_dsn, "operator")) as conn:
        yield conn


def begin(conn: psycopg.Connection[Any], level: str) -> None:
    """Open a transaction at level and take its snapshot (the first query does)."""
    conn.execute(f"BEGIN ISOLATION LEVEL {level}")
    conn.execute("SELECT 1")


def admit(conn: psycopg.Connection[Any], command: dict[str, Any]) -> Any:
    row = conn.execute("SELECT ql3_ai.admit_invocation(%s)", (Jsonb(command),)).fetchone()
    assert row is not None
    return row[0]


def revoke(conn: psycopg.Connection[Any], setup: Setup) -> None:
    conn.execute("SELECT ql3.revoke_revision(%s, 'tester', 'fence test')", (setup.revision_id,))


def replace(conn: psycopg.Connection[Any], setup: Setup) -> None:
    """Activate another revision of the policy contract."""
    row = conn.execute(
        "SELECT revision_id FROM ql3.put_revision(%s, %s, %s, '{\"route\": \"b\"}', 'tester')",
        (setup.project, FAMILY, CONTRACT),
    ).fetchone()
    assert row is not None
    conn.execute(
        "SELECT * FROM ql3.activate_revision(%s, %s, %s, %s, 'tester')",
        (setup.project, FAMILY, CONTRACT, row[0]),
    )


def expected_refusal(level: str) -> str:
    return "Q3C02" if level == "READ COMMITTED" else "40001"


@pytest.mark.parametrize("change", [revoke, replace], ids=["revoked", "replaced"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_change_committed_after_the_snapshot_refuses_the_admission(
    setup: Setup,
    runtime: psycopg.Connection[Any],
    operator: psycopg.Connection[Any],
    level: str,
    change: Any,
) -> None:
    begin(runtime, level)  # the snapshot predates the change...
    with operator.transaction():
        change(operator, setup)  # ...which commits before the admission runs
    with pytest.raises(psycopg.Error) as caught:
        admit(runtime, setup.command())
    assert caught.value.sqlstate == expected_refusal(level)
    runtime.rollback()
    assert setup.starts() == 0


@pytest.mark.parametrize("level", SNAPSHOT_LEVELS)
def test_an_admission_before_the_change_is_fine_and_holds_the_change_off(
    setup: Setup,
    runtime: psycopg.Connection[Any],
    operator: psycopg.Connection[Any],
    level: str,
) -> None:
    begin(runtime, level)
    assert admit(runtime, setup.command())["status"] == "created"
    revoked = threading.Event()

    def revoke_now() -> None:
        with operator.transaction():
            revoke(operator, setup)
        revoked.set()

    revoker = threading.Thread(target=revoke_now)
    revoker.start()
    try:
        # The revocation waits for the admission's transaction: it cannot commit in between.
        assert wait_until_blocked(setup.dsn, "ql3_test_operator")
        assert not revoked.is_set()
        runtime.commit()
        revoker.join(timeout=30)
        assert revoked.is_set()
    finally:
        if revoker.is_alive():
            runtime.rollback()
            revoker.join(timeout=30)
    assert setup.starts() == 1


def test_under_read_committed_a_change_in_flight_is_ordered_after_the_admission(
    setup: Setup, runtime: psycopg.Connection[Any], operator: psycopg.Connection[Any]
) -> None:
    operator.execute("BEGIN")
    revoke(operator, setup)  # in flight
    begin(runtime, "READ COMMITTED")
    runtime.execute("SET LOCAL lock_timeout = '5s'")  # a wait would be a failure, not a hang
    assert admit(runtime, setup.command())["status"] == "created"  # no wait
    operator.commit()  # the revocation commits first...
    runtime.commit()  # ...and the admission after it: it read the pointer before the change
    assert setup.starts() == 1
    with operator.transaction():
        row = operator.execute(
            "SELECT count(*) FROM ql3.revision_revocations WHERE revision_id = %s",
            (setup.revision_id,),
        ).fetchone()
    assert row == (1,)


@pytest.mark.parametrize("level", SNAPSHOT_LEVELS)
def test_a_concurrent_revocation_refuses_the_admission_that_waits_for_it(
    setup: Setup,
    runtime: psycopg.Connection[Any],
    operator: psycopg.Connection[Any],
    level: str,
) -> None:
    operator.execute("BEGIN")
    revoke(operator, setup)  # not committed yet: the admission meets it in flight
    outcome: dict[str, Any] = {}

    def admit_now() -> None:
        begin(runtime, level)
        try:
            outcome["result"] = admit(runtime, setup.command())
        except psycopg.Error as exc:
            outcome["sqlstate"] = exc.sqlstate
        runtime.rollback()

    admitter = threading.Thread(target=admit_now)
    admitter.start()
    try:
        assert wait_until_blocked(setup.dsn, "ql3_test_runtime")
        operator.commit()
    finally:
        if admitter.is_alive() and operator.info.transaction_status:
            operator.rollback()
        admitter.join(timeout=30)
    assert outcome == {"sqlstate": expected_refusal(level)}
    assert setup.starts() == 0


def wait_until_blocked(dsn: str, user: str, timeout: float = 10.0) -> bool:
    """True once a session of user waits for a lock (pg_stat_activity says so)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE usename = %s AND wait_event_type = 'Lock' AND datname = current_database()",
                (user,),
            ).fetchone()
            if row is not None and row[0] > 0:
                return True
            time.sleep(0.02)
    return False
