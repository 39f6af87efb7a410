"""ql3 behind Debian's PgBouncer in transaction pooling mode (issue 21, D54).

Every component connects through the pooler as its least-privilege login: the stores,
the revision cache, the gateway, the recovery loop, the relay's work connections and
``ql3 migrate``. The pooler's server pool is smaller than the client count, so clients
share server connections; psycopg's automatic prepared statements would then run one
client's statement under another's name, and startup options would be lost. The tests
require zero errors, the safety settings in force on every transaction, and no row the
clients did not ask for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from fix_invocations import admission, completion
from fix_pgbouncer import Through, bouncers, pgbouncers  # noqa: F401  (fixtures)
from fix_provider import MODEL, provider  # noqa: F401  (provider is a fixture)
from fix_servers import role_dsn
from fix_tcp_proxy import proxy_for
from ql3 import errors, pooler
from ql3.cache import RevisionCache
from ql3.db import Timeouts
from ql3.gateway import ModelCall, ModelGateway, deadline_in
from ql3.invocations import Outcome
from ql3.migrate import migrate
from ql3.providers import (
    TOPOLOGY_CONTRACT,
    TOPOLOGY_FAMILY,
    TOPOLOGY_PROJECT,
    OpenAICompatibleProvider,
    topology_body,
)
from ql3.recovery import RecoveryConfig, RecoveryLoop
from ql3.relay import Relay, RelayConfig
from ql3.store import PgStore
from ql3.store_async import AsyncPgStore
from ql3.stub_provider import StubProvider

PROJECT = "pooled"
POLICY = "pooled-policy"
READ_CONTRACT = "pooled-read"  # activated again and again while the cache reads it
THREADS = 8
ROUNDS = 12
MESSAGES = [{"role": "user", "content": "hello through the pooler"}]
CONFIGS = ("default", "ignore_options")


@pytest.fixture(params=CONFIGS)
def through(request: pytest.FixtureRequest, pgbouncers: dict[str, Through]) -> Through:  # noqa: F811
    return pgbouncers[str(request.param)]


def query(dsn: str, sql: str, *params: Any) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return list(conn.cursor(row_factory=dict_row).execute(sql, params).fetchall())


def test_ql3_connections_prepare_nothing_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pooler.PREPARED_STATEMENTS_VAR, raising=False)
    assert pooler.prepare_threshold() is None
    assert pooler.prepare_threshold({pooler.PREPARED_STATEMENTS_VAR: "on"}) == 5
    with pytest.raises(errors.Misconfigured, match="QL3_PREPARED_STATEMENTS"):
        pooler.prepare_threshold({pooler.PREPARED_STATEMENTS_VAR: "sometimes"})


def test_options_become_one_set_config_statement_per_transaction() -> None:
    sql = pooler.local_settings_sql(
        r"-c statement_timeout=5000 --lock_timeout=2s -csearch_path=a\ b "
        f"-c ql3.outbox_notify=deferred {pooler.MARKER_OPTION}"
    )
    assert sql == (
        "SELECT set_config('statement_timeout', '5000', true), "
        "set_config('lock_timeout', '2s', true), set_config('search_path', 'a b', true), "
        "set_config('ql3.outbox_notify', 'deferred', true)"
    )
    with pytest.raises(errors.Misconfigured, match="cannot be set per transaction"):
        pooler.local_settings_sql("-v1")


def test_a_direct_connection_keeps_its_startup_options(db_dsn: str) -> None:
    with PgStore(db_dsn) as store, store.connection() as conn:
        assert pooler.local_settings(conn) is None


def test_safety_settings_hold_on_every_pooled_transaction(db_dsn: str, through: Through) -> None:
    """The startup options are refused or dropped by the pooler; the statement and lock
    timeouts and the deferred NOTIFY are in force all the same."""
    dsn = through(role_dsn(db_dsn, "runtime"))
    with PgStore(dsn, timeouts=Timeouts(statement_ms=300, lock_ms=250)) as store:
        with store.connection() as conn:
            assert pooler.local_settings(conn) is not None
        settings = store._row(
            "SELECT current_setting('statement_timeout') AS st, "
            "current_setting('lock_timeout') AS lt, "
            "current_setting('ql3.outbox_notify', true) AS notify"
        )
        assert settings == {"st": "300ms", "lt": "250ms", "notify": "deferred"}
        started = time.monotonic()
        with pytest.raises(errors.Unavailable, match="57014"):
            store._rows("SELECT pg_sleep(5)")
        assert time.monotonic() - started < 3.0


def lent_servers(through: Through, db_dsn: str) -> list[dict[str, Any]]:
    """PgBouncer's pools of the test database whose server connections are lent to a
    client (SHOW POOLS; the admin console speaks the simple protocol only)."""
    database = str(conninfo_to_dict(db_dsn)["dbname"])
    admin = through(make_conninfo(db_dsn, dbname="pgbouncer", user="postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        cur = psycopg.ClientCursor(conn, row_factory=dict_row)
        pools = cur.execute("SHOW POOLS").fetchall()
    return [p for p in pools if p["database"] == database and p["sv_active"]]


def test_an_idle_client_keeps_no_server_connection(
    world: str, through: Through, caplog: pytest.LogCaptureFixture
) -> None:
    """What a client sends after the end of its transaction may reach PgBouncer after the
    server's answer (here a proxy holds it back 50 ms): ql3's calls must send nothing
    there, or PgBouncer lends the idle client a server connection until its next
    transaction, and a few idle clients hold the whole server pool (D64: psycopg's
    pipelines end in a Flush after the Sync)."""
    runtime, operator = role_dsn(world, "runtime"), role_dsn(world, "operator")
    proxy = proxy_for(through(runtime))
    proxy.hold_after_sync(0.05)
    caplog.set_level(logging.WARNING, logger="ql3.store")

    async def async_side_then_look(run_id: str) -> list[dict[str, Any]]:
        async with AsyncPgStore(proxy.dsn(through(runtime)), max_connections=1) as store:
            step = await store.add_step_run(run_id, "model")
            admitted = await store.admit_invocation(
                admission(run_id, step, project=PROJECT, trace="idle-client")
            )
            await store.complete_invocation(completion(admitted, Outcome.SUCCEEDED))
            await asyncio.sleep(0.3)  # whatever was held back has arrived
            return lent_servers(through, world)  # every store still open, and idle

    try:
        with (
            PgStore(proxy.dsn(through(runtime)), max_connections=1) as store,
            PgStore(proxy.dsn(through(operator)), max_connections=1) as ops,
        ):
            run_id = store.create_run(PROJECT, "idle-client")
            step = store.add_step_run(run_id, "model")
            store.admit_invocation(admission(run_id, step, project=PROJECT, trace="idle-client"))
            revision = ops.put_revision(PROJECT, "policy_routing", READ_CONTRACT, {"n": 1}, "t")
            ops.activate_revision(  # the call, then its wake (D25)
                PROJECT, "policy_routing", READ_CONTRACT, revision["revision_id"], "t"
            )
            assert asyncio.run(async_side_then_look(run_id)) == []
    finally:
        proxy.close()
    assert "wake_relays failed" not in caplog.text


def test_an_outbox_write_behind_the_pooler_commits_before_its_wake(
    world: str, through: Through, caplog: pytest.LogCaptureFixture
) -> None:
    """Behind the pooler the call and its wake are two messages (D64): a call that fails
    raises its own error and writes nothing; a wake that fails is logged, and the committed
    activation is returned."""
    caplog.set_level(logging.WARNING, logger="ql3.store")
    events = "SELECT count(*) AS n FROM ql3.contract_outbox WHERE project_id = %s"
    with PgStore(through(role_dsn(world, "operator")), max_connections=1) as ops:
        r1, r2 = (
            str(ops.put_revision(PROJECT, "policy_routing", READ_CONTRACT, {"n": n}, "t")
                ["revision_id"])
            for n in (1, 2)
        )  # fmt: skip
        ops.activate_revision(PROJECT, "policy_routing", READ_CONTRACT, r1, "t")
        before = query(world, events, PROJECT)
        with pytest.raises(errors.Conflict, match="expected active revision"):
            ops.activate_revision(PROJECT, "policy_routing", READ_CONTRACT, r2, "t", r2)
        assert query(world, events, PROJECT) == before
        assert ops.active_revision(PROJECT, "policy_routing", READ_CONTRACT)["revision_id"] == r1  # type: ignore[index]
        assert "wake_relays failed" not in caplog.text
        with psycopg.connect(world, autocommit=True) as admin:
            admin.execute("REVOKE EXECUTE ON FUNCTION ql3.wake_relays() FROM ql3_operator")
            try:
                event = ops.activate_revision(PROJECT, "policy_routing", READ_CONTRACT, r2, "t")
            finally:
                admin.execute("GRANT EXECUTE ON FUNCTION ql3.wake_relays() TO ql3_operator")
    assert event is not None and str(event["new_revision_id"]) == r2
    assert query(world, events, PROJECT) == [{"n": before[0]["n"] + 1}]
    assert "wake_relays failed after COMMIT" in caplog.text


def test_the_relay_notices_that_listen_does_not_deliver_through_the_pooler(
    db_dsn: str,
    redis_url: str,
    pgbouncers: dict[str, Through],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """LISTEN through a transaction pooler registers on a server connection lent to others
    at once: the relay's own NOTIFY never comes back, so it says it is polling, and why,
    and still delivers (by the poll)."""
    through = pgbouncers["ignore_options"]
    relay_dsn = role_dsn(db_dsn, "relay")

    async def deliver(relay: Relay, contract: str, within: float) -> dict[str, Any]:
        """Start the relay alone, activate once, and wait for it to publish the event."""
        await relay.start()
        try:
            await relay.wait_ready(15.0)
            with PgStore(through(role_dsn(db_dsn, "operator"))) as ops:
                revision = ops.put_revision(PROJECT, "policy_routing", contract, {"v": 1}, "t")
                started = time.monotonic()
                ops.activate_revision(
                    PROJECT, "policy_routing", contract, revision["revision_id"], "t"
                )
            while relay.published < 1:
                assert time.monotonic() - started < within, "the event was not delivered"
                await asyncio.sleep(0.02)
            return {
                "health": relay.health(),
                "listening": sample(relay, "ql3_relay_listening"),
                "polling": sample(relay, "ql3_relay_polling"),
            }
        finally:
            await relay.stop()

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        pooled = Relay(RelayConfig(
            dsn=through(relay_dsn), redis_url=redis_url, channel_prefix="pooledlisten",
            poll_interval=0.3, listen_probe_interval=1.0,
        ))  # fmt: skip
        # A 30 s poll: only a NOTIFY delivers within the 3 s allowed.
        direct = Relay(RelayConfig(
            dsn=through(relay_dsn), listen_dsn=relay_dsn, redis_url=redis_url,
            channel_prefix="directlisten", poll_interval=30.0,
        ))  # fmt: skip
        return (await deliver(pooled, "by-poll", 3.0), await deliver(direct, "by-notify", 3.0))

    with caplog.at_level(logging.WARNING, logger="ql3.relay"):
        pooled, direct = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert pooled["health"]["delivery"] == "polling"
    assert (pooled["listening"], pooled["polling"]) == (0.0, 1.0)
    assert direct["health"]["delivery"] == "listen"
    assert (direct["listening"], direct["polling"]) == (1.0, 0.0)
    why = [
        r.__dict__["ql3"]["reason"]
        for r in caplog.records
        if r.getMessage() == "listen_not_delivering"
    ]
    assert why and "transaction pooler" in why[0]


def sample(relay: Relay, name: str) -> float:
    value = relay.registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_migrate_runs_twice_through_the_pooler(fresh_db: Any, through: Through) -> None:
    dsn = through(fresh_db())
    migrate(dsn, with_ai=True)
    migrate(dsn, with_ai=True)  # the second found "prepared statement already exists"
    rows = query(dsn, "SELECT count(*) AS n FROM ql3_ai.model_invocation_starts")
    assert rows == [{"n": 0}]


@pytest.fixture
def world(db_dsn: str, provider: StubProvider) -> Iterator[str]:  # noqa: F811
    """An active policy and topology for the gateway (written directly, as the superuser)."""
    with PgStore(db_dsn) as ops:
        topology = topology_body([("stub-a", provider.base_url, [MODEL])])
        revision = ops.put_revision(
            TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, topology, "test"
        )
        ops.activate_revision(
            TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, revision["revision_id"], "t"
        )
        policy = ops.put_revision(
            PROJECT, "policy_routing", POLICY, {"routes": [{"model": MODEL}]}, "test"
        )
        ops.activate_revision(PROJECT, "policy_routing", POLICY, policy["revision_id"], "t")
    yield db_dsn


def test_everything_at_once_through_the_pooler(
    world: str, redis_url: str, through: Through
) -> None:
    """Eight threads of admit/complete pairs, activations read by eight cache readers, eight
    gateway calls at a time, the recovery loop and the relay, all through the pooler: no
    error, every acknowledged fact present, and no row nobody asked for."""
    db_dsn = world
    runtime, relay_login = role_dsn(db_dsn, "runtime"), role_dsn(db_dsn, "relay")
    operator = role_dsn(db_dsn, "operator")
    failures: list[BaseException] = []
    acknowledged: dict[str, set[str]] = {"runs": set(), "starts": set(), "completions": set()}
    ack_lock = threading.Lock()

    def pairs(worker: int) -> None:
        with PgStore(through(runtime), max_connections=2) as store:
            for i in range(ROUNDS):
                run_id = store.create_run(PROJECT, f"pair-{worker}-{i}")
                step = store.add_step_run(run_id, "model")
                admitted = store.admit_invocation(
                    admission(run_id, step, project=PROJECT, trace=f"pair-{worker}-{i}")
                )
                assert admitted["status"] == "created"
                done = store.complete_invocation(completion(admitted, Outcome.SUCCEEDED))
                assert done["status"] == "created"
                with ack_lock:
                    acknowledged["runs"].add(run_id)
                    acknowledged["starts"].add(admitted["start"]["invocation_id"])
                    acknowledged["completions"].add(admitted["start"]["invocation_id"])

    def expired_starts() -> list[str]:
        """Admissions whose deadline passes at once: the recovery loop settles them."""
        ids = []
        with PgStore(through(runtime), max_connections=1) as store:
            for i in range(4):
                run_id = store.create_run(PROJECT, f"expiring-{i}")
                step = store.add_step_run(run_id, "model")
                admitted = store.admit_invocation(
                    admission(run_id, step, project=PROJECT, trace=f"expiring-{i}",
                              deadline=deadline_in(0.2))
                )  # fmt: skip
                ids.append(admitted["start"]["invocation_id"])
                acknowledged["runs"].add(run_id)
        return ids

    activated: list[str] = []

    def activations(first: int, count: int) -> None:
        with PgStore(through(operator), max_connections=1) as ops:
            for i in range(first, first + count):
                revision = ops.put_revision(PROJECT, "policy_routing", READ_CONTRACT, {"n": i}, "t")
                activated.append(str(revision["revision_id"]))
                ops.activate_revision(
                    PROJECT, "policy_routing", READ_CONTRACT, revision["revision_id"], "t"
                )
                time.sleep(0.05)

    async def async_side(pairs_done: asyncio.Event) -> dict[str, Any]:
        cache = RevisionCache(through(runtime), redis_url, channel_prefix="pooled")
        relay = Relay(RelayConfig(
            dsn=through(relay_login), listen_dsn=relay_login, redis_url=redis_url,
            channel_prefix="pooled", poll_interval=0.5,
        ))  # fmt: skip
        await relay.start()
        await cache.start()
        reads = 0
        calls: list[str] = []
        store = AsyncPgStore(through(runtime), max_connections=4)
        gateway = ModelGateway(store, cache, OpenAICompatibleProvider(cache))

        async def reader() -> None:
            nonlocal reads
            while not pairs_done.is_set():
                effective = await cache.get_effective(PROJECT, "policy_routing", READ_CONTRACT)
                assert effective.revision_id in activated
                reads += 1
                await asyncio.sleep(0.005)

        async def caller(worker: int) -> None:
            # A blocking store of its own, opened and closed off the loop (closing a pool
            # joins its threads, which would hold up every task on the loop meanwhile).
            setup = await asyncio.to_thread(PgStore, through(runtime), max_connections=1)
            try:
                for i in range(3):
                    run_id = await asyncio.to_thread(setup.create_run, PROJECT, f"gw-{worker}-{i}")
                    step = await asyncio.to_thread(setup.add_step_run, run_id, "model")
                    result = await gateway.invoke(ModelCall(
                        project_id=PROJECT, run_id=run_id, step_run_id=step,
                        trace_id=f"gw-{worker}-{i}", policy_id=POLICY, messages=MESSAGES,
                        deadline_at=deadline_in(30.0),
                    ))  # fmt: skip
                    calls.append(result.invocation_id)
                    acknowledged["runs"].add(run_id)
            finally:
                await asyncio.to_thread(setup.close)

        try:
            await relay.wait_ready(15.0)
            # A task group: when one fails, the others are cancelled and awaited before the
            # store, cache and gateway close under them.
            async with asyncio.TaskGroup() as group:
                for w in range(THREADS):
                    group.create_task(reader())
                    group.create_task(caller(w))
            deadline = time.monotonic() + 15.0
            while query(
                db_dsn, "SELECT count(*) AS n FROM ql3.contract_outbox WHERE delivered_at IS NULL"
            )[0]["n"]:
                assert time.monotonic() < deadline, "the relay left outbox rows undelivered"
                await asyncio.sleep(0.1)
            latest = await cache.get_effective(PROJECT, "policy_routing", READ_CONTRACT)
            return {
                "reads": reads,
                "calls": calls,
                "latest": latest.revision_id,
                "health": relay.health(),
            }
        finally:
            async with contextlib.AsyncExitStack() as closing:  # each runs, even if one raises
                for close in (relay.stop, cache.close, store.close, gateway.aclose):
                    closing.push_async_callback(close)

    activations(0, 1)  # the cache's readers start with one active revision
    pairs_done = asyncio.Event()
    loop = asyncio.new_event_loop()
    recovery = RecoveryLoop(through(operator), RecoveryConfig(interval=0.2, grace_seconds=0.0))
    recovery.start()
    pauses = Pauses()
    try:
        with pauses, concurrent.futures.ThreadPoolExecutor(THREADS + 2) as pool:
            async_result = pool.submit(loop.run_until_complete, async_side(pairs_done))
            work = [pool.submit(pairs, w) for w in range(THREADS)]
            work.append(pool.submit(activations, 1, 9))
            expiring_future = pool.submit(expired_starts)
            failures.extend(exc for future in work if (exc := future.exception(120)))
            expiring = expiring_future.result(60)
            loop.call_soon_threadsafe(pairs_done.set)
            if exc := async_result.exception(120):
                failures.append(exc)
        if failures:  # every one, with its traceback, and whether the machine stalled
            raise BaseExceptionGroup(f"failed through the pooler; {pauses}", failures)
        side = async_result.result()
        recovery.wait_until(lambda r: settled(db_dsn, expiring), timeout=20.0)
        assert recovery.last_error is None
    finally:
        recovery.stop()
        close_loop(loop)
    assert side["reads"] > 0
    assert side["latest"] == activated[-1]
    assert side["health"]["status"] == "ok" and side["health"]["delivery"] == "listen"
    assert_no_bogus_rows(db_dsn, acknowledged, side["calls"], expiring, len(activated))


class Pauses(threading.Thread):
    """The longest time a thread that asks to wake every 50 ms went without running: when
    the machine stalls (or some thread holds the GIL), every timeout in the process runs out
    at once, and a failed run says whether it saw that."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.longest = 0.0
        self._done = threading.Event()

    def run(self) -> None:
        last = time.monotonic()
        while not self._done.wait(0.05):
            now = time.monotonic()
            self.longest = max(self.longest, now - last - 0.05)
            last = now

    def __enter__(self) -> Pauses:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join()

    def __str__(self) -> str:
        return f"the longest pause of this process's threads was {self.longest:.2f} s"


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what a failed run left on the loop and close it: its sockets close now, not
    in a later test's garbage collection (as unraisable ResourceWarnings)."""

    async def cancel_the_rest() -> None:
        pending = asyncio.all_tasks() - {asyncio.current_task()}
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await loop.shutdown_asyncgens()

    loop.run_until_complete(cancel_the_rest())
    loop.close()


def undelivered(dsn: str) -> int:
    sql = "SELECT count(*) AS n FROM ql3.contract_outbox WHERE delivered_at IS NULL"
    return int(query(dsn, sql)[0]["n"])


def settled(dsn: str, invocation_ids: list[str]) -> bool:
    rows = query(
        dsn,
        "SELECT count(*) AS n FROM ql3_ai.model_invocation_completions "
        "WHERE invocation_id = ANY(%s) AND outcome = 'lost'",
        invocation_ids,
    )
    return int(rows[0]["n"]) == len(invocation_ids)


def assert_no_bogus_rows(
    dsn: str,
    acknowledged: dict[str, set[str]],
    gateway_calls: list[str],
    expiring: list[str],
    activations: int,
) -> None:
    """Exactly the rows the clients asked for, each with what they sent: a statement run
    as another (create_run for add_step_run) would leave a run with a uuid for a project
    or 'model' for a trace."""
    runs = query(dsn, "SELECT run_id::text, project_id, trace_id FROM ql3.runs")
    assert {r["run_id"] for r in runs} == acknowledged["runs"]
    trace = re.compile(r"(pair|gw)-\d+-\d+|expiring-\d+")
    assert all(r["project_id"] == PROJECT and trace.fullmatch(r["trace_id"]) for r in runs)
    steps = query(dsn, "SELECT kind, status, run_id::text FROM ql3.step_runs")
    assert len(steps) == len(runs) and {s["kind"] for s in steps} == {"model"}
    assert {s["status"] for s in steps} <= {"succeeded", "lost"}
    starts = {r["id"] for r in query(
        dsn, "SELECT invocation_id AS id FROM ql3_ai.model_invocation_starts"
    )}  # fmt: skip
    assert starts == acknowledged["starts"] | set(gateway_calls) | set(expiring)
    outcomes = query(
        dsn, "SELECT invocation_id AS id, outcome FROM ql3_ai.model_invocation_completions"
    )
    by_id = {r["id"]: r["outcome"] for r in outcomes}
    assert set(by_id) == starts
    assert all(by_id[i] == "succeeded" for i in acknowledged["completions"] | set(gateway_calls))
    assert all(by_id[i] == "lost" for i in expiring)
    events = query(
        dsn, "SELECT count(*) AS n FROM ql3.contract_outbox WHERE project_id = %s", PROJECT
    )
    assert events == [{"n": activations + 1}]  # and the world's first activation


def test_a_pool_that_gets_no_connection_says_why(db_dsn: str, through: Through) -> None:
    """PgStore's pool retries in the background; its timeout names the server's reason."""
    missing = through(db_dsn.replace("dbname=", "dbname=nosuch_"))
    refused = pytest.raises(errors.NotSent, match=r"last connection attempt failed: .*nosuch_")
    with PgStore(missing, timeouts=Timeouts(connect_s=1)) as store, refused:
        store._rows("SELECT 1")
