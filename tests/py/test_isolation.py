"""Project isolation through the Python driver and the command line (D47): real logins of
two projects against one database, each as a client would run it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from fix_invocations import PAST, admission, completion, model_step
from ql3 import cli, errors
from ql3.invocations import Outcome
from ql3.store import PgStore


class Logins:
    """LOGIN roles made for one test: ``dsn(name)`` connects as one of them."""

    def __init__(self, dsn: str) -> None:
        self.base = dsn
        self.suffix = uuid.uuid4().hex[:8]
        self.made: list[str] = []

    def make(self, name: str, group: str) -> str:
        role = f"iso_{name}_{self.suffix}"
        with psycopg.connect(self.base, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                    sql.Identifier(role), sql.Identifier(group)
                )
            )
        self.made.append(role)
        return role

    def dsn(self, role: str) -> str:
        params: dict[str, Any] = dict(conninfo_to_dict(self.base))
        params["user"] = role
        params.pop("password", None)
        return make_conninfo(**params)

    def drop(self) -> None:
        with psycopg.connect(self.base, autocommit=True) as conn:
            for role in self.made:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@pytest.fixture
def logins(db_dsn: str) -> Iterator[Logins]:
    made = Logins(db_dsn)
    try:
        yield made
    finally:
        made.drop()


def grant(dsn: str, role: str, project: str | None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT ql3.grant_project(%s, %s)", (role, project))


@pytest.fixture
def two_projects(db_dsn: str, logins: Logins) -> dict[str, str]:
    """Runtime logins of projects a and b, an operator of a, an operator of every project."""
    roles = {
        "ops": logins.make("ops", "ql3_operator"),
        "op_a": logins.make("op_a", "ql3_operator"),
        "rt_a": logins.make("rt_a", "ql3_runtime"),
        "rt_b": logins.make("rt_b", "ql3_runtime"),
    }
    ops = logins.dsn(roles["ops"])
    grant(ops, roles["ops"], None)  # the first grant, made while isolation is still off
    for who, project in (("op_a", "a"), ("rt_a", "a"), ("rt_b", "b")):
        grant(ops, roles[who], project)
    return {who: logins.dsn(role) for who, role in roles.items()}


def test_without_grants_every_login_acts_on_every_project(db_dsn: str, logins: Logins) -> None:
    runtime = PgStore(logins.dsn(logins.make("rt", "ql3_runtime")))
    try:
        for project in ("a", "b"):
            run_id, step = model_step(runtime, project=project)
            assert runtime.admit_invocation(admission(run_id, step, project=project))["status"] == (
                "created"
            )
    finally:
        runtime.close()


def test_a_runtime_login_acts_on_its_project_only(two_projects: dict[str, str]) -> None:
    with PgStore(two_projects["rt_a"]) as a, PgStore(two_projects["rt_b"]) as b:
        run_a, step_a = model_step(a, project="a")
        admitted = a.admit_invocation(admission(run_a, step_a, project="a"))
        with pytest.raises(errors.PermissionDenied, match="may not act on project 'b'"):
            a.create_run("b", "trace-1")
        with pytest.raises(errors.PermissionDenied):
            b.admit_invocation(admission(run_a, step_a, project="a"))
        # Under its own project, a's run is as absent as a missing one: nothing about its
        # step (state, version, kind, the admitted command) comes back.
        with pytest.raises(errors.NotFound, match="does not exist"):
            b.admit_invocation(admission(run_a, step_a, project="b", version=2))
        # A's invocation is as absent to b as one never admitted: no completion, no probe.
        with pytest.raises(errors.NotFound, match="never admitted"):
            b.complete_invocation(completion(admitted, Outcome.SUCCEEDED))
        with pytest.raises(errors.NotFound):
            b.add_step_run(run_a, "model")
        assert b.step_run(step_a) is None  # row-level security: not there to read
        # Ids b reuses from a's rows conflict without naming a's run or a's command digest.
        run_b, step_b = model_step(b, project="b")
        with pytest.raises(errors.Conflict) as taken:
            b.add_step_run(run_b, "model", step_a)
        assert "another project" in str(taken.value) and run_a not in str(taken.value)
        reused = admission(
            run_b, step_b, project="b", invocation_id=admitted["start"]["invocation_id"]
        )
        with pytest.raises(errors.Conflict) as taken:
            b.admit_invocation(reused)
        assert "another project" in str(taken.value)
        assert admitted["start"]["command_digest"] not in str(taken.value)
        assert a.complete_invocation(completion(admitted, Outcome.SUCCEEDED))["status"] == "created"


def test_an_operator_of_one_project_recovers_and_grants_within_it(
    two_projects: dict[str, str], logins: Logins
) -> None:
    with PgStore(two_projects["rt_a"]) as a, PgStore(two_projects["rt_b"]) as b:
        for store, project in ((a, "a"), (b, "b")):
            run_id, step = model_step(store, project=project)
            store.admit_invocation(admission(run_id, step, project=project, deadline=PAST))
    with PgStore(two_projects["op_a"]) as op_a:
        settled = op_a.recover_expired(100, 0)
        with pytest.raises(errors.PermissionDenied):
            op_a.put_revision("b", "policy_routing", "c1", {"v": 1}, "op_a")
    assert {r["invocation_id"] for r in settled["recovered"]} and settled["failed"] == []
    with psycopg.connect(two_projects["ops"]) as conn:
        lost = conn.execute(
            "SELECT st.project_id, c.outcome FROM ql3_ai.model_invocation_completions AS c"
            " JOIN ql3_ai.model_invocation_starts AS st USING (invocation_id)"
        ).fetchall()
    assert lost == [("a", "lost")]  # b's expired start is not op_a's to settle
    intruder = logins.make("intruder", "ql3_runtime")
    with (
        psycopg.connect(two_projects["op_a"], autocommit=True) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute("SELECT ql3.grant_project(%s, 'b')", (intruder,))


def test_invocations_list_shows_the_logins_projects_only(
    two_projects: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    for who, project in (("rt_a", "a"), ("rt_b", "b")):
        with PgStore(two_projects[who]) as store:
            run_id, step = model_step(store, project=project)
            store.admit_invocation(admission(run_id, step, project=project))
    code = cli.main(["invocations", "list", "--dsn", two_projects["rt_b"]])
    out = capsys.readouterr().out
    assert code == 0
    listed = json.loads(out)
    assert listed and {row["project_id"] for row in listed} == {"b"}
