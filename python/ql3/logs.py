"""What the daemons (relay, recovery) share: JSON-line logs and capped, jittered backoff."""

from __future__ import annotations

import logging
import random
import sys
from datetime import UTC, datetime
from typing import Any

from ql3 import errors
from ql3.safe_text import json_text, redact


def backoff_delay(failures: int, *, initial: float, cap: float) -> float:
    """Capped exponential backoff with jitter: ~initial * 2^(failures-1), at most cap."""
    base: float = min(cap, initial * (2 ** max(0, min(failures - 1, 30))))
    return float(base * random.uniform(0.5, 1.0))


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, then the record's ``ql3`` fields.

    Every text in it has its connection passwords redacted (an error may quote a DSN or a
    Redis URL) and the line has no raw control character (a field may hold a project_id
    with ESC in it): ``ql3.safe_text``."""

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.fromtimestamp(record.created, UTC)
        doc: dict[str, Any] = {
            "ts": moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        fields = getattr(record, "ql3", None)
        if isinstance(fields, dict):
            doc.update(fields)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json_text(redacted(doc))


def redacted(value: Any) -> Any:
    """A log field with the passwords in its texts redacted; what JSON cannot hold as it is
    becomes its text first, redacted too."""
    if isinstance(value, dict):
        return {str(key): redacted(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(item) for item in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    return redact(str(value))


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def configure_logging(level: str = "info") -> None:
    """Send every log record of ``level`` or above to stderr as a JSON line; another level
    name is InvalidArgument (and changes nothing)."""
    name = level.strip().lower()
    if name not in LOG_LEVELS:
        raise errors.Misconfigured(
            f"QL3_INVALID_ARGUMENT: log level {level!r} is not one of {', '.join(LOG_LEVELS)}"
        )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(name.upper())


def describe_error(exc: BaseException) -> str:
    """``Type: first line of the message`` (or just the type), for logs and last_error
    (served by /healthz), with any connection password in it redacted."""
    message = redact(str(exc)).strip()
    text = message.splitlines()[0] if message else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
