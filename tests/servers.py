"""Throwaway servers for tests: ``python tests/servers.py -- CMD`` (see ql3.devservers)."""

from __future__ import annotations

import sys

from ql3.devservers import (
    PostgresServer,
    RedisServer,
    create_database,
    free_port,
    main,
    start_postgres,
    start_redis,
    test_servers,
)

__all__ = [
    "PostgresServer",
    "RedisServer",
    "create_database",
    "free_port",
    "main",
    "start_postgres",
    "start_redis",
    "test_servers",
]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
