"""The ``root_logging`` fixture: the root logger as it was before the test.

``ql3 relay`` and ``ql3 recover --loop`` configure the root logger when their CLI runs
in-process; a test that runs them restores it, so later tests log as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
