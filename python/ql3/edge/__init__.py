"""``ql3.edge``: the SQLite edge shim (SPEC section 10).

``EdgeStore(path, journal_mode="wal", ai=True)`` offers the store interface of
``ql3.PgStore`` on one SQLite file: the same procedures as Python transactions, the same
records, digests, identities, errors and state machine. ``EdgeRelay`` delivers its outbox
to in-process subscribers (and to Redis when ``QL3_REDIS_URL`` is set), and
``EdgeRevisionCache`` is a worker revision cache those deliveries invalidate.
"""

from __future__ import annotations

from ql3.edge.cache import EdgeRevisionCache
from ql3.edge.relay import EdgeRelay
from ql3.edge.schema import EdgeReadyReport
from ql3.edge.store import EdgeStore

__all__ = ["EdgeReadyReport", "EdgeRelay", "EdgeRevisionCache", "EdgeStore"]
