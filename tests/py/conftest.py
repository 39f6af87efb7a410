from __future__ import annotations

import pytest

from fix_logging import root_logging
from fix_pgbouncer import FAILED_STATES
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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The state of each PgBouncer after a test that failed through it, at the end of the
    output (the part CI always shows)."""
    if FAILED_STATES:
        terminalreporter.section("pgbouncer after a failed test")
        for state in FAILED_STATES:
            terminalreporter.write_line(state)
