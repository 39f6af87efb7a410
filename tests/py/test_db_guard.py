"""The store calls' guards (ql3.db_guard): no dead pooled connection is handed out, and no
call waits forever on a backend that has stopped answering. Both stores, real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from fix_invocations import PROJECT, TRACE, admission, model_step
from ql3 import errors
from ql3.cache import RevisionCache
from ql3.db import Timeouts
from ql3.db_guard import WATCHDOG, bounded, checked_out
from ql3.store import PgStore
from ql3.store_async import AsyncPgStore

POOL = 4


def backend_pids(dsn: str, application: str | None = None) -> set[int]:
    """The pids of the other client connections to the test database (of one
    application_name if given)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            " AND (%s::text IS NULL OR application_name = %s)",
            (application, application),
        ).fetchall()
    return {int(r[0]) for r in rows}


def terminate(dsn: str, pids: set[int]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    deadline = time.monotonic() + 10
    while backend_pids(dsn) & pids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not backend_pids(dsn) & pids


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The backend process frozen (SIGSTOP): it neither answers nor closes its socket."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def warm(store: PgStore) -> None:
    """Every connection of the pool open and idle."""
    with contextlib.ExitStack() as stack:
        for _ in range(POOL):
            stack.enter_context(store.pool.connection())


def test_connections_the_server_ended_while_idle_are_not_handed_out(db_dsn: str) -> None:
    with PgStore(db_dsn, max_connections=POOL) as store:
        store.pool.wait()
        warm(store)
        pids = backend_pids(db_dsn)
        assert len(pids) == POOL
        terminate(db_dsn, pids)  # as a restart or idle_session_timeout would
        for _ in range(POOL + 2):  # every call finds a live connection, none fails
            run_id, step_run_id = model_step(store)
            assert store.admit_invocation(admission(run_id, step_run_id))["status"] == "created"
        assert not backend_pids(db_dsn) & pids


def test_the_async_store_skips_connections_the_server_ended(db_dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncPgStore(db_dsn, max_connections=POOL) as store:
            await store.pool.wait()
            async with contextlib.AsyncExitStack() as stack:
                for _ in range(POOL):
                    await stack.enter_async_context(store.pool.connection())
            pids = await asyncio.to_thread(backend_pids, db_dsn)
            assert len(pids) == POOL
            await asyncio.to_thread(terminate, db_dsn, pids)
            for _ in range(POOL + 2):
                run_id = await store.create_run(PROJECT, TRACE)
                step_run_id = await store.add_step_run(run_id, "model")
                admitted = await store.admit_invocation(admission(run_id, step_run_id))
                assert admitted["status"] == "created"

    asyncio.run(asyncio.wait_for(scenario(), 60))


def only_backend(dsn: str, store: Any) -> int:
    pids = backend_pids(dsn)
    assert len(pids) == 1, pids
    return pids.pop()


def test_a_call_to_a_backend_that_stopped_answering_ends_unavailable(db_dsn: str) -> None:
    with PgStore(db_dsn, max_connections=1, timeouts=Timeouts(call_s=1.0)) as store:
        run_id, step_run_id = model_step(store)
        command = admission(run_id, step_run_id)
        pid = only_backend(db_dsn, store)
        with stopped(pid):
            started = time.monotonic()
            with pytest.raises(errors.Unavailable, match="outcome is unknown"):
                store.admit_invocation(command)
            waited = time.monotonic() - started
        assert 1.0 <= waited < 5.0
        # The cut connection was dropped and the next call runs on a new one. The call's
        # outcome was unknown indeed: once continued, the backend may still run what it had
        # received, so the durable recheck (a replay) answers either way, never an error.
        assert store.admit_invocation(command)["status"] in ("created", "existing")
        deadline = time.monotonic() + 10  # the continued backend finds its socket shut
        while pid in backend_pids(db_dsn) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid not in backend_pids(db_dsn)


def test_an_async_call_to_a_backend_that_stopped_answering_ends_unavailable(db_dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncPgStore(db_dsn, max_connections=1, timeouts=Timeouts(call_s=1.0)) as store:
            run_id = await store.create_run(PROJECT, TRACE)
            step_run_id = await store.add_step_run(run_id, "model")
            command = admission(run_id, step_run_id)
            pid = await asyncio.to_thread(only_backend, db_dsn, store)
            with stopped(pid):
                started = time.monotonic()
                with pytest.raises(errors.Unavailable, match="outcome is unknown"):
                    await store.admit_invocation(command)
                waited = time.monotonic() - started
            # psycopg's cancel request waits for the frozen backend a few seconds more
            assert 1.0 <= waited < 15.0
            assert (await store.admit_invocation(command))["status"] in ("created", "existing")

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_call_limit_follows_the_statement_timeout_unless_set() -> None:
    assert Timeouts().call_limit() == 10.0
    assert Timeouts(statement_ms=60_000).call_limit() == 65.0
    assert Timeouts(call_s=2.5).call_limit() == 2.5
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(errors.InvalidArgument, match="call_s"):
            Timeouts(call_s=bad)


def test_a_cache_read_from_a_backend_that_stopped_answering_ends_unavailable(
    db_dsn: str, redis_url: str
) -> None:
    with PgStore(db_dsn) as store:
        rev = store.put_revision("acme", "policy_routing", "guarded", {"v": 1}, "t")
        store.activate_revision("acme", "policy_routing", "guarded", rev["revision_id"], "t")

    async def scenario() -> None:
        cache = RevisionCache(db_dsn, redis_url, channel_prefix="guard", db_timeout=0.5)
        async with cache:
            first = await cache.get_effective("acme", "policy_routing", "guarded")
            assert first.revision_id == rev["revision_id"]
            pids = await asyncio.to_thread(backend_pids, db_dsn, "ql3-cache")
            assert pids
            with contextlib.ExitStack() as stack:
                for pid in pids:
                    stack.enter_context(stopped(pid))
                started = time.monotonic()
                with pytest.raises(errors.Unavailable, match="outcome is unknown"):
                    await cache.verify_all()
                waited = time.monotonic() - started
            assert 5.5 <= waited < 20.0  # db_timeout + 5 s, then psycopg's cancel wait
            again = await cache.get_effective("acme", "policy_routing", "guarded")
            assert again.revision_id == rev["revision_id"]

    asyncio.run(asyncio.wait_for(scenario(), 60))


SLOW_COMMIT_SQL = """
CREATE FUNCTION public.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(3);
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER runs_slow_commit AFTER INSERT ON ql3.runs
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.slow_commit();
"""


def test_the_commit_of_a_transactional_pool_is_inside_the_call_limit(db_dsn: str) -> None:
    """A pool passed in commits when the call returns: that COMMIT (here slowed by a
    deferred trigger, as a synchronous standby would) is bounded like the statement."""
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(SLOW_COMMIT_SQL)
    limit = Timeouts(call_s=1.0)
    with ConnectionPool(db_dsn, min_size=1, max_size=1, open=True) as pool:
        store = PgStore(pool, timeouts=limit)
        started = time.monotonic()
        with pytest.raises(errors.Unavailable, match="outcome is unknown"):
            store.create_run(PROJECT, TRACE)
        assert time.monotonic() - started < 2.5

    async def scenario() -> None:
        async with AsyncConnectionPool(db_dsn, min_size=1, max_size=1, open=False) as apool:
            store = AsyncPgStore(apool, timeouts=limit)
            started = time.monotonic()
            with pytest.raises(errors.Unavailable, match="outcome is unknown"):
                await store.create_run(PROJECT, TRACE)
            assert time.monotonic() - started < 2.5 + 5  # psycopg's cancel wait

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_failure_after_the_connection_was_cut_is_overdue_and_drops_it(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        with pytest.raises(errors.Unavailable, match="outcome is unknown"):  # noqa: SIM117
            with bounded(conn, 0.05):
                time.sleep(0.6)  # the watchdog cuts meanwhile
                raise ValueError("something after the cut")
        assert conn.closed


def test_a_forked_child_gets_a_watchdog_of_its_own() -> None:
    WATCHDOG.disarm(WATCHDOG.arm(object(), 60))  # type: ignore[arg-type]  # the parent's runs
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once
        fresh = WATCHDOG._thread is None and not WATCHDOG._armed
        WATCHDOG.disarm(WATCHDOG.arm(object(), 60))  # type: ignore[arg-type]
        started = WATCHDOG._thread is not None and WATCHDOG._thread.is_alive()
        os.write(write, b"ok" if fresh and started else b"no")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 2)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"ok"


def test_a_pool_that_only_hands_out_closed_connections_is_unavailable(db_dsn: str) -> None:
    closed = psycopg.connect(db_dsn)
    closed.close()
    offered: list[int] = []

    @contextlib.contextmanager
    def only_closed() -> Iterator[psycopg.Connection[Any]]:
        offered.append(1)
        yield closed

    with (
        pytest.raises(errors.Unavailable, match="every pooled connection was closed"),
        checked_out(only_closed),
    ):
        raise AssertionError("a closed connection was handed out")
    assert len(offered) > 1  # each one discarded, the next one tried
