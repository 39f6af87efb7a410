"""Many clients racing to admit the same ready step admit it exactly once (SPEC section 4).

Each client is its own PgStore with its own connection; a barrier releases them together,
so the admissions meet at the step's row lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from fix_invocations import admission, model_step
from fix_servers import role_dsn
from ql3 import errors
from ql3.canonical import JSON
from ql3.store import PgStore

CLIENTS = 16
ROUNDS = 3


@pytest.fixture
def clients(db_dsn: str) -> Iterator[list[PgStore]]:
    """CLIENTS runtime stores, each with one connection of its own, already connected."""
    stores = [PgStore(role_dsn(db_dsn, "runtime"), max_connections=1) for _ in range(CLIENTS)]
    try:
        for s in stores:
            s.pool.wait(timeout=10)
        yield stores
    finally:
        for s in stores:
            s.close()


def race(clients: list[PgStore], commands: list[dict[str, JSON]]) -> list[str]:
    """Every client admits its command at the same moment: each one's status or error code."""
    barrier = threading.Barrier(len(clients))

    def admit(client: PgStore, command: dict[str, JSON]) -> str:
        barrier.wait(timeout=10)
        try:
            return str(client.admit_invocation(command)["status"])
        except errors.Ql3Error as exc:
            return exc.code

    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        return list(pool.map(admit, clients, commands))


def run_rounds(
    clients: list[PgStore], commands_for: Callable[[str, str], list[dict[str, JSON]]]
) -> list[tuple[Counter[str], Any]]:
    outcomes = []
    for _ in range(ROUNDS):
        run_id, step = model_step(clients[0])
        results = Counter(race(clients, commands_for(run_id, step)))
        outcomes.append((results, clients[0].step_run(step)))
    return outcomes


def test_racing_admissions_with_different_invocation_ids_admit_exactly_one(
    clients: list[PgStore],
) -> None:
    def commands(run_id: str, step: str) -> list[dict[str, JSON]]:
        return [admission(run_id, step) for _ in clients]

    for results, step in run_rounds(clients, commands):
        assert results == Counter({"created": 1, "QL3_CONFLICT": CLIENTS - 1})
        assert (step["status"], step["version"], step["attempt_count"]) == ("running", 2, 1)


def test_racing_replays_of_one_command_create_once_and_the_rest_are_existing(
    clients: list[PgStore],
) -> None:
    def commands(run_id: str, step: str) -> list[dict[str, JSON]]:
        return [admission(run_id, step)] * len(clients)

    for results, step in run_rounds(clients, commands):
        assert results == Counter({"created": 1, "existing": CLIENTS - 1})
        assert (step["status"], step["version"], step["attempt_count"]) == ("running", 2, 1)
