"""ql3: durable contract revisions and durable model invocations on PostgreSQL.

``PgStore`` is imported on first use (``from ql3 import PgStore``), not with the package:
``pip install ql3`` without extras serves the SQLite edge shim (``ql3.edge``), which must
not need, or load, the PostgreSQL driver (``pip install 'ql3[postgres]'`` brings it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ql3.errors import Ql3Error

if TYPE_CHECKING:
    from ql3.store import PgStore

# A library leaves logging to the application: without this, an application that has not
# configured logging gets Python's last-resort handler, which prints ql3's warnings to
# stderr without their structured fields (``record.ql3``).
logging.getLogger("ql3").addHandler(logging.NullHandler())

# The modules the server side needs that the bare package does not install.
_SERVER_DRIVERS = frozenset({"psycopg", "psycopg_pool"})


def __getattr__(name: str) -> Any:
    if name == "PgStore":
        try:
            from ql3.store import PgStore
        except ModuleNotFoundError as exc:
            if exc.name not in _SERVER_DRIVERS:
                raise
            raise ImportError(
                f"ql3.PgStore needs {exc.name}, which this install lacks: "
                "pip install 'ql3[postgres]' (or 'ql3[all]')",
                name=exc.name,
            ) from exc
        globals()["PgStore"] = PgStore
        return PgStore
    raise AttributeError(f"module 'ql3' has no attribute {name!r}")


__all__ = ["PgStore", "Ql3Error"]
