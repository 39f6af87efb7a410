"""Stable error codes of ql3, mapped from PostgreSQL SQLSTATEs to Python exceptions.

Callers catch these classes (or test ``.code``) and never need to import psycopg.
"""

from __future__ import annotations


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
    """The database could not be reached, did not answer in time, or refused the call for
    a transient reason; try again later.

    ``outcome`` says whether the call took effect (D49); the code stays ``QL3_UNAVAILABLE``
    for all three, so ``except Unavailable`` and ``.code`` checks see no difference:

    - ``"not_sent"`` (``NotSent``): the call never reached PostgreSQL (no pooled connection
      in time, the connection could not be opened): nothing was done, a retry is safe.
    - ``"unknown"`` (``OutcomeUnknown``): the call was sent and no answer came (the
      connection was lost, a COMMIT's reply never arrived, the call was given up): it may
      have committed. Read back, or replay an idempotent command, before acting on it.
    - ``"rolled_back"`` (this class itself): PostgreSQL answered with a transient error
      (statement or lock timeout, serialization failure, deadlock, a read-only standby):
      the call's transaction was rolled back.
    """

    code = "QL3_UNAVAILABLE"
    outcome: str = "rolled_back"


class NotSent(Unavailable):
    """The call never reached PostgreSQL: nothing was done (``outcome == "not_sent"``)."""

    outcome = "not_sent"


class OutcomeUnknown(Unavailable):
    """The call was sent but its outcome is unknown: it may have committed
    (``outcome == "unknown"``)."""

    outcome = "unknown"


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
