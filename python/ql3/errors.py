"""Stable error codes of ql3, mapped from PostgreSQL SQLSTATEs to Python exceptions.

Callers catch these classes (or test ``.code``) and never need to import psycopg.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping


class Ql3Error(Exception):
    """Base class of every ql3 error; ``code`` is the stable name (SPEC section 6)."""

    code = "QL3_ERROR"
    sqlstate: str | None = None

    def __init__(self, message: str = "", *, detail: str | None = None) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        self.detail = detail


class InvalidArgument(Ql3Error, ValueError):
    code = "QL3_INVALID_ARGUMENT"
    sqlstate = "Q3V01"


class Misconfigured(InvalidArgument):
    """A command or daemon cannot start: a missing or malformed DSN, a bad setting. The
    CLI exits 2 for it (1 for errors of the work itself)."""


class RecordTooLarge(InvalidArgument):
    code = "QL3_RECORD_TOO_LARGE"
    sqlstate = "Q3V02"


class IdentifierTooLong(InvalidArgument):
    code = "QL3_IDENTIFIER_TOO_LONG"
    sqlstate = "Q3V03"


class NotFound(Ql3Error, LookupError):
    code = "QL3_NOT_FOUND"
    sqlstate = "Q3N01"


class Conflict(Ql3Error):
    code = "QL3_CONFLICT"
    sqlstate = "Q3C01"


class StaleRevision(Conflict):
    code = "QL3_STALE_REVISION"
    sqlstate = "Q3C02"


class IllegalTransition(Ql3Error):
    code = "QL3_ILLEGAL_TRANSITION"
    sqlstate = "Q3S01"


class RevisionRevoked(Ql3Error):
    code = "QL3_REVISION_REVOKED"
    sqlstate = "Q3R01"


class Unavailable(Ql3Error):
    """The database could not be reached or did not answer in time."""

    code = "QL3_UNAVAILABLE"


class PermissionDenied(Ql3Error, PermissionError):
    """The connected role lacks the grant for this call (SQLSTATE 42501)."""

    code = "QL3_PERMISSION_DENIED"


class DatabaseError(Ql3Error):
    """Any other database error; the message carries the SQLSTATE."""

    code = "QL3_DATABASE_ERROR"


class MigrationError(Ql3Error):
    """A migration was refused: checksum drift, a database ahead of the code, a bad file."""

    code = "QL3_MIGRATION_REFUSED"


BY_SQLSTATE: dict[str, type[Ql3Error]] = {
    cls.sqlstate: cls
    for cls in (
        InvalidArgument,
        RecordTooLarge,
        IdentifierTooLong,
        NotFound,
        Conflict,
        StaleRevision,
        IllegalTransition,
        RevisionRevoked,
    )
    if cls.sqlstate is not None
}

BY_CODE: dict[str, type[Ql3Error]] = {cls.code: cls for cls in BY_SQLSTATE.values()}


def from_sqlstate(sqlstate: str | None, message: str, detail: str | None = None) -> Ql3Error | None:
    """The ql3 exception for a custom SQLSTATE, or None when the state is not one of ours."""
    cls = BY_SQLSTATE.get(sqlstate or "")
    if cls is None:
        return None
    return cls(message, detail=detail)


def check_text_args(*values: object) -> None:
    """Refuses text arguments PostgreSQL would not take as text: each is a ``str`` or None,
    and none holds U+0000 (PostgreSQL text cannot). Both stores call it first, as
    PostgreSQL resolves argument types before a function runs. (psycopg would send an
    empty list as the untyped literal ``'{}'``, which PostgreSQL then takes as text.)"""
    for value in values:
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidArgument(
                f"QL3_INVALID_ARGUMENT: a text argument must be text, not {type(value).__name__}"
            )
        if "\x00" in value:
            raise InvalidArgument("QL3_INVALID_ARGUMENT: a text argument contains NUL (U+0000)")


def check_uuid_args(*values: object) -> None:
    """Refuses uuid arguments that are neither text, a ``uuid.UUID`` nor None. (psycopg
    would send a list of one string as the array literal ``'{...}'``, which is also a
    spelling PostgreSQL accepts for a uuid.) The text itself is checked by the cast."""
    for value in values:
        if value is not None and not isinstance(value, str | uuid.UUID):
            raise InvalidArgument(
                f"QL3_INVALID_ARGUMENT: a uuid argument must be text, not {type(value).__name__}"
            )


def check_contract_key(project_id: object, contract_family: object, contract_id: object) -> None:
    """Refuses a contract key a revision cache could not look up: each part must be text
    that PostgreSQL can hold (no U+0000, no lone surrogate)."""
    parts = (project_id, contract_family, contract_id)
    for part in parts:
        if not isinstance(part, str):
            raise InvalidArgument(
                f"QL3_INVALID_ARGUMENT: a contract key part must be text, not {type(part).__name__}"
            )
    check_text_args(*parts)
    try:
        "".join(parts).encode()  # type: ignore[arg-type]
    except UnicodeEncodeError:
        raise InvalidArgument(
            "QL3_INVALID_ARGUMENT: a contract key part is not valid Unicode (a lone surrogate)"
        ) from None


def check_seconds(name: str, value: object, *, zero: bool = False) -> float:
    """A setting in seconds: a finite real number above 0 (or at least 0 with ``zero``).
    NaN would compare false everywhere, so a NaN timeout could silently never expire."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero)
    ):
        bound = "at least 0" if zero else "above 0"
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: {name} must be a finite number of seconds {bound}, "
            f"not {value!r}"
        )
    return float(value)


def check_staleness(overrides: object) -> dict[str, float]:
    """``max_staleness`` of a revision cache: family name -> seconds (0 = verify every use)."""
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: max_staleness must map families to seconds, "
            f"not {type(overrides).__name__}"
        )
    checked: dict[str, float] = {}
    for family, seconds in overrides.items():
        if not isinstance(family, str):
            raise InvalidArgument(
                f"QL3_INVALID_ARGUMENT: max_staleness keys are family names, not {family!r}"
            )
        checked[family] = check_seconds(f"max_staleness[{family!r}]", seconds, zero=True)
    return checked


def check_projects(projects: object) -> list[str] | None:
    """A subscription's project ids: None (every project) or an iterable of non-empty
    ids. A string is refused: its characters would be taken for the projects, and the
    subscriber would never hear the project it named."""
    if projects is None:
        return None
    if isinstance(projects, str | bytes) or not isinstance(projects, Iterable):
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: projects must be a list of project ids, "
            f"not {type(projects).__name__}"
        )
    checked = list(projects)
    for project in checked:
        try:
            check_contract_key(project, "", "")
        except InvalidArgument as exc:
            raise InvalidArgument(f"{exc.message} (a project id of projects)") from None
        if not project:
            raise InvalidArgument("QL3_INVALID_ARGUMENT: a project id of projects is empty")
    return checked


def check_count(name: str, value: object, low: int, high: int | None = None) -> int:
    """A whole-number setting in low..high (a bool or a float is not one)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bounds = f"{low}..{high}" if high is not None else f">= {low}"
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: {name} must be a whole number {bounds}, not {value!r}"
        )
    return value
