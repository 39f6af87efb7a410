"""Random sequences of admissions, completions, resolutions and recoveries keep the
invocation invariants (SPEC section 11), on every store kind.

The state machine keeps a model of what the store has said so far and, after every step,
compares it with what the store shows (``step_run``, ``run``, ``usage_summary``):

- at most one running invocation per step, and it is the step's current invocation;
- every completion has a start (its record names the start digest admission returned);
- run event seqs are gap-free: ``event_seq`` equals the transitions the model counted;
- ledger rows exist only for usage that exists (``usage_summary`` equals the model's sums);
- ``attempt_count`` equals the number of starts of that step.

On PostgreSQL the same invariants are also read from the tables themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg.rows import dict_row

from fix_invocations import PAST, admission, completion, new_id
from ql3 import errors
from ql3.canonical import JSON
from ql3.invocations import Decision, Outcome, Usage, resolution_command
from ql3.store import PgStore

Store = Any
SummaryKey = tuple[str, str, str | None]

RESULT_CODES = {
    Outcome.SUCCEEDED: ["ok"],
    Outcome.FAILED: ["provider_error", "http_500"],
    Outcome.TIMED_OUT: ["MODEL_DEADLINE_EXCEEDED"],
}
RESOLVED = {
    Decision.RETRY: ("ready", None),
    Decision.FAIL: ("failed", "model_outcome_rejected"),
    Decision.CANCEL: ("cancelled", "model_outcome_cancelled"),
}


@dataclass
class StepModel:
    run_id: str
    status: str = "ready"
    version: int = 1
    current: str | None = None
    result_code: str | None = None
    output_ref: str | None = None
    starts: list[str] = field(default_factory=list)


@dataclass
class InvocationModel:
    step: str
    command: dict[str, JSON]
    start_digest: str
    expired: bool
    provider: str
    model: str
    completion: dict[str, JSON] | None = None
    completion_digest: str | None = None
    outcome: str | None = None
    resolution: dict[str, JSON] | None = None


@st.composite
def usages(draw: st.DrawFn) -> Usage | None:
    if draw(st.booleans()):
        return None
    tokens = st.none() | st.integers(min_value=0, max_value=10**6)
    currency = draw(st.none() | st.sampled_from(["USD", "EUR"]))
    cost = None if currency is None else draw(st.none() | st.integers(0, 10**9))
    return Usage(input_tokens=draw(tokens), output_tokens=draw(tokens), cost_micros=cost,
                 currency=currency)  # fmt: skip


def _add(total: int | None, value: int | None) -> int | None:
    if value is None:
        return total
    return value if total is None else total + value


class InvocationMachine(RuleBasedStateMachine):
    store: ClassVar[Store]

    def __init__(self) -> None:
        super().__init__()
        # Examples share the store: a project and runs of their own keep them apart.
        self.project = new_id("prj")
        self.transitions: dict[str, int] = {}
        self.steps: dict[str, StepModel] = {}
        self.invocations: dict[str, InvocationModel] = {}
        self.summary: dict[SummaryKey, dict[str, int | None]] = {}
        self.admissions = 0

    # -- helpers ---------------------------------------------------------------------

    def _pick(self, data: st.DataObject, ids: list[str]) -> str:
        # ids in creation order: random ids must not decide which one a draw picks, or
        # hypothesis could not replay an example.
        return data.draw(st.sampled_from(ids))

    def _steps_in(self, *statuses: str) -> list[str]:
        return [k for k, s in self.steps.items() if s.status in statuses]

    def _invocations(self, predicate: Any) -> list[str]:
        return [k for k, i in self.invocations.items() if predicate(i)]

    def _transition(self, step_id: str, status: str) -> StepModel:
        step = self.steps[step_id]
        step.status = status
        step.version += 1
        self.transitions[step.run_id] += 1
        return step

    def _record_completion(self, invocation_id: str, command: dict[str, JSON],
                           result: dict[str, Any]) -> None:  # fmt: skip
        inv = self.invocations[invocation_id]
        record = result["completion"]
        assert record["start_digest"] == inv.start_digest
        inv.completion = command
        inv.completion_digest = result["completion_digest"]
        inv.outcome = record["outcome"]
        step = self._transition(inv.step, record["outcome"])
        step.result_code = record["result_code"]
        step.output_ref = record["output_ref"]
        usage = record["usage"]
        if usage is not None and any(v is not None for v in usage.values()):
            key = (inv.provider, inv.model, usage["currency"])
            row = self.summary.setdefault(key, {
                "completions": 0, "input_tokens": None, "output_tokens": None,
                "known_cost_micros": None, "known_cost_completions": 0,
                "unknown_cost_completions": 0,
            })  # fmt: skip
            row["completions"] = (row["completions"] or 0) + 1
            row["input_tokens"] = _add(row["input_tokens"], usage["input_tokens"])
            row["output_tokens"] = _add(row["output_tokens"], usage["output_tokens"])
            row["known_cost_micros"] = _add(row["known_cost_micros"], usage["cost_micros"])
            known = "known" if usage["cost_micros"] is not None else "unknown"
            row[f"{known}_cost_completions"] = (row[f"{known}_cost_completions"] or 0) + 1

    # -- rules -----------------------------------------------------------------------

    @initialize(steps=st.integers(1, 3))
    def first_run(self, steps: int) -> None:
        self.new_run(steps)

    @precondition(lambda self: len(self.transitions) < 4)
    @rule(steps=st.integers(1, 3))
    def new_run(self, steps: int) -> None:
        run_id = self.store.create_run(self.project, "trace")
        self.transitions[run_id] = 0
        for _ in range(steps):
            self.steps[self.store.add_step_run(run_id, "model")] = StepModel(run_id=run_id)

    @rule(
        data=st.data(),
        drift=st.sampled_from([0, 0, 0, 1, -1]),
        expired=st.booleans(),
        provider=st.sampled_from(["ollama", "openai"]),
        model=st.sampled_from(["m1", "m2"]),
    )
    def admit(
        self, data: st.DataObject, drift: int, expired: bool, provider: str, model: str
    ) -> None:
        step_id = self._pick(data, list(self.steps))
        step = self.steps[step_id]
        version = max(1, step.version + drift)
        # Distinct past deadlines: recovery takes the oldest first, so its choice is replayable.
        self.admissions += 1
        deadline = PAST + timedelta(seconds=self.admissions) if expired else None
        command = admission(step.run_id, step_id, version=version, project=self.project,
                            trace="trace", deadline=deadline,
                            provider=provider, model=model)  # fmt: skip
        if step.status != "ready" or version != step.version:
            with pytest.raises(errors.Conflict) as raised:
                self.store.admit_invocation(command)
            assert type(raised.value) is errors.Conflict
            return
        result = self.store.admit_invocation(command)
        assert result["status"] == "created"
        assert result["start"]["attempt"] == len(step.starts) + 1
        invocation_id = str(command["invocation_id"])
        self.invocations[invocation_id] = InvocationModel(
            step=step_id, command=command, start_digest=result["start_digest"],
            expired=expired, provider=provider, model=model,
        )  # fmt: skip
        step = self._transition(step_id, "running")
        step.current = invocation_id
        step.starts.append(invocation_id)

    @precondition(lambda self: bool(self.invocations))
    @rule(data=st.data())
    def replay_admission(self, data: st.DataObject) -> None:
        inv = self.invocations[self._pick(data, list(self.invocations))]
        result = self.store.admit_invocation(inv.command)
        assert result["status"] == "existing"
        assert result["start_digest"] == inv.start_digest

    @precondition(lambda self: bool(self.invocations))
    @rule(data=st.data())
    def admission_with_other_content(self, data: st.DataObject) -> None:
        inv = self.invocations[self._pick(data, list(self.invocations))]
        with pytest.raises(errors.Conflict):
            self.store.admit_invocation({**inv.command, "request_id": new_id("other")})

    @precondition(lambda self: bool(self._steps_in("running")))
    @rule(data=st.data(), outcome=st.sampled_from(list(Outcome)), usage=usages())
    def complete(self, data: st.DataObject, outcome: Outcome, usage: Usage | None) -> None:
        step = self.steps[self._pick(data, self._steps_in("running"))]
        assert step.current is not None
        inv = self.invocations[step.current]
        code = (
            None if outcome is Outcome.LOST else data.draw(st.sampled_from(RESULT_CODES[outcome]))
        )
        output = b"answer" if outcome is Outcome.SUCCEEDED else None
        admitted = {"start": inv.command, "start_digest": inv.start_digest}
        command = completion(admitted, outcome, result_code=code, usage=usage, output=output)
        result = self.store.complete_invocation(command)
        assert result["status"] == "created"
        self._record_completion(step.current, command, result)

    @precondition(lambda self: any(i.completion for i in self.invocations.values()))
    @rule(data=st.data())
    def replay_completion(self, data: st.DataObject) -> None:
        inv = self.invocations[self._pick(data, self._invocations(lambda i: i.completion))]
        assert inv.completion is not None
        result = self.store.complete_invocation(inv.completion)
        assert result["status"] == "existing"
        assert result["completion_digest"] == inv.completion_digest

    @precondition(lambda self: any(i.completion for i in self.invocations.values()))
    @rule(data=st.data())
    def completion_with_other_content(self, data: st.DataObject) -> None:
        inv = self.invocations[self._pick(data, self._invocations(lambda i: i.completion))]
        assert inv.completion is not None
        other = "failed" if inv.outcome != "failed" else "timed_out"
        command = {**inv.completion, "outcome": other, "result_code": "other_code"}
        with pytest.raises(errors.Conflict):
            self.store.complete_invocation(command)

    @precondition(lambda self: bool(self._steps_in("lost")))
    @rule(data=st.data(), decision=st.sampled_from(list(Decision)))
    def resolve(self, data: st.DataObject, decision: Decision) -> None:
        step_id = self._pick(data, self._steps_in("lost"))
        step = self.steps[step_id]
        assert step.current is not None
        inv = self.invocations[step.current]
        assert inv.completion_digest is not None
        command = resolution_command(
            invocation_id=step.current, completion_digest=inv.completion_digest,
            decision=decision, user_id="alice", expected_step_run_version=step.version,
        )  # fmt: skip
        result = self.store.resolve_invocation(command)
        assert result["status"] == "created"
        inv.resolution = command
        status, code = RESOLVED[decision]
        step = self._transition(step_id, status)
        step.result_code = code
        if decision is Decision.RETRY:
            step.current = None

    @precondition(lambda self: any(i.resolution for i in self.invocations.values()))
    @rule(data=st.data())
    def replay_resolution(self, data: st.DataObject) -> None:
        inv = self.invocations[self._pick(data, self._invocations(lambda i: i.resolution))]
        assert inv.resolution is not None
        assert self.store.resolve_invocation(inv.resolution)["status"] == "existing"

    @precondition(
        lambda self: any(i.outcome not in (None, "lost") for i in self.invocations.values())
    )
    @rule(data=st.data(), decision=st.sampled_from(list(Decision)))
    def resolving_a_definite_outcome_is_illegal(
        self, data: st.DataObject, decision: Decision
    ) -> None:
        invocation_id = self._pick(
            data, self._invocations(lambda i: i.outcome not in (None, "lost"))
        )
        inv = self.invocations[invocation_id]
        assert inv.completion_digest is not None
        command = resolution_command(
            invocation_id=invocation_id, completion_digest=inv.completion_digest,
            decision=decision, user_id="alice",
            expected_step_run_version=self.steps[inv.step].version,
        )  # fmt: skip
        with pytest.raises(errors.IllegalTransition):
            self.store.resolve_invocation(command)

    @rule(limit=st.integers(1, 4))
    def recover(self, limit: int) -> None:
        expired = self._invocations(lambda i: i.expired and i.completion is None)
        result = self.store.recover_expired(limit, 0)
        recovered = [item["invocation_id"] for item in result["recovered"]]
        assert result["count"] == len(recovered) == min(limit, len(expired))

        def deadline(i: str) -> tuple[str, str]:
            return str(self.invocations[i].command["deadline_at"]), i

        # The oldest deadlines are chosen, then settled run by run (D33).
        chosen = sorted(expired, key=deadline)[:limit]
        run_by_run = sorted(chosen, key=lambda i: (str(self.invocations[i].command["run_id"]),
                                                   *deadline(i)))  # fmt: skip
        assert recovered == run_by_run
        for item in result["recovered"]:
            inv = self.invocations[item["invocation_id"]]
            admitted = {"start": inv.command, "start_digest": inv.start_digest}
            command = completion(admitted, Outcome.LOST)
            record = {"start_digest": inv.start_digest, "outcome": "lost", "usage": None,
                      "result_code": "outcome_unknown", "output_ref": None}  # fmt: skip
            self._record_completion(
                item["invocation_id"], command,
                {"completion": record, "completion_digest": item["completion_digest"]},
            )  # fmt: skip

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def steps_match_the_model(self) -> None:
        for step_id, model in self.steps.items():
            row = self.store.step_run(step_id)
            assert (row["status"], row["version"], row["current_invocation_id"]) == (
                model.status, model.version, model.current
            ), step_id  # fmt: skip
            assert (row["result_code"], row["output_ref"]) == (model.result_code,
                                                               model.output_ref)  # fmt: skip
            assert row["attempt_count"] == len(model.starts)
            running = [i for i in model.starts if self.invocations[i].completion is None]
            assert len(running) <= 1
            assert running == ([model.current] if model.status == "running" else [])

    @invariant()
    def run_event_seqs_count_every_transition(self) -> None:
        for run_id, transitions in self.transitions.items():
            run = self.store.run(run_id)
            assert (run["event_seq"], run["version"]) == (transitions, transitions + 1)

    @invariant()
    def ledger_holds_exactly_the_reported_usage(self) -> None:
        rows = self.store.usage_summary(self.project)
        seen = {(r["provider"], r["model"], r["currency"]): r for r in rows}
        assert set(seen) == set(self.summary)
        for key, expected in self.summary.items():
            got = {k: seen[key][k] for k in expected}
            assert got == expected, key

    @invariant()
    def tables_agree_on_postgresql(self) -> None:
        if isinstance(self.store, PgStore):
            check_tables(self.store, self.project)

    def teardown(self) -> None:
        # Later examples share the store: settle what this one left expired.
        self.store.recover_expired(10000, 0)


_TABLE_CHECKS = {
    "a step with two running invocations": """
        SELECT st.step_run_id FROM ql3_ai.model_invocation_starts AS st
        LEFT JOIN ql3_ai.model_invocation_completions AS c USING (invocation_id)
        WHERE st.project_id = %(p)s AND c.invocation_id IS NULL
        GROUP BY st.step_run_id HAVING count(*) > 1""",
    "a running step whose invocation is not the unfinished start": """
        SELECT s.step_run_id FROM ql3.step_runs AS s
        INNER JOIN ql3.runs AS r USING (run_id)
        LEFT JOIN ql3_ai.model_invocation_completions AS c
            ON c.invocation_id = s.current_invocation_id
        WHERE r.project_id = %(p)s AND s.status = 'running' AND c.invocation_id IS NOT NULL""",
    "a completion without its start": """
        SELECT c.invocation_id FROM ql3_ai.model_invocation_completions AS c
        LEFT JOIN ql3_ai.model_invocation_starts AS st USING (invocation_id)
        WHERE c.project_id = %(p)s
          AND (st.invocation_id IS NULL OR st.start_digest <> c.start_digest)""",
    "a run whose event seqs have gaps": """
        SELECT r.run_id FROM ql3.runs AS r
        LEFT JOIN ql3.run_events AS e USING (run_id)
        WHERE r.project_id = %(p)s
        GROUP BY r.run_id, r.event_seq
        HAVING count(e.seq) <> r.event_seq OR coalesce(max(e.seq), 0) <> r.event_seq
            OR coalesce(min(e.seq), 1) <> 1""",
    "a ledger row without usage, or usage without a ledger row": """
        SELECT c.invocation_id FROM ql3_ai.model_invocation_completions AS c
        LEFT JOIN ql3_ai.usage_ledger AS u USING (invocation_id)
        WHERE c.project_id = %(p)s
          AND (u.invocation_id IS NOT NULL) <> (
              coalesce(c.input_tokens, c.output_tokens, c.cost_micros) IS NOT NULL
              OR c.currency IS NOT NULL)""",
    "a step whose attempt_count is not its number of starts": """
        SELECT s.step_run_id FROM ql3.step_runs AS s
        INNER JOIN ql3.runs AS r USING (run_id)
        WHERE r.project_id = %(p)s AND s.attempt_count <> (
            SELECT count(*) FROM ql3_ai.model_invocation_starts AS st
            WHERE st.step_run_id = s.step_run_id)""",
}


def check_tables(store: PgStore, project: str) -> None:
    with store.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        for what, sql in _TABLE_CHECKS.items():
            cur.execute(sql, {"p": project})
            assert cur.fetchall() == [], what


def test_random_invocation_histories_keep_the_invariants(store: Store) -> None:
    machine = type("InvocationMachineOnStore", (InvocationMachine,), {"store": store})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=30,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
