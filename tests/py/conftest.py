from __future__ import annotations

import pytest

from fix_logging import root_logging
from fix_redis_topologies import redis_cluster, redis_sentinel
from fix_servers import base_dsn, db_dsn, fresh_db, migrated_template, postgresql_server, redis_url
from fix_stores import every_store, store

__all__ = [
    "base_dsn",
    "db_dsn",
    "every_store",
    "fresh_db",
    "migrated_template",
    "postgresql_server",
    "redis_cluster",
    "redis_sentinel",
    "redis_url",
    "root_logging",
    "store",
]


def pytest_configure(config: pytest.Config) -> None:
    """Markers beyond pyproject's list: ``ha`` selects the failover tests (make test-ha)."""
    config.addinivalue_line("markers", "ha: failover with a primary and a streaming replica")
