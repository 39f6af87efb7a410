from __future__ import annotations

from fix_logging import root_logging
from fix_servers import base_dsn, db_dsn, fresh_db, migrated_template, postgresql_server, redis_url
from fix_stores import store

__all__ = [
    "base_dsn",
    "db_dsn",
    "fresh_db",
    "migrated_template",
    "postgresql_server",
    "redis_url",
    "root_logging",
    "store",
]
