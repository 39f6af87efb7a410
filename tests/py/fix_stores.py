"""The ``store`` fixture: one test body, run against every store implementation.

Each parameter yields a fresh, fully migrated store (AI on). PgStore connects as the
superuser here because one test drives both runtime work (admission) and operator work
(resolution); the role split is proven by the privilege tests, not here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ql3.store import PgStore

STORE_KINDS = ["pg"]


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh store of each kind in STORE_KINDS."""
    kind = request.param
    if kind == "pg":
        dsn: str = request.getfixturevalue("db_dsn")
        with PgStore(dsn) as s:
            yield s
        return
    raise AssertionError(f"unknown store kind {kind}")
