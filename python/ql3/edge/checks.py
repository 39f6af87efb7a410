"""Argument and command checks of the edge procedures: the Python twins of ql3's SQL
helpers (``ql3._check_identifier``, ``ql3_ai._check_shape``, ``_checked_digest``,
``_uuid``, ``_check_sha256``, ``_timestamp``), with the same codes, the same messages and
the same order, so one bad command is refused the same way by both stores.

Canonical JSON and digests are ``ql3.canonical``'s; nothing here re-implements them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final, NoReturn

from ql3 import canonical
from ql3.errors import IdentifierTooLong, InvalidArgument

_HEX: Final = frozenset("0123456789abcdef")
_DIGITS: Final = str.maketrans("", "", "0123456789")
_HEX_DELETE: Final = str.maketrans("", "", "0123456789abcdef")
_LETTERS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_RESULT_CODE_CHARS: Final = _LETTERS | frozenset("0123456789_.:-")
_UPPER: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def invalid(message: str) -> NoReturn:
    raise InvalidArgument(f"QL3_INVALID_ARGUMENT: {message}")


def json_type(value: object) -> str:
    """``jsonb_typeof`` of a Python JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    return type(value).__name__


def json_text(value: object) -> str:
    """The JSON text of a value for a message (PostgreSQL prints jsonb the same way)."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    except (TypeError, ValueError):
        return repr(value)


def check_identifier(field: str, value: object) -> str:
    """``ql3._check_identifier``: 1..128 characters."""
    if value is None or value == "":
        invalid(f"{field} is required")
    if not isinstance(value, str):
        invalid(f"{field} must be text, not {json_type(value)}")
    if len(value) > canonical.MAX_IDENTIFIER_CHARS:
        raise IdentifierTooLong(
            f"QL3_IDENTIFIER_TOO_LONG: {field} has {len(value)} characters (at most 128)"
        )
    if "\x00" in value:
        invalid(f"{field} contains U+0000")
    return value


def check_shape(
    what: str,
    command: object,
    schema_name: str | None,
    fields: Sequence[str],
    kinds: Sequence[str],
) -> Mapping[str, Any]:
    """``ql3_ai._check_shape``: an object of exactly ``fields`` with these JSON kinds.

    kinds: string | integer (an int >= 0; never a float) | object, suffixed
    with ``?`` when null is allowed. Every field is required, nullable ones included.
    """
    if not isinstance(command, Mapping):
        invalid(
            f"{what} must be a JSON object, not {'NULL' if command is None else json_type(command)}"
        )
    if schema_name is not None:
        schema = command.get("schema")
        if schema != schema_name:
            shown = "missing" if "schema" not in command else json_text(schema)
            invalid(f"{what} schema must be '{schema_name}', not {shown}")
    missing = sorted(f for f in fields if f not in command)
    if missing:
        invalid(f"{what} lacks required field(s) {', '.join(missing)}")
    unknown = sorted(str(k) for k in command if k not in fields)
    if unknown:
        invalid(f"{what} has unknown field(s) {', '.join(unknown)}")
    for field, kind in zip(fields, kinds, strict=True):
        value = command[field]
        got = json_type(value)
        if got == "number":
            # A float is refused even when integral: the JSON PostgreSQL receives for it
            # (512.0) has a fraction, which its shape check refuses (D15, D29).
            if kind.startswith("integer") and isinstance(value, int) and value >= 0:
                continue
        elif got == "null":
            if kind.endswith("?"):
                continue
        elif got == kind.rstrip("?"):
            continue
        expected = kind.rstrip("?") + " or null" if kind.endswith("?") else kind
        invalid(f"{what} field {field} must be {expected}, not {json_text(value)[:64]}")
    return command


def checked_digest(what: str, domain: str, value: Any) -> tuple[str, str]:
    """``ql3_ai._checked_digest``: (digest, canonical text), refusing over 24 KiB.

    One canonical pass serves the size check, the digest and the stored text: the digest
    is the framing of ``ql3.canonical.digest`` over the bytes ``check_size`` returns.
    """
    encoded = canonical.check_size(what, value)
    digest = hashlib.sha256(domain.encode("utf-8") + b"\x00" + encoded).hexdigest()
    return digest, encoded.decode("utf-8")


def check_uuid(field: str, value: str) -> str:
    """``ql3_ai._uuid``: only the canonical lowercase hyphenated spelling."""
    if (
        len(value) != 36
        or value.translate(_HEX_DELETE) != "----"
        or value[8] != "-"
        or value[13] != "-"
        or value[18] != "-"
        or value[23] != "-"
    ):
        invalid(f"{field} must be a lowercase hyphenated uuid, not '{value[:64]}'")
    return value


def check_sha256(field: str, value: str) -> None:
    """``ql3_ai._check_sha256``: 64 lowercase hex digits."""
    if len(value) != 64 or not set(value) <= _HEX:
        invalid(f"{field} must be 64 lowercase hex digits, not '{value[:80]}'")


def check_timestamp(field: str, value: str) -> datetime:
    """``ql3_ai._timestamp``: ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` and a real instant."""
    problem = (
        f"{field} must be RFC 3339 UTC with six fractional digits "
        f"(2026-12-02T12:00:00.000000Z), not '{value[:64]}'"
    )
    if (
        len(value) != 27
        or value.translate(_DIGITS) != "--T::.Z"
        or value[4] != "-"
        or value[7] != "-"
        or value[10] != "T"
        or value[13] != ":"
        or value[16] != ":"
        or value[19] != "."
        or value[26] != "Z"
    ):
        invalid(problem)
    try:
        return datetime(
            int(value[0:4]),
            int(value[5:7]),
            int(value[8:10]),
            int(value[11:13]),
            int(value[14:16]),
            int(value[17:19]),
            int(value[20:26]),
            tzinfo=UTC,
        )
    except ValueError:
        invalid(problem)


def check_result_code(value: str) -> None:
    if not set(value) <= _RESULT_CODE_CHARS or value[0] not in _LETTERS:
        invalid(f"result_code must match [A-Za-z][A-Za-z0-9_.:-]*, not '{value}'")


def check_currency(value: str) -> None:
    if len(value) != 3 or not set(value) <= _UPPER:
        invalid(f"usage.currency must be an ISO 4217 code, not '{value[:64]}'")
