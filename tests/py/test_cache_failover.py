"""The worker revision cache across a failover (D48): the database decides, even backwards.

After an asynchronous promotion the new primary may hold a lower pointer_version than a
cache has seen, and other revisions. A second database cloned from the first before its
last activations stands in for the promoted replica: it has its own failover epoch (the
database oid is part of it), as a promoted replica has (a new timeline). The cache's pool
is pointed at it, as a multi-host DSN would be, and the relay moves with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from fix_servers import create_database, drop_database
from ql3 import errors
from ql3.cache import _LOAD_ONE_SQL, RevisionCache
from ql3.relay import project_channel
from test_cache import (
    FAMILY,
    fake_heartbeats,
    operator,
    publish,
    relay,
    run,
    until,
    until_served,
)
from test_cache_races import HeldReads

KEY = ("proj", FAMILY, "routing")


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:10]}"


def epoch_of(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT ql3.failover_epoch()").fetchone()
    assert row is not None
    return str(row[0])


def dbname(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


def terminate_backends(base_dsn: str, dsn: str) -> None:
    """Ends every session on dsn's database but ours: the server it lived on is gone."""
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname(dsn),),
        )


def logged(caplog: pytest.LogCaptureFixture, event_name: str) -> list[dict[str, Any]]:
    return [r.__dict__["ql3"] for r in caplog.records if r.getMessage() == event_name]


@contextlib.asynccontextmanager
async def switchable_cache(
    target: list[str], redis_url: str, prefix: str, **options: Any
) -> AsyncIterator[RevisionCache]:
    """A cache whose pool connects to ``target[0]``, whatever it is by then."""

    async def conninfo() -> str:
        return target[0]

    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        conninfo, min_size=1, max_size=4, open=False, timeout=5, kwargs={"autocommit": True}
    )
    await pool.open()
    try:
        settings: dict[str, Any] = {
            "heartbeat_timeout": 0.5,
            "redis_timeout": 1.0,
            "max_staleness": {FAMILY: 60.0},
        }
        settings.update(options)
        cache = RevisionCache(pool, redis_url, channel_prefix=prefix, **settings)
        async with cache:
            yield cache
    finally:
        await pool.close()


def test_after_a_failover_the_cache_takes_the_lower_pointer_version_without_a_restart(
    db_dsn: str, base_dsn: str, redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The promoted database lost the last two activations: once the cache has seen its
    epoch it serves what that database holds, never what only the old one held."""
    caplog.set_level(logging.INFO, logger="ql3.cache")
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        first = conn.execute(
            "SELECT revision_id::text FROM ql3.put_revision(%s, %s, %s, '{\"v\": 1}', 't')", KEY
        ).fetchone()
        assert first is not None
        conn.execute("SELECT ql3.activate_revision(%s, %s, %s, %s::uuid, 't')", (*KEY, first[0]))
    replica = create_database(base_dsn, template=dbname(db_dsn), prefix="promoted")
    try:
        old_epoch, new_epoch = epoch_of(db_dsn), epoch_of(replica)
        assert old_epoch != new_epoch

        async def scenario() -> None:
            target = [db_dsn]
            served: list[tuple[str | None, str]] = []  # (epoch before the call, revision)
            async with (
                operator(db_dsn) as old_ops,
                switchable_cache(target, redis_url, prefix) as cache,
            ):
                async with relay(db_dsn, redis_url, prefix):
                    await until(lambda: cache.mode == "normal", 5, "normal mode")
                    await old_ops.activate(KEY, {"v": 2})
                    lost = await old_ops.activate(KEY, {"v": 3})
                    await until_served(cache, KEY, lost, 5)
                    assert (await cache.get_effective(*KEY)).pointer_version == 3

                async def keep_reading() -> None:
                    while True:
                        before = cache.health().failover_epoch
                        with contextlib.suppress(errors.Unavailable):
                            served.append((before, (await cache.get_effective(*KEY)).revision_id))
                        await asyncio.sleep(0.005)

                reader = asyncio.create_task(keep_reading())
                try:
                    # The old primary is gone; the DSN now reaches the promoted replica.
                    target[0] = replica
                    terminate_backends(base_dsn, db_dsn)
                    async with relay(replica, redis_url, prefix), operator(replica) as ops:
                        await until_served(cache, KEY, first[0], 10)
                        health = cache.health()
                        assert health.failover_epoch == new_epoch
                        assert health.failover_epoch_changes == 1
                        # Activations on the new primary reach the cache by message, at a
                        # pointer_version below the one it held before.
                        after = await ops.activate(KEY, {"v": 4})
                        await until_served(cache, KEY, after, 5)
                        assert (await cache.get_effective(*KEY)).pointer_version == 2
                        await until(lambda: cache.mode == "normal", 5, "normal mode again")
                finally:
                    reader.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reader
            held_by_replica = {first[0], after}
            seen_new = [revision for epoch, revision in served if epoch == new_epoch]
            assert seen_new and set(seen_new) <= held_by_replica
            changes = logged(caplog, "cache_failover_epoch_changed")
            assert [(c["previous"], c["epoch"]) for c in changes] == [(old_epoch, new_epoch)]

        run(scenario())
    finally:
        drop_database(base_dsn, replica)


def test_without_an_epoch_change_a_lower_pointer_version_is_never_served(
    db_dsn: str, redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Same epoch, lower pointer: the cache stays monotonic (it fails closed rather than
    serve an older revision) and says the database is behind."""
    caplog.set_level(logging.INFO, logger="ql3.cache")

    async def scenario() -> None:
        async with (
            operator(db_dsn) as ops,
            relay(db_dsn, redis_url, prefix),
            switchable_cache([db_dsn], redis_url, prefix, max_staleness={FAMILY: 0.3}) as cache,
        ):
            await until(lambda: cache.mode == "normal", 5, "normal mode")
            older = await ops.activate(KEY, {"v": 1})
            newer = await ops.activate(KEY, {"v": 2})
            await until_served(cache, KEY, newer, 5)
            # Rewritten behind the functions' back, as no failover would leave it.
            await ops.conn.execute("SET session_replication_role = replica")
            await ops.conn.execute(
                "UPDATE ql3.active_revisions SET active_revision_id = %s::uuid, pointer_version = 1"
                " WHERE project_id = %s AND contract_family = %s AND contract_id = %s",
                (older, *KEY),
            )
            await asyncio.sleep(0.4)  # past the budget: the next use verifies
            for _ in range(3):
                with contextlib.suppress(errors.Unavailable):
                    assert (await cache.get_effective(*KEY)).revision_id == newer
            assert logged(caplog, "cache_database_behind")
            assert cache.health().failover_epoch_changes == 0

    run(scenario())


def test_a_message_or_heartbeat_of_another_epoch_is_checked_once_and_then_ignored(
    db_dsn: str, redis_url: str, prefix: str
) -> None:
    """A message from another history orders nothing here and a heartbeat from it is no
    sign of a working feed; the database is asked once which epoch it is in, so a relay
    left on an old primary (or a forger) costs one read, not one per message."""

    async def scenario() -> None:
        async with (
            operator(db_dsn) as ops,
            relay(db_dsn, redis_url, prefix),
            switchable_cache([db_dsn], redis_url, prefix) as cache,
        ):
            await until(lambda: cache.mode == "normal", 5, "normal mode")
            revision_id = await ops.activate(KEY, {"v": 1})
            await until_served(cache, KEY, revision_id, 5)
            own = cache.health().failover_epoch
            verifications = cache.health().verifications
            foreign = "1/1/1"
            message = {
                "project_id": KEY[0], "contract_family": KEY[1], "contract_id": KEY[2],
                "pointer_version": 99, "failover_epoch": foreign,
            }  # fmt: skip
            beat = {"type": "heartbeat", "relay_id": "old", "seq": 0, "at": "x",
                    "failover_epoch": foreign}  # fmt: skip
            await publish(redis_url, project_channel(prefix, KEY[0]), *[json.dumps(message)] * 20)
            await publish(redis_url, f"{prefix}:__heartbeat__", *[json.dumps(beat)] * 20)
            await until(lambda: cache.health().verifications > verifications, 5, "a check")
            await asyncio.sleep(0.2)
            health = cache.health()
            assert health.failover_epoch == own and health.failover_epoch_changes == 0
            assert health.verifications - verifications <= 2
            assert (await cache.get_effective(*KEY)).revision_id == revision_id  # no reload

    run(scenario())


def test_heartbeats_of_another_epoch_alone_leave_the_cache_degraded(
    db_dsn: str, redis_url: str, prefix: str
) -> None:
    async def scenario() -> None:
        async with switchable_cache([db_dsn], redis_url, prefix) as cache:
            beat = {"type": "heartbeat", "relay_id": "old", "seq": 0, "at": "x",
                    "failover_epoch": "1/1/1"}  # fmt: skip
            for _ in range(20):
                await publish(redis_url, f"{prefix}:__heartbeat__", json.dumps(beat))
                await asyncio.sleep(0.05)
            assert cache.health().mode == "degraded"
            beat["failover_epoch"] = cache.health().failover_epoch
            for _ in range(3):
                await publish(redis_url, f"{prefix}:__heartbeat__", json.dumps(beat))
                await asyncio.sleep(0.05)
            assert cache.health().mode == "normal"

    run(scenario())


def test_a_read_of_the_old_epoch_answered_after_the_new_one_was_seen_installs_nothing(
    db_dsn: str, base_dsn: str, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload sent to the old primary whose answer arrives after the cache has read the
    promoted one must not bring back a revision the new database does not hold."""
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        first = conn.execute(
            "SELECT revision_id::text FROM ql3.put_revision(%s, %s, %s, '{\"v\": 1}', 't')", KEY
        ).fetchone()
        assert first is not None
        conn.execute("SELECT ql3.activate_revision(%s, %s, %s, %s::uuid, 't')", (*KEY, first[0]))
    replica = create_database(base_dsn, template=dbname(db_dsn), prefix="promoted")
    try:

        async def scenario() -> None:
            target = [db_dsn]
            async with (
                operator(db_dsn) as old_ops,
                fake_heartbeats(redis_url, prefix),
                switchable_cache(target, redis_url, prefix) as cache,
            ):
                await until(lambda: cache.mode == "normal", 5, "normal mode")
                assert (await cache.get_effective(*KEY)).revision_id == first[0]
                held = HeldReads(cache, _LOAD_ONE_SQL, monkeypatch)
                lost = await old_ops.activate(KEY, {"v": 2})
                message = {"project_id": KEY[0], "contract_family": KEY[1],
                           "contract_id": KEY[2], "pointer_version": 2}  # fmt: skip
                await publish(redis_url, project_channel(prefix, KEY[0]), json.dumps(message))
                await asyncio.wait_for(held.sent.wait(), 5)  # the old primary answered v2
                target[0] = replica
                terminate_backends(base_dsn, db_dsn)
                # The message dropped the entry: this use loads it from the promoted database.
                assert (await cache.get_effective(*KEY)).revision_id == first[0]
                assert cache.health().failover_epoch_changes == 1
                held.release_first.set()
                await asyncio.wait_for(held.answered.wait(), 5)
                await asyncio.sleep(0.05)
                served = await cache.get_effective(*KEY)
                assert served.revision_id == first[0] != lost

        run(scenario())
    finally:
        drop_database(base_dsn, replica)
