"""Conformance: PostgreSQL (``PgStore``) and the SQLite shim (``EdgeStore``, both journal
modes) are one store (SPEC sections 10 and 11, River's driver conformance suite).

- The ``store`` fixture runs each scenario against every kind: the same statuses, states,
  versions, identities, command digests and error codes, every refusal writing nothing.
- ``test_pinned_clocks_give_byte_identical_records`` builds all three stores in one test,
  pins their clocks (PostgreSQL: ``ql3._now()``, core 0004) and requires the records and
  their digests PostgreSQL writes to be exactly those of both SQLite files.
- Every shared vector (``tests/vectors/*.json``) runs through the store's own paths:
  ``body_hash`` of ``put_revision``, the shim's command/record digest, and the identities
  admission, completion and resolution store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sqlite3
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from fix_servers import drop_database, role_dsn, with_dbname
from fix_stores import make_edge_store, pin_clock
from ql3 import canonical, errors
from ql3.edge import EdgeStore
from ql3.edge.checks import checked_digest
from ql3.invocations import (
    ADMISSION_SCHEMA,
    COMPLETION_COMMAND_SCHEMA,
    RESOLUTION_COMMAND_SCHEMA,
    format_timestamp,
)
from ql3.migrate import migrate
from ql3.store import PgStore
from test_canonical import RFC8785_OK, RFC8785_VALUES, Rfc8785Case, load_vectors

REPO = Path(__file__).resolve().parents[2]
FAMILY = "policy_routing"
R1 = "aaaaaaaa-0000-0000-0000-000000000001"
R2 = "aaaaaaaa-0000-0000-0000-000000000002"
TOOL = "bbbbbbbb-0000-0000-0000-0000000000ff"
R2_STEP = "bbbbbbbb-0000-0000-0000-000000000021"
FAR = "2999-01-01T00:00:00.000000Z"
T_PAST = "2000-01-01T00:00:00.000000Z"
DAY = timedelta(days=1)

Store = Any
"""A PgStore or an EdgeStore: the tests call only what both offer."""


def step(n: int) -> str:
    return f"bbbbbbbb-0000-0000-0000-{n:012d}"


# -- commands, as the pgTAP helpers (tests/sql/lib/invocation_helpers.sql) build them -------


def admission(
    invocation_id: str,
    run_id: str,
    step_run_id: str,
    version: int,
    *,
    policy: dict[str, Any] | None = None,
    deadline_at: str = FAR,
    project_id: str = "proj",
    trace_id: str = "trace-1",
) -> dict[str, Any]:
    return {
        "schema": ADMISSION_SCHEMA,
        "invocation_id": invocation_id,
        "request_id": "req-" + invocation_id[:100],
        "project_id": project_id,
        "run_id": run_id,
        "step_run_id": step_run_id,
        "trace_id": trace_id,
        "expected_step_run_version": version,
        "provider": "ollama",
        "model": "llama3.1:8b",
        "policy": policy,
        "request_digest": hashlib.sha256(f"prompt of {invocation_id}".encode()).hexdigest(),
        "input_bytes": 512,
        "deadline_at": deadline_at,
    }


def usage(
    input_tokens: float | None, output_tokens: int | None, cost: int | None, currency: str | None
) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cost_micros": cost,
        "currency": currency,
    }


@dataclass
class World:
    """One store with the fixture of the pgTAP invocation files, and what it returned."""

    store: Store
    starts: dict[str, dict[str, Any]] = field(default_factory=dict)
    completions: dict[str, dict[str, Any]] = field(default_factory=dict)
    revisions: dict[str, str] = field(default_factory=dict)

    def admit(self, command: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.store.admit_invocation(command)
        self.starts[command["invocation_id"]] = result
        return result

    def completion(
        self,
        invocation_id: str,
        outcome: str = "succeeded",
        result_code: str = "ok",
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        started = self.starts.get(invocation_id)
        return {
            "schema": COMPLETION_COMMAND_SCHEMA,
            "invocation_id": invocation_id,
            "start_digest": "0" * 64 if started is None else started["start_digest"],
            "outcome": outcome,
            "result_code": result_code,
            "output_bytes": 2048 if outcome == "succeeded" else None,
            "output_digest": "c" * 64 if outcome == "succeeded" else None,
            "usage": usage,
        }

    def complete(self, command: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.store.complete_invocation(command)
        self.completions[command["invocation_id"]] = result
        return result

    def resolution(
        self, invocation_id: str, decision: str, user_id: str = "alice", reason: str | None = None
    ) -> dict[str, Any]:
        done = self.completions.get(invocation_id)
        started = self.starts.get(invocation_id)
        version = 1
        if started is not None:
            version = self.store.step_run(started["start"]["step_run_id"])["version"]
        return {
            "schema": RESOLUTION_COMMAND_SCHEMA,
            "invocation_id": invocation_id,
            "completion_digest": "0" * 64 if done is None else done["completion_digest"],
            "decision": decision,
            "user_id": user_id,
            "expected_step_run_version": version,
            "reason": reason,
        }

    def policy(self, contract_id: str, name: str) -> dict[str, Any]:
        return {
            "contract_family": FAMILY,
            "contract_id": contract_id,
            "revision_id": self.revisions[name],
        }


def build_world(store: Store) -> World:
    """Run R1 (proj/trace-1): S1 running (inv-a1), S2 ready, S3 lost (inv-r3), S4 succeeded
    with usage (inv-r4), S5 running (inv-r5), S6 failed, S7 timed_out, S8 running under
    policy revision a (inv-p1), S9 ready; a tool step. Run R2 (proj/trace-2), one step.
    Policy router: a, then b active; idle: c never active."""
    world = World(store)
    store.create_run("proj", "trace-1", R1)
    store.create_run("proj", "trace-2", R2)
    for n in range(1, 10):
        store.add_step_run(R1, "model", step(n))
    store.add_step_run(R1, "tool", TOOL)
    store.add_step_run(R2, "model", R2_STEP)
    for name, contract, body in (("a", "router", {"route": "a"}), ("b", "router", {"route": "b"}),
                                 ("c", "idle", {"route": "c"})):  # fmt: skip
        world.revisions[name] = store.put_revision("proj", FAMILY, contract, body, "ops")[
            "revision_id"
        ]
    store.activate_revision("proj", FAMILY, "router", world.revisions["a"], "ops")
    world.admit(admission("inv-a1", R1, step(1), 1))
    for n in (3, 4, 5, 6, 7):
        world.admit(admission(f"inv-r{n}", R1, step(n), 1))
    world.admit(admission("inv-p1", R1, step(8), 1, policy=world.policy("router", "a")))
    store.activate_revision("proj", FAMILY, "router", world.revisions["b"], "ops")
    world.complete(world.completion("inv-r3", "lost", "outcome_unknown"))
    world.complete(world.completion("inv-r4", usage=usage(100, 20, 1500, "USD")))
    world.complete(world.completion("inv-r6", "failed", "provider_error"))
    world.complete(world.completion("inv-r7", "timed_out", "MODEL_DEADLINE_EXCEEDED"))
    return world


# -- footprints: every row count and version a procedure can change -----------------------

_FOOTPRINT = [
    "SELECT count(*), coalesce(sum(version), 0), coalesce(sum(event_seq), 0) FROM {ql3}runs",
    "SELECT count(*), coalesce(sum(version), 0) FROM {ql3}step_runs",
    "SELECT step_run_id, status, attempt_count, current_invocation_id, output_ref, result_code"
    " FROM {ql3}step_runs ORDER BY step_run_id",
    "SELECT count(*) FROM {ai}model_invocation_starts",
    "SELECT count(*) FROM {ai}model_invocation_completions",
    "SELECT count(*) FROM {ai}model_invocation_resolutions",
    "SELECT count(*) FROM {ai}usage_ledger",
    "SELECT count(*) FROM {ql3}run_events",
    "SELECT count(*) FROM {ql3}step_run_mutations",
    "SELECT count(*) FROM {ql3}contract_revisions",
    "SELECT count(*) FROM {ql3}revision_revocations",
    "SELECT count(*) FROM {ql3}contract_outbox",
    "SELECT project_id, contract_family, contract_id, active_revision_id, pointer_version,"
    " last_revision_no FROM {ql3}active_revisions ORDER BY 1, 2, 3",
]


def query(store: Store, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows of a read-only query on the store's database, in its own dialect."""
    if isinstance(store, EdgeStore):
        with contextlib.closing(sqlite3.connect(store.path)) as conn:
            rows = conn.execute(sql.format(ql3="", ai=""), params).fetchall()
        return [tuple(row) for row in rows]
    with store.pool.connection() as conn:
        text = sql.format(ql3="ql3.", ai="ql3_ai.").replace("?", "%s")
        rows = conn.execute(text, params).fetchall()
        return [tuple(str(v) if isinstance(v, uuid.UUID) else v for v in row) for row in rows]


def footprint(store: Store) -> list[list[tuple[Any, ...]]]:
    return [query(store, sql) for sql in _FOOTPRINT]


# -- the refusals: each has the same code on every store and writes nothing ----------------

Case = tuple[str, Callable[[World], Any], str]


def _with(command: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**command, **changes}


def _without(command: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in command.items() if k != key}


def _ok2() -> dict[str, Any]:
    return admission("inv-v", R1, step(2), 1)


ADMISSION_CASES: list[Case] = [
    ("same id, other content", lambda w: w.store.admit_invocation(
        _with(admission("inv-a1", R1, step(1), 1), model="other-model")), "QL3_CONFLICT"),
    ("same id, other step", lambda w: w.store.admit_invocation(
        admission("inv-a1", R1, step(2), 1)), "QL3_CONFLICT"),
    ("running step", lambda w: w.store.admit_invocation(
        admission("inv-a2", R1, step(1), 2)), "QL3_CONFLICT"),
    ("version drift", lambda w: w.store.admit_invocation(
        admission("inv-a3", R1, step(2), 2)), "QL3_CONFLICT"),
    ("unknown run", lambda w: w.store.admit_invocation(
        admission("inv-a4", "aaaaaaaa-0000-0000-0000-00000000dead", step(2), 1)), "QL3_NOT_FOUND"),
    ("unknown step", lambda w: w.store.admit_invocation(
        admission("inv-a4", R1, "bbbbbbbb-0000-0000-0000-00000000dead", 1)), "QL3_NOT_FOUND"),
    ("step of another run", lambda w: w.store.admit_invocation(
        admission("inv-a4", R2, step(2), 1, trace_id="trace-2")), "QL3_NOT_FOUND"),
    ("other project", lambda w: w.store.admit_invocation(
        admission("inv-a4", R1, step(2), 1, project_id="other")), "QL3_CONFLICT"),
    ("other trace", lambda w: w.store.admit_invocation(
        admission("inv-a4", R1, step(2), 1, trace_id="trace-x")), "QL3_CONFLICT"),
    ("not a model step", lambda w: w.store.admit_invocation(
        admission("inv-a4", R1, TOOL, 1)), "QL3_INVALID_ARGUMENT"),
    ("a succeeded step", lambda w: w.store.admit_invocation(
        admission("inv-r4b", R1, step(4), 3)), "QL3_CONFLICT"),
    ("a lost step", lambda w: w.store.admit_invocation(
        admission("inv-r3b", R1, step(3), 3)), "QL3_CONFLICT"),
    ("other schema", lambda w: w.store.admit_invocation(
        _with(_ok2(), schema="ql3/model-invocation-admission@v2")), "QL3_INVALID_ARGUMENT"),
    ("missing field", lambda w: w.store.admit_invocation(
        _without(_ok2(), "deadline_at")), "QL3_INVALID_ARGUMENT"),
    ("missing nullable field", lambda w: w.store.admit_invocation(
        _without(_ok2(), "policy")), "QL3_INVALID_ARGUMENT"),
    ("unknown field", lambda w: w.store.admit_invocation(
        _with(_ok2(), prompt="hello")), "QL3_INVALID_ARGUMENT"),
    ("string integer", lambda w: w.store.admit_invocation(
        _with(_ok2(), input_bytes="512")), "QL3_INVALID_ARGUMENT"),
    ("boolean integer", lambda w: w.store.admit_invocation(
        _with(_ok2(), input_bytes=True)), "QL3_INVALID_ARGUMENT"),
    ("negative input_bytes", lambda w: w.store.admit_invocation(
        _with(_ok2(), input_bytes=-1)), "QL3_INVALID_ARGUMENT"),
    ("fractional input_bytes", lambda w: w.store.admit_invocation(
        _with(_ok2(), input_bytes=1.5)), "QL3_INVALID_ARGUMENT"),
    ("integral float input_bytes", lambda w: w.store.admit_invocation(
        _with(_ok2(), input_bytes=512.0)), "QL3_INVALID_ARGUMENT"),
    ("integral float input_bytes and a 129-character invocation_id", lambda w:
     w.store.admit_invocation(_with(_ok2(), input_bytes=512.0, invocation_id="i" * 129)),
     "QL3_INVALID_ARGUMENT"),
    ("integral float version and a command over 24 KiB", lambda w: w.store.admit_invocation(
        _with(_ok2(), expected_step_run_version=1.0, model="m" * 30000)), "QL3_INVALID_ARGUMENT"),
    ("number beyond 2^53-1", lambda w: w.store.admit_invocation(
        _with(_ok2(), input_bytes=2**53)), "QL3_INVALID_ARGUMENT"),
    ("version 0", lambda w: w.store.admit_invocation(
        _with(_ok2(), expected_step_run_version=0)), "QL3_INVALID_ARGUMENT"),
    ("empty invocation_id", lambda w: w.store.admit_invocation(
        _with(_ok2(), invocation_id="")), "QL3_INVALID_ARGUMENT"),
    ("129-character invocation_id", lambda w: w.store.admit_invocation(
        _with(_ok2(), invocation_id="i" * 129)), "QL3_IDENTIFIER_TOO_LONG"),
    ("129-character request_id", lambda w: w.store.admit_invocation(
        _with(_ok2(), request_id="r" * 129)), "QL3_IDENTIFIER_TOO_LONG"),
    ("129-character model", lambda w: w.store.admit_invocation(
        _with(_ok2(), model="m" * 129)), "QL3_IDENTIFIER_TOO_LONG"),
    ("command over 24 KiB", lambda w: w.store.admit_invocation(
        _with(_ok2(), model="m" * 30000)), "QL3_RECORD_TOO_LARGE"),
    ("uppercase run_id", lambda w: w.store.admit_invocation(
        _with(_ok2(), run_id=R1.upper())), "QL3_INVALID_ARGUMENT"),
    ("step_run_id not a uuid", lambda w: w.store.admit_invocation(
        _with(_ok2(), step_run_id="step-2")), "QL3_INVALID_ARGUMENT"),
    ("uppercase request_digest", lambda w: w.store.admit_invocation(
        _with(_ok2(), request_digest=_ok2()["request_digest"].upper())), "QL3_INVALID_ARGUMENT"),
    ("deadline without fraction", lambda w: w.store.admit_invocation(
        _with(_ok2(), deadline_at="2030-01-01T00:00:00Z")), "QL3_INVALID_ARGUMENT"),
    ("deadline not UTC", lambda w: w.store.admit_invocation(
        _with(_ok2(), deadline_at="2030-01-01T00:00:00.000000+01:00")), "QL3_INVALID_ARGUMENT"),
    ("deadline with a digit after the Z", lambda w: w.store.admit_invocation(
        _with(_ok2(), deadline_at="2030-01-01T00:00:00.12345Z6")), "QL3_INVALID_ARGUMENT"),
    ("deadline with the Z inside the fraction", lambda w: w.store.admit_invocation(
        _with(_ok2(), deadline_at="2030-01-01T00:00:00.Z000000")), "QL3_INVALID_ARGUMENT"),
    ("deadline on February 30", lambda w: w.store.admit_invocation(
        _with(_ok2(), deadline_at="2030-02-30T00:00:00.000000Z")), "QL3_INVALID_ARGUMENT"),
    ("policy without contract and revision", lambda w: w.store.admit_invocation(
        _with(_ok2(), policy={"contract_family": FAMILY})), "QL3_INVALID_ARGUMENT"),
    ("policy not an object", lambda w: w.store.admit_invocation(
        _with(_ok2(), policy="router")), "QL3_INVALID_ARGUMENT"),
    ("policy of an unknown family", lambda w: w.store.admit_invocation(
        _with(_ok2(), policy={"contract_family": "no_such_family", "contract_id": "router",
                              "revision_id": "00000000-0000-0000-0000-000000000000"})),
     "QL3_INVALID_ARGUMENT"),
    ("stale policy revision", lambda w: w.store.admit_invocation(
        admission("inv-p2", R1, step(9), 1, policy=w.policy("router", "a"))),
     "QL3_STALE_REVISION"),
    ("policy of a contract with none active", lambda w: w.store.admit_invocation(
        admission("inv-p3", R1, step(9), 1, policy=w.policy("idle", "c"))), "QL3_STALE_REVISION"),
    ("policy revision of another contract", lambda w: w.store.admit_invocation(
        admission("inv-p3", R1, step(9), 1, policy=w.policy("router", "c"))),
     "QL3_STALE_REVISION"),
]  # fmt: skip

COMPLETION_CASES: list[Case] = [
    ("replay with another outcome", lambda w: w.store.complete_invocation(
        w.completion("inv-r4", "failed", "provider_error")), "QL3_CONFLICT"),
    ("replay with other usage", lambda w: w.store.complete_invocation(
        w.completion("inv-r4", usage=usage(100, 21, 1500, "USD"))), "QL3_CONFLICT"),
    ("unknown outcome", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", "cancelled", "ok")), "QL3_INVALID_ARGUMENT"),
    ("lost without outcome_unknown", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", "lost", "provider_error")), "QL3_INVALID_ARGUMENT"),
    ("outcome_unknown without lost", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", "failed", "outcome_unknown")), "QL3_INVALID_ARGUMENT"),
    ("reserved result_code", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", "failed", "model_outcome_rejected")), "QL3_INVALID_ARGUMENT"),
    ("a message as result_code", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", "failed", "rate limited: try later")), "QL3_INVALID_ARGUMENT"),
    ("129-character result_code", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", "failed", "e" * 129)), "QL3_IDENTIFIER_TOO_LONG"),
    ("cost without currency", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", usage=usage(1, 2, 3, None))), "QL3_INVALID_ARGUMENT"),
    ("lowercase currency", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", usage=usage(1, 2, 3, "usd"))), "QL3_INVALID_ARGUMENT"),
    ("negative tokens", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", usage=usage(-1, 2, 3, "USD"))), "QL3_INVALID_ARGUMENT"),
    ("fractional tokens", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", usage=usage(1.5, 2, 3, "USD"))), "QL3_INVALID_ARGUMENT"),
    ("integral float tokens", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", usage=usage(1.0, 2, 3, "USD"))), "QL3_INVALID_ARGUMENT"),
    ("replay with integral float tokens", lambda w: w.store.complete_invocation(
        w.completion("inv-r4", usage=usage(100.0, 20, 1500, "USD"))), "QL3_INVALID_ARGUMENT"),
    ("replay with an integral float output_bytes", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-r4", usage=usage(100, 20, 1500, "USD")), output_bytes=2048.0)),
     "QL3_INVALID_ARGUMENT"),
    ("never admitted, integral float output_bytes", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-never"), output_bytes=2048.0)), "QL3_INVALID_ARGUMENT"),
    ("other start_digest, integral float output_bytes", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-r5"), start_digest="0" * 64, output_bytes=2048.0)),
     "QL3_INVALID_ARGUMENT"),
    ("unknown usage field", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", usage={**usage(1, 2, 3, "USD"), "prompt_tokens": 1})),
     "QL3_INVALID_ARGUMENT"),
    ("partial usage", lambda w: w.store.complete_invocation(
        w.completion("inv-r5", usage={"input_tokens": 1})), "QL3_INVALID_ARGUMENT"),
    ("missing usage", lambda w: w.store.complete_invocation(
        _without(w.completion("inv-r5"), "usage")), "QL3_INVALID_ARGUMENT"),
    ("unknown field", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-r5"), output="the answer")), "QL3_INVALID_ARGUMENT"),
    ("another command's schema", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-r5"), schema=ADMISSION_SCHEMA)), "QL3_INVALID_ARGUMENT"),
    ("malformed output_digest", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-r5"), output_digest="xyz")), "QL3_INVALID_ARGUMENT"),
    ("string output_bytes", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-r5"), output_bytes="2048")), "QL3_INVALID_ARGUMENT"),
    ("malformed start_digest", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-r5"), start_digest="abc")), "QL3_INVALID_ARGUMENT"),
    ("command over 24 KiB", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-r5"), output_digest="f" * 30000)), "QL3_RECORD_TOO_LARGE"),
    ("other start_digest", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-r5"), start_digest="0" * 64)), "QL3_CONFLICT"),
    ("never admitted", lambda w: w.store.complete_invocation(
        w.completion("inv-never")), "QL3_NOT_FOUND"),
    ("empty invocation_id", lambda w: w.store.complete_invocation(
        _with(w.completion("inv-r5"), invocation_id="")), "QL3_INVALID_ARGUMENT"),
]  # fmt: skip

RESOLUTION_CASES: list[Case] = [
    ("other completion_digest", lambda w: w.store.resolve_invocation(
        _with(w.resolution("inv-r3", "retry"), completion_digest="0" * 64)), "QL3_CONFLICT"),
    ("version drift", lambda w: w.store.resolve_invocation(
        _with(w.resolution("inv-r3", "retry"), expected_step_run_version=2)), "QL3_CONFLICT"),
    ("unknown decision", lambda w: w.store.resolve_invocation(
        w.resolution("inv-r3", "approve")), "QL3_INVALID_ARGUMENT"),
    ("empty user_id", lambda w: w.store.resolve_invocation(
        w.resolution("inv-r3", "retry", "")), "QL3_INVALID_ARGUMENT"),
    ("129-character user_id", lambda w: w.store.resolve_invocation(
        w.resolution("inv-r3", "retry", "u" * 129)), "QL3_IDENTIFIER_TOO_LONG"),
    ("empty reason", lambda w: w.store.resolve_invocation(
        w.resolution("inv-r3", "retry", "alice", "")), "QL3_INVALID_ARGUMENT"),
    ("command over 24 KiB", lambda w: w.store.resolve_invocation(
        w.resolution("inv-r3", "retry", "alice", "why " * 7000)), "QL3_RECORD_TOO_LARGE"),
    ("missing reason", lambda w: w.store.resolve_invocation(
        _without(w.resolution("inv-r3", "retry"), "reason")), "QL3_INVALID_ARGUMENT"),
    ("unknown field", lambda w: w.store.resolve_invocation(
        _with(w.resolution("inv-r3", "retry"), force=True)), "QL3_INVALID_ARGUMENT"),
    ("string version", lambda w: w.store.resolve_invocation(
        _with(w.resolution("inv-r3", "retry"), expected_step_run_version="3")),
     "QL3_INVALID_ARGUMENT"),
    ("integral float version and a 129-character user_id", lambda w: w.store.resolve_invocation(
        _with(w.resolution("inv-r3", "retry", "u" * 129), expected_step_run_version=3.0)),
     "QL3_INVALID_ARGUMENT"),
    ("record schema name", lambda w: w.store.resolve_invocation(
        _with(w.resolution("inv-r3", "retry"), schema="ql3/model-invocation-resolution@v1")),
     "QL3_INVALID_ARGUMENT"),
    ("a succeeded invocation", lambda w: w.store.resolve_invocation(
        w.resolution("inv-r4", "retry")), "QL3_ILLEGAL_TRANSITION"),
    ("a running invocation", lambda w: w.store.resolve_invocation(
        w.resolution("inv-r5", "cancel")), "QL3_ILLEGAL_TRANSITION"),
    ("a failed invocation", lambda w: w.store.resolve_invocation(
        w.resolution("inv-r6", "retry")), "QL3_ILLEGAL_TRANSITION"),
    ("a timed_out invocation", lambda w: w.store.resolve_invocation(
        w.resolution("inv-r7", "retry")), "QL3_ILLEGAL_TRANSITION"),
    ("never admitted", lambda w: w.store.resolve_invocation(
        w.resolution("inv-never", "retry")), "QL3_NOT_FOUND"),
]  # fmt: skip

OTHER_CASES: list[Case] = [
    ("recovery limit 0", lambda w: w.store.recover_expired(0, 0), "QL3_INVALID_ARGUMENT"),
    ("recovery limit 10001", lambda w: w.store.recover_expired(10001, 0), "QL3_INVALID_ARGUMENT"),
    ("recovery negative grace", lambda w: w.store.recover_expired(10, -1.0),
     "QL3_INVALID_ARGUMENT"),
    ("recovery limit as a float", lambda w: w.store.recover_expired(5.0, 0),
     "QL3_INVALID_ARGUMENT"),
    ("recovery limit as a boolean", lambda w: w.store.recover_expired(True, 0),
     "QL3_INVALID_ARGUMENT"),
    ("recovery grace over 36500 days", lambda w: w.store.recover_expired(10, 36500 * 86400 + 1),
     "QL3_INVALID_ARGUMENT"),
    ("recovery grace of 10^13 s", lambda w: w.store.recover_expired(10, 1e13),
     "QL3_INVALID_ARGUMENT"),
    ("recovery infinite grace", lambda w: w.store.recover_expired(10, float("inf")),
     "QL3_INVALID_ARGUMENT"),
    ("recovery NaN grace", lambda w: w.store.recover_expired(10, float("nan")),
     "QL3_INVALID_ARGUMENT"),
    ("usage of an empty project", lambda w: w.store.usage_summary(""), "QL3_INVALID_ARGUMENT"),
    ("usage of a project that is not text", lambda w: w.store.usage_summary(5),
     "QL3_INVALID_ARGUMENT"),
    ("usage of a 129-character project", lambda w: w.store.usage_summary("p" * 129),
     "QL3_IDENTIFIER_TOO_LONG"),
    ("usage from after to", lambda w: w.store.usage_summary(
        "proj", datetime(2030, 1, 2, tzinfo=UTC), datetime(2030, 1, 1, tzinfo=UTC)),
     "QL3_INVALID_ARGUMENT"),
    ("run with other content", lambda w: w.store.create_run("proj", "trace-9", R1),
     "QL3_CONFLICT"),
    ("run with a 129-character trace", lambda w: w.store.create_run("proj", "t" * 129),
     "QL3_IDENTIFIER_TOO_LONG"),
    ("step of an unknown run", lambda w: w.store.add_step_run(
        "aaaaaaaa-0000-0000-0000-00000000dead", "model"), "QL3_NOT_FOUND"),
    ("step of a bad kind", lambda w: w.store.add_step_run(R1, "Model"), "QL3_INVALID_ARGUMENT"),
    ("step with other content", lambda w: w.store.add_step_run(R1, "tool", step(1)),
     "QL3_CONFLICT"),
    ("run id that is not a uuid", lambda w: w.store.create_run("proj", "t", "run-1"),
     "QL3_INVALID_ARGUMENT"),
    ("run id with a leading space", lambda w: w.store.create_run(
        "proj", "t", " aaaaaaaa-0000-0000-0000-0000000000a9"), "QL3_INVALID_ARGUMENT"),
    ("run id with a newline after it", lambda w: w.store.create_run(
        "proj", "t", "aaaaaaaa-0000-0000-0000-0000000000a9\n"), "QL3_INVALID_ARGUMENT"),
    ("run id as a urn", lambda w: w.store.create_run(
        "proj", "t", "urn:uuid:aaaaaaaa-0000-0000-0000-0000000000a9"), "QL3_INVALID_ARGUMENT"),
    ("run id with a misplaced hyphen", lambda w: w.store.create_run(
        "proj", "t", "aaaaaaa-a0000-0000-0000-0000000000a9"), "QL3_INVALID_ARGUMENT"),
    ("step lookup with a leading space", lambda w: w.store.step_run(" " + step(2)),
     "QL3_INVALID_ARGUMENT"),
    ("put under an unknown family", lambda w: w.store.put_revision(
        "proj", "no_such_family", "c", {}, "ops"), "QL3_INVALID_ARGUMENT"),
    ("put an array body", lambda w: w.store.put_revision(
        "proj", FAMILY, "c", [{"model": "m1"}], "ops"), "QL3_INVALID_ARGUMENT"),
    ("put a null body", lambda w: w.store.put_revision("proj", FAMILY, "c", None, "ops"),
     "QL3_INVALID_ARGUMENT"),
    ("put a body number of 2^53", lambda w: w.store.put_revision(
        "proj", FAMILY, "c", {"n": 2**53}, "ops"), "QL3_INVALID_ARGUMENT"),
    ("put a body of 24577 bytes", lambda w: w.store.put_revision(
        "proj", FAMILY, "c", {"a": "x" * 24569}, "ops"), "QL3_RECORD_TOO_LARGE"),
    ("put with a 129-character project", lambda w: w.store.put_revision(
        "p" * 129, FAMILY, "c", {}, "ops"), "QL3_IDENTIFIER_TOO_LONG"),
    ("put with an empty actor", lambda w: w.store.put_revision("proj", FAMILY, "c", {}, ""),
     "QL3_INVALID_ARGUMENT"),
    ("activate with a stale expectation", lambda w: w.store.activate_revision(
        "proj", FAMILY, "router", w.revisions["a"], "ops", w.revisions["a"]), "QL3_CONFLICT"),
    ("activate a revision of another contract", lambda w: w.store.activate_revision(
        "proj", FAMILY, "router", w.revisions["c"], "ops"), "QL3_INVALID_ARGUMENT"),
    ("activate an unknown revision", lambda w: w.store.activate_revision(
        "proj", FAMILY, "router", "00000000-0000-0000-0000-000000000000", "ops"),
     "QL3_NOT_FOUND"),
    ("activate a malformed revision id", lambda w: w.store.activate_revision(
        "proj", FAMILY, "router", "rev-1", "ops"), "QL3_INVALID_ARGUMENT"),
    ("revoke with an empty reason", lambda w: w.store.revoke_revision(
        w.revisions["a"], "ops", ""), "QL3_INVALID_ARGUMENT"),
    ("revoke an unknown revision", lambda w: w.store.revoke_revision(
        "00000000-0000-0000-0000-000000000000", "ops", "x"), "QL3_NOT_FOUND"),
    ("pointers of a malformed key", lambda w: w.store.active_pointers([("proj", FAMILY)]),
     "QL3_INVALID_ARGUMENT"),
    ("put with a NUL in the project", lambda w: w.store.put_revision(
        "pr\x00oj", FAMILY, "c", {}, "ops"), "QL3_INVALID_ARGUMENT"),
    ("active revision of a project with a NUL", lambda w: w.store.active_revision(
        "pr\x00oj", FAMILY, "router"), "QL3_INVALID_ARGUMENT"),
    ("pointers of a key with a NUL", lambda w: w.store.active_pointers(
        [("proj", FAMILY, "rou\x00ter")]), "QL3_INVALID_ARGUMENT"),
    ("usage of a project with a NUL", lambda w: w.store.usage_summary("pr\x00oj"),
     "QL3_INVALID_ARGUMENT"),
    ("put with a lone surrogate in the contract", lambda w: w.store.put_revision(
        "proj", FAMILY, "c\ud800", {}, "ops"), "QL3_INVALID_ARGUMENT"),
    ("active revision of a project with a lone surrogate", lambda w: w.store.active_revision(
        "pr\udfffoj", FAMILY, "router"), "QL3_INVALID_ARGUMENT"),
    ("put a body holding a datetime", lambda w: w.store.put_revision(
        "proj", FAMILY, "c", {"at": datetime(2026, 1, 1, tzinfo=UTC)}, "ops"),
     "QL3_INVALID_ARGUMENT"),
    ("admit a command that is not an object", lambda w: w.store.admit_invocation(None),
     "QL3_INVALID_ARGUMENT"),
    ("complete a command that is a list", lambda w: w.store.complete_invocation([]),
     "QL3_INVALID_ARGUMENT"),
    ("usage since a text date", lambda w: w.store.usage_summary("proj", "yesterday"),
     "QL3_INVALID_ARGUMENT"),
    ("revision by a number", lambda w: w.store.revision(12345), "QL3_INVALID_ARGUMENT"),
    ("revision by an object", lambda w: w.store.revision(object()), "QL3_INVALID_ARGUMENT"),
    ("active revision by numbers", lambda w: w.store.active_revision(1, 2, 3),
     "QL3_INVALID_ARGUMENT"),
    ("pointers of a number key", lambda w: w.store.active_pointers([1]), "QL3_INVALID_ARGUMENT"),
    ("pointers of no keys at all", lambda w: w.store.active_pointers(None),
     "QL3_INVALID_ARGUMENT"),
    # psycopg sends an empty list as the untyped literal '{}', which PostgreSQL took as text
    ("put under a contract id that is an empty list", lambda w: w.store.put_revision(
        "proj", FAMILY, [], {}, "ops"), "QL3_INVALID_ARGUMENT"),
    ("activate by an actor that is an empty list", lambda w: w.store.activate_revision(
        "proj", FAMILY, "idle", w.revisions["c"], []), "QL3_INVALID_ARGUMENT"),
    ("revoke with a reason that is an empty list", lambda w: w.store.revoke_revision(
        w.revisions["c"], "ops", []), "QL3_INVALID_ARGUMENT"),
    ("a run of a project that is an empty list", lambda w: w.store.create_run([], "t"),
     "QL3_INVALID_ARGUMENT"),
    ("a step of a kind that is an empty list", lambda w: w.store.add_step_run(R1, []),
     "QL3_INVALID_ARGUMENT"),
    ("active revision of a contract that is an empty list", lambda w: w.store.active_revision(
        "proj", FAMILY, []), "QL3_INVALID_ARGUMENT"),
    # PostgreSQL resolves argument types before the function checks their values
    ("put with a long project and a number for the family", lambda w: w.store.put_revision(
        "p" * 129, 0, "c", {}, "ops"), "QL3_INVALID_ARGUMENT"),
    ("activate with a long project and a number for the actor",
     lambda w: w.store.activate_revision("p" * 129, FAMILY, "idle", w.revisions["c"], 0),
     "QL3_INVALID_ARGUMENT"),
    ("a run of a long project and a number for the trace", lambda w: w.store.create_run(
        "p" * 129, 7), "QL3_INVALID_ARGUMENT"),
    ("usage of a long project until a number", lambda w: w.store.usage_summary(
        "p" * 129, None, 0), "QL3_INVALID_ARGUMENT"),
    ("pointers of a three-letter string key", lambda w: w.store.active_pointers(["abc"]),
     "QL3_INVALID_ARGUMENT"),
    ("pointers of a mapping's keys", lambda w: w.store.active_pointers({"abc": 1}),
     "QL3_INVALID_ARGUMENT"),
    # psycopg sends a list of one string as '{...}', a uuid spelling PostgreSQL accepts
    ("revision by a list of its id", lambda w: w.store.revision([w.revisions["a"]]),
     "QL3_INVALID_ARGUMENT"),
    ("step by a list of its id", lambda w: w.store.step_run([step(1)]), "QL3_INVALID_ARGUMENT"),
    ("run by a list of its id", lambda w: w.store.run([R1]), "QL3_INVALID_ARGUMENT"),
    ("activate a list of a revision id", lambda w: w.store.activate_revision(
        "proj", FAMILY, "idle", [w.revisions["c"]], "ops"), "QL3_INVALID_ARGUMENT"),
    ("a step in a list of a run id", lambda w: w.store.add_step_run([R1], "model"),
     "QL3_INVALID_ARGUMENT"),
]  # fmt: skip

R9 = "aaaaaaaa-0000-0000-0000-000000000009"
N9 = "cccccccc-0000-0000-0000-000000000009"

# admit_in_new_run (D59): every refusal writes nothing, not even the run or the step.
NEW_RUN_CASES: list[Case] = [
    ("new run: run id taken by another trace", lambda w: w.store.admit_in_new_run(
        admission("inv-n1", R1, N9, 1, trace_id="other-trace")), "QL3_CONFLICT"),
    ("new run: step id taken in another run", lambda w: w.store.admit_in_new_run(
        admission("inv-n2", R9, step(2), 1)), "QL3_CONFLICT"),
    ("new run: a new step expected at version 2", lambda w: w.store.admit_in_new_run(
        admission("inv-n3", R9, N9, 2)), "QL3_CONFLICT"),
    ("new run: a bad deadline", lambda w: w.store.admit_in_new_run(
        admission("inv-n4", R9, N9, 1, deadline_at="tomorrow")), "QL3_INVALID_ARGUMENT"),
    ("new run: a stale policy revision", lambda w: w.store.admit_in_new_run(
        admission("inv-n5", R9, N9, 1, policy=w.policy("router", "a"))), "QL3_STALE_REVISION"),
    ("new run: no run_id", lambda w: w.store.admit_in_new_run(
        _without(admission("inv-n6", R9, N9, 1), "run_id")), "QL3_INVALID_ARGUMENT"),
    ("new run: an uppercase step id", lambda w: w.store.admit_in_new_run(
        admission("inv-n7", R9, N9.upper(), 1)), "QL3_INVALID_ARGUMENT"),
    ("new run: a 129-character project", lambda w: w.store.admit_in_new_run(
        admission("inv-n8", R9, N9, 1, project_id="p" * 129)), "QL3_IDENTIFIER_TOO_LONG"),
    ("new run: not an object", lambda w: w.store.admit_in_new_run([]), "QL3_INVALID_ARGUMENT"),
]  # fmt: skip

ALL_CASES = ADMISSION_CASES + COMPLETION_CASES + RESOLUTION_CASES + OTHER_CASES + NEW_RUN_CASES


def test_every_refusal_has_the_same_code_and_writes_nothing(store: Store) -> None:
    world = build_world(store)
    wrong: list[str] = []
    for name, call, code in ALL_CASES:
        before = footprint(store)
        try:
            call(world)
        except errors.Ql3Error as exc:
            got = exc.code
        except Exception as exc:  # anything else is a store letting bad input through raw
            got = f"raw {type(exc).__name__}: {exc}"
        else:
            got = "no error"
        if got != code:
            wrong.append(f"{name}: {got}, expected {code}")
        elif footprint(store) != before:
            wrong.append(f"{name}: refused with {code} but wrote something")
    assert not wrong, "\n".join(wrong)


def test_an_admission_in_a_new_run_is_the_run_the_step_and_the_admission(store: Store) -> None:
    world = build_world(store)
    command = admission("inv-n", R9, N9, 1, trace_id="trace-9", policy=world.policy("router", "b"))
    created = store.admit_in_new_run(command)
    assert created["status"] == "created"
    run = store.run(R9)
    assert (run["project_id"], run["trace_id"], run["version"], run["event_seq"]) == (
        "proj", "trace-9", 2, 1)  # fmt: skip
    state = store.step_run(N9)
    assert (state["run_id"], state["kind"], state["status"], state["version"]) == (
        R9, "model", "running", 2)  # fmt: skip
    assert (state["attempt_count"], state["current_invocation_id"]) == (1, "inv-n")
    before = footprint(store)
    again = store.admit_in_new_run(command)
    assert again["status"] == "existing" and again["start"] == created["start"]
    assert store.admit_invocation(command)["status"] == "existing"
    assert footprint(store) == before, "a replay writes nothing"
    # The error of a command the run and step cannot take is admit_invocation's, word for word.
    refused: list[Any] = [[], _without(command, "run_id"), _with(command, project_id="p" * 129)]
    for bad in refused:
        errors_seen = []
        for admit in (store.admit_in_new_run, store.admit_invocation):
            with pytest.raises(errors.Ql3Error) as caught:
                admit(bad)
            errors_seen.append((caught.value.code, str(caught.value)))
        assert errors_seen[0] == errors_seen[1]


def test_stale_revision_detail_names_the_active_revision(store: Store) -> None:
    world = build_world(store)
    with pytest.raises(errors.StaleRevision) as stale:
        world.store.admit_invocation(
            admission("inv-p2", R1, step(9), 1, policy=world.policy("router", "a"))
        )
    assert stale.value.detail == world.revisions["b"]
    with pytest.raises(errors.StaleRevision) as none_active:
        world.store.admit_invocation(
            admission("inv-p3", R1, step(9), 1, policy=world.policy("idle", "c"))
        )
    assert none_active.value.detail in ("", None)


def test_the_fixture_world_has_the_same_states_everywhere(store: Store) -> None:
    world = build_world(store)
    states = {n: store.step_run(step(n)) for n in range(1, 10)}
    assert {n: (s["status"], s["version"], s["attempt_count"], s["current_invocation_id"],
                s["output_ref"], s["result_code"]) for n, s in states.items()} == {
        1: ("running", 2, 1, "inv-a1", None, None),
        2: ("ready", 1, 0, None, None, None),
        3: ("lost", 3, 1, "inv-r3", None, "outcome_unknown"),
        4: ("succeeded", 3, 1, "inv-r4", "model-invocation:inv-r4", "ok"),
        5: ("running", 2, 1, "inv-r5", None, None),
        6: ("failed", 3, 1, "inv-r6", None, "provider_error"),
        7: ("timed_out", 3, 1, "inv-r7", None, "MODEL_DEADLINE_EXCEEDED"),
        8: ("running", 2, 1, "inv-p1", None, None),
        9: ("ready", 1, 0, None, None, None),
    }  # fmt: skip
    run = store.run(R1)
    assert (run["version"], run["event_seq"], run["status"]) == (12, 11, "open")
    assert [row[0] for row in query(store, "SELECT seq FROM {ql3}run_events WHERE run_id = ?"
                                    " ORDER BY seq", (R1,))] == list(range(1, 12))  # fmt: skip
    assert store.active_pointers([("proj", FAMILY, "router"), ("proj", FAMILY, "idle")]) == [
        {"project_id": "proj", "contract_family": FAMILY, "contract_id": "router",
         "revision_id": world.revisions["b"], "pointer_version": 2},
        {"project_id": "proj", "contract_family": FAMILY, "contract_id": "idle",
         "revision_id": None, "pointer_version": 0},
    ]  # fmt: skip


def test_receipts_bind_the_same_digests_identities_and_versions(store: Store) -> None:
    world = build_world(store)
    command = admission("inv-x", R1, step(2), 1)
    admitted = world.admit(command)
    start = admitted["start"]
    assert admitted["status"] == "created"
    assert start["command_digest"] == canonical.digest(ADMISSION_SCHEMA, command)
    assert admitted["start_digest"] == canonical.digest(start["schema"], start)
    assert (start["mutation_id"], start["event_id"], start["dedupe_key"]) == (
        canonical.mutation_id("inv-x", "admission"),
        canonical.event_id("inv-x", "admission"),
        canonical.dedupe_key("inv-x", "admission"),
    )
    assert (start["attempt"], start["step_run_version"], start["run_version"],
            start["run_event_seq"]) == (1, 2, 13, 12)  # fmt: skip
    assert world.store.admit_invocation(command) == {**admitted, "status": "existing"}

    lost = world.completion("inv-x", "lost", "outcome_unknown")
    done = world.complete(lost)
    record = done["completion"]
    assert record["command_digest"] == canonical.digest(COMPLETION_COMMAND_SCHEMA, lost)
    assert done["completion_digest"] == canonical.digest(record["schema"], record)
    assert (record["step_run_version"], record["run_version"], record["run_event_seq"],
            record["recovered"], record["output_ref"], record["usage"]) == (
        3, 14, 13, False, None, None)  # fmt: skip
    assert world.store.complete_invocation(lost) == {**done, "status": "existing"}

    retry = world.resolution("inv-x", "retry", "alice", "provider says it never ran")
    resolved = world.store.resolve_invocation(retry)
    resolution = resolved["resolution"]
    assert resolution["command_digest"] == canonical.digest(RESOLUTION_COMMAND_SCHEMA, retry)
    assert resolved["resolution_digest"] == canonical.digest(resolution["schema"], resolution)
    assert (resolution["to_status"], resolution["result_code"], resolution["step_run_version"],
            resolution["attempt"]) == ("ready", None, 4, 1)  # fmt: skip
    assert world.store.resolve_invocation(retry)["status"] == "existing"
    with pytest.raises(errors.Conflict):
        world.store.resolve_invocation({**retry, "decision": "fail"})

    again = world.admit(admission("inv-x2", R1, step(2), 4))
    assert (again["start"]["attempt"], again["start"]["step_run_version"]) == (2, 5)
    paid = world.complete(world.completion("inv-x2", usage=usage(7, 8, None, None)))
    assert paid["completion"]["usage"] == usage(7, 8, None, None)
    assert world.store.step_run(step(2))["attempt_count"] == 2
    summary = world.store.usage_summary("proj")
    assert summary == [
        {"provider": "ollama", "model": "llama3.1:8b", "currency": "USD", "completions": 1,
         "input_tokens": 100, "output_tokens": 20, "known_cost_micros": 1500,
         "known_cost_completions": 1, "unknown_cost_completions": 0},
        {"provider": "ollama", "model": "llama3.1:8b", "currency": None, "completions": 1,
         "input_tokens": 7, "output_tokens": 8, "known_cost_micros": None,
         "known_cost_completions": 0, "unknown_cost_completions": 1},
    ]  # fmt: skip


def test_recovery_settles_the_same_starts_in_the_same_order(store: Store) -> None:
    store.create_run("proj", "trace-1", R1)
    deadlines = {1: "2000-01-01T00:00:00.000000Z", 2: FAR, 3: "2000-06-01T00:00:00.000000Z",
                 5: "2001-01-01T00:00:00.000000Z", 6: "2002-01-01T00:00:00.000000Z"}  # fmt: skip
    starts: dict[int, dict[str, Any]] = {}
    for n, deadline in deadlines.items():
        store.add_step_run(R1, "model", step(n))
        starts[n] = store.admit_invocation(
            admission(f"inv-e{n}", R1, step(n), 1, deadline_at=deadline)
        )
    world = World(store, starts={f"inv-e{n}": s for n, s in starts.items()})
    store.complete_invocation(world.completion("inv-e3"))

    first = store.recover_expired(1, 0)
    assert first["count"] == 1
    assert {k: v for k, v in first["recovered"][0].items() if k != "completion_digest"} == {
        "invocation_id": "inv-e1", "run_id": R1, "step_run_id": step(1),
        "deadline_at": "2000-01-01T00:00:00.000000Z",
    }  # fmt: skip
    rest = store.recover_expired(10, 3600)
    assert [r["invocation_id"] for r in rest["recovered"]] == ["inv-e5", "inv-e6"]
    assert store.recover_expired(10, 0) == {"count": 0, "recovered": [], "failed": []}
    lost = world.completion("inv-e1", "lost", "outcome_unknown")
    assert store.complete_invocation(lost)["status"] == "existing"
    with pytest.raises(errors.Conflict):
        store.complete_invocation(world.completion("inv-e1"))
    assert [store.step_run(step(n))["status"] for n in deadlines] == [
        "lost",
        "running",
        "succeeded",
        "lost",
        "lost",
    ]


def test_outbox_event_ids_are_time_ordered_version_7_uuids(store: Store) -> None:
    """D25: every store draws event_ids from uuid v7, whose first 48 bits are Unix ms."""
    one = store.put_revision("p", FAMILY, "v7", {"n": 1}, "alice")
    two = store.put_revision("p", FAMILY, "v7", {"n": 2}, "alice")
    before = time.time_ns() // 1_000_000
    first = store.activate_revision("p", FAMILY, "v7", one["revision_id"], "alice")
    time.sleep(0.003)
    second = store.activate_revision("p", FAMILY, "v7", two["revision_id"], "alice")
    after = time.time_ns() // 1_000_000
    assert first is not None and second is not None
    ids = [uuid.UUID(str(e["event_id"])) for e in (first, second)]
    assert [(u.version, u.variant) for u in ids] == [(7, uuid.RFC_4122)] * 2
    assert before - 1 <= ids[0].int >> 80 < ids[1].int >> 80 <= after + 1
    assert ids[0] < ids[1]


def test_contract_lifecycle_gives_the_same_versions_and_events(store: Store) -> None:
    r1 = store.put_revision("p", FAMILY, "c", {"model": "m1", "n": 1}, "alice")
    assert store.put_revision("p", FAMILY, "c", {"n": 1.0, "model": "m1"}, "bob") == r1
    r2 = store.put_revision("p", FAMILY, "c", {"model": "m2"}, "alice")
    assert (r1["revision_no"], r2["revision_no"]) == (1, 2)
    assert r1["body_hash"] == "ade9d26ad4dc3fe97f268265f454a71745013e9505ed0aec4befe730e4eed1bd"
    shape = ("event_type", "old_revision_id", "new_revision_id", "pointer_version",
             "delivered_at", "relay_attempts", "last_error")  # fmt: skip

    def event(row: dict[str, Any] | None) -> tuple[Any, ...] | None:
        return None if row is None else tuple(row[k] for k in shape)

    a1 = store.activate_revision("p", FAMILY, "c", r1["revision_id"], "alice")
    assert event(a1) == ("revision_activated", None, r1["revision_id"], 1, None, 0, None)
    assert store.activate_revision("p", FAMILY, "c", r1["revision_id"], "carol") is None
    with pytest.raises(errors.Conflict) as cas:
        store.activate_revision("p", FAMILY, "c", r2["revision_id"], "bob", r2["revision_id"])
    assert cas.value.detail == r1["revision_id"]
    a2 = store.activate_revision("p", FAMILY, "c", r2["revision_id"], "bob", r1["revision_id"])
    assert event(a2) == ("revision_activated", r1["revision_id"], r2["revision_id"], 2, None, 0,
                         None)  # fmt: skip
    v2 = store.revoke_revision(r2["revision_id"], "carol", "bad routing")
    assert event(v2) == ("revision_revoked", r2["revision_id"], r2["revision_id"], 3, None, 0,
                         None)  # fmt: skip
    assert store.revoke_revision(r2["revision_id"], "dave", "again") is None
    assert store.active_revision("p", FAMILY, "c") is None
    with pytest.raises(errors.RevisionRevoked):
        store.activate_revision("p", FAMILY, "c", r2["revision_id"], "bob")
    v1 = store.revoke_revision(r1["revision_id"], "carol", "obsolete")
    assert event(v1) == ("revision_revoked", None, r1["revision_id"], 3, None, 0, None)
    assert a1 is not None and a2 is not None and v1 is not None
    assert a1["seq"] < a2["seq"] < v1["seq"]
    backlog = store.outbox_backlog()
    assert (backlog["undelivered"], backlog["max_seq"]) == (4, v1["seq"])


def deliver_aged(store: Store, seqs: list[int], age: timedelta) -> None:
    """Mark outbox rows delivered through the relay's procedure, then move their
    ``delivered_at`` back by ``age`` (as the database's owner: the delivery columns are the
    ones the outbox lets change)."""
    if isinstance(store, EdgeStore):
        assert store.mark_outbox_delivered(seqs) == len(seqs)
        when = format_timestamp(datetime.now(UTC) - age)
        with contextlib.closing(sqlite3.connect(store.path)) as conn, conn:
            conn.executemany(
                "UPDATE contract_outbox SET delivered_at = ? WHERE seq = ?",
                [(when, seq) for seq in seqs],
            )
        return
    with store.pool.connection() as conn:
        conn.execute("SELECT ql3.mark_outbox_delivered(%s::bigint[])", (seqs,))
        conn.execute(
            "UPDATE ql3.contract_outbox SET delivered_at = now() - %s WHERE seq = ANY(%s)",
            (age, seqs),
        )


def outbox_seqs(store: Store) -> list[int]:
    return [int(row[0]) for row in query(store, "SELECT seq FROM {ql3}contract_outbox ORDER BY 1")]


def test_prune_removes_the_same_outbox_rows_on_every_store(store: Store) -> None:
    """``prune_outbox`` (D55; the shim's, D65): delivered rows delivered before the cut-off,
    oldest first, at most a batch; never an undelivered row, never a row at its pointer's
    version; a refused call removes nothing."""

    def put(contract: str, n: int) -> str:
        return str(store.put_revision("p", FAMILY, contract, {"n": n}, "ops")["revision_id"])

    def activate(contract: str, revision_id: str) -> int:
        row = store.activate_revision("p", FAMILY, contract, revision_id, "ops")
        assert row is not None
        return int(row["seq"])

    flip = [put("a", 0), put("a", 1)]
    a1, a2, a3, a4 = (activate("a", flip[i % 2]) for i in range(4))  # pointer versions 1..4
    b1 = activate("b", put("b", 0))
    revoked = store.revoke_revision(flip[0], "ops", "not active: repeats version 4")
    assert revoked is not None and revoked["pointer_version"] == 4
    r = int(revoked["seq"])
    deliver_aged(store, [a1, a2, a3, b1, r], 2 * DAY)

    before = footprint(store)
    for delivered_before, batch in [
        (timedelta(seconds=-1), 10),
        (DAY, 0),
        (DAY, 100_001),
        (DAY, True),
        (DAY, 10.0),
        (86400, 10),
    ]:
        with pytest.raises(errors.InvalidArgument, match=r"^QL3_INVALID_ARGUMENT: "):
            store.prune_outbox(delivered_before, batch)
    assert footprint(store) == before

    assert store.prune_outbox(3 * DAY, 100) == 0
    # a cut-off before any instant the store can hold: nothing was delivered then (D65)
    assert store.prune_outbox(timedelta(days=3_000_000), 100) == 0
    assert store.prune_outbox(timedelta.max, 100) == 0
    assert store.prune_outbox(DAY, 1) == 1
    assert outbox_seqs(store) == [a2, a3, a4, b1, r]
    assert store.prune_outbox(DAY, 100) == 2
    assert outbox_seqs(store) == [a4, b1, r]  # undelivered; b's newest; at a's version

    deliver_aged(store, [a4], 2 * DAY)
    assert store.prune_outbox(DAY, 100) == 0  # a4 and r are at the pointer's version
    a5 = activate("a", put("a", 2))
    deliver_aged(store, [a5], 2 * DAY)
    assert store.prune_outbox(timedelta(0), 100_000) == 2
    assert outbox_seqs(store) == [b1, a5]
    backlog = store.outbox_backlog()
    assert (backlog["undelivered"], backlog["max_seq"]) == (0, a5)


# -- one test, three stores, pinned clocks: byte-identical records -------------------------

T0 = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)


def _at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def pinned_history(store: Store) -> list[tuple[str, Any]]:
    """A whole invocation history under a pinned clock; what each step returned."""
    out: list[tuple[str, Any]] = []

    def step_at(name: str, minutes: float, call: Callable[[], Any]) -> Any:
        pin_clock(store, _at(minutes))
        result = call()
        out.append((name, result))
        return result

    store.create_run("proj", "trace-1", R1)
    for n in (1, 2, 3):
        store.add_step_run(R1, "model", step(n))
    deadline = format_timestamp(_at(5))
    world = World(store)

    def admit(invocation_id: str, n: int, version: int) -> Callable[[], Any]:
        command = admission(invocation_id, R1, step(n), version, deadline_at=deadline)
        return lambda: world.admit(command)

    def complete(invocation_id: str, *args: Any) -> Callable[[], Any]:
        return lambda: world.complete(world.completion(invocation_id, *args))

    def resolve(invocation_id: str, *args: Any) -> Callable[[], Any]:
        return lambda: store.resolve_invocation(world.resolution(invocation_id, *args))

    step_at("admit 1", 1, admit("inv-1", 1, 1))
    step_at("admit 2", 1.5, admit("inv-2", 2, 1))
    step_at("admit 3", 1.75, admit("inv-3", 3, 1))
    step_at("complete 1 lost", 2, complete("inv-1", "lost", "outcome_unknown"))
    step_at("resolve 1 retry", 3, resolve("inv-1", "retry", "alice", "never ran"))
    step_at("admit 1b", 4, admit("inv-1b", 1, 4))
    step_at("complete 1b", 4.5, complete("inv-1b", "succeeded", "ok", usage(100, 20, 1500, "USD")))
    step_at(
        "complete 3", 4.75, complete("inv-3", "timed_out", "deadline", usage(10, None, None, None))
    )
    recovered = step_at("recover", 10, lambda: store.recover_expired(10, 60))
    world.completions["inv-2"] = recovered["recovered"][0]
    step_at("resolve 2 fail", 11, resolve("inv-2", "fail", "bob"))
    step_at("usage", 12, lambda: store.usage_summary("proj"))
    step_at("usage window", 12, lambda: store.usage_summary("proj", _at(4.5), _at(4.75)))
    keep = ("status", "version", "attempt_count", "current_invocation_id", "output_ref",
            "result_code", "updated_at")  # fmt: skip
    for n in (1, 2, 3):
        row = store.step_run(step(n))
        out.append((f"step {n}", {k: row[k] for k in keep}))
    run = store.run(R1)
    out.append(("run", (run["version"], run["event_seq"], run["updated_at"])))
    events = "SELECT seq, event_id, event_type, step_run_id, payload FROM {ql3}run_events"
    rows = sorted(query(store, events), key=lambda row: int(row[0]))
    out.append(
        ("events", [(*r[:4], json.loads(r[4]) if isinstance(r[4], str) else r[4]) for r in rows])
    )
    mutations = (
        "SELECT mutation_id, dedupe_key, from_status, to_status, from_version, command_digest"
        " FROM {ql3}step_run_mutations"
    )
    out.append(("mutations", sorted(query(store, mutations))))
    return out


def test_pinned_clocks_give_byte_identical_records(every_store: dict[str, Store]) -> None:
    histories = {kind: pinned_history(s) for kind, s in every_store.items()}
    expected = histories.pop("pg")
    by_name = dict(expected)
    assert by_name["admit 1"]["start"]["admitted_at"] == "2026-12-02T12:01:00.000000Z"
    assert by_name["recover"]["count"] == 1
    assert by_name["recover"]["recovered"][0]["invocation_id"] == "inv-2"
    kinds = ("start_digest", "completion_digest", "resolution_digest")
    digests = [v[k] for _, v in expected if isinstance(v, dict) for k in kinds if k in v]
    assert len(digests) == 9
    for kind, history in histories.items():
        assert [name for name, _ in history] == [name for name, _ in expected]
        for (name, got), (_, want) in zip(history, expected, strict=True):
            assert got == want, f"{kind}: {name} differs from PostgreSQL"


def test_a_pinned_clock_moves_recovery_on_every_store(store: Store) -> None:
    store.create_run("proj", "trace-1", R1)
    store.add_step_run(R1, "model", step(1))
    pin_clock(store, T0)
    store.admit_invocation(admission("inv-1", R1, step(1), 1, deadline_at=format_timestamp(_at(1))))
    assert store.recover_expired(10, 0)["count"] == 0
    pin_clock(store, _at(1))
    assert store.recover_expired(10, 0)["count"] == 0, "deadline + grace must be strictly past"
    pin_clock(store, _at(1) + timedelta(microseconds=1))
    done = store.recover_expired(10, 0)
    assert done["count"] == 1
    pin_clock(store, None)


def test_uuid_arguments_take_the_spellings_postgresql_takes(store: Store) -> None:
    """D29: braces, upper case, no hyphens or one after any group of four; all one run."""
    spellings = {
        "{AAAAAAAA-0000-0000-0000-0000000000B1}": "aaaaaaaa-0000-0000-0000-0000000000b1",
        "aaaaaaaa0000000000000000000000b2": "aaaaaaaa-0000-0000-0000-0000000000b2",
        "aaaa-aaaa-0000-0000-0000-0000-0000-00b3": "aaaaaaaa-0000-0000-0000-0000000000b3",
    }
    for given, canonical_id in spellings.items():
        assert store.create_run("proj", "trace-u", given) == canonical_id
        assert store.run(given.upper())["run_id"] == canonical_id


def test_recovery_grace_is_exact_seconds_in_any_session_time_zone(
    db_dsn: str, tmp_path: Path
) -> None:
    """D29: a grace of 86,400 s is 24 hours, also across a DST change of the session's time
    zone (PostgreSQL once added it as '1 day', a calendar day: 23 hours here)."""
    new_york = make_conninfo(db_dsn, options="-c TimeZone=America/New_York")
    with PgStore(new_york) as pg, make_edge_store("edge-wal", tmp_path) as edge:
        for s in (pg, edge):
            s.create_run("proj", "trace-1", R1)
            s.add_step_run(R1, "model", step(1))
            # 07:00 in New York on the day before its clocks go forward.
            deadline = "2030-03-09T12:00:00.000000Z"
            s.admit_invocation(admission("inv-1", R1, step(1), 1, deadline_at=deadline))
            pin_clock(s, datetime(2030, 3, 10, 11, 30, tzinfo=UTC))  # 23.5 h later
            assert s.recover_expired(10, 86400)["count"] == 0, type(s).__name__
            pin_clock(s, datetime(2030, 3, 10, 12, 0, 1, tzinfo=UTC))  # 24 h and 1 s later
            assert s.recover_expired(10, 86400)["count"] == 1, type(s).__name__
            pin_clock(s, None)


def test_usage_bounds_without_a_time_zone_are_utc_in_any_session(
    db_dsn: str, tmp_path: Path
) -> None:
    """D29: naive ``since``/``until`` are UTC on every store, not the session's zone."""
    new_york = make_conninfo(db_dsn, options="-c TimeZone=America/New_York")
    with PgStore(new_york) as pg, make_edge_store("edge-wal", tmp_path) as edge:
        for s in (pg, edge):
            world = World(s)
            s.create_run("proj", "trace-1", R1)
            s.add_step_run(R1, "model", step(1))
            pin_clock(s, datetime(2030, 1, 1, 2, 0, tzinfo=UTC))  # 21:00 the day before in NY
            world.admit(admission("inv-1", R1, step(1), 1))
            s.complete_invocation(world.completion("inv-1", usage=usage(10, 5, 100, "USD")))
            pin_clock(s, None)
            naive = s.usage_summary("proj", datetime(2030, 1, 1), datetime(2030, 1, 2))
            aware = s.usage_summary(
                "proj", datetime(2030, 1, 1, tzinfo=UTC), datetime(2030, 1, 2, tzinfo=UTC)
            )
            assert [r["completions"] for r in naive] == [1], type(s).__name__
            assert naive == aware


def test_orders_are_byte_orders_whatever_the_database_collation(
    base_dsn: str, tmp_path: Path
) -> None:
    """D29: recovery and the usage summary sort text by bytes, as SQLite does, also in a
    database whose default collation is ICU's en-US (where 'inv-a' sorts before 'inv-B')."""
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        name = f"icu_{uuid.uuid4().hex[:12]}"
        conn.execute(
            f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu"
            " ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
        )
    dsn = with_dbname(base_dsn, name)
    try:
        migrate(dsn, with_ai=True)
        with PgStore(dsn) as pg, make_edge_store("edge-wal", tmp_path) as edge:
            orders = {}
            for s in (pg, edge):
                world = World(s)
                s.create_run("proj", "trace-1", R1)
                for n, invocation_id in ((1, "inv-a"), (2, "inv-B")):
                    s.add_step_run(R1, "model", step(n))
                    world.admit(admission(invocation_id, R1, step(n), 1, deadline_at=T_PAST))
                for n, provider in ((3, "b-provider"), (4, "B-provider")):
                    s.add_step_run(R1, "model", step(n))
                    command = _with(admission(f"inv-u{n}", R1, step(n), 1), provider=provider)
                    world.admit(command)
                    done = world.completion(f"inv-u{n}", usage=usage(1, 1, 1, "USD"))
                    s.complete_invocation(done)
                recovered = s.recover_expired(1, 0)["recovered"]
                summary = s.usage_summary("proj")
                orders[type(s).__name__] = (
                    [r["invocation_id"] for r in recovered],
                    [r["provider"] for r in summary],
                )
        assert orders["PgStore"] == orders["EdgeStore"] == (["inv-B"], ["B-provider", "b-provider"])
    finally:
        drop_database(base_dsn, dsn)


# -- the test clock is test-only ------------------------------------------------------------


@pytest.mark.parametrize("role", ["runtime", "operator", "relay", "reader"])
def test_no_ql3_role_can_pin_the_postgresql_clock(db_dsn: str, role: str) -> None:
    with psycopg.connect(role_dsn(db_dsn, role), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(
                "CREATE OR REPLACE FUNCTION ql3._now() RETURNS timestamptz LANGUAGE sql STABLE"
                " AS $$ SELECT '2000-01-01T00:00:00Z'::timestamptz $$"
            )
        # No role may even call it: the functions that read it run as its owner (D46).
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT ql3._now()")


AI_0001 = REPO / "sql/ql3_ai/0001_invocations.sql"


def test_ql3_ai_reads_the_clock_only_through_the_pinnable_ql3_now() -> None:
    """Pinning ql3._now() (D14) must move every receipt timestamp, so no bare now()."""
    text = AI_0001.read_text(encoding="utf-8")
    assert text.startswith("-- requires: core 0004"), "ql3._now() is created by core 0004"
    assert "ql3._now()" in text
    clocks = r"(?<![\w.])(?:now|clock_timestamp|statement_timestamp|transaction_timestamp)\s*\("
    clocks += r"|\b(?:current_timestamp|localtimestamp)\b"
    bare = re.findall(clocks, text.replace("ql3._now()", ""), flags=re.IGNORECASE)
    assert bare == [], "ql3_ai must read the clock through ql3._now()"


def test_edge_migrations_keep_the_postgresql_versions() -> None:
    for stream in ("core", "ql3_ai"):
        pg = sorted(p.name for p in (REPO / "sql" / stream).glob("*.sql"))
        edge = sorted(p.name for p in (REPO / "python/ql3/edge_sql" / stream).glob("*.sql"))
        assert edge == pg, stream


# -- the shared vectors through the stores' own paths ----------------------------------------

BODY_DOMAIN = "ql3/contract-body@v1"
JCS_VECTORS = load_vectors("jcs.json")
DIGEST_VECTORS = load_vectors("digest.json")
IDENTITY_VECTORS = load_vectors("identity.json")


def _framed(domain: str, canonical_text: str) -> str:
    return hashlib.sha256(domain.encode() + b"\x00" + canonical_text.encode()).hexdigest()


def test_jcs_vectors_become_the_body_hash_and_the_stored_body(store: Store) -> None:
    for n, vector in enumerate(v for v in JCS_VECTORS if not v.get("error")):
        value = canonical.parse_json(vector["input"])
        row = store.put_revision("vec", FAMILY, f"jcs-{n}", {"v": value}, "vectors")
        expected = '{"v":' + vector["canonical"] + "}"
        assert row["body_hash"] == _framed(BODY_DOMAIN, expected), vector["name"]
        if isinstance(store, EdgeStore):
            stored = query(store, "SELECT body FROM contract_revisions WHERE revision_id = ?",
                           (row["revision_id"],))  # fmt: skip
            assert stored == [(expected,)], vector["name"]
        if isinstance(value, dict):
            direct = store.put_revision("vec", FAMILY, f"jcs-obj-{n}", value, "vectors")
            assert direct["body_hash"] == _framed(BODY_DOMAIN, vector["canonical"]), vector["name"]
    assert hashlib.sha256(b"{}").hexdigest() == JCS_VECTORS[0]["sha256"]


def test_jcs_error_vectors_are_refused_and_write_nothing(store: Store) -> None:
    before = footprint(store)
    for vector in (v for v in JCS_VECTORS if v.get("error")):
        value = json.loads(vector["input"])  # lenient: the store must be the one refusing
        with pytest.raises(errors.InvalidArgument):
            store.put_revision("vec", FAMILY, "jcs-error", {"v": value}, "vectors")
    assert footprint(store) == before


@pytest.mark.parametrize("case", RFC8785_OK, ids=lambda c: c.name)
def test_rfc8785_test_data_becomes_the_body_hash_and_the_stored_body(
    store: Store, case: Rfc8785Case
) -> None:
    # Parsed as a client would (json.loads): canonicalising is the store's own work.
    value = json.loads(case.input)
    bodies = [({"v": value}, b'{"v":' + case.expected + b"}")]
    if isinstance(value, dict):
        bodies.append((value, case.expected))
    for n, (body, expected) in enumerate(bodies):
        row = store.put_revision("vec", FAMILY, f"rfc8785-{n}", body, "vectors")
        framed = BODY_DOMAIN.encode() + b"\x00" + expected
        assert row["body_hash"] == hashlib.sha256(framed).hexdigest(), case.name
        if isinstance(store, EdgeStore):
            stored = query(store, "SELECT body FROM contract_revisions WHERE revision_id = ?",
                           (row["revision_id"],))  # fmt: skip
            assert [(text.encode("utf-8"),) for (text,) in stored] == [(expected,)]


def test_rfc8785_values_with_1e30_is_refused_and_writes_nothing(store: Store) -> None:
    value = json.loads(RFC8785_VALUES.input)  # lenient: 1E30 reaches the store, as 1e30
    before = footprint(store)
    for body in ({"v": value}, value):
        with pytest.raises(errors.InvalidArgument) as raised:
            store.put_revision("vec", FAMILY, "rfc8785-values", body, "vectors")
        assert raised.type is errors.InvalidArgument and raised.value.sqlstate == "Q3V01"
    assert footprint(store) == before


def test_digest_vectors_through_put_revision_and_the_shim_digest(store: Store) -> None:
    for n, vector in enumerate(DIGEST_VECTORS):
        if vector["domain"] == BODY_DOMAIN:
            row = store.put_revision("vec", FAMILY, f"digest-{n}", vector["value"], "vectors")
            assert row["body_hash"] == vector["digest"]
        digest, _ = checked_digest("vector", vector["domain"], vector["value"])
        assert digest == vector["digest"], vector


def test_identity_vectors_are_the_identities_every_phase_stores(store: Store) -> None:
    store.create_run("proj", "trace-1", R1)
    world = World(store)
    for n, vector in enumerate(IDENTITY_VECTORS, start=1):
        invocation_id = vector["invocation_id"]
        store.add_step_run(R1, "model", step(n))
        start = world.admit(admission(invocation_id, R1, step(n), 1))["start"]
        completion = world.complete(world.completion(invocation_id, "lost", "outcome_unknown"))
        resolution = store.resolve_invocation(world.resolution(invocation_id, "cancel"))
        for phase, record in (("admission", start), ("completion", completion["completion"]),
                              ("resolution", resolution["resolution"])):  # fmt: skip
            want = vector[phase]
            got = {k: record[k] for k in ("mutation_id", "event_id", "dedupe_key")}
            assert got == want, (invocation_id[:16], phase)
            mutation = "SELECT dedupe_key FROM {ql3}step_run_mutations WHERE mutation_id = ?"
            assert query(store, mutation, (want["mutation_id"],)) == [(want["dedupe_key"],)]
            assert query(store, "SELECT count(*) FROM {ql3}run_events WHERE event_id = ?",
                         (want["event_id"],)) == [(1,)]  # fmt: skip
