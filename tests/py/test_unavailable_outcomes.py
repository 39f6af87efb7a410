"""``QL3_UNAVAILABLE`` says whether the call took effect (D49): ``NotSent`` (nothing reached
PostgreSQL), ``OutcomeUnknown`` (sent, no answer: it may have committed) and plain
``Unavailable`` (PostgreSQL refused it and rolled it back), against real PostgreSQL and a
TCP proxy that can lose a COMMIT's answer or swallow a connection.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from fix_provider import provider  # noqa: F401  (a fixture of the world fixture)
from fix_tcp_proxy import PgProxy, pg_proxy  # noqa: F401  (pg_proxy is a fixture)
from ql3 import errors, pooler
from ql3.cache import RevisionCache
from ql3.db import Timeouts, translate
from ql3.gateway import ModelAuditUnavailable
from ql3.store import PgStore
from ql3.store_async import AsyncPgStore
from test_gateway import (  # noqa: F401  (world is a fixture)
    World,
    close_store,
    harness,
    make_store,
    run,
    world,
)

KEY = ("proj", "policy_routing", "routing")


def closed_port_dsn(dsn: str) -> str:
    """``dsn`` rerouted to a local port nobody listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return psycopg.conninfo.make_conninfo(dsn, host="127.0.0.1", port=str(port))


def test_the_three_unavailable_outcomes_share_one_code() -> None:
    for cls, outcome in (
        (errors.NotSent, "not_sent"),
        (errors.OutcomeUnknown, "unknown"),
        (errors.Unavailable, "rolled_back"),
    ):
        error = cls("QL3_UNAVAILABLE: x")
        assert isinstance(error, errors.Unavailable)
        assert (error.code, error.outcome) == ("QL3_UNAVAILABLE", outcome)


def test_a_pool_that_cannot_connect_has_sent_nothing(db_dsn: str) -> None:
    with (
        PgStore(closed_port_dsn(db_dsn), timeouts=Timeouts(connect_s=1)) as store,
        pytest.raises(errors.NotSent) as caught,
    ):
        store.active_revision(*KEY)
    assert caught.value.outcome == "not_sent"


def test_a_connection_that_cannot_be_opened_has_sent_nothing(db_dsn: str) -> None:
    with pytest.raises(errors.NotSent, match="nothing was sent"):
        PgStore.checked(closed_port_dsn(db_dsn), timeouts=Timeouts(connect_s=1))


def refused_elsewhere(dsn: str) -> None:
    """A connection refused in this process, to a server no pool below uses."""
    with pytest.raises(errors.NotSent, match="refused"):
        PgStore.checked(closed_port_dsn(dsn), timeouts=Timeouts(connect_s=1))


def assert_says_the_pool_is_full(message: str) -> None:
    """The timeout of a pool of one connection, held, with no failure of its own."""
    assert "1 of at most 1 connections, 0 idle" in message, message
    assert "no connection attempt failed in the last minute" in message, message
    assert "refused" not in message, message


def test_a_full_pool_says_so_and_not_another_servers_refusal(db_dsn: str) -> None:
    """Every connection of the pool is in use: its timeout says so, and does not borrow
    the reason of a connection refused elsewhere in the process (a misleading 'refused'
    for a pool that only had to wait)."""
    refused_elsewhere(db_dsn)
    with (
        PgStore(db_dsn, timeouts=Timeouts(connect_s=1), max_connections=1) as store,
        store.connection(),  # its only connection, held
        pytest.raises(errors.NotSent) as caught,
    ):
        store._rows("SELECT 1")
    assert_says_the_pool_is_full(str(caught.value))


def test_a_full_asyncio_pool_says_so_too(db_dsn: str) -> None:
    refused_elsewhere(db_dsn)

    async def timed_out() -> str:
        store = AsyncPgStore(db_dsn, timeouts=Timeouts(connect_s=1), max_connections=1)
        async with store, store.pool.connection():  # its only connection, held
            with pytest.raises(errors.NotSent) as caught:
                await store._value("SELECT 1", ())
        return str(caught.value)

    assert_says_the_pool_is_full(asyncio.run(asyncio.wait_for(timed_out(), 30.0)))


@pytest.mark.parametrize("conninfo", ["text", "callable"])
def test_a_pool_of_your_own_is_not_said_to_have_had_no_failure(db_dsn: str, conninfo: str) -> None:
    """ql3 follows the connection attempts of its own connection classes only: a pool the
    caller made (psycopg's class, or a conninfo callable) times out without the claim
    that no attempt failed, which ql3 could not know."""
    refused_elsewhere(db_dsn)
    info: Any = db_dsn if conninfo == "text" else (lambda: db_dsn)
    with (
        ConnectionPool(
            info, min_size=1, max_size=1, timeout=1, kwargs={"autocommit": True}, name="own"
        ) as pool,
        PgStore(pool) as store,
        store.connection(),
        pytest.raises(errors.NotSent) as caught,
    ):
        store._rows("SELECT 1")
    message = str(caught.value)
    assert "pool own: 1 of at most 1 connections, 0 idle" in message, message
    assert "does not follow this pool's connection attempts" in message, message
    assert "no connection attempt failed" not in message, message


def test_the_revision_caches_pool_names_its_own_failed_attempt(db_dsn: str) -> None:
    """The cache's own pool opens ql3's connections, so its timeout says why they failed."""

    async def message() -> str:
        cache = RevisionCache(closed_port_dsn(db_dsn), "redis://127.0.0.1:1", db_timeout=1)
        await cache._pool.open()
        try:
            with pytest.raises(errors.Unavailable) as caught:
                await cache._fetch("SELECT 1 AS one", ())
        finally:
            await cache._pool.close()
        return str(caught.value)

    text = asyncio.run(asyncio.wait_for(message(), 30.0))
    assert "pool " in text and "the last connection attempt failed:" in text, text
    assert "refused" in text, text


def test_a_connection_opened_ends_its_conninfos_last_failure(db_dsn: str) -> None:
    """'The last connection attempt failed' stays true: an attempt that works clears it."""
    pooler._record_failure(db_dsn, RuntimeError("refused, once"))
    assert pooler.recent_connect_failure(db_dsn, 60.0) == "refused, once"
    pooler.Connection.connect(db_dsn).close()
    assert pooler.recent_connect_failure(db_dsn, 60.0) is None


def test_only_the_newest_conninfos_failures_are_kept() -> None:
    """A process that meets ever new conninfos keeps a bounded record of their failures."""
    conninfos = [f"host=192.0.2.1 port={5000 + i}" for i in range(pooler._FAILURES_KEPT + 1)]
    for conninfo in conninfos:
        pooler._record_failure(conninfo, RuntimeError(conninfo))
    assert pooler.recent_connect_failure(conninfos[0], 60.0) is None  # the oldest, dropped
    assert pooler.recent_connect_failure(conninfos[1], 60.0) == conninfos[1]
    assert pooler.recent_connect_failure(conninfos[-1], 60.0) == conninfos[-1]


def test_a_call_given_up_unanswered_has_an_unknown_outcome(
    db_dsn: str,
    pg_proxy: PgProxy,  # noqa: F811
) -> None:
    with PgStore(pg_proxy.dsn(db_dsn), timeouts=Timeouts(call_s=0.5)) as store:
        assert store.active_revision(*KEY) is None
        pg_proxy.freeze()
        with pytest.raises(errors.OutcomeUnknown, match="outcome is unknown"):
            store.active_revision(*KEY)


def test_a_lost_commit_answer_of_an_activation_has_an_unknown_outcome_and_committed(
    db_dsn: str,
    pg_proxy: PgProxy,  # noqa: F811
) -> None:
    with PgStore(pg_proxy.dsn(db_dsn)) as store:
        revision = store.put_revision(*KEY, {"v": 1}, "test")
        pg_proxy.arm_commit_loss()  # the pipeline's COMMIT: BEGIN, the call, COMMIT, wake
        with pytest.raises(errors.OutcomeUnknown, match="COMMIT were sent"):
            store.activate_revision(*KEY, revision["revision_id"], "test")
        assert pg_proxy.commit_lost.is_set()
    with PgStore(db_dsn) as direct:
        active = direct.active_revision(*KEY)
    assert active is not None and active["revision_id"] == revision["revision_id"]


def test_a_call_the_server_refused_was_rolled_back(db_dsn: str) -> None:
    with (
        PgStore(db_dsn, timeouts=Timeouts(statement_ms=100)) as store,
        pytest.raises(errors.Unavailable) as caught,
    ):
        store._value("SELECT pg_sleep(2)")
    assert type(caught.value) is errors.Unavailable
    assert caught.value.outcome == "rolled_back" and "57014" in str(caught.value)


def test_an_admission_never_sent_calls_no_provider(world: World) -> None:  # noqa: F811
    call = world.call()
    failure: list[ModelAuditUnavailable] = []

    async def scenario() -> None:
        store = make_store(world, closed_port_dsn(world.runtime_dsn), Timeouts(connect_s=1))
        try:
            async with harness(world, store=store) as h:
                with pytest.raises(ModelAuditUnavailable) as caught:
                    await h.gateway.invoke(call)
                failure.append(caught.value)
        finally:
            await close_store(store)

    run(scenario())
    [error] = failure
    assert (error.phase, error.cause_code, error.cause_outcome) == (
        "admission",
        "QL3_UNAVAILABLE",
        "not_sent",
    )
    assert world.provider.calls == 0
    assert world.ops.admit_invocation(error.command)["status"] == "created"  # never written


def test_an_admission_lost_on_the_way_is_replayed_and_the_call_goes_on(
    world: World,  # noqa: F811
    pg_proxy: PgProxy,  # noqa: F811
) -> None:
    """The admission's connection is swallowed before PostgreSQL sees it: its outcome is
    unknown, the gateway replays it on a new connection, which answers ``created``."""
    call = world.call()
    results: list[Any] = []

    async def scenario() -> None:
        store = make_store(world, pg_proxy.dsn(world.runtime_dsn), Timeouts(call_s=1.0))
        try:
            async with harness(world, store=store) as h:
                pg_proxy.freeze()  # the pool's idle connection: the admission goes nowhere
                results.append(await h.gateway.invoke(call))
        finally:
            await close_store(store)

    run(scenario())
    assert len(results) == 1 and world.provider.calls == 1
    world.assert_settled(call.invocation_id, "succeeded", "ok")


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ("08006", errors.OutcomeUnknown),
        ("57P01", errors.OutcomeUnknown),
        ("40003", errors.OutcomeUnknown),
        ("57014", errors.Unavailable),
        ("55P03", errors.Unavailable),
        ("40001", errors.Unavailable),
        ("25006", errors.Unavailable),
    ],
)
def test_a_transient_sqlstate_says_whether_the_call_may_have_committed(
    db_dsn: str, state: str, expected: type[errors.Unavailable]
) -> None:
    with (
        psycopg.connect(db_dsn, autocommit=True) as conn,
        pytest.raises(psycopg.Error) as caught,
    ):
        conn.execute(f"DO $$BEGIN RAISE EXCEPTION USING ERRCODE = '{state}'; END$$")
    error = translate(caught.value)
    assert type(error) is expected and error.code == "QL3_UNAVAILABLE"
    assert state in str(error)
