"""Builders for invocation tests: a model step, and commands with sensible defaults."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from ql3.canonical import JSON
from ql3.invocations import (
    Outcome,
    PolicyBinding,
    Usage,
    admission_command,
    completion_command,
    output_digest,
    request_digest,
)

PROJECT = "proj"
TRACE = "trace-1"
PROVIDER = "ollama"
MODEL = "qwen2.5:7b"
PAST = datetime(2020, 1, 1, tzinfo=UTC)
"""A deadline recovery treats as expired by any database clock."""


def future() -> datetime:
    """A deadline no test outlives."""
    return datetime.now(UTC) + timedelta(hours=1)


def new_id(prefix: str = "inv") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def model_step(store: Any, *, project: str = PROJECT, trace: str = TRACE) -> tuple[str, str]:
    """A new run with one ready model step: (run_id, step_run_id)."""
    run_id = store.create_run(project, trace)
    return run_id, store.add_step_run(run_id, "model")


def admission(
    run_id: str,
    step_run_id: str,
    *,
    invocation_id: str | None = None,
    version: int = 1,
    project: str = PROJECT,
    trace: str = TRACE,
    policy: PolicyBinding | None = None,
    deadline: datetime | None = None,
    provider: str = PROVIDER,
    model: str = MODEL,
    request_id: str | None = None,
    prompt: bytes = b"hello model",
) -> dict[str, JSON]:
    return admission_command(
        invocation_id=invocation_id or new_id(),
        request_id=request_id or new_id("req"),
        project_id=project,
        run_id=run_id,
        step_run_id=step_run_id,
        trace_id=trace,
        expected_step_run_version=version,
        provider=provider,
        model=model,
        policy=policy,
        request_digest=request_digest(prompt),
        input_bytes=len(prompt),
        deadline_at=deadline or future(),
    )


def completion(
    admitted: dict[str, Any],
    outcome: Outcome,
    *,
    result_code: str | None = None,
    usage: Usage | None = None,
    output: bytes | None = None,
) -> dict[str, JSON]:
    """The completion command of an admission result."""
    codes = {Outcome.SUCCEEDED: "ok", Outcome.FAILED: "provider_error",
             Outcome.TIMED_OUT: "MODEL_DEADLINE_EXCEEDED"}  # fmt: skip
    return completion_command(
        invocation_id=admitted["start"]["invocation_id"],
        start_digest=admitted["start_digest"],
        outcome=outcome,
        result_code=result_code or codes.get(outcome),
        output_bytes=None if output is None else len(output),
        output_digest=None if output is None else output_digest(output),
        usage=usage,
    )
