"""ql3: durable contract revisions and durable model invocations on PostgreSQL."""

from __future__ import annotations

import logging

from ql3.errors import Ql3Error
from ql3.store import PgStore

# A library leaves logging to the application: without this, an application that has not
# configured logging gets Python's last-resort handler, which prints ql3's warnings to
# stderr without their structured fields (``record.ql3``).
logging.getLogger("ql3").addHandler(logging.NullHandler())

__all__ = ["PgStore", "Ql3Error"]
