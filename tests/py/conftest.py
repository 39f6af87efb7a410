from __future__ import annotations

from fix_servers import base_dsn, db_dsn, fresh_db, migrated_template, redis_url, test_servers

__all__ = ["base_dsn", "db_dsn", "fresh_db", "migrated_template", "redis_url", "test_servers"]
