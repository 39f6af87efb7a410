"""The worker revision cache (SPEC section 8) against real PostgreSQL, Redis and relays.

Budgets are shortened (max staleness 1 s instead of 30 s, heartbeat timeout 0.5 s) so the
fallback paths run in a test's time; the ADR-113 acceptance figure (every worker on the
new revision within the budget) is asserted with the shortened budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from ql3 import canonical, devservers, errors
from ql3.cache import BodyHashMismatch, EffectiveRevision, RevisionCache
from ql3.migrate import migrate
from ql3.relay import Relay, RelayConfig

FAMILY = "policy_routing"
BUDGET = 1.0  # shortened max staleness of FAMILY (seconds)


# -- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture
def db(db_dsn: str) -> str:
    """A fresh, fully migrated database (superuser DSN)."""
    return db_dsn


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:10]}"


@pytest.fixture
def scratch() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="ql3-cache-test-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def run(scenario: Coroutine[Any, Any, None], timeout: float = 60.0) -> None:
    """asyncio.run with a deadline, so a hung scenario fails instead of stalling CI."""
    asyncio.run(asyncio.wait_for(scenario, timeout))


async def until(pred: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll pred until true; the seconds it took. Fails with what after timeout."""
    started = time.monotonic()
    while not pred():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - started


async def until_served(
    cache: RevisionCache, key: tuple[str, str, str], revision_id: str, timeout: float
) -> float:
    """Call get_effective until it returns revision_id; the seconds it took."""
    started = time.monotonic()
    while True:
        with contextlib.suppress(errors.NotFound):
            if (await cache.get_effective(*key)).revision_id == revision_id:
                return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{revision_id} not served after {timeout}s")
        await asyncio.sleep(0.005)


async def until_not_found(cache: RevisionCache, key: tuple[str, str, str], timeout: float) -> None:
    started = time.monotonic()
    while True:
        try:
            await cache.get_effective(*key)
        except errors.NotFound:
            return
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{key} still served after {timeout}s")
        await asyncio.sleep(0.005)


class Db:
    """The operator side: puts, activates and revokes revisions."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn

    async def put(self, key: tuple[str, str, str], body: dict[str, Any]) -> str:
        cur = await self.conn.execute(
            "SELECT revision_id FROM ql3.put_revision(%s, %s, %s, %s::jsonb, 'test')",
            (*key, Jsonb(body)),
        )
        row = await cur.fetchone()
        assert row is not None
        return str(row[0])

    async def activate(self, key: tuple[str, str, str], body: dict[str, Any]) -> str:
        revision_id = await self.put(key, body)
        await self.conn.execute(
            "SELECT ql3.activate_revision(%s, %s, %s, %s::uuid, 'test')", (*key, revision_id)
        )
        return revision_id

    async def revoke(self, revision_id: str) -> None:
        await self.conn.execute(
            "SELECT ql3.revoke_revision(%s::uuid, 'test', 'compromised')", (revision_id,)
        )


@contextlib.asynccontextmanager
async def operator(dsn: str) -> AsyncIterator[Db]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        yield Db(conn)


def relay_config(dsn: str, redis_url: str, prefix: str, **kw: Any) -> RelayConfig:
    base: dict[str, Any] = {
        "heartbeat_interval": 0.1,
        "backoff_initial": 0.02,
        "backoff_max": 0.2,
        "poll_interval": 0.2,
    }
    base.update(kw)
    return RelayConfig(dsn=dsn, redis_url=redis_url, channel_prefix=prefix, **base)


@contextlib.asynccontextmanager
async def relay(dsn: str, redis_url: str, prefix: str, **kw: Any) -> AsyncIterator[Relay]:
    r = Relay(relay_config(dsn, redis_url, prefix, **kw))
    await r.start()
    try:
        await r.wait_ready()
        yield r
    finally:
        await r.stop()


@contextlib.asynccontextmanager
async def worker(
    dsn: str, redis_url: str, prefix: str, *, staleness: float = BUDGET, **kw: Any
) -> AsyncIterator[RevisionCache]:
    options: dict[str, Any] = {"heartbeat_timeout": 0.5, "redis_timeout": 1.0}
    options.update(kw)
    cache = RevisionCache(
        dsn, redis_url, channel_prefix=prefix, max_staleness={FAMILY: staleness}, **options
    )
    async with cache:
        yield cache


@contextlib.asynccontextmanager
async def fake_heartbeats(redis_url: str, prefix: str) -> AsyncIterator[None]:
    """Heartbeats with no relay behind them: the event messages are 'lost'."""
    client = aioredis.Redis.from_url(redis_url)

    async def beat() -> None:
        while True:
            doc = {"type": "heartbeat", "relay_id": "fake", "seq": 0, "at": "x"}
            await client.publish(f"{prefix}:__heartbeat__", json.dumps(doc))
            await asyncio.sleep(0.05)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose()


async def publish(redis_url: str, channel: str, *payloads: bytes | str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        for payload in payloads:
            await client.publish(channel, payload)
    finally:
        await client.aclose()


# -- serving -------------------------------------------------------------------------------


def test_get_effective_returns_the_active_revision_with_its_verified_hash(
    db: str, redis_url: str, prefix: str
) -> None:
    key = ("proj", FAMILY, "routing")
    body: dict[str, Any] = {"route": "local", "weights": [1, 2.5], "note": "漢字"}

    async def scenario() -> None:
        async with operator(db) as ops, RevisionCache(db, redis_url, channel_prefix=prefix) as c:
            revision_id = await ops.activate(key, body)
            rev = await c.get_effective(*key)
            assert isinstance(rev, EffectiveRevision)
            assert (rev.revision_id, rev.revision_no, rev.pointer_version) == (revision_id, 1, 1)
            assert rev.body == body
            assert rev.body_hash == canonical.digest("ql3/contract-body@v1", body)
            assert rev.cached_at <= rev.verified_at
            # Budgets come from ql3.contract_families unless overridden.
            assert (c.staleness(FAMILY), c.staleness("channel_event")) == (30.0, 300.0)

    run(scenario())


def test_a_hit_serves_the_same_revision_object_until_the_entry_is_verified_again(
    db: str, redis_url: str, prefix: str
) -> None:
    key = ("proj", FAMILY, "routing")

    async def scenario() -> None:
        async with operator(db) as ops, worker(db, redis_url, prefix, staleness=60.0) as c:
            revision_id = await ops.activate(key, {"v": 1})
            degraded = await c.get_effective(*key)  # no relay yet: verified before every use
            assert (await c.get_effective(*key)).verified_at > degraded.verified_at
            async with relay(db, redis_url, prefix):
                await until(lambda: c.mode == "normal", 5, "normal mode")
                rev = await c.get_effective(*key)
                assert await c.get_effective(*key) is rev  # a hit: no new object
                await asyncio.sleep(0.01)
                await c.verify_all()
                again = await c.get_effective(*key)
                assert (again.revision_id, again.cached_at) == (revision_id, rev.cached_at)
                assert again.verified_at > rev.verified_at

    run(scenario())


def test_a_contract_never_activated_raises_not_found(db: str, redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with RevisionCache(db, redis_url, channel_prefix=prefix) as c:
            with pytest.raises(errors.NotFound, match="no active revision"):
                await c.get_effective("proj", FAMILY, "missing")

    run(scenario())


def test_revoke_makes_get_effective_fail_closed(db: str, redis_url: str, prefix: str) -> None:
    key = ("proj", FAMILY, "routing")

    async def scenario() -> None:
        async with (
            operator(db) as ops,
            relay(db, redis_url, prefix),
            worker(db, redis_url, prefix, staleness=60.0) as c,
        ):
            first = await ops.activate(key, {"v": 1})
            await until_served(c, key, first, 5)
            await ops.revoke(first)
            await until_not_found(c, key, 5)
            with pytest.raises(errors.NotFound):
                await c.get_effective(*key)
            second = await ops.activate(key, {"v": 2})
            await until_served(c, key, second, 5)

    run(scenario())


def test_a_body_that_does_not_match_its_hash_is_refused(
    db: str, redis_url: str, prefix: str
) -> None:
    key = ("proj", FAMILY, "routing")

    async def scenario() -> None:
        async with operator(db) as ops:
            revision_id = await ops.activate(key, {"v": 1})
            # Tamper behind the immutability trigger (a superuser in replica mode).
            await ops.conn.execute("SET session_replication_role = replica")
            await ops.conn.execute(
                "UPDATE ql3.contract_revisions SET body = '{\"v\": 2}' WHERE revision_id = %s",
                (revision_id,),
            )
        async with RevisionCache(db, redis_url, channel_prefix=prefix) as c:
            with pytest.raises(BodyHashMismatch) as caught:
                await c.get_effective(*key)
            assert caught.value.code == "QL3_CONFLICT"
            assert c.health().entries == 0

    run(scenario())


# -- propagation (ADR-113 acceptance) ------------------------------------------------------


def recorder(seen: list[str]) -> Callable[[EffectiveRevision], None]:
    def record(rev: EffectiveRevision) -> None:
        seen.append(rev.revision_id)

    return record


def broken_callback(rev: EffectiveRevision) -> None:
    raise RuntimeError(f"callback bug on {rev.revision_id}")


def test_every_activation_reaches_every_subscribed_worker_within_the_budget(
    db: str, redis_url: str, prefix: str
) -> None:
    key = ("proj", FAMILY, "routing")

    async def scenario() -> None:
        async with (
            operator(db) as ops,
            relay(db, redis_url, prefix),
            worker(db, redis_url, prefix) as w1,
            worker(db, redis_url, prefix) as w2,
            worker(db, redis_url, prefix, projects=["proj"]) as w3,
        ):
            workers = [w1, w2, w3]
            changes: list[list[str]] = [[] for _ in workers]
            for w, seen in zip(workers, changes, strict=True):
                w.on_change(FAMILY, "routing", recorder(seen))
                w.on_change(FAMILY, "routing", broken_callback)  # contained, never propagates
            await until(lambda: all(w.mode == "normal" for w in workers), 5, "heartbeats")
            activated = []
            worst = 0.0
            for i in range(8):
                revision_id = await ops.activate(key, {"v": i})
                activated.append(revision_id)
                for w in workers:
                    worst = max(worst, await until_served(w, key, revision_id, BUDGET + 1))
            assert worst <= BUDGET
            for seen in changes:
                await until(lambda seen=seen: seen == activated, 2, "every on_change")  # type: ignore[misc]
            assert all(w.health().mode == "normal" for w in workers)
            assert all(w.health().messages >= 8 for w in workers)

    run(scenario())


@pytest.mark.slow
def test_a_worker_never_serves_an_older_pointer_version_than_one_it_has_seen(
    db: str, redis_url: str, prefix: str
) -> None:
    """Two relays (out-of-order delivery across them), three workers reading in a loop."""
    key = ("proj", FAMILY, "routing")

    async def reader(c: RevisionCache, seen: list[int], stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(errors.NotFound):
                seen.append((await c.get_effective(*key)).pointer_version)
            await asyncio.sleep(0.001)

    async def scenario() -> None:
        async with (
            operator(db) as ops,
            relay(db, redis_url, prefix, batch=2, relay_id="a"),
            relay(db, redis_url, prefix, batch=2, relay_id="b"),
            worker(db, redis_url, prefix) as w1,
            worker(db, redis_url, prefix) as w2,
            worker(db, redis_url, prefix) as w3,
        ):
            workers = [w1, w2, w3]
            stop = asyncio.Event()
            seen: list[list[int]] = [[] for _ in workers]
            tasks = [
                asyncio.create_task(reader(w, s, stop)) for w, s in zip(workers, seen, strict=True)
            ]
            revisions = [await ops.put(key, {"side": side}) for side in ("a", "b")]
            for i in range(40):  # A, B, A, B...: old revision ids come back at new versions
                await ops.conn.execute(
                    "SELECT ql3.activate_revision(%s, %s, %s, %s::uuid, 'test')",
                    (*key, revisions[i % 2]),
                )
                await asyncio.sleep(0.002)
            final = revisions[39 % 2]
            for w in workers:
                assert await until_served(w, key, final, BUDGET + 1) <= BUDGET
            await until(lambda: all(s and s[-1] == 40 for s in seen), BUDGET, "version 40")
            stop.set()
            await asyncio.gather(*tasks)
            for versions in seen:
                assert versions == sorted(versions), "served an older pointer_version"
                assert len(versions) >= 5

    run(scenario())


# -- faults --------------------------------------------------------------------------------


def test_dropped_messages_converge_through_the_fallback_within_the_budget(
    db: str, redis_url: str, prefix: str
) -> None:
    """Heartbeats arrive but event messages never do: the staleness fallback repairs it."""
    key = ("proj", FAMILY, "routing")

    async def scenario() -> None:
        async with (
            operator(db) as ops,
            fake_heartbeats(redis_url, prefix),
            worker(db, redis_url, prefix) as c,
        ):
            changed = asyncio.Event()
            c.on_change(FAMILY, "routing", lambda rev: changed.set())
            await until(lambda: c.mode == "normal", 5, "normal mode")
            first = await ops.activate(key, {"v": 1})
            await until_served(c, key, first, 2)
            changed.clear()
            second = await ops.activate(key, {"v": 2})  # no relay: this message is lost
            started = time.monotonic()
            await asyncio.wait_for(changed.wait(), BUDGET + 1)  # nobody calls get_effective
            assert time.monotonic() - started <= BUDGET
            assert (await c.get_effective(*key)).revision_id == second
            assert c.health().mode == "normal" and c.health().messages == 0

    run(scenario())


def test_heartbeat_loss_degrades_the_cache_and_their_return_restores_it(
    db: str, redis_url: str, prefix: str
) -> None:
    key = ("proj", FAMILY, "routing")

    async def scenario() -> None:
        async with operator(db) as ops, worker(db, redis_url, prefix, staleness=60.0) as c:
            async with relay(db, redis_url, prefix):
                await until(lambda: c.mode == "normal", 5, "normal mode")
                first = await ops.activate(key, {"v": 1})
                await until_served(c, key, first, 5)
            await until(lambda: c.mode == "degraded", 3, "degraded mode")
            verified = c.health().last_verification_at
            # No relay, a 60 s budget: only verify-before-use can find the new revision.
            second = await ops.activate(key, {"v": 2})
            assert (await c.get_effective(*key)).revision_id == second
            assert c.health().last_verification_at != verified
            async with relay(db, redis_url, prefix):
                await until(lambda: c.mode == "normal", 3, "normal mode again")
                third = await ops.activate(key, {"v": 3})
                await until_served(c, key, third, 2)

    run(scenario())


KILL_CACHE_BACKENDS = """
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000))
FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'ql3-cache' AND pid <> pg_backend_pid()
"""


@pytest.mark.parametrize("pool_size", [0, 3], ids=["own pool", "given pool of 3"])
def test_killed_backends_are_replaced_and_the_next_read_succeeds(
    db: str, redis_url: str, prefix: str, pool_size: int
) -> None:
    """No checkout check: a read that finds its connection dead retries on a working one."""
    key = ("proj", FAMILY, "routing")

    async def scenario() -> None:
        given: AsyncConnectionPool[Any] | None = None
        if pool_size:  # several idle connections, all of them killed at once
            given = AsyncConnectionPool(
                db,
                min_size=pool_size,
                max_size=pool_size,
                open=False,
                kwargs={"autocommit": True, "application_name": "ql3-cache"},
            )
            await given.open(wait=True)
        try:
            async with operator(db) as ops, RevisionCache(given or db, redis_url) as c:
                # No relay, so no heartbeat: degraded mode reads the database on every use.
                first = await ops.activate(key, {"v": 1})
                assert (await c.get_effective(*key)).revision_id == first
                cur = await ops.conn.execute(KILL_CACHE_BACKENDS)
                killed = await cur.fetchone()
                assert killed is not None and killed[0] >= max(1, pool_size)
                second = await ops.activate(key, {"v": 2})
                rev = await asyncio.wait_for(c.get_effective(*key), 10)
                assert rev.revision_id == second
                assert (await c.get_effective(*key)).revision_id == second
        finally:
            if given is not None:
                await given.close()

    run(scenario())


def test_malformed_messages_are_logged_and_ignored(
    db: str, redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = ("proj", FAMILY, "routing")
    valid = {"project_id": "proj", "contract_family": FAMILY, "contract_id": "routing"}
    garbage: list[bytes | str] = [
        b"\xff\xfe\x00",
        "not json",
        "[1, 2]",
        json.dumps({"project_id": "proj"}),
        json.dumps({**valid, "pointer_version": "9"}),
        json.dumps({**valid, "pointer_version": True}),
        json.dumps({**valid, "pointer_version": -1}),
        json.dumps({**valid, "contract_id": 7, "pointer_version": 9}),
        json.dumps({**valid, "project_id": "other", "pointer_version": 9}),  # wrong channel
    ]

    async def scenario() -> None:
        async with (
            operator(db) as ops,
            relay(db, redis_url, prefix),
            worker(db, redis_url, prefix, staleness=60.0) as c,
        ):
            first = await ops.activate(key, {"v": 1})
            await until_served(c, key, first, 5)
            with caplog.at_level(logging.WARNING, logger="ql3.cache"):
                await publish(redis_url, f"{prefix}:proj", *garbage)
                await publish(redis_url, f"{prefix}:__heartbeat__", "{}", "nope")
                await until(lambda: c.health().malformed_messages == 11, 5, "11 malformed")
            logged = [r for r in caplog.records if r.getMessage() == "cache_malformed_message"]
            assert len(logged) == 11
            assert (await c.get_effective(*key)).revision_id == first
            second = await ops.activate(key, {"v": 2})
            await until_served(c, key, second, 2)

    run(scenario())


def test_messages_are_hints_ordered_by_pointer_version(
    db: str, redis_url: str, prefix: str
) -> None:
    key = ("proj", FAMILY, "routing")

    def hint(version: int) -> str:
        return json.dumps(
            {"project_id": key[0], "contract_family": key[1], "contract_id": key[2],
             "pointer_version": version}
        )  # fmt: skip

    async def scenario() -> None:
        async with (
            operator(db) as ops,
            fake_heartbeats(redis_url, prefix),
            worker(db, redis_url, prefix, staleness=60.0) as c,
        ):
            await until(lambda: c.mode == "normal", 5, "normal mode")
            await ops.activate(key, {"v": 1})
            revision_id = await ops.activate(key, {"v": 2})
            rev = await c.get_effective(*key)
            assert (rev.revision_id, rev.pointer_version) == (revision_id, 2)
            reloads = c.health().reloads
            # Duplicates and late messages are ignored: no reload.
            await publish(redis_url, f"{prefix}:proj", hint(1), hint(2))
            await until(lambda: c.health().messages == 2, 5, "two messages")
            assert c.health().reloads == reloads
            # A newer hint drops and reloads; the database does not confirm it and wins.
            await publish(redis_url, f"{prefix}:proj", hint(99))
            await until(lambda: c.health().reloads > reloads, 5, "a reload")
            rev = await c.get_effective(*key)
            assert (rev.revision_id, rev.pointer_version) == (revision_id, 2)

    run(scenario())


@pytest.mark.slow
def test_workers_reconverge_after_redis_stops_and_restarts(
    db: str, prefix: str, scratch: Path
) -> None:
    rd = devservers.start_redis(scratch)
    key = ("proj", FAMILY, "routing")

    async def scenario() -> None:
        async with (
            operator(db) as ops,
            relay(db, rd.url, prefix) as r,
            worker(db, rd.url, prefix, staleness=60.0) as w1,
            worker(db, rd.url, prefix, staleness=60.0) as w2,
        ):
            workers = [w1, w2]
            await until(lambda: all(w.mode == "normal" for w in workers), 5, "normal mode")
            first = await ops.activate(key, {"v": 1})
            for w in workers:
                await until_served(w, key, first, 2)
            rd.stop()
            await until(lambda: all(w.mode == "degraded" for w in workers), 5, "degraded")
            # While Redis is down the relay keeps the row; workers verify before every use.
            second = await ops.activate(key, {"v": 2})
            for w in workers:
                assert (await w.get_effective(*key)).revision_id == second
            await until(lambda: r.health()["redis"] is False, 5, "the relay to see Redis down")
            verifications = [w.health().verifications for w in workers]
            rd.start()
            await until(lambda: all(w.mode == "normal" for w in workers), 10, "normal again")
            # Every entry is re-verified after the resubscription.
            await until(
                lambda: all(
                    w.health().verifications > v
                    for w, v in zip(workers, verifications, strict=True)
                ),
                2,
                "a verification after the resubscription",
            )
            third = await ops.activate(key, {"v": 3})
            for w in workers:
                assert await until_served(w, key, third, 2) <= BUDGET
            async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
                deadline = time.monotonic() + 5
                while True:
                    cur = await conn.execute(
                        "SELECT count(*) FILTER (WHERE delivered_at IS NULL),"
                        " max(relay_attempts) FROM ql3.contract_outbox"
                    )
                    row = await cur.fetchone()
                    assert row is not None
                    if row[0] == 0 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.02)
            assert row[0] == 0 and row[1] >= 2  # the outage was recorded, then delivered

    try:
        run(scenario())
    finally:
        rd.stop()


@pytest.mark.slow
def test_an_entry_that_needs_verification_fails_closed_while_postgres_is_down(
    redis_url: str, prefix: str
) -> None:
    root = Path(tempfile.mkdtemp(prefix="ql3-cache-pg-"))
    pg = devservers.start_postgres(root)
    key = ("proj", FAMILY, "routing")

    async def scenario(dsn: str) -> None:
        async with (
            fake_heartbeats(redis_url, prefix),
            worker(dsn, redis_url, prefix, db_timeout=1.0) as c,
        ):
            await until(lambda: c.mode == "normal", 5, "normal mode")
            async with operator(dsn) as ops:
                first = await ops.activate(key, {"v": 1})
            await until_served(c, key, first, 2)
            await asyncio.to_thread(pg.stop)
            # Within its budget the entry is served from memory...
            assert (await c.get_effective(*key)).revision_id == first
            # ...past it, it must be verified first, and cannot be: fail closed.
            await asyncio.sleep(BUDGET)
            with pytest.raises(errors.Unavailable):
                await c.get_effective(*key)
            await asyncio.to_thread(pg.start)
            deadline = time.monotonic() + 20
            while True:  # the pool reconnects with its own backoff
                with contextlib.suppress(errors.Unavailable):
                    assert (await c.get_effective(*key)).revision_id == first
                    break
                assert time.monotonic() < deadline, "not served after the restart"
                await asyncio.sleep(0.05)

    try:
        dsn = devservers.create_database(pg, "cache_pg_down")
        migrate(dsn)
        run(scenario(dsn))
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_start_fails_closed_and_leaves_nothing_running_when_postgres_is_unreachable(
    redis_url: str, prefix: str
) -> None:
    # Nothing listens on this port: the family budgets cannot be read.
    dsn = f"postgresql://postgres@127.0.0.1:{devservers.free_port()}/ql3?connect_timeout=1"
    channels = [f"{prefix}:proj", f"{prefix}:__heartbeat__"]

    async def scenario() -> None:
        before = asyncio.all_tasks()
        cache = RevisionCache(dsn, redis_url, channel_prefix=prefix, projects=["proj"],
                              db_timeout=1.0)  # fmt: skip
        with pytest.raises(errors.Unavailable) as failure:
            async with cache:
                raise AssertionError("the cache started without its database")
        assert str(failure.value).startswith("QL3_UNAVAILABLE: cannot read the contract family")
        health = cache.health()
        assert (health.mode, health.subscribed) == ("closed", False)
        assert asyncio.all_tasks() == before  # no subscription, pool or background task
        client = aioredis.Redis.from_url(redis_url)
        try:
            assert [n for _, n in await client.pubsub_numsub(*channels)] == [0, 0]
        finally:
            await client.aclose()

    run(scenario())
