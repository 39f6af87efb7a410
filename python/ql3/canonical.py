"""Canonical JSON, digests, derived identities and size limits (SPEC section 2).

This is the Python twin of ``sql/core/0001_canonical.sql``: RFC 8785 (JCS) through the
``rfc8785`` package, after checking the ql3 rules that package does not enforce (numbers
within +-(2^53-1), integral or not; no U+0000 and no lone surrogate in any string or key;
at most ``MAX_DEPTH`` nested containers). ``tests/vectors/*.json`` hold both
implementations, and the SQLite shim built on this module, to the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from decimal import Decimal
from typing import Any, Final, NoReturn, TypeAlias

import rfc8785

from ql3.errors import IdentifierTooLong, InvalidArgument, RecordTooLarge

JSON: TypeAlias = "bool | int | float | str | list[JSON] | dict[str, JSON] | None"
"""A JSON value as ``json.loads`` builds it (tuples are accepted as arrays on input)."""

MAX_SAFE_INTEGER: Final = 2**53 - 1
MAX_RECORD_BYTES: Final = 24576
MAX_IDENTIFIER_CHARS: Final = 128
MAX_DEPTH: Final = 64
# The digest domain of contract revision bodies (body_hash).
BODY_DOMAIN: Final = "ql3/contract-body@v1"
"""Most containers on any path from the root (``[[]]`` has depth 2); ql3.jcs agrees."""

PHASES: Final = ("admission", "completion", "resolution")

MUTATION_ID_DOMAIN: Final = "ql3/mutation-id@v1"
EVENT_ID_DOMAIN: Final = "ql3/run-event-id@v1"
DEDUPE_KEY_DOMAIN: Final = "ql3/dedupe-key@v1"

_FORBIDDEN_CHARS = re.compile("[\x00\ud800-\udfff]")
_MAX_SAFE_DECIMAL = Decimal(MAX_SAFE_INTEGER)
_MAX_FRACTION_DIGITS = 16383


def _shown(text: str) -> str:
    return text if len(text) <= 40 else text[:40] + "..."


def _invalid(reason: str) -> NoReturn:
    raise InvalidArgument(f"QL3_INVALID_ARGUMENT: {reason}")


def _check_text(what: str, text: str) -> None:
    found = _FORBIDDEN_CHARS.search(text)
    if found is not None:
        char = "U+0000" if found.group() == "\x00" else "a lone surrogate"
        _invalid(f"{what} contains {char}")


def _validate(value: object, depth: int) -> None:
    """Raise InvalidArgument unless value is JSON that JCS can encode under the ql3 rules."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            return
        _invalid(f"number {value} is outside the safe range -(2^53-1)..2^53-1")
    if isinstance(value, float):
        if not math.isfinite(value):
            _invalid(f"number {value} is not finite")
        if abs(value) > MAX_SAFE_INTEGER:
            _invalid(f"number {value!r} is outside the safe range -(2^53-1)..2^53-1")
        return
    if isinstance(value, str):
        _check_text("string", value)
        return
    if isinstance(value, (list, tuple, dict)):
        if depth >= MAX_DEPTH:
            _invalid(f"JSON nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    _invalid(f"object key {key!r} is not a string")
                _check_text("object key", key)
                _validate(item, depth + 1)
        else:
            for item in value:
                _validate(item, depth + 1)
        return
    _invalid(f"{type(value).__name__} is not a JSON value")


def validate(value: object) -> None:
    """Raise InvalidArgument unless ``jcs(value)`` would succeed."""
    _validate(value, 0)


def _reject_constant(name: str) -> NoReturn:
    _invalid(f"{name} is not JSON")


def _parse_int(text: str) -> int:
    # The length test first: int() refuses over 4300 digits with a plain ValueError.
    if len(text) > 17 or abs(number := int(text)) > MAX_SAFE_INTEGER:
        _invalid(f"number {_shown(text)} is outside the safe range -(2^53-1)..2^53-1")
    return number


def _parse_float(text: str) -> float:
    # Decide the range on the exact decimal, as PostgreSQL's numeric does: 9007199254740991.4
    # is out of range even though it rounds to 2^53-1 as a double.
    # Comparisons, unlike abs(), never round or overflow a Decimal context.
    exact = Decimal(text)
    if not -_MAX_SAFE_DECIMAL <= exact <= _MAX_SAFE_DECIMAL:
        _invalid(f"number {_shown(text)} is outside the safe range -(2^53-1)..2^53-1")
    exponent = exact.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -_MAX_FRACTION_DIGITS:
        # PostgreSQL's numeric (and so jsonb) holds at most 16383 digits after the point.
        _invalid(f"number {_shown(text)} has over {_MAX_FRACTION_DIGITS} digits after the point")
    number = float(text)
    if number == 0 and exact != 0:
        _invalid(f"number {_shown(text)} is too close to 0 to be a nonzero double")
    return number


def parse_json(text: str) -> JSON:
    """Parse JSON text strictly: what ql3.parse_json accepts, with the same result.

    Rejects NaN and Infinity, U+0000 and lone surrogates (escaped or not), numbers outside
    +-(2^53-1), nonzero numbers that a double rounds to 0, numbers with more than 16383
    digits after the point (PostgreSQL's numeric limit), and nesting deeper than
    ``MAX_DEPTH``. Duplicate keys keep the last value.
    """
    if not isinstance(text, str):
        _invalid(f"JSON text must be str, not {type(text).__name__}")
    try:
        value: JSON = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_reject_constant,
        )
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"QL3_INVALID_ARGUMENT: not valid JSON: {exc}") from None
    except RecursionError:
        _invalid(f"JSON nests deeper than {MAX_DEPTH} levels")
    validate(value)
    return value


# In json.dumps output: a lone surrogate, a character outside the BMP (UTF-16 key order
# may differ from code point order), or an escaped U+0000 (or a false alarm: a literal
# backslash before "u0000"). Any of them sends the value to the exact path.
_NOT_PLAIN_TEXT = re.compile(r"[\ud800-\udfff\U00010000-\U0010ffff]|\\u0000")


def _plain(container: dict[str, Any] | list[Any], depth: int) -> bool:
    """Whether ``json.dumps(sort_keys=True)`` writes this container exactly as JCS does.

    True when it nests at most ``MAX_DEPTH`` deep and holds only str keys, strings,
    booleans, nulls, safe integers, and non-integral floats in [1e-4, 2^53-1] (where
    ``repr`` and ECMAScript both write plain shortest-round-trip decimals). Anything else
    (integral floats, exponents, tuples, values ql3 refuses) is left to the exact path.
    """
    if depth >= MAX_DEPTH:
        return False
    items: Iterable[Any]
    if isinstance(container, dict):  # exactly dict or list: the callers check type()
        for name in container:
            if type(name) is not str:
                return False
        items = container.values()
    else:
        items = container
    for item in items:
        kind = type(item)
        if kind is str or kind is bool or item is None:
            continue
        if kind is int:
            if -MAX_SAFE_INTEGER <= item <= MAX_SAFE_INTEGER:
                continue
            return False
        if kind is float:
            if 1e-4 <= abs(item) <= MAX_SAFE_INTEGER and not item.is_integer():
                continue
            return False
        if (kind is dict or kind is list) and _plain(item, depth + 1):
            continue
        return False
    return True


def _fast_jcs_bytes(value: dict[str, Any] | list[Any]) -> bytes | None:
    """JCS bytes through C-speed ``json.dumps`` when they are provably the same, else None.

    The pure-Python encoder costs about 0.4 ms per KiB; policy bodies, commands and
    receipts are almost always "plain" JSON, for which ``json.dumps`` with sorted keys and
    no spaces writes exactly the RFC 8785 text (tests/py/test_canonical_fast.py holds the
    two paths equal on the shared vectors, the cases where they part ways, and generated
    values).
    """
    if not _plain(value, 0):
        return None
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    # ASCII text (the common case) can only hold the escaped U+0000: a faster test.
    if "\\u0000" in text if text.isascii() else _NOT_PLAIN_TEXT.search(text) is not None:
        return None
    return text.encode("utf-8")


def _jcs_bytes_exact(value: JSON) -> bytes:
    validate(value)
    encoded: bytes = rfc8785.dumps(value)
    return encoded


def jcs_bytes(value: JSON) -> bytes:
    """The RFC 8785 canonical UTF-8 bytes of value under the ql3 rules."""
    if isinstance(value, (dict, list)) and type(value) in (dict, list):
        fast = _fast_jcs_bytes(value)
        if fast is not None:
            return fast
    return _jcs_bytes_exact(value)


def jcs(value: JSON) -> str:
    """The RFC 8785 canonical text of value under the ql3 rules (same as ql3.jcs)."""
    return jcs_bytes(value).decode("utf-8")


def digest(domain: str, value: JSON) -> str:
    """Lowercase hex SHA-256 of UTF-8(domain) || 0x00 || UTF-8(JCS(value))."""
    if not isinstance(domain, str):
        _invalid(f"digest domain must be str, not {type(domain).__name__}")
    _check_text("digest domain", domain)
    return hashlib.sha256(domain.encode("utf-8") + b"\x00" + jcs_bytes(value)).hexdigest()


def check_identifier(field: str, value: object) -> str:
    """Return value if it is an identifier of 1..128 characters, else raise.

    IdentifierTooLong (QL3_IDENTIFIER_TOO_LONG) over 128 characters; InvalidArgument when
    value is not a str, is empty, or holds U+0000 or a lone surrogate.
    """
    if not isinstance(value, str):
        _invalid(f"{field} must be a string, not {type(value).__name__}")
    if not value:
        _invalid(f"{field} must be 1..{MAX_IDENTIFIER_CHARS} characters")
    if len(value) > MAX_IDENTIFIER_CHARS:
        raise IdentifierTooLong(
            f"QL3_IDENTIFIER_TOO_LONG: {field} has {len(value)} characters, "
            f"at most {MAX_IDENTIFIER_CHARS} are allowed"
        )
    _check_text(field, value)
    return value


def check_size(field: str, value: JSON) -> bytes:
    """Return the canonical bytes of value, raising RecordTooLarge over 24 KiB of them."""
    encoded = jcs_bytes(value)
    if len(encoded) > MAX_RECORD_BYTES:
        raise RecordTooLarge(
            f"QL3_RECORD_TOO_LARGE: {field} is {len(encoded)} bytes of canonical JSON "
            f"(at most {MAX_RECORD_BYTES})"
        )
    return encoded


def _identity(prefix: str, domain: str, invocation_id: str, phase: str) -> str:
    check_identifier("invocation_id", invocation_id)
    if phase not in PHASES:
        _invalid(f"phase must be admission, completion or resolution, not {phase!r}")
    return prefix + digest(domain, [invocation_id, phase])


def mutation_id(invocation_id: str, phase: str) -> str:
    """``mut_`` || digest('ql3/mutation-id@v1', [invocation_id, phase]), as ql3.mutation_id."""
    return _identity("mut_", MUTATION_ID_DOMAIN, invocation_id, phase)


def event_id(invocation_id: str, phase: str) -> str:
    """``evt_`` || digest('ql3/run-event-id@v1', [invocation_id, phase]), as ql3.event_id."""
    return _identity("evt_", EVENT_ID_DOMAIN, invocation_id, phase)


def dedupe_key(invocation_id: str, phase: str) -> str:
    """``ddp_`` || digest('ql3/dedupe-key@v1', [invocation_id, phase]), as ql3.dedupe_key."""
    return _identity("ddp_", DEDUPE_KEY_DOMAIN, invocation_id, phase)


__all__ = [
    "DEDUPE_KEY_DOMAIN",
    "EVENT_ID_DOMAIN",
    "JSON",
    "MAX_DEPTH",
    "MAX_IDENTIFIER_CHARS",
    "MAX_RECORD_BYTES",
    "MAX_SAFE_INTEGER",
    "MUTATION_ID_DOMAIN",
    "PHASES",
    "check_identifier",
    "check_size",
    "dedupe_key",
    "digest",
    "event_id",
    "jcs",
    "jcs_bytes",
    "mutation_id",
    "parse_json",
    "validate",
]
