"""Durable model invocations on SQLite: admission, completion, resolution, recovery and
the usage summary of ``sql/ql3_ai/0001_invocations.sql`` as Python transactions.

Every rule, check order, error code, record field and identity is the SQL function's;
the comments name the SQL they mirror where the translation is not obvious. The caller's
``Tx`` holds the write lock from its first statement, which is what the step row lock
(``FOR UPDATE``) does in PostgreSQL: everything that happens to one step is serialised.
``tx.point(name)`` marks each statement boundary for the crash-window tests.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from ql3 import canonical, errors
from ql3.arguments import check_text_args
from ql3.edge import runs
from ql3.edge.checks import (
    check_currency,
    check_identifier,
    check_result_code,
    check_sha256,
    check_shape,
    check_timestamp,
    check_uuid,
    checked_digest,
    invalid,
)
from ql3.edge.db import Row, Tx, translate, utc_text
from ql3.invocations import (
    ADMISSION_SCHEMA,
    COMPLETION_COMMAND_SCHEMA,
    COMPLETION_SCHEMA,
    RESOLUTION_COMMAND_SCHEMA,
    RESOLUTION_SCHEMA,
    START_SCHEMA,
    as_utc,
    completion_command,
    recovery_arguments,
)

ADMISSION_FIELDS: Final = (
    "schema", "invocation_id", "request_id", "project_id", "run_id", "step_run_id", "trace_id",
    "expected_step_run_version", "provider", "model", "policy", "request_digest", "input_bytes",
    "deadline_at",
)  # fmt: skip
ADMISSION_KINDS: Final = (
    "string", "string", "string", "string", "string", "string", "string",
    "integer", "string", "string", "object?", "string", "integer", "string",
)  # fmt: skip
POLICY_FIELDS: Final = ("contract_family", "contract_id", "revision_id")
COMPLETION_FIELDS: Final = (
    "schema", "invocation_id", "start_digest", "outcome", "result_code", "output_bytes",
    "output_digest", "usage",
)  # fmt: skip
COMPLETION_KINDS: Final = (
    "string", "string", "string", "string", "string", "integer?", "string?", "object?",
)  # fmt: skip
USAGE_FIELDS: Final = ("input_tokens", "output_tokens", "cost_micros", "currency")
USAGE_KINDS: Final = ("integer?", "integer?", "integer?", "string?")
RESOLUTION_FIELDS: Final = (
    "schema", "invocation_id", "completion_digest", "decision", "user_id",
    "expected_step_run_version", "reason",
)  # fmt: skip
RESOLUTION_KINDS: Final = ("string", "string", "string", "string", "string", "integer", "string?")

OUTCOMES: Final = ("succeeded", "failed", "timed_out", "lost")
RESERVED_RESULT_CODES: Final = ("model_outcome_rejected", "model_outcome_cancelled")
DECISIONS: Final = {
    "retry": ("ready", None),
    "fail": ("failed", "model_outcome_rejected"),
    "cancel": ("cancelled", "model_outcome_cancelled"),
}


def _identities(invocation_id: str, phase: str) -> tuple[str, str, str]:
    return (
        canonical.mutation_id(invocation_id, phase),
        canonical.event_id(invocation_id, phase),
        canonical.dedupe_key(invocation_id, phase),
    )


def _verify_receipt(what: str, domain: str, stored: str, stored_digest: str) -> Any:
    """The stored record, re-verified against its digest (``ql3_ai._verify_receipt``)."""
    try:
        record = canonical.parse_json(stored)
        digest, _ = checked_digest(what, domain, record)
    except errors.InvalidArgument:
        digest = None
    if digest != stored_digest:
        raise errors.Conflict(
            f"QL3_CONFLICT: stored {what} no longer matches its digest {stored_digest}"
        )
    return record


def _bump_run(tx: Tx, run_id: str) -> sqlite3.Row:
    run = tx.one(
        "UPDATE runs SET version = version + 1, event_seq = event_seq + 1, updated_at = ?"
        " WHERE run_id = ? RETURNING version, event_seq, project_id, trace_id",
        (tx.now_text, run_id),
    )
    assert run is not None
    return run


def _append_history(
    tx: Tx,
    *,
    run_id: str,
    seq: int,
    event_id: str,
    event_type: str,
    step_run_id: str,
    payload: dict[str, Any],
    mutation: tuple[str, str, str, str, int, str],
) -> None:
    """The run event and the step mutation of one transition (after the step update)."""
    tx.run(
        "INSERT INTO run_events (run_id, seq, event_id, event_type, step_run_id, payload,"
        " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (run_id, seq, event_id, event_type, step_run_id, canonical.jcs(payload), tx.now_text),
    )
    tx.point("after_event_insert")
    mutation_id, dedupe_key, from_status, to_status, from_version, command_digest = mutation
    tx.run(
        "INSERT INTO step_run_mutations (mutation_id, dedupe_key, step_run_id, from_status,"
        " to_status, from_version, to_version, command_digest, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (mutation_id, dedupe_key, step_run_id, from_status, to_status, from_version,
         from_version + 1, command_digest, tx.now_text),
    )  # fmt: skip
    tx.point("after_mutation_insert")


# -- admission ------------------------------------------------------------------------


_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _names_a_run(command: Any) -> bool:
    """Whether ``create_run`` and ``add_step_run`` can take the run and step the command
    names: ``ql3_ai.admit_in_new_run``'s test, to the letter (D59)."""
    if not isinstance(command, Mapping):
        return False
    project, trace = command.get("project_id"), command.get("trace_id")
    run_id, step_run_id = command.get("run_id"), command.get("step_run_id")
    if not (
        isinstance(project, str)
        and isinstance(trace, str)
        and isinstance(run_id, str)
        and isinstance(step_run_id, str)
    ):
        return False
    return (
        all(1 <= len(text) <= canonical.MAX_IDENTIFIER_CHARS for text in (project, trace))
        and "\x00" not in project + trace
        and _CANONICAL_UUID.fullmatch(run_id) is not None
        and _CANONICAL_UUID.fullmatch(step_run_id) is not None
    )


def admit_in_new_run(tx: Tx, command: Any) -> Row:
    """``ql3_ai.admit_in_new_run``: create the run and the model step the command names
    (or find them, the same), then admit, in the caller's one transaction. A command whose
    run and step cannot be taken goes to ``admit_invocation`` as it is, for its own error."""
    if _names_a_run(command):
        runs.create_run(tx, command["project_id"], command["trace_id"], command["run_id"])
        runs.add_step_run(tx, command["run_id"], "model", command["step_run_id"])
    return admit_invocation(tx, command)


def admit_invocation(tx: Tx, command: Any) -> Row:
    check_shape("admission command", command, ADMISSION_SCHEMA, ADMISSION_FIELDS, ADMISSION_KINDS)
    policy = command["policy"]
    if policy is not None:
        check_shape("admission command policy", policy, None, POLICY_FIELDS, ("string",) * 3)
    command_digest, _ = checked_digest("admission command", ADMISSION_SCHEMA, command)
    invocation_id = check_identifier("invocation_id", command["invocation_id"])
    check_identifier("request_id", command["request_id"])
    project_id = check_identifier("project_id", command["project_id"])
    trace_id = check_identifier("trace_id", command["trace_id"])
    check_identifier("provider", command["provider"])
    check_identifier("model", command["model"])
    run_id = check_uuid("run_id", command["run_id"])
    step_run_id = check_uuid("step_run_id", command["step_run_id"])
    expected_version = command["expected_step_run_version"]
    if expected_version < 1:
        invalid("expected_step_run_version must be >= 1")
    check_sha256("request_digest", command["request_digest"])
    input_bytes = command["input_bytes"]
    check_timestamp("deadline_at", command["deadline_at"])
    policy_family = policy_contract = policy_revision = None
    if policy is not None:
        policy_family = check_identifier("policy.contract_family", policy["contract_family"])
        policy_contract = check_identifier("policy.contract_id", policy["contract_id"])
        policy_revision = check_uuid("policy.revision_id", policy["revision_id"])

    step = tx.one("SELECT * FROM step_runs WHERE step_run_id = ?", (step_run_id,))
    tx.point("after_step_select")
    if step is None or step["run_id"] != run_id:
        if tx.one("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)) is None:
            raise errors.NotFound(f"QL3_NOT_FOUND: run {run_id} does not exist")
        raise errors.NotFound(
            f"QL3_NOT_FOUND: step run {step_run_id} does not exist in run {run_id}"
        )

    prior = tx.one(
        "SELECT command_digest, record, start_digest FROM model_invocation_starts"
        " WHERE invocation_id = ?",
        (invocation_id,),
    )
    tx.point("after_prior_select")
    if prior is not None:
        if prior["command_digest"] == command_digest:
            record = _verify_receipt(
                "start record", START_SCHEMA, prior["record"], prior["start_digest"]
            )
            return {"status": "existing", "start": record, "start_digest": prior["start_digest"]}
        raise errors.Conflict(
            f"QL3_CONFLICT: invocation {invocation_id} was admitted with another command "
            f"(digest {prior['command_digest']})"
        )

    if step["kind"] != "model":
        invalid(f"step run {step_run_id} is of kind '{step['kind']}', not model")
    if step["status"] != "ready":
        raise errors.Conflict(
            f"QL3_CONFLICT: step run {step_run_id} is {step['status']}, not ready"
        )
    if step["version"] != expected_version:
        raise errors.Conflict(
            f"QL3_CONFLICT: step run {step_run_id} is at version {step['version']}, "
            f"the command expects {expected_version}"
        )

    # The policy fence, read in this transaction after the step "lock" (the write lock).
    if policy_revision is not None:
        fence = tx.one(
            "SELECT a.active_revision_id FROM contract_families AS f"
            " LEFT JOIN active_revisions AS a ON a.project_id = ?"
            " AND a.contract_family = f.contract_family AND a.contract_id = ?"
            " WHERE f.contract_family = ?",
            (project_id, policy_contract, policy_family),
        )
        tx.point("after_policy_select")
        if fence is None:
            invalid(f"unknown contract family '{policy_family}'")
        active = fence[0]
        if active != policy_revision:
            raise errors.StaleRevision(
                f"QL3_STALE_REVISION: policy revision {policy_revision} of "
                f"{policy_family}/{policy_contract} is not active (active: {active or 'none'})",
                detail=active or "",
            )

    run = _bump_run(tx, run_id)
    tx.point("after_run_update")
    if (run["project_id"], run["trace_id"]) != (project_id, trace_id):
        raise errors.Conflict(
            f"QL3_CONFLICT: run {run_id} belongs to project '{run['project_id']}' and trace "
            f"'{run['trace_id']}', not '{project_id}' and '{trace_id}'"
        )

    mutation_id, event_id, dedupe_key = _identities(invocation_id, "admission")
    attempt = int(step["attempt_count"]) + 1
    step_version = int(step["version"]) + 1
    receipt = {
        "schema": START_SCHEMA,
        "invocation_id": invocation_id,
        "request_id": command["request_id"],
        "project_id": project_id,
        "run_id": run_id,
        "step_run_id": step_run_id,
        "trace_id": trace_id,
        "attempt": attempt,
        "provider": command["provider"],
        "model": command["model"],
        "policy": None if policy is None else dict(policy),
        "request_digest": command["request_digest"],
        "input_bytes": input_bytes,
        "deadline_at": command["deadline_at"],
        "command_digest": command_digest,
        "step_run_version": step_version,
        "run_version": int(run["version"]),
        "run_event_seq": int(run["event_seq"]),
        "mutation_id": mutation_id,
        "event_id": event_id,
        "dedupe_key": dedupe_key,
        "admitted_at": tx.now_text,
    }
    start_digest, record_text = checked_digest("start record", START_SCHEMA, receipt)

    tx.run(
        "INSERT INTO model_invocation_starts (invocation_id, request_id, project_id, run_id,"
        " step_run_id, trace_id, attempt, provider, model, policy_contract_family,"
        " policy_contract_id, policy_revision_id, request_digest, deadline_at, input_bytes,"
        " command_digest, record, start_digest, mutation_id, event_id, dedupe_key, admitted_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (invocation_id, command["request_id"], project_id, run_id, step_run_id, trace_id,
         attempt, command["provider"], command["model"], policy_family, policy_contract,
         policy_revision, command["request_digest"], command["deadline_at"], input_bytes,
         command_digest, record_text, start_digest, mutation_id, event_id, dedupe_key,
         tx.now_text),
    )  # fmt: skip
    tx.point("after_start_insert")
    tx.run(
        "UPDATE step_runs SET status = 'running', version = version + 1,"
        " attempt_count = attempt_count + 1, current_invocation_id = ?, updated_at = ?"
        " WHERE step_run_id = ?",
        (invocation_id, tx.now_text, step_run_id),
    )
    tx.point("after_step_update")
    _append_history(
        tx,
        run_id=run_id,
        seq=int(run["event_seq"]),
        event_id=event_id,
        event_type="model_invocation_admitted",
        step_run_id=step_run_id,
        payload={
            "invocation_id": invocation_id,
            "attempt": attempt,
            "from_status": "ready",
            "to_status": "running",
            "step_run_version": step_version,
            "start_digest": start_digest,
        },
        mutation=(mutation_id, dedupe_key, "ready", "running", step_version - 1, command_digest),
    )
    return {"status": "created", "start": receipt, "start_digest": start_digest}


# -- completion -----------------------------------------------------------------------


def _write_completion(
    tx: Tx,
    start: sqlite3.Row,
    step_version: int,
    command: Any,
    command_digest: str,
    recovered: bool,
) -> Row:
    """``ql3_ai._write_completion``: the receipt, its ledger row and the transition."""
    invocation_id = start["invocation_id"]
    outcome = command["outcome"]
    result_code = command["result_code"]
    usage = command["usage"]
    input_tokens = output_tokens = cost_micros = currency = None
    if usage is not None:
        input_tokens = usage["input_tokens"]
        output_tokens = usage["output_tokens"]
        cost_micros = usage["cost_micros"]
        currency = usage["currency"]
        usage = {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cost_micros": cost_micros,
            "currency": currency,
        }
    output_ref = f"model-invocation:{invocation_id}" if outcome == "succeeded" else None
    mutation_id, event_id, dedupe_key = _identities(invocation_id, "completion")
    run = _bump_run(tx, start["run_id"])
    tx.point("after_run_update")
    output_bytes = command["output_bytes"]
    receipt = {
        "schema": COMPLETION_SCHEMA,
        "invocation_id": invocation_id,
        "start_digest": start["start_digest"],
        "project_id": start["project_id"],
        "run_id": start["run_id"],
        "step_run_id": start["step_run_id"],
        "trace_id": start["trace_id"],
        "attempt": int(start["attempt"]),
        "provider": start["provider"],
        "model": start["model"],
        "outcome": outcome,
        "result_code": result_code,
        "output_bytes": output_bytes,
        "output_digest": command["output_digest"],
        "usage": usage,
        "recovered": recovered,
        "output_ref": output_ref,
        "command_digest": command_digest,
        "step_run_version": step_version + 1,
        "run_version": int(run["version"]),
        "run_event_seq": int(run["event_seq"]),
        "mutation_id": mutation_id,
        "event_id": event_id,
        "dedupe_key": dedupe_key,
        "completed_at": tx.now_text,
    }
    completion_digest, record_text = checked_digest("completion record", COMPLETION_SCHEMA, receipt)
    tx.run(
        "INSERT INTO model_invocation_completions (invocation_id, start_digest, project_id,"
        " run_id, step_run_id, outcome, result_code, output_bytes, output_digest, input_tokens,"
        " output_tokens, cost_micros, currency, recovered, command_digest, record,"
        " completion_digest, mutation_id, event_id, dedupe_key, completed_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (invocation_id, start["start_digest"], start["project_id"], start["run_id"],
         start["step_run_id"], outcome, result_code, output_bytes, command["output_digest"],
         input_tokens, output_tokens, cost_micros, currency, int(recovered), command_digest,
         record_text, completion_digest, mutation_id, event_id, dedupe_key, tx.now_text),
    )  # fmt: skip
    tx.point("after_completion_insert")
    if any(v is not None for v in (input_tokens, output_tokens, cost_micros, currency)):
        tx.run(
            "INSERT INTO usage_ledger (invocation_id, project_id, run_id, provider, model,"
            " input_tokens, output_tokens, cost_micros, currency, outcome, completion_digest,"
            " recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (invocation_id, start["project_id"], start["run_id"], start["provider"],
             start["model"], input_tokens, output_tokens, cost_micros, currency, outcome,
             completion_digest, tx.now_text),
        )  # fmt: skip
        tx.point("after_ledger_insert")
    tx.run(
        "UPDATE step_runs SET status = ?, version = version + 1, output_ref = ?, result_code = ?,"
        " updated_at = ? WHERE step_run_id = ?",
        (outcome, output_ref, result_code, tx.now_text, start["step_run_id"]),
    )
    tx.point("after_step_update")
    _append_history(
        tx,
        run_id=start["run_id"],
        seq=int(run["event_seq"]),
        event_id=event_id,
        event_type="model_invocation_completed",
        step_run_id=start["step_run_id"],
        payload={
            "invocation_id": invocation_id,
            "outcome": outcome,
            "result_code": result_code,
            "recovered": recovered,
            "from_status": "running",
            "to_status": outcome,
            "step_run_version": step_version + 1,
            "completion_digest": completion_digest,
        },
        mutation=(mutation_id, dedupe_key, "running", outcome, step_version, command_digest),
    )
    return {"status": "created", "completion": receipt, "completion_digest": completion_digest}


def _check_completion_command(command: Any) -> tuple[str, str]:
    """Shape, digest and formats of a completion command; (invocation_id, command_digest)."""
    check_shape(
        "completion command",
        command,
        COMPLETION_COMMAND_SCHEMA,
        COMPLETION_FIELDS,
        COMPLETION_KINDS,
    )
    usage = command["usage"]
    if usage is not None:
        check_shape("completion command usage", usage, None, USAGE_FIELDS, USAGE_KINDS)
    command_digest, _ = checked_digest("completion command", COMPLETION_COMMAND_SCHEMA, command)
    invocation_id = check_identifier("invocation_id", command["invocation_id"])
    check_sha256("start_digest", command["start_digest"])
    outcome = command["outcome"]
    if outcome not in OUTCOMES:
        invalid(f"outcome must be succeeded, failed, timed_out or lost, not '{str(outcome)[:64]}'")
    result_code = check_identifier("result_code", command["result_code"])
    check_result_code(result_code)
    if (outcome == "lost") != (result_code == "outcome_unknown"):
        invalid(
            f"outcome {outcome} with result_code {result_code} (lost goes with "
            f"outcome_unknown, and only lost)"
        )
    if result_code in RESERVED_RESULT_CODES:
        invalid(f"result_code {result_code} is reserved for resolutions")
    if command["output_digest"] is not None:
        check_sha256("output_digest", command["output_digest"])
    if usage is not None:
        if usage["currency"] is not None:
            check_currency(usage["currency"])
        if usage["cost_micros"] is not None and usage["currency"] is None:
            invalid("usage.cost_micros needs usage.currency")
    return invocation_id, command_digest


def complete_invocation(tx: Tx, command: Any) -> Row:
    invocation_id, command_digest = _check_completion_command(command)

    start = tx.one(
        "SELECT * FROM model_invocation_starts WHERE invocation_id = ?", (invocation_id,)
    )
    tx.point("after_start_select")
    if start is None:
        raise errors.NotFound(f"QL3_NOT_FOUND: invocation {invocation_id} was never admitted")
    step = tx.one("SELECT * FROM step_runs WHERE step_run_id = ?", (start["step_run_id"],))
    tx.point("after_step_select")
    assert step is not None

    prior = tx.one(
        "SELECT * FROM model_invocation_completions WHERE invocation_id = ?", (invocation_id,)
    )
    tx.point("after_prior_select")
    if prior is not None:
        if prior["command_digest"] != command_digest:
            raise errors.Conflict(
                f"QL3_CONFLICT: invocation {invocation_id} was completed with another command "
                f"(outcome {prior['outcome']}, result_code {prior['result_code']})"
            )
        record = _verify_receipt(
            "completion record", COMPLETION_SCHEMA, prior["record"], prior["completion_digest"]
        )
        _verify_ledger(tx, invocation_id, prior)
        return {
            "status": "existing",
            "completion": record,
            "completion_digest": prior["completion_digest"],
        }

    if start["start_digest"] != command["start_digest"]:
        raise errors.Conflict(
            f"QL3_CONFLICT: start_digest of invocation {invocation_id} is "
            f"{start['start_digest']}, not {command['start_digest']}"
        )
    if step["status"] != "running" or step["current_invocation_id"] != invocation_id:
        raise errors.IllegalTransition(
            f"QL3_ILLEGAL_TRANSITION: step run {step['step_run_id']} is {step['status']} with "
            f"invocation {step['current_invocation_id'] or 'none'}, not running {invocation_id}"
        )
    return _write_completion(tx, start, int(step["version"]), command, command_digest, False)


_LEDGER_FIELDS: Final = (
    "input_tokens", "output_tokens", "cost_micros", "currency", "outcome", "completion_digest",
    "project_id", "run_id",
)  # fmt: skip


def _verify_ledger(tx: Tx, invocation_id: str, prior: sqlite3.Row) -> None:
    """A replay re-verifies the ledger row against the completion (or its absence)."""
    ledger = tx.one("SELECT * FROM usage_ledger WHERE invocation_id = ?", (invocation_id,))
    should_exist = any(
        prior[f] is not None for f in ("input_tokens", "output_tokens", "cost_micros", "currency")
    )
    if (ledger is not None) != should_exist or (
        ledger is not None and any(ledger[f] != prior[f] for f in _LEDGER_FIELDS)
    ):
        raise errors.Conflict(
            f"QL3_CONFLICT: the usage_ledger row of invocation {invocation_id} does not match "
            f"its completion"
        )


# -- resolution -----------------------------------------------------------------------


def resolve_invocation(tx: Tx, command: Any) -> Row:
    check_shape(
        "resolution command",
        command,
        RESOLUTION_COMMAND_SCHEMA,
        RESOLUTION_FIELDS,
        RESOLUTION_KINDS,
    )
    command_digest, _ = checked_digest("resolution command", RESOLUTION_COMMAND_SCHEMA, command)
    invocation_id = check_identifier("invocation_id", command["invocation_id"])
    user_id = check_identifier("user_id", command["user_id"])
    check_sha256("completion_digest", command["completion_digest"])
    decision = command["decision"]
    if decision not in DECISIONS:
        invalid(f"decision must be retry, fail or cancel, not '{str(decision)[:64]}'")
    new_status, new_result_code = DECISIONS[decision]
    expected_version = command["expected_step_run_version"]
    if expected_version < 1:
        invalid("expected_step_run_version must be >= 1")
    if command["reason"] == "":
        invalid("reason must be null or non-empty")

    start = tx.one(
        "SELECT * FROM model_invocation_starts WHERE invocation_id = ?", (invocation_id,)
    )
    tx.point("after_start_select")
    if start is None:
        raise errors.NotFound(f"QL3_NOT_FOUND: invocation {invocation_id} was never admitted")
    step = tx.one("SELECT * FROM step_runs WHERE step_run_id = ?", (start["step_run_id"],))
    tx.point("after_step_select")
    assert step is not None

    prior = tx.one(
        "SELECT command_digest, decision, user_id, record, resolution_digest"
        " FROM model_invocation_resolutions WHERE invocation_id = ?",
        (invocation_id,),
    )
    tx.point("after_prior_select")
    if prior is not None:
        if prior["command_digest"] != command_digest:
            raise errors.Conflict(
                f"QL3_CONFLICT: invocation {invocation_id} was already resolved "
                f"({prior['decision']} by {prior['user_id']})"
            )
        record = _verify_receipt(
            "resolution record", RESOLUTION_SCHEMA, prior["record"], prior["resolution_digest"]
        )
        return {
            "status": "existing",
            "resolution": record,
            "resolution_digest": prior["resolution_digest"],
        }

    completion = tx.one(
        "SELECT outcome, completion_digest FROM model_invocation_completions"
        " WHERE invocation_id = ?",
        (invocation_id,),
    )
    tx.point("after_completion_select")
    if completion is None or completion["outcome"] != "lost":
        state = "not completed" if completion is None else completion["outcome"]
        raise errors.IllegalTransition(
            f"QL3_ILLEGAL_TRANSITION: invocation {invocation_id} is {state}, only "
            f"lost/outcome_unknown is resolved"
        )
    if completion["completion_digest"] != command["completion_digest"]:
        raise errors.Conflict(
            f"QL3_CONFLICT: completion_digest of invocation {invocation_id} is "
            f"{completion['completion_digest']}, not {command['completion_digest']}"
        )
    if step["status"] != "lost" or step["current_invocation_id"] != invocation_id:
        raise errors.IllegalTransition(
            f"QL3_ILLEGAL_TRANSITION: step run {step['step_run_id']} is {step['status']} with "
            f"invocation {step['current_invocation_id'] or 'none'}, not lost with {invocation_id}"
        )
    if step["version"] != expected_version:
        raise errors.Conflict(
            f"QL3_CONFLICT: step run {step['step_run_id']} is at version {step['version']}, "
            f"the command expects {expected_version}"
        )

    run = _bump_run(tx, start["run_id"])
    tx.point("after_run_update")
    mutation_id, event_id, dedupe_key = _identities(invocation_id, "resolution")
    step_version = int(step["version"]) + 1
    receipt = {
        "schema": RESOLUTION_SCHEMA,
        "invocation_id": invocation_id,
        "completion_digest": completion["completion_digest"],
        "project_id": start["project_id"],
        "run_id": start["run_id"],
        "step_run_id": start["step_run_id"],
        "trace_id": start["trace_id"],
        "attempt": int(start["attempt"]),
        "decision": decision,
        "user_id": user_id,
        "reason": command["reason"],
        "to_status": new_status,
        "result_code": new_result_code,
        "command_digest": command_digest,
        "step_run_version": step_version,
        "run_version": int(run["version"]),
        "run_event_seq": int(run["event_seq"]),
        "mutation_id": mutation_id,
        "event_id": event_id,
        "dedupe_key": dedupe_key,
        "resolved_at": tx.now_text,
    }
    resolution_digest, record_text = checked_digest("resolution record", RESOLUTION_SCHEMA, receipt)
    tx.run(
        "INSERT INTO model_invocation_resolutions (invocation_id, completion_digest, run_id,"
        " step_run_id, decision, user_id, reason, command_digest, record, resolution_digest,"
        " mutation_id, event_id, dedupe_key, resolved_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (invocation_id, completion["completion_digest"], start["run_id"], start["step_run_id"],
         decision, user_id, command["reason"], command_digest, record_text, resolution_digest,
         mutation_id, event_id, dedupe_key, tx.now_text),
    )  # fmt: skip
    tx.point("after_resolution_insert")
    # retry clears the old result (the next admission needs a new invocation_id, its start
    # raises attempt_count); fail and cancel keep the invocation that ended the step.
    tx.run(
        "UPDATE step_runs SET status = ?, version = version + 1, output_ref = NULL,"
        " result_code = ?, current_invocation_id = CASE WHEN ? = 'ready' THEN NULL"
        " ELSE current_invocation_id END, updated_at = ? WHERE step_run_id = ?",
        (new_status, new_result_code, new_status, tx.now_text, start["step_run_id"]),
    )
    tx.point("after_step_update")
    _append_history(
        tx,
        run_id=start["run_id"],
        seq=int(run["event_seq"]),
        event_id=event_id,
        event_type="model_invocation_resolved",
        step_run_id=start["step_run_id"],
        payload={
            "invocation_id": invocation_id,
            "decision": decision,
            "user_id": user_id,
            "from_status": "lost",
            "to_status": new_status,
            "step_run_version": step_version,
            "resolution_digest": resolution_digest,
        },
        mutation=(mutation_id, dedupe_key, "lost", new_status, step_version - 1, command_digest),
    )
    return {"status": "created", "resolution": receipt, "resolution_digest": resolution_digest}


# -- recovery and usage ---------------------------------------------------------------


def _recovery_failure_code(exc: errors.Ql3Error | sqlite3.Error) -> str:
    """The SQLSTATE a skipped start is reported with, as PostgreSQL reports it: a taken
    receipt identity (a UNIQUE failure) is Q3C01 (D46); any other SQLite error is what
    ``translate`` makes of it."""
    if isinstance(exc, sqlite3.Error):
        if getattr(exc, "sqlite_errorname", "") in _UNIQUE_FAILURES:
            return errors.Conflict.sqlstate or ""
        exc = translate(exc)
    return exc.sqlstate or "XX000"


_UNIQUE_FAILURES = frozenset({"SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY"})


def recover_expired(tx: Tx, limit: object, grace_seconds: object) -> Row:
    batch, grace = recovery_arguments(limit, grace_seconds)
    horizon = utc_text(tx.now - grace)
    # An unfinished start is exactly the current invocation of a running step, so the scan
    # walks running steps (a partial index), never the whole start history.
    expired = tx.all(
        "SELECT s.version, st.* FROM step_runs AS s"
        " JOIN model_invocation_starts AS st ON st.invocation_id = s.current_invocation_id"
        " WHERE s.status = 'running' AND st.deadline_at < ?"
        " AND NOT EXISTS (SELECT 1 FROM model_invocation_completions AS c"
        " WHERE c.invocation_id = st.invocation_id)"
        " ORDER BY st.deadline_at, st.invocation_id LIMIT ?",
        (horizon, batch),
    )
    recovered: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    # Settled run by run, as PostgreSQL settles them (there, to lock runs in one order),
    # each under a savepoint of its own: one start that cannot be settled is reported and
    # skipped, and the rest of the batch is settled (D46).
    for start in sorted(expired, key=lambda s: (s["run_id"], s["deadline_at"], s["invocation_id"])):
        command = completion_command(
            invocation_id=start["invocation_id"], start_digest=start["start_digest"], outcome="lost"
        )
        tx.run("SAVEPOINT ql3_recover_one")
        try:
            command_digest, _ = checked_digest(
                "completion command", COMPLETION_COMMAND_SCHEMA, command
            )
            result = _write_completion(
                tx, start, int(start["version"]), command, command_digest, True
            )
        except (errors.Ql3Error, sqlite3.Error) as exc:
            tx.run("ROLLBACK TO SAVEPOINT ql3_recover_one")
            tx.run("RELEASE SAVEPOINT ql3_recover_one")
            code = _recovery_failure_code(exc)
            failed.append(
                {
                    "invocation_id": start["invocation_id"],
                    "run_id": start["run_id"],
                    "step_run_id": start["step_run_id"],
                    "sqlstate": code,
                    "message": str(exc),
                }
            )
            continue
        tx.run("RELEASE SAVEPOINT ql3_recover_one")
        recovered.append(
            {
                "invocation_id": start["invocation_id"],
                "run_id": start["run_id"],
                "step_run_id": start["step_run_id"],
                "deadline_at": start["deadline_at"],
                "completion_digest": result["completion_digest"],
            }
        )
    return {"count": len(recovered), "recovered": recovered, "failed": failed}


def usage_summary(
    tx: Tx, project_id: object, since: datetime | None, until: datetime | None
) -> list[Row]:
    # The bounds first: PostgreSQL takes them as timestamptz arguments before its checks.
    lower, upper = (None if m is None else utc_text(as_utc(m)) for m in (since, until))
    if project_id is None or project_id == "":
        invalid("project_id is required")
    if not isinstance(project_id, str):
        invalid(f"project_id must be text, not {type(project_id).__name__}")
    check_text_args(project_id)
    if len(project_id) > canonical.MAX_IDENTIFIER_CHARS:
        raise errors.IdentifierTooLong(
            f"QL3_IDENTIFIER_TOO_LONG: project_id has {len(project_id)} characters (at most 128)"
        )
    if lower is not None and upper is not None and lower > upper:
        invalid("from is after to")
    rows = tx.all(
        "SELECT provider, model, currency, count(*) AS completions,"
        " sum(input_tokens) AS input_tokens, sum(output_tokens) AS output_tokens,"
        " sum(cost_micros) AS known_cost_micros, count(cost_micros) AS known_cost_completions,"
        " count(*) - count(cost_micros) AS unknown_cost_completions"
        " FROM usage_ledger WHERE project_id = ?1"
        " AND (?2 IS NULL OR recorded_at >= ?2) AND (?3 IS NULL OR recorded_at < ?3)"
        " GROUP BY provider, model, currency"
        " ORDER BY provider, model, currency IS NULL, currency",  # PostgreSQL: NULLS LAST
        (project_id, lower, upper),
    )
    return [dict(zip(row.keys(), tuple(row), strict=True)) for row in rows]
