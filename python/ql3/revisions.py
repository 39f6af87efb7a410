"""What a worker revision cache hands out, shared by ``ql3.cache.RevisionCache``
(PostgreSQL and Redis) and ``ql3.edge.EdgeRevisionCache`` (SQLite): ``ql3.cache``
re-exports both names. Nothing here imports a database driver or Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ql3 import errors


class BodyHashMismatch(errors.Conflict):
    """A loaded body does not hash to its stored body_hash: the revision is refused."""


@dataclass(frozen=True, kw_only=True)
class EffectiveRevision:
    """The revision a worker acts under. ``body`` is shared: do not mutate it."""

    project_id: str
    contract_family: str
    contract_id: str
    revision_id: str
    revision_no: int
    body: dict[str, Any]
    body_hash: str
    pointer_version: int
    cached_at: datetime
    verified_at: datetime


__all__ = ["BodyHashMismatch", "EffectiveRevision"]
