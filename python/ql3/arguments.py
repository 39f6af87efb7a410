"""Checks of arguments given in code, shared by both stores, the revision caches and the
relays: each refuses what it cannot take as ``QL3_INVALID_ARGUMENT`` naming it, before
anything is sent or written, so that a mistake fails where it is made (D40, D41)."""

from __future__ import annotations

import argparse
import math
import re
import uuid
from collections.abc import Iterable, Mapping
from datetime import timedelta

from ql3.errors import InvalidArgument, Misconfigured


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


def check_key_part(what: str, part: object) -> str:
    """Refuses what PostgreSQL could not hold as an identifier's text: anything but a
    ``str``, U+0000, a lone surrogate."""
    if not isinstance(part, str):
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: {what} must be text, not {type(part).__name__}"
        )
    if "\x00" in part:
        raise InvalidArgument(f"QL3_INVALID_ARGUMENT: {what} contains NUL (U+0000)")
    try:
        part.encode()
    except UnicodeEncodeError:
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: {what} is not valid Unicode (a lone surrogate)"
        ) from None
    return part


def check_contract_key(project_id: object, contract_family: object, contract_id: object) -> None:
    """Refuses a contract key a revision cache could not look up (``check_key_part``)."""
    for part in (project_id, contract_family, contract_id):
        check_key_part("a contract key part", part)


def check_seconds(
    name: str, value: object, *, zero: bool = False, most: float | None = None
) -> float:
    """A setting in seconds: a finite real number above 0 (or at least 0 with ``zero``),
    and at most ``most`` when given. NaN would compare false everywhere, so a NaN timeout
    could silently never expire (or spin a loop); infinity overflows waits."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero)
        or (most is not None and value > most)
    ):
        bounds = (">= 0" if zero else "> 0") + ("" if most is None else f" and at most {most:g}")
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: {name} must be a number of seconds {bounds}, not {value!r}"
        )
    return float(value)


def check_channel_prefix(value: object) -> str:
    """The prefix of the Redis channels: a non-empty string."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(
            f"QL3_INVALID_ARGUMENT: channel_prefix must be a non-empty string, not {value!r}"
        )
    return value


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
        if not check_key_part("a project id of projects", project):
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


#: The longest duration a command line or setting may give (``--older-than``, retention).
MAX_DURATION = timedelta(days=36500)
# Six digits at most: 999999 weeks still fits a timedelta (more would raise OverflowError);
# MAX_DURATION bounds the rest.
_DURATION = re.compile(r"([0-9]{1,6})([smhdw])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


#: The most rows one ``prune_outbox`` call removes (the SQL function's bound, D55).
PRUNE_MAX_BATCH = 100_000


def check_prune(delivered_before: object, batch: object) -> tuple[timedelta, int]:
    """``prune_outbox``'s arguments, as both stores take them: a non-negative timedelta
    (PostgreSQL's interval; one reaching before any representable instant removes nothing)
    and a batch of 1..``PRUNE_MAX_BATCH`` rows."""
    if not isinstance(delivered_before, timedelta) or delivered_before < timedelta(0):
        raise InvalidArgument(
            "QL3_INVALID_ARGUMENT: delivered_before must be a non-negative interval"
        )
    return delivered_before, check_count("batch", batch, 1, PRUNE_MAX_BATCH)


def parse_duration(text: str) -> timedelta:
    """``30s``, ``10m``, ``2h``, ``7d``, ``1w`` as a timedelta, at most ``MAX_DURATION``.
    Anything else raises ``Misconfigured`` (a setting the CLI refuses with exit 2);
    ``duration_type`` is the same for argparse."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise Misconfigured(
            f"QL3_INVALID_ARGUMENT: {text!r} is not a duration such as 30s, 10m, 2h, 7d or 1w"
        )
    duration = timedelta(**{_UNITS[match[2]]: int(match[1])})
    if duration > MAX_DURATION:
        raise Misconfigured(f"QL3_INVALID_ARGUMENT: {text!r} is more than {MAX_DURATION.days}d")
    return duration


def duration_type(text: str) -> timedelta:
    """``parse_duration`` as an argparse type: anything else is a usage error (exit 2)."""
    try:
        return parse_duration(text)
    except Misconfigured as exc:
        raise argparse.ArgumentTypeError(
            exc.message.removeprefix("QL3_INVALID_ARGUMENT: ")
        ) from None
