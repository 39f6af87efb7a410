"""Durable model invocations through the store interface (SPEC sections 4, 6 and 10).

Every test but the role test runs against each store kind of ``fix_stores.STORE_KINDS``
and uses only the SPEC section 10 methods plus ``step_run`` and ``run``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from fix_invocations import PAST, PROJECT, admission, completion, model_step, new_id
from fix_servers import role_dsn
from ql3 import canonical, errors
from ql3.canonical import JSON
from ql3.invocations import (
    Decision,
    Outcome,
    PolicyBinding,
    Usage,
    command_digest,
    completion_command,
    format_timestamp,
    parse_timestamp,
    request_digest,
    resolution_command,
)
from ql3.store import PgStore

Store = Any


def snapshot(store: Store, run_id: str, step_run_id: str) -> tuple[Any, Any]:
    return store.step_run(step_run_id), store.run(run_id)


def admitted_and(store: Store, outcome: Outcome, **kw: Any) -> tuple[str, str, dict[str, Any]]:
    """A step admitted and completed with outcome: (run_id, step_run_id, completion result)."""
    run_id, step = model_step(store)
    start = store.admit_invocation(admission(run_id, step))
    return run_id, step, store.complete_invocation(completion(start, outcome, **kw))


def resolution_of(
    store: Store, done: dict[str, Any], decision: Decision, *, user: str = "alice"
) -> dict[str, Any]:
    record = done["completion"]
    step = store.step_run(record["step_run_id"])
    return resolution_command(
        invocation_id=record["invocation_id"],
        completion_digest=done["completion_digest"],
        decision=decision,
        user_id=user,
        expected_step_run_version=step["version"],
        reason="checked with the provider",
    )


# -- builders ------------------------------------------------------------------------


def test_format_timestamp_is_utc_with_six_fractional_digits() -> None:
    plus_two = timezone(timedelta(hours=2))
    assert format_timestamp(datetime(2026, 12, 2, 14, 0, tzinfo=plus_two)) == (
        "2026-12-02T12:00:00.000000Z"
    )
    assert format_timestamp(datetime(5, 1, 2, 3, 4, 5, 6, tzinfo=UTC)) == (
        "0005-01-02T03:04:05.000006Z"
    )
    with pytest.raises(errors.InvalidArgument):
        format_timestamp(datetime(2026, 12, 2, 12, 0))


def test_parse_timestamp_reads_offsets_and_takes_naive_text_as_utc() -> None:
    assert parse_timestamp("2026-12-02T12:00:00Z") == datetime(2026, 12, 2, 12, tzinfo=UTC)
    assert parse_timestamp("2026-12-02T12:00:00") == datetime(2026, 12, 2, 12, tzinfo=UTC)
    assert parse_timestamp("2026-12-02T14:00:00+02:00") == datetime(2026, 12, 2, 12, tzinfo=UTC)
    with pytest.raises(errors.InvalidArgument):
        parse_timestamp("yesterday")


def test_request_digest_hashes_bytes_raw_and_json_canonically() -> None:
    assert request_digest(b"prompt") == hashlib.sha256(b"prompt").hexdigest()
    body: JSON = {"messages": [{"role": "user", "content": "hi"}], "model": "m"}
    reordered: JSON = {"model": "m", "messages": [{"content": "hi", "role": "user"}]}
    assert request_digest(body) == request_digest(reordered)
    assert request_digest(body) == canonical.digest("ql3/model-request@v1", body)


def test_builders_spell_uuids_lowercase_and_fill_every_field() -> None:
    run_id = "AAAAAAAA-0000-0000-0000-000000000001"
    command = admission(run_id, run_id.replace("A", "B"))
    assert command["run_id"] == run_id.lower()
    assert command["step_run_id"] == "bbbbbbbb-0000-0000-0000-000000000001"
    assert command["policy"] is None
    lost = completion_command(invocation_id="i", start_digest="0" * 64, outcome="lost")
    assert lost["result_code"] == "outcome_unknown"
    assert lost["usage"] is None and lost["output_bytes"] is None
    with pytest.raises(errors.InvalidArgument):
        completion_command(invocation_id="i", start_digest="0" * 64, outcome="succeeded")
    with pytest.raises(errors.InvalidArgument):
        completion_command(invocation_id="i", start_digest="0" * 64, outcome="exploded")
    with pytest.raises(errors.InvalidArgument):
        resolution_command(invocation_id="i", completion_digest="0" * 64, decision="ignore",
                           user_id="u", expected_step_run_version=1)  # fmt: skip
    with pytest.raises(errors.InvalidArgument):
        admission("not-a-uuid", run_id)


def test_the_sql_accepts_every_builder_and_agrees_on_command_digests(store: Store) -> None:
    revision = store.put_revision(PROJECT, "policy_routing", "bot", {"model": "m"}, "alice")
    store.activate_revision(PROJECT, "policy_routing", "bot", revision["revision_id"], "alice")
    policy = PolicyBinding(
        contract_family="policy_routing", contract_id="bot", revision_id=revision["revision_id"]
    )
    for outcome in Outcome:
        run_id, step = model_step(store)
        command = admission(run_id, step, policy=policy)
        start = store.admit_invocation(command)
        assert start["status"] == "created"
        assert start["start"]["command_digest"] == command_digest(command)
        assert start["start"]["policy"] == policy.as_json()
        done_command = completion(
            start, outcome, usage=Usage(input_tokens=1, cost_micros=2, currency="EUR")
        )
        done = store.complete_invocation(done_command)
        assert done["completion"]["command_digest"] == command_digest(done_command)
        assert done["completion_digest"] == canonical.digest(
            "ql3/model-invocation-completion@v1", done["completion"]
        )
    resolve = resolution_of(store, done, Decision.CANCEL)
    result = store.resolve_invocation(resolve)
    assert result["resolution"]["command_digest"] == command_digest(resolve)


# -- lifecycle -----------------------------------------------------------------------


def test_admission_fences_a_ready_step_to_running_and_writes_the_start(store: Store) -> None:
    run_id, step = model_step(store)
    command = admission(run_id, step)
    result = store.admit_invocation(command)
    assert result["status"] == "created"
    start = result["start"]
    assert start["attempt"] == 1 and start["invocation_id"] == command["invocation_id"]
    assert start["step_run_version"] == 2 and start["run_event_seq"] == 1
    assert result["start_digest"] == canonical.digest("ql3/model-invocation-start@v1", start)
    assert start["mutation_id"] == canonical.mutation_id(str(command["invocation_id"]),
                                                         "admission")  # fmt: skip
    row, run = snapshot(store, run_id, step)
    assert (row["status"], row["version"], row["attempt_count"]) == ("running", 2, 1)
    assert row["current_invocation_id"] == command["invocation_id"]
    assert (run["version"], run["event_seq"]) == (2, 1)


def test_succeeded_stores_only_an_output_ref(store: Store) -> None:
    run_id, step, done = admitted_and(
        store, Outcome.SUCCEEDED, output=b"the answer", usage=Usage(input_tokens=5, output_tokens=7)
    )
    invocation_id = done["completion"]["invocation_id"]
    assert done["status"] == "created"
    assert done["completion"]["output_ref"] == f"model-invocation:{invocation_id}"
    assert done["completion"]["output_digest"] == hashlib.sha256(b"the answer").hexdigest()
    row = store.step_run(step)
    assert (row["status"], row["version"], row["result_code"]) == ("succeeded", 3, "ok")
    assert row["output_ref"] == f"model-invocation:{invocation_id}"
    assert store.run(run_id)["event_seq"] == 2


def test_failed_keeps_the_usage_it_reported_and_unknown_cost_stays_unknown(
    store: Store,
) -> None:
    _, step, done = admitted_and(
        store, Outcome.FAILED, usage=Usage(input_tokens=11, output_tokens=None)
    )
    assert done["completion"]["usage"] == {
        "input_tokens": 11, "output_tokens": None, "cost_micros": None, "currency": None
    }  # fmt: skip
    row = store.step_run(step)
    assert (row["status"], row["result_code"], row["output_ref"]) == (
        "failed", "provider_error", None
    )  # fmt: skip
    [summary] = store.usage_summary(PROJECT)
    assert summary["completions"] == 1 and summary["input_tokens"] == 11
    assert summary["known_cost_micros"] is None and summary["unknown_cost_completions"] == 1


def test_a_completion_without_usage_writes_no_ledger_row(store: Store) -> None:
    admitted_and(store, Outcome.SUCCEEDED)
    admitted_and(store, Outcome.FAILED, usage=Usage())
    assert store.usage_summary(PROJECT) == []


def test_timed_out_ends_the_step(store: Store) -> None:
    _, step, done = admitted_and(store, Outcome.TIMED_OUT)
    assert done["completion"]["outcome"] == "timed_out"
    row = store.step_run(step)
    assert (row["status"], row["result_code"]) == ("timed_out", "MODEL_DEADLINE_EXCEEDED")


def test_lost_then_retry_gives_a_new_invocation_with_attempt_2(store: Store) -> None:
    run_id, step, lost = admitted_and(store, Outcome.LOST)
    assert lost["completion"]["result_code"] == "outcome_unknown"
    assert store.step_run(step)["status"] == "lost"

    resolved = store.resolve_invocation(resolution_of(store, lost, Decision.RETRY))
    assert resolved["status"] == "created"
    assert resolved["resolution"]["to_status"] == "ready"
    row = store.step_run(step)
    assert (row["status"], row["version"], row["attempt_count"]) == ("ready", 4, 1)
    assert row["current_invocation_id"] is None and row["result_code"] is None

    retry = store.admit_invocation(admission(run_id, step, version=4))
    assert retry["status"] == "created" and retry["start"]["attempt"] == 2
    done = store.complete_invocation(completion(retry, Outcome.SUCCEEDED))
    assert done["completion"]["attempt"] == 2
    row, run = snapshot(store, run_id, step)
    assert (row["status"], row["version"], row["attempt_count"]) == ("succeeded", 6, 2)
    assert (run["event_seq"], run["version"]) == (5, 6)


def test_old_receipts_survive_a_retry_unchanged(store: Store) -> None:
    run_id, step = model_step(store)
    first_command = admission(run_id, step)
    first = store.admit_invocation(first_command)
    lost_command = completion(first, Outcome.LOST)
    lost = store.complete_invocation(lost_command)
    resolve = resolution_of(store, lost, Decision.RETRY)
    resolved = store.resolve_invocation(resolve)
    store.admit_invocation(admission(run_id, step, version=4))

    again = store.admit_invocation(first_command)
    assert again["status"] == "existing" and again["start"] == first["start"]
    assert store.complete_invocation(lost_command)["completion"] == lost["completion"]
    replayed = store.resolve_invocation(resolve)
    assert replayed["status"] == "existing" and replayed["resolution"] == resolved["resolution"]


@pytest.mark.parametrize(
    ("decision", "status", "result_code"),
    [
        (Decision.FAIL, "failed", "model_outcome_rejected"),
        (Decision.CANCEL, "cancelled", "model_outcome_cancelled"),
    ],
)
def test_fail_and_cancel_end_a_lost_step(
    store: Store, decision: Decision, status: str, result_code: str
) -> None:
    run_id, step, lost = admitted_and(store, Outcome.LOST)
    result = store.resolve_invocation(resolution_of(store, lost, decision))
    assert result["resolution"]["to_status"] == status
    row = store.step_run(step)
    assert (row["status"], row["result_code"], row["version"]) == (status, result_code, 4)
    assert row["current_invocation_id"] == lost["completion"]["invocation_id"]
    with pytest.raises(errors.Conflict):
        store.admit_invocation(admission(run_id, step, version=4))


def test_exact_replays_are_existing_and_write_nothing(store: Store) -> None:
    run_id, step = model_step(store)
    command = admission(run_id, step)
    start = store.admit_invocation(command)
    lost_command = completion(start, Outcome.LOST)
    lost = store.complete_invocation(lost_command)
    resolve = resolution_of(store, lost, Decision.FAIL)
    store.resolve_invocation(resolve)
    before = snapshot(store, run_id, step)

    assert store.admit_invocation(command)["status"] == "existing"
    assert store.complete_invocation(lost_command)["status"] == "existing"
    assert store.resolve_invocation(resolve)["status"] == "existing"
    assert snapshot(store, run_id, step) == before


def test_replays_with_other_content_are_conflicts(store: Store) -> None:
    run_id, step = model_step(store)
    command = admission(run_id, step)
    start = store.admit_invocation(command)
    lost = store.complete_invocation(completion(start, Outcome.LOST))
    store.resolve_invocation(resolution_of(store, lost, Decision.RETRY))
    before = snapshot(store, run_id, step)

    with pytest.raises(errors.Conflict):
        store.admit_invocation({**command, "request_id": "another-request"})
    with pytest.raises(errors.Conflict):
        store.complete_invocation(completion(start, Outcome.FAILED))
    other_user = resolution_command(
        invocation_id=str(command["invocation_id"]), completion_digest=lost["completion_digest"],
        decision=Decision.RETRY, user_id="mallory", expected_step_run_version=3,
        reason="checked with the provider",
    )  # fmt: skip
    with pytest.raises(errors.Conflict):
        store.resolve_invocation(other_user)
    assert snapshot(store, run_id, step) == before


def test_admitting_a_step_that_is_not_ready_or_at_another_version_is_conflict(
    store: Store,
) -> None:
    run_id, step = model_step(store)
    with pytest.raises(errors.Conflict) as drift:
        store.admit_invocation(admission(run_id, step, version=2))
    assert drift.value.code == "QL3_CONFLICT"
    store.admit_invocation(admission(run_id, step))
    before = snapshot(store, run_id, step)
    with pytest.raises(errors.Conflict):
        store.admit_invocation(admission(run_id, step, version=2))
    assert snapshot(store, run_id, step) == before


def test_admission_under_a_revision_that_is_no_longer_active_is_stale(store: Store) -> None:
    a = store.put_revision(PROJECT, "policy_routing", "bot", {"model": "a"}, "alice")
    b = store.put_revision(PROJECT, "policy_routing", "bot", {"model": "b"}, "alice")
    store.activate_revision(PROJECT, "policy_routing", "bot", a["revision_id"], "alice")
    under_a = PolicyBinding(contract_family="policy_routing", contract_id="bot",
                            revision_id=a["revision_id"])  # fmt: skip
    run_id, step = model_step(store)
    assert store.admit_invocation(admission(run_id, step, policy=under_a))["status"] == "created"

    store.activate_revision(PROJECT, "policy_routing", "bot", b["revision_id"], "alice")
    run_id, step = model_step(store)
    before = snapshot(store, run_id, step)
    with pytest.raises(errors.StaleRevision) as stale:
        store.admit_invocation(admission(run_id, step, policy=under_a))
    assert stale.value.code == "QL3_STALE_REVISION"
    assert stale.value.detail == b["revision_id"]
    assert snapshot(store, run_id, step) == before

    under_b = PolicyBinding(contract_family="policy_routing", contract_id="bot",
                            revision_id=b["revision_id"])  # fmt: skip
    assert store.admit_invocation(admission(run_id, step, policy=under_b))["status"] == "created"


# -- errors --------------------------------------------------------------------------

Case = Callable[[Store, str, str], object]


def _admit_with(**changes: Any) -> Case:
    def call(store: Store, run_id: str, step: str) -> object:
        command = admission(run_id, step)
        command.update(changes)
        for key in [k for k, v in changes.items() if v is _DROP]:
            del command[key]
        return store.admit_invocation(command)

    return call


_DROP = object()


def _complete_unknown(store: Store, run_id: str, step: str) -> object:
    return store.complete_invocation(
        completion_command(invocation_id=new_id(), start_digest="0" * 64, outcome="lost")
    )


def _lost_with_wrong_code(store: Store, run_id: str, step: str) -> object:
    start = store.admit_invocation(admission(run_id, step))
    command = completion(start, Outcome.LOST)
    return store.complete_invocation({**command, "result_code": "timeout"})


def _resolve_a_running_invocation(store: Store, run_id: str, step: str) -> object:
    start = store.admit_invocation(admission(run_id, step))
    return store.resolve_invocation(resolution_command(
        invocation_id=start["start"]["invocation_id"], completion_digest="0" * 64,
        decision="retry", user_id="alice", expected_step_run_version=2,
    ))  # fmt: skip


def _unknown_policy_revision(store: Store, run_id: str, step: str) -> object:
    policy = PolicyBinding(contract_family="policy_routing", contract_id="nothing",
                           revision_id="00000000-0000-0000-0000-000000000000")  # fmt: skip
    return store.admit_invocation(admission(run_id, step, policy=policy))


ERROR_CASES: dict[str, tuple[Case, type[errors.Ql3Error], str]] = {
    "missing field": (_admit_with(model=_DROP), errors.InvalidArgument, "QL3_INVALID_ARGUMENT"),
    "unknown schema": (
        _admit_with(schema="ql3/model-invocation-admission@v9"),
        errors.InvalidArgument,
        "QL3_INVALID_ARGUMENT",
    ),
    "extra field": (_admit_with(note="x"), errors.InvalidArgument, "QL3_INVALID_ARGUMENT"),
    "uppercase uuid": (
        _admit_with(run_id="AAAAAAAA-0000-0000-0000-000000000001"),
        errors.InvalidArgument,
        "QL3_INVALID_ARGUMENT",
    ),
    "lost needs outcome_unknown": (
        _lost_with_wrong_code,
        errors.InvalidArgument,
        "QL3_INVALID_ARGUMENT",
    ),
    "oversize command": (
        _admit_with(invocation_id="i" * 30000),
        errors.RecordTooLarge,
        "QL3_RECORD_TOO_LARGE",
    ),
    "overlong identity": (
        _admit_with(invocation_id="i" * 129),
        errors.IdentifierTooLong,
        "QL3_IDENTIFIER_TOO_LONG",
    ),
    "unknown step": (
        _admit_with(step_run_id="00000000-0000-0000-0000-000000000000"),
        errors.NotFound,
        "QL3_NOT_FOUND",
    ),
    "unknown invocation": (_complete_unknown, errors.NotFound, "QL3_NOT_FOUND"),
    "version drift": (_admit_with(expected_step_run_version=7), errors.Conflict, "QL3_CONFLICT"),
    "stale revision": (_unknown_policy_revision, errors.StaleRevision, "QL3_STALE_REVISION"),
    "resolving what is not lost": (
        _resolve_a_running_invocation,
        errors.IllegalTransition,
        "QL3_ILLEGAL_TRANSITION",
    ),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_each_error_raises_its_class_with_its_stable_code(store: Store, case: str) -> None:
    call, cls, code = ERROR_CASES[case]
    run_id, step = model_step(store)
    with pytest.raises(errors.Ql3Error) as raised:
        call(store, run_id, step)
    assert type(raised.value) is cls
    assert raised.value.code == code
    assert raised.value.message.startswith(code)


def test_a_failed_admission_writes_nothing(store: Store) -> None:
    run_id, step = model_step(store)
    before = snapshot(store, run_id, step)
    for name in ("missing field", "oversize command", "overlong identity", "version drift"):
        with pytest.raises(errors.Ql3Error):
            ERROR_CASES[name][0](store, run_id, step)
    assert snapshot(store, run_id, step) == before


# -- recovery ------------------------------------------------------------------------


def test_recovery_settles_expired_starts_as_lost_by_the_database_clock(store: Store) -> None:
    run_id, expired_step = model_step(store)
    expired = store.admit_invocation(admission(run_id, expired_step, deadline=PAST))
    live_step = store.add_step_run(run_id, "model")
    live = store.admit_invocation(admission(run_id, live_step))

    result = store.recover_expired(100, 0)
    assert result["count"] == 1
    [item] = result["recovered"]
    assert item["invocation_id"] == expired["start"]["invocation_id"]
    assert item["deadline_at"] == format_timestamp(PAST)
    assert store.step_run(expired_step)["status"] == "lost"
    assert store.step_run(expired_step)["result_code"] == "outcome_unknown"
    assert store.step_run(live_step)["status"] == "running"
    assert store.recover_expired(100, 0)["count"] == 0

    # A late gateway with a real outcome is refused; the same lost command replays.
    with pytest.raises(errors.Conflict):
        store.complete_invocation(completion(expired, Outcome.SUCCEEDED))
    late = store.complete_invocation(completion(expired, Outcome.LOST))
    assert late["status"] == "existing" and late["completion"]["recovered"] is True
    assert late["completion_digest"] == item["completion_digest"]
    assert store.complete_invocation(completion(live, Outcome.SUCCEEDED))["status"] == "created"


def test_recovery_waits_for_the_grace_and_is_bounded_by_its_limit(store: Store) -> None:
    run_id = store.create_run(PROJECT, "trace-1")
    recent = datetime.now(UTC) - timedelta(seconds=1)
    for _ in range(3):
        step = store.add_step_run(run_id, "model")
        store.admit_invocation(admission(run_id, step, deadline=recent))
    assert store.recover_expired(100, 3600)["count"] == 0
    assert store.recover_expired(2, 0)["count"] == 2
    assert store.recover_expired(2, 0)["count"] == 1
    with pytest.raises(errors.InvalidArgument):
        store.recover_expired(0, 0)


# -- roles (PostgreSQL only) -----------------------------------------------------------


def test_runtime_admits_and_completes_but_cannot_resolve_or_recover(db_dsn: str) -> None:
    with PgStore(role_dsn(db_dsn, "runtime")) as runtime:
        run_id, step = model_step(runtime)
        start = runtime.admit_invocation(admission(run_id, step))
        lost = runtime.complete_invocation(completion(start, Outcome.LOST))
        resolve = resolution_of(runtime, lost, Decision.RETRY)
        with pytest.raises(errors.PermissionDenied) as denied:
            runtime.resolve_invocation(resolve)
        assert denied.value.code == "QL3_PERMISSION_DENIED"
        with pytest.raises(errors.PermissionDenied):
            runtime.recover_expired(10, 0)
        row = runtime.step_run(step)
        assert row is not None and row["status"] == "lost"
    with PgStore(role_dsn(db_dsn, "operator")) as operator:
        assert operator.resolve_invocation(resolve)["status"] == "created"
        assert operator.recover_expired(10, 0)["count"] == 0
