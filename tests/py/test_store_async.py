"""AsyncPgStore: the same SQL function calls as PgStore, on psycopg's asyncio pool (D24).
(Every gateway test also runs over it: tests/py/test_gateway.py.)"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from ql3 import errors
from ql3.db import Timeouts
from ql3.devservers import free_port
from ql3.invocations import admission_command, completion_command, resolution_command
from ql3.store_async import AsyncPgStore


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 30.0))


async def admitted_step(store: AsyncPgStore, deadline_in: float = 60.0) -> dict[str, Any]:
    run_id = await store.create_run("acme", "trace-async")
    step_run_id = await store.add_step_run(run_id, "model")
    command = admission_command(
        invocation_id=f"inv-{uuid.uuid4().hex}",
        request_id="req-1",
        project_id="acme",
        run_id=run_id,
        step_run_id=step_run_id,
        trace_id="trace-async",
        expected_step_run_version=1,
        provider="ollama",
        model="llama3.1:8b",
        policy=None,
        request_digest=hashlib.sha256(b"hello").hexdigest(),
        input_bytes=5,
        deadline_at=datetime.now(UTC) + timedelta(seconds=deadline_in),
    )
    admitted = await store.admit_invocation(command)
    assert admitted["status"] == "created"
    assert await store.admit_invocation(command) == {**admitted, "status": "existing"}
    return admitted


def test_a_lost_call_is_resolved_for_retry_through_the_async_store(db_dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncPgStore(db_dsn) as store:
            admitted = await admitted_step(store)
            start = admitted["start"]
            completed = await store.complete_invocation(
                completion_command(
                    invocation_id=start["invocation_id"],
                    start_digest=admitted["start_digest"],
                    outcome="lost",
                )
            )
            assert completed["completion"]["outcome"] == "lost"
            resolved = await store.resolve_invocation(
                resolution_command(
                    invocation_id=start["invocation_id"],
                    completion_digest=completed["completion_digest"],
                    decision="retry",
                    user_id="alice",
                    expected_step_run_version=3,
                )
            )
            assert (resolved["status"], resolved["resolution"]["decision"]) == ("created", "retry")

    run(scenario())


def test_recover_expired_settles_a_start_past_its_deadline(db_dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncPgStore(db_dsn) as store:
            admitted = await admitted_step(store, deadline_in=0.3)
            await asyncio.sleep(0.5)
            recovered = await store.recover_expired(10, 0.0)
            assert [r["invocation_id"] for r in recovered["recovered"]] == [
                admitted["start"]["invocation_id"]
            ]
            assert (await store.recover_expired(10, 0.0))["count"] == 0

    run(scenario())


def test_errors_are_ql3_errors(db_dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncPgStore(db_dsn) as store:
            unknown = completion_command(
                invocation_id="inv-nobody", start_digest="0" * 64, outcome="lost"
            )
            with pytest.raises(errors.NotFound):
                await store.complete_invocation(unknown)
            with pytest.raises(errors.InvalidArgument):
                await store.admit_invocation({"schema": "nonsense"})

    run(scenario())


def test_an_unreachable_database_is_unavailable_within_the_connect_timeout(db_dsn: str) -> None:
    params = conninfo_to_dict(db_dsn)
    params.update(host="127.0.0.1", port=str(free_port()))
    nowhere = make_conninfo(**params)  # type: ignore[arg-type]

    async def scenario() -> None:
        async with AsyncPgStore(nowhere, timeouts=Timeouts(connect_s=1)) as store:
            with pytest.raises(errors.Unavailable):
                await store.create_run("acme", "trace-x")

    run(scenario())


def test_own_pool_is_autocommit_with_the_timeouts_and_a_pool_passed_in_stays_open(
    db_dsn: str,
) -> None:
    async def scenario() -> None:
        async with AsyncPgStore(db_dsn, timeouts=Timeouts(statement_ms=2345)) as store:
            await store.create_run("acme", "trace-y")  # opened on first use as well
            async with store.pool.connection() as conn:
                assert conn.autocommit
                cur = await conn.execute("SHOW statement_timeout")
                assert await cur.fetchone() == ("2345ms",)
                cur = await conn.execute("SHOW ql3.outbox_notify")
                assert await cur.fetchone() == ("deferred",)
        assert store.pool.closed
        async with AsyncConnectionPool(db_dsn, min_size=1, open=False) as pool:
            async with AsyncPgStore(pool) as theirs:
                assert await theirs.create_run("acme", "trace-z")
            assert not pool.closed

    run(scenario())
