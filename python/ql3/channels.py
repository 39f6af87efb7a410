"""The Redis channels and the JSON message of an outbox event (SPEC section 7).

Shared by the PostgreSQL relay (``ql3.relay``, which re-exports every name), the worker
cache (``ql3.cache``) and the SQLite edge relay (``ql3.edge.relay``), so the two relays
publish the same bytes on the same channels. Nothing here imports Redis or PostgreSQL:
the edge shim uses it on an install without the ``redis`` or ``postgres`` extras.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

DEFAULT_CHANNEL_PREFIX: Final = "platform:contract:invalidate"
HEARTBEAT_NAME: Final = "__heartbeat__"


def project_channel(prefix: str, project_id: str) -> str:
    """The Redis channel that carries the events of one project."""
    return f"{prefix}:{project_id}"


def heartbeat_channel(prefix: str) -> str:
    """The Redis channel of relay heartbeats."""
    return f"{prefix}:{HEARTBEAT_NAME}"


def rfc3339(moment: datetime) -> str:
    """RFC 3339 UTC with exactly six fractional digits (SPEC section 2)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_message(row: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON document published for one outbox row.

    A row with a ``failover_epoch`` (the PostgreSQL relay's, D48) carries it last; the edge
    relay's rows have none.
    """
    old = row["old_revision_id"]
    message = {
        "seq": int(row["seq"]),
        "event_id": str(row["event_id"]),
        "event_type": row["event_type"],
        "project_id": row["project_id"],
        "contract_family": row["contract_family"],
        "contract_id": row["contract_id"],
        "old_revision_id": None if old is None else str(old),
        "new_revision_id": str(row["new_revision_id"]),
        "pointer_version": int(row["pointer_version"]),
        "created_at": rfc3339(row["created_at"]),
    }
    if "failover_epoch" in row:
        message["failover_epoch"] = str(row["failover_epoch"])
    return message


__all__ = [
    "DEFAULT_CHANNEL_PREFIX",
    "HEARTBEAT_NAME",
    "event_message",
    "heartbeat_channel",
    "project_channel",
    "rfc3339",
]
