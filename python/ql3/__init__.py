"""ql3: durable contract revisions and durable model invocations on PostgreSQL."""

from __future__ import annotations

from ql3.errors import Ql3Error
from ql3.store import PgStore

__all__ = ["PgStore", "Ql3Error"]
