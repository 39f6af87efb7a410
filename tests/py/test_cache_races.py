"""The worker revision cache under forced interleavings and faults (SPEC section 8, D13).

The race tests hold the answer of one database read (the read really runs, so its snapshot
is taken, but the cache sees its rows only when the test opens a gate), change the
database or send messages meanwhile, then let the answer through and check what is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ql3.cache import _LOAD_ONE_SQL, _VERIFY_SQL, BodyHashMismatch, RevisionCache
from ql3.relay import project_channel
from test_cache import (
    FAMILY,
    Db,
    fake_heartbeats,
    operator,
    publish,
    run,
    until,
    worker,
)

KEY = ("proj", FAMILY, "routing")


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:10]}"


@contextlib.asynccontextmanager
async def steady_worker(
    db_dsn: str, redis_url: str, prefix: str
) -> AsyncIterator[tuple[Db, RevisionCache]]:
    """An operator connection and a worker cache in normal mode: heartbeats are faked and
    no relay runs, so a test announces (or withholds) each message by hand."""
    async with (
        operator(db_dsn) as ops,
        fake_heartbeats(redis_url, prefix),
        worker(db_dsn, redis_url, prefix, staleness=60.0) as c,
    ):
        await until(lambda: c.mode == "normal", 5, "normal mode")
        yield ops, c


def event(key: tuple[str, str, str], pointer_version: int) -> str:
    """An invalidation message as the relay publishes it (or as a forger would)."""
    project_id, family, contract_id = key
    return json.dumps(
        {"project_id": project_id, "contract_family": family, "contract_id": contract_id,
         "pointer_version": pointer_version}
    )  # fmt: skip


class HeldReads:
    """Delays the answers of the cache's reads of one SQL statement.

    The first such read runs, sets ``sent`` (its snapshot is taken) and answers only after
    ``release_first`` is set, then sets ``answered``: by the time a waiter of ``answered``
    runs, the cache has processed those rows. Later reads answer after ``release_later``,
    which is open unless ``hold_later``.
    """

    def __init__(
        self,
        cache: RevisionCache,
        sql: str,
        monkeypatch: pytest.MonkeyPatch,
        *,
        hold_later: bool = False,
    ) -> None:
        self.sent = asyncio.Event()
        self.release_first = asyncio.Event()
        self.answered = asyncio.Event()
        self.release_later = asyncio.Event()
        if not hold_later:
            self.release_later.set()
        fetch = cache._fetch
        calls = 0

        async def held(statement: str, params: Any) -> list[dict[str, Any]]:
            nonlocal calls
            rows = await fetch(statement, params)
            if statement != sql:
                return rows
            calls += 1
            if calls == 1:
                self.sent.set()
                await self.release_first.wait()
                self.answered.set()
            else:
                await self.release_later.wait()
            return rows

        monkeypatch.setattr(cache, "_fetch", held)


def logged(caplog: pytest.LogCaptureFixture, event_name: str) -> list[dict[str, Any]]:
    """The structured fields of every cache log record of that event."""
    return [r.__dict__["ql3"] for r in caplog.records if r.getMessage() == event_name]


# -- 1. a malformed message or a bug never ends the subscription ---------------------------


def test_a_message_nested_too_deeply_to_parse_is_counted_as_malformed_and_ignored(
    db_dsn: str, redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with steady_worker(db_dsn, redis_url, prefix) as (ops, c):
            await ops.activate(KEY, {"v": 1})
            await c.get_effective(*KEY)
            second = await ops.activate(KEY, {"v": 2})  # no relay: announced by hand below
            with caplog.at_level(logging.WARNING, logger="ql3.cache"):
                # json.loads raises RecursionError on this one.
                await publish(redis_url, f"{prefix}:proj", "[" * 100_000, event(KEY, 2))
                await until(lambda: c.health().messages == 1, 2, "the message after it")
            assert c.health().malformed_messages == 1
            assert len(logged(caplog, "cache_malformed_message")) == 1
            assert (await c.get_effective(*KEY)).revision_id == second
            assert c.health().subscribed and c.mode == "normal"

    run(scenario())


def test_an_unexpected_error_in_the_subscription_loop_resubscribes_and_reverifies_entries(
    db_dsn: str,
    redis_url: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> None:
        async with steady_worker(db_dsn, redis_url, prefix) as (ops, c):
            await ops.activate(KEY, {"v": 1})
            await c.get_effective(*KEY)
            second = await ops.activate(KEY, {"v": 2})  # no relay: this message is lost
            on_message = c._on_message

            def buggy(channel: object, data: object) -> None:
                if data in (b"boom", "boom"):
                    raise RuntimeError("a bug in the message path")
                on_message(channel, data)

            monkeypatch.setattr(c, "_on_message", buggy)
            with caplog.at_level(logging.INFO, logger="ql3.cache"):
                await publish(redis_url, f"{prefix}:proj", "boom")
                await until(
                    lambda: any(not f["first"] for f in logged(caplog, "cache_subscribed")),
                    3,
                    "a resubscription",
                )
            (lost,) = logged(caplog, "cache_subscription_lost")
            assert "a bug in the message path" in lost["error"]
            await until(lambda: c.mode == "normal", 3, "normal mode again")
            # Resubscribed entries are verified again: the lost activation is found.
            assert (await c.get_effective(*KEY)).revision_id == second

    run(scenario())


# -- 2. a read counts as of when it was sent -----------------------------------------------


def test_in_degraded_mode_a_verification_sent_before_a_call_does_not_serve_that_call(
    db_dsn: str, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        async with operator(db_dsn) as ops, worker(db_dsn, redis_url, prefix) as c:
            assert c.mode == "degraded"  # no heartbeat: verify before every use
            first = await ops.activate(KEY, {"v": 1})
            assert (await c.get_effective(*KEY)).revision_id == first
            held = HeldReads(c, _VERIFY_SQL, monkeypatch)
            earlier = asyncio.create_task(c.get_effective(*KEY))
            await held.sent.wait()  # its verification has read the database: first is active
            second = await ops.activate(KEY, {"v": 2})
            later = asyncio.create_task(c.get_effective(*KEY))
            await asyncio.sleep(0)  # later is called, and waits for the verification in flight
            held.release_first.set()
            assert (await earlier).revision_id == first
            assert (await later).revision_id == second

    run(scenario())


@pytest.mark.parametrize("read", ["verification", "load"])
def test_a_read_sent_before_entries_were_marked_unverified_does_not_verify_them(
    db_dsn: str, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    """Heartbeats returning (like a resubscription) mark every entry unverified."""

    async def scenario() -> None:
        async with operator(db_dsn) as ops, worker(db_dsn, redis_url, prefix, staleness=60.0) as c:
            assert c.mode == "degraded"
            await ops.activate(KEY, {"v": 1})
            old: asyncio.Task[Any]
            if read == "verification":
                await c.get_effective(*KEY)
                held = HeldReads(c, _VERIFY_SQL, monkeypatch, hold_later=True)
                old = asyncio.create_task(c.verify_all())
            else:
                held = HeldReads(c, _LOAD_ONE_SQL, monkeypatch, hold_later=True)
                old = asyncio.create_task(c.get_effective(*KEY))
            await held.sent.wait()  # snapshot: the first revision
            second = await ops.activate(KEY, {"v": 2})  # no relay: this message is lost
            async with fake_heartbeats(redis_url, prefix):
                await until(lambda: c.mode == "normal", 5, "normal mode")
                held.release_first.set()
                await held.answered.wait()
                new = asyncio.create_task(c.get_effective(*KEY))
                await asyncio.sleep(0)
                held.release_later.set()
                assert (await new).revision_id == second
                await old

    run(scenario())


# -- 3. a hint the database does not confirm hides no real message -------------------------


def test_a_real_message_after_an_unconfirmed_hint_is_still_read(
    db_dsn: str, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel = project_channel(prefix, KEY[0])

    async def scenario() -> None:
        async with steady_worker(db_dsn, redis_url, prefix) as (ops, c):
            first = await ops.activate(KEY, {"v": 1})
            assert (await c.get_effective(*KEY)).revision_id == first
            held = HeldReads(c, _LOAD_ONE_SQL, monkeypatch)
            await publish(redis_url, channel, event(KEY, 1000))  # forged or corrupt
            await held.sent.wait()  # the reload it caused has read version 1
            second = await ops.activate(KEY, {"v": 2})
            await publish(redis_url, channel, event(KEY, 2))  # the relay's real message
            await until(lambda: c.health().messages == 2, 5, "both messages")
            held.release_first.set()  # version 1 < 1000: the database does not confirm it
            await held.answered.wait()
            assert (await c.get_effective(*KEY)).revision_id == second
            assert c.health().messages == 2

    run(scenario())


# -- 4. a refused revision is never replaced by an older one -------------------------------


def test_a_load_sent_before_a_refused_revision_does_not_install_an_older_one(
    db_dsn: str, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        async with steady_worker(db_dsn, redis_url, prefix) as (ops, c):
            await ops.activate(KEY, {"v": 1})
            held = HeldReads(c, _LOAD_ONE_SQL, monkeypatch)
            caller = asyncio.create_task(c.get_effective(*KEY))
            await held.sent.wait()  # its snapshot: version 1
            second = await ops.activate(KEY, {"v": 2})
            # Tamper behind the immutability trigger (a superuser in replica mode).
            await ops.conn.execute("SET session_replication_role = replica")
            await ops.conn.execute(
                "UPDATE ql3.contract_revisions SET body = '{\"v\": 999}' WHERE revision_id = %s",
                (second,),
            )
            await publish(redis_url, project_channel(prefix, KEY[0]), event(KEY, 2))
            await until(lambda: c.health().reloads == 1, 5, "the reload of version 2")
            held.release_first.set()  # version 1 arrives after version 2 was refused
            with pytest.raises(BodyHashMismatch):
                await caller
            with pytest.raises(BodyHashMismatch):
                await c.get_effective(*KEY)
            assert c.health().entries == 0

    run(scenario())


# -- 5. close -------------------------------------------------------------------------------


def test_close_waits_for_the_on_change_callbacks_it_cancels(db_dsn: str, redis_url: str) -> None:
    async def scenario() -> None:
        async with operator(db_dsn) as ops:
            await ops.activate(KEY, {"v": 1})
        started = asyncio.Event()
        cleaned = asyncio.Event()

        async def reset_clients(rev: Any) -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                await asyncio.sleep(0.2)  # cleanup that takes a while, e.g. closing clients
                cleaned.set()

        cache = RevisionCache(db_dsn, redis_url)
        await cache.start()
        cache.on_change(FAMILY, KEY[2], reset_clients)
        await cache.get_effective(*KEY)
        await started.wait()
        await cache.close()
        assert cleaned.is_set()

    run(scenario())
