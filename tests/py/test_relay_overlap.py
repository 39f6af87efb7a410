"""The relay's drain overlaps consecutive batches on two connections (``Relay._drain``).

Batch N is marked delivered and committed on one connection while batch N+1 is claimed
and published on the other. These tests check that events still go out once each in seq
order, and that a Redis failure mid-drain commits the batch before it and records the
failure on its own rows only.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from redis.exceptions import ConnectionError as RedisConnectionError

from ql3.relay import ClaimedRow, RedisUnavailable, Relay, RelayConfig


def run(coro: Any, timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def write_events(dsn: str, count: int) -> list[int]:
    """``count`` activations of one contract, flipping between two revisions; their seqs."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        revisions = []
        for n in range(2):
            cur = await conn.execute(
                "SELECT revision_id FROM ql3.put_revision('p', 'policy_routing', 'overlap',"
                " %s::jsonb, 'test')",
                (Jsonb({"n": n}),),
            )
            row = await cur.fetchone()
            assert row is not None
            revisions.append(row[0])
        seqs = []
        for i in range(count):
            cur = await conn.execute(
                "SELECT seq FROM ql3.activate_revision('p', 'policy_routing', 'overlap', %s,"
                " 'test')",
                (revisions[i % 2],),
            )
            row = await cur.fetchone()
            assert row is not None and row[0] is not None
            seqs.append(int(row[0]))
        return seqs


async def outbox(dsn: str, seqs: list[int]) -> list[dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(
            "SELECT seq, delivered_at, relay_attempts, last_error FROM ql3.contract_outbox"
            " WHERE seq = ANY(%s) ORDER BY seq",
            (seqs,),
        )
        return await cur.fetchall()


async def received_seqs(url: str, pattern: str, expect: int, action: Any) -> list[int]:
    """Run action while subscribed to pattern; the seqs of the first ``expect`` messages."""
    client = aioredis.Redis.from_url(url)
    pubsub: Any = client.pubsub()
    try:
        await pubsub.psubscribe(pattern)
        confirmation = await pubsub.get_message(timeout=5.0)
        assert confirmation is not None and confirmation["type"] == "psubscribe"
        await action()
        seqs: list[int] = []
        deadline = asyncio.get_running_loop().time() + 10
        while len(seqs) < expect and asyncio.get_running_loop().time() < deadline:
            message = await pubsub.get_message(timeout=0.2)
            if message is not None and message["type"] == "pmessage":
                seqs.append(int(json.loads(message["data"])["seq"]))
        await asyncio.sleep(0.2)  # anything beyond expect would be a duplicate
        while (message := await pubsub.get_message(timeout=0.05)) is not None:
            if message["type"] == "pmessage":
                seqs.append(int(json.loads(message["data"])["seq"]))
        return seqs
    finally:
        await pubsub.aclose()
        await client.aclose()


def test_overlapped_drain_publishes_once_each_in_seq_order(db_dsn: str, redis_url: str) -> None:
    prefix = f"test:{uuid.uuid4().hex[:10]}"

    async def scenario() -> None:
        written = await write_events(db_dsn, 41)
        relay = Relay(RelayConfig(dsn=db_dsn, redis_url=redis_url, channel_prefix=prefix, batch=4))

        async def drain() -> None:
            await relay._connect_pg()
            await relay._drain()  # 10 full batches and a short one

        try:
            got = await received_seqs(redis_url, f"{prefix}:*", len(written), drain)
            async with await psycopg.AsyncConnection.connect(db_dsn, autocommit=True) as conn:
                cur = await conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ql3-relay'"
                    " AND datname = current_database()"
                )
                row = await cur.fetchone()
                assert row is not None and row[0] == 2  # the drain used both connections
        finally:
            await relay.stop()
        assert got == written
        assert relay.published == len(written) and relay.delivered_seq == written[-1]
        assert all(row["delivered_at"] is not None for row in await outbox(db_dsn, written))

    run(scenario())


def test_redis_failure_mid_drain_commits_the_batch_before_and_records_its_own(
    db_dsn: str, redis_url: str
) -> None:
    prefix = f"test:{uuid.uuid4().hex[:10]}"

    class FailsThirdPublish(Relay):
        calls = 0

        async def _publish_many(self, rows: Sequence[ClaimedRow]) -> None:
            self.calls += 1
            if self.calls == 3:
                raise RedisConnectionError("Redis went away")
            await super()._publish_many(rows)

    async def scenario() -> None:
        written = await write_events(db_dsn, 20)
        relay = FailsThirdPublish(
            RelayConfig(dsn=db_dsn, redis_url=redis_url, channel_prefix=prefix, batch=5)
        )

        async def drain() -> None:
            await relay._connect_pg()
            with pytest.raises(RedisUnavailable, match="Redis went away"):
                await relay._drain()

        try:
            got = await received_seqs(redis_url, f"{prefix}:*", 10, drain)
        finally:
            await relay.stop()
        assert got == written[:10]
        assert relay.published == 10 and relay.delivered_seq == written[9]
        rows = await outbox(db_dsn, written)
        # Batches 1 and 2 committed (2 while batch 3 was failing); 3 recorded the failure;
        # 4 was never claimed.
        assert [r["delivered_at"] is not None for r in rows] == [True] * 10 + [False] * 10
        assert [r["relay_attempts"] for r in rows] == [1] * 15 + [0] * 5
        assert all("Redis went away" in r["last_error"] for r in rows[10:15])
        assert all(r["last_error"] is None for r in rows[:10] + rows[15:])
        assert relay.health()["redis"] is False

    run(scenario())
