"""Typed builders of the v1 invocation commands (SPEC section 4), so callers never write
the JSON by hand.

The SQL functions are the authority on every rule; the builders only put each field in
its one canonical spelling (lowercase hyphenated uuids, ``YYYY-MM-DDTHH:MM:SS.ffffffZ``
timestamps, every field present, nullable ones as ``null``), because the command digest
decides whether a replay is exact and one meaning must have one digest. The few checks
made here are the ones that need Python types (an aware datetime, a known enum value);
they raise the ``ql3.errors`` class the database would raise for the same mistake.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Final, Protocol, TypeVar, overload

from ql3 import canonical
from ql3.canonical import JSON
from ql3.errors import InvalidArgument

ADMISSION_SCHEMA: Final = "ql3/model-invocation-admission@v1"
START_SCHEMA: Final = "ql3/model-invocation-start@v1"
COMPLETION_COMMAND_SCHEMA: Final = "ql3/model-invocation-completion-command@v1"
COMPLETION_SCHEMA: Final = "ql3/model-invocation-completion@v1"
RESOLUTION_COMMAND_SCHEMA: Final = "ql3/model-invocation-resolution-command@v1"
RESOLUTION_SCHEMA: Final = "ql3/model-invocation-resolution@v1"
REQUEST_DIGEST_DOMAIN: Final = "ql3/model-request@v1"
"""Domain of ``request_digest`` over a JSON request body (bytes are hashed as they are)."""

_E = TypeVar("_E", bound=StrEnum)

OUTCOME_UNKNOWN: Final = "outcome_unknown"
"""The one result code of a lost outcome, and only of a lost outcome."""
OUTCOME_REJECTED: Final = "model_outcome_rejected"
"""Result code a ``fail`` resolution gives the step (reserved for resolutions)."""
OUTCOME_CANCELLED: Final = "model_outcome_cancelled"
"""Result code a ``cancel`` resolution gives the step (reserved for resolutions)."""


class Outcome(StrEnum):
    """How a model call ended, as a completion records it."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    LOST = "lost"


class Decision(StrEnum):
    """A human's resolution of a lost outcome."""

    RETRY = "retry"
    FAIL = "fail"
    CANCEL = "cancel"


class WriteStatus(StrEnum):
    """``status`` of an admission, completion or resolution result."""

    CREATED = "created"
    EXISTING = "existing"


class StepStatus(StrEnum):
    """``status`` of a step run."""

    READY = "ready"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    LOST = "lost"
    CANCELLED = "cancelled"


TERMINAL_STEP_STATUSES: Final = frozenset(
    {StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.TIMED_OUT, StepStatus.CANCELLED}
)
"""Statuses nothing moves on from (``lost`` waits for a resolution)."""


class _RevisionLike(Protocol):
    @property
    def contract_family(self) -> str: ...
    @property
    def contract_id(self) -> str: ...
    @property
    def revision_id(self) -> str: ...


@dataclass(frozen=True, kw_only=True)
class PolicyBinding:
    """The contract revision a call runs under; admission fences it against the active one."""

    contract_family: str
    contract_id: str
    revision_id: str | uuid.UUID

    @classmethod
    def of(cls, revision: _RevisionLike) -> PolicyBinding:
        """The binding of anything naming a revision (``ql3.cache.EffectiveRevision``...)."""
        return cls(
            contract_family=revision.contract_family,
            contract_id=revision.contract_id,
            revision_id=revision.revision_id,
        )

    def as_json(self) -> dict[str, JSON]:
        return {
            "contract_family": self.contract_family,
            "contract_id": self.contract_id,
            "revision_id": format_uuid(self.revision_id, "policy.revision_id"),
        }


@dataclass(frozen=True, kw_only=True)
class Usage:
    """What a provider reported; None means unknown, never 0. A cost needs its currency."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cost_micros: int | None = None
    currency: str | None = None

    @property
    def known(self) -> bool:
        """Whether any field is known (only then does the completion get a ledger row)."""
        return any(
            v is not None
            for v in (self.input_tokens, self.output_tokens, self.cost_micros, self.currency)
        )

    def as_json(self) -> dict[str, JSON]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_micros": self.cost_micros,
            "currency": self.currency,
        }


def format_timestamp(moment: datetime) -> str:
    """``moment`` as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` in UTC (SPEC section 2).

    A naive datetime is refused: its instant is unknown, and guessing would change the
    command digest with the machine's time zone.
    """
    if not isinstance(moment, datetime):
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: a timestamp must be a datetime, not {type(moment).__name__}"
        )
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise InvalidArgument(
            "QL3_INVALID_ARGUMENT: a timestamp must be timezone-aware (naive datetime given)"
        )
    u = moment.astimezone(UTC)
    return (
        f"{u.year:04d}-{u.month:02d}-{u.day:02d}T"
        f"{u.hour:02d}:{u.minute:02d}:{u.second:02d}.{u.microsecond:06d}Z"
    )


@overload
def as_utc(moment: datetime) -> datetime: ...
@overload
def as_utc(moment: None) -> None: ...
def as_utc(moment: datetime | None) -> datetime | None:
    """A bound of a time range: an aware datetime as it is, a naive one taken as UTC (never
    as the session's or the machine's time zone), None as None."""
    if moment is None:
        return None
    if not isinstance(moment, datetime):
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: a time bound must be a datetime, not {type(moment).__name__}"
        )
    if moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def parse_timestamp(text: str) -> datetime:
    """An aware datetime from ISO 8601 / RFC 3339 text; text without an offset is UTC."""
    try:
        moment = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: not an ISO 8601 timestamp: {text!r}"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


_CANONICAL_UUID: Final = re.compile(
    "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.ASCII
)


def format_uuid(value: str | uuid.UUID, field: str = "uuid") -> str:
    """The canonical lowercase hyphenated spelling of a uuid."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, str) and _CANONICAL_UUID.fullmatch(value):
        return value  # already what str(uuid.UUID(value)) would give
    try:
        return str(uuid.UUID(value))
    except (TypeError, ValueError, AttributeError):
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: {field} must be a uuid, not {value!r:.64}"
        ) from None


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of raw bytes."""
    return hashlib.sha256(data).hexdigest()


def request_digest(body: bytes | JSON) -> str:
    """The ``request_digest`` of a model request.

    Bytes are hashed as they are (the exact bytes sent to the provider, so an auditor can
    recompute it from a captured request). Any other value is a JSON body and gets the
    domain-separated digest ``digest('ql3/model-request@v1', body)``, which does not depend
    on how the body happens to be serialised. A ``str`` is a JSON string here; pass
    ``text.encode()`` to hash text as bytes.
    """
    if isinstance(body, bytes | bytearray | memoryview):
        return sha256_hex(bytes(body))
    return canonical.digest(REQUEST_DIGEST_DOMAIN, body)


def output_digest(body: bytes) -> str:
    """The ``output_digest`` of a provider response: lowercase hex SHA-256 of its bytes."""
    return sha256_hex(bytes(body))


def _enum(kind: type[_E], value: _E | str, field: str) -> _E:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: {field} must be one of {allowed}, not {value!r:.64}"
        ) from None


def admission_command(
    *,
    invocation_id: str,
    request_id: str,
    project_id: str,
    run_id: str | uuid.UUID,
    step_run_id: str | uuid.UUID,
    trace_id: str,
    expected_step_run_version: int,
    provider: str,
    model: str,
    policy: PolicyBinding | None,
    request_digest: str,
    input_bytes: int,
    deadline_at: datetime,
) -> dict[str, JSON]:
    """The ``ql3/model-invocation-admission@v1`` command for ``admit_invocation``."""
    return {
        "schema": ADMISSION_SCHEMA,
        "invocation_id": invocation_id,
        "request_id": request_id,
        "project_id": project_id,
        "run_id": format_uuid(run_id, "run_id"),
        "step_run_id": format_uuid(step_run_id, "step_run_id"),
        "trace_id": trace_id,
        "expected_step_run_version": expected_step_run_version,
        "provider": provider,
        "model": model,
        "policy": None if policy is None else policy.as_json(),
        "request_digest": request_digest,
        "input_bytes": input_bytes,
        "deadline_at": format_timestamp(deadline_at),
    }


def completion_command(
    *,
    invocation_id: str,
    start_digest: str,
    outcome: Outcome | str,
    result_code: str | None = None,
    output_bytes: int | None = None,
    output_digest: str | None = None,
    usage: Usage | None = None,
) -> dict[str, JSON]:
    """The ``ql3/model-invocation-completion-command@v1`` command for ``complete_invocation``.

    ``result_code`` may be left out only for ``lost``, whose code is always
    ``outcome_unknown``. A lost completion built here is exactly the command recovery
    writes, so a gateway that settles a call as lost after recovery did replays as
    ``existing``.
    """
    kind = _enum(Outcome, outcome, "outcome")
    if result_code is None:
        if kind is not Outcome.LOST:
            raise InvalidArgument(
                f"QL3_INVALID_ARGUMENT: result_code is required for outcome {kind.value}"
            )
        result_code = OUTCOME_UNKNOWN
    return {
        "schema": COMPLETION_COMMAND_SCHEMA,
        "invocation_id": invocation_id,
        "start_digest": start_digest,
        "outcome": kind.value,
        "result_code": result_code,
        "output_bytes": output_bytes,
        "output_digest": output_digest,
        "usage": None if usage is None else usage.as_json(),
    }


def resolution_command(
    *,
    invocation_id: str,
    completion_digest: str,
    decision: Decision | str,
    user_id: str,
    expected_step_run_version: int,
    reason: str | None = None,
) -> dict[str, JSON]:
    """The ``ql3/model-invocation-resolution-command@v1`` command for ``resolve_invocation``."""
    return {
        "schema": RESOLUTION_COMMAND_SCHEMA,
        "invocation_id": invocation_id,
        "completion_digest": completion_digest,
        "decision": _enum(Decision, decision, "decision").value,
        "user_id": user_id,
        "expected_step_run_version": expected_step_run_version,
        "reason": reason,
    }


MAX_RECOVERY_LIMIT: Final = 10000
MAX_GRACE_SECONDS: Final = 36500 * 86400
"""``recover_expired``'s bounds: at most 10,000 starts a call, a grace of 0..36,500 days."""


def recovery_arguments(limit: object, grace_seconds: object) -> tuple[int, timedelta]:
    """``recover_expired``'s argument checks, as its SQL makes them (D29), for the Python
    stores: a grace that is not a finite number of seconds is refused here too, since no
    interval could carry it to the database."""
    if (
        not isinstance(limit, int)
        or isinstance(limit, bool)
        or not 1 <= limit <= MAX_RECOVERY_LIMIT
    ):
        raise InvalidArgument(f"QL3_INVALID_ARGUMENT: limit must be 1..{MAX_RECOVERY_LIMIT}")
    if (
        not isinstance(grace_seconds, int | float)
        or isinstance(grace_seconds, bool)
        or not math.isfinite(grace_seconds)
        or not 0 <= grace_seconds <= MAX_GRACE_SECONDS
    ):
        raise InvalidArgument(
            "QL3_INVALID_ARGUMENT: grace must be a non-negative interval of at most 36500 days"
        )
    return limit, timedelta(seconds=grace_seconds)


def command_digest(command: dict[str, JSON]) -> str:
    """The digest of a command under its own ``schema`` domain (decides exact replays)."""
    schema = command.get("schema")
    if not isinstance(schema, str):
        raise InvalidArgument("QL3_INVALID_ARGUMENT: a command needs a string schema")
    return canonical.digest(schema, command)


__all__ = [
    "ADMISSION_SCHEMA",
    "COMPLETION_COMMAND_SCHEMA",
    "COMPLETION_SCHEMA",
    "MAX_GRACE_SECONDS",
    "MAX_RECOVERY_LIMIT",
    "OUTCOME_CANCELLED",
    "OUTCOME_REJECTED",
    "OUTCOME_UNKNOWN",
    "REQUEST_DIGEST_DOMAIN",
    "RESOLUTION_COMMAND_SCHEMA",
    "RESOLUTION_SCHEMA",
    "START_SCHEMA",
    "TERMINAL_STEP_STATUSES",
    "Decision",
    "Outcome",
    "PolicyBinding",
    "StepStatus",
    "Usage",
    "WriteStatus",
    "admission_command",
    "as_utc",
    "command_digest",
    "completion_command",
    "format_timestamp",
    "format_uuid",
    "output_digest",
    "parse_timestamp",
    "recovery_arguments",
    "request_digest",
    "resolution_command",
    "sha256_hex",
]
