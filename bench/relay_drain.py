"""Relay events/s draining a backlog, against raw pipelined PUBLISH of as many messages.

The backlog is written straight into ``ql3.contract_outbox`` in one statement (superuser,
referencing real revisions), then an in-process ``ql3.relay.Relay`` with its default
configuration is timed from ``start()`` until it has delivered every row (confirmed by
``ql3.outbox_backlog()``). A subscriber in another process counts what Redis delivered.
The baseline publishes the same number of messages of the same size with redis-py, in
pipelines of the relay's batch size, to one subscriber likewise: what a Python relay that
sends one PUBLISH per event through redis-py could reach at best (the relay itself sends
one Lua script call per batch, so it can beat this baseline).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import psycopg
import redis.asyncio as aioredis
from psycopg.rows import dict_row

from bench.common import (
    FAMILY,
    PROJECT,
    Helper,
    Result,
    Row,
    Settings,
    contract_pair,
    fresh_database,
    helpers,
    ratio,
    verdict,
)
from ql3.relay import Relay, RelayConfig, event_message, project_channel

TARGET_EVENTS_PER_S = 20_000.0
CONTRACT = "drain"

FILL_SQL = """
INSERT INTO ql3.contract_outbox
    (event_type, project_id, contract_family, contract_id, old_revision_id, new_revision_id,
     pointer_version)
SELECT 'revision_activated', %(project)s, %(family)s, %(contract)s,
       CASE WHEN g %% 2 = 0 THEN %(rev2)s::uuid ELSE %(rev1)s::uuid END,
       CASE WHEN g %% 2 = 0 THEN %(rev1)s::uuid ELSE %(rev2)s::uuid END,
       g + 1
FROM generate_series(1, %(events)s) AS g
"""


def fill_backlog(dsn: str, events: int) -> tuple[float, int]:
    """Writes the backlog; (seconds it took, size in bytes of one published message)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rev1, rev2 = contract_pair(conn, CONTRACT)
        # The setup's own activation is not part of the backlog.
        conn.execute("SELECT ql3.mark_outbox_delivered(array_agg(seq)) FROM ql3.contract_outbox")
        started = time.perf_counter()
        conn.execute(
            FILL_SQL,
            {"project": PROJECT, "family": FAMILY, "contract": CONTRACT, "rev1": rev1,
             "rev2": rev2, "events": events},
        )  # fmt: skip
        seconds = time.perf_counter() - started
        conn.execute("ANALYZE ql3.contract_outbox")
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(
                "SELECT * FROM ql3.contract_outbox WHERE delivered_at IS NULL ORDER BY seq DESC"
                " LIMIT 1"
            )
            row = cur.fetchone()
    assert row is not None
    return seconds, len(json.dumps(event_message(row)).encode())


def undelivered(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT undelivered FROM ql3.outbox_backlog()").fetchone()
        assert row is not None
        return int(row[0])


async def counted(counter: Helper) -> int:
    line = await counter.expect("count", timeout=120)
    return int(line[1])


async def raw_publish(redis_url: str, channel: str, events: int, size: int, batch: int) -> float:
    """Seconds to PUBLISH ``events`` messages of ``size`` bytes, ``batch`` per pipeline."""
    client = aioredis.Redis.from_url(redis_url)
    payloads = [f"{i:08d}".encode().ljust(size, b"x") for i in range(events)]
    try:
        await client.ping()
        started = time.perf_counter()
        for first in range(0, events, batch):
            async with client.pipeline(transaction=False) as pipe:
                for payload in payloads[first : first + batch]:
                    pipe.publish(channel, payload)
                await pipe.execute()
        return time.perf_counter() - started
    finally:
        await client.aclose()


async def relay_drain(dsn: str, redis_url: str, prefix: str, events: int) -> tuple[float, int]:
    """Seconds for a fresh relay to deliver the backlog, and how many it published."""
    relay = Relay(RelayConfig(dsn=dsn, redis_url=redis_url, channel_prefix=prefix))
    started = time.perf_counter()
    await relay.start()
    try:
        progress, progress_at = 0, started
        while relay.published < events:
            now = time.perf_counter()
            if relay.published != progress:
                progress, progress_at = relay.published, now
            elif now - progress_at > 30:
                raise TimeoutError(f"relay stalled after delivering {progress} of {events}")
            await asyncio.sleep(0.002)
        seconds = time.perf_counter() - started
    finally:
        await relay.stop()
    return seconds, relay.published


async def measure(settings: Settings, dsn: str, events: int, message_bytes: int) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    relay_prefix = f"bench:{tag}:relay"
    raw_channel = project_channel(f"bench:{tag}:raw", PROJECT)
    batch = RelayConfig(dsn=dsn, redis_url=settings.redis_url).batch
    idle = "30"

    async with helpers(
        "count-raw", 1, "count", "--redis-url", settings.redis_url, "--channel", raw_channel,
        "--expect", str(events), "--idle", idle,
    ) as (counter,):  # fmt: skip
        await counter.expect("ready", timeout=30)
        raw_seconds = await raw_publish(
            settings.redis_url, raw_channel, events, message_bytes, batch
        )
        raw_received = await counted(counter)

    async with helpers(
        "count-relay", 1, "count", "--redis-url", settings.redis_url,
        "--channel", project_channel(relay_prefix, PROJECT), "--expect", str(events),
        "--idle", idle,
    ) as (counter,):  # fmt: skip
        await counter.expect("ready", timeout=30)
        relay_seconds, published = await relay_drain(dsn, settings.redis_url, relay_prefix, events)
        relay_received = await counted(counter)
    return {
        "batch": batch,
        "raw_seconds": raw_seconds,
        "raw_received": raw_received,
        "relay_seconds": relay_seconds,
        "relay_published": published,
        "relay_received": relay_received,
    }


def run(settings: Settings) -> Result:
    events = 5_000 if settings.quick else 50_000
    with fresh_database(settings.base_dsn, "relay_drain") as dsn:
        fill_seconds, message_bytes = fill_backlog(dsn, events)
        m = asyncio.run(measure(settings, dsn, events, message_bytes))
        left = undelivered(dsn)
    if left != 0:
        raise RuntimeError(f"{left} outbox rows still undelivered after the relay finished")
    if m["relay_received"] != events:
        raise RuntimeError(f"the subscriber received {m['relay_received']} of {events} events")
    relay_rate = events / m["relay_seconds"]
    raw_rate = events / m["raw_seconds"]
    ok = relay_rate >= TARGET_EVENTS_PER_S
    return Result(
        name="relay_drain",
        figures={
            "events": events,
            "relay_events_per_s": round(relay_rate, 1),
            "relay_seconds": round(m["relay_seconds"], 3),
            "relay_batch": m["batch"],
            "message_bytes": message_bytes,
            "backlog_fill_seconds": round(fill_seconds, 3),
        },
        baseline={
            "raw_publish_per_s": round(raw_rate, 1),
            "raw_seconds": round(m["raw_seconds"], 3),
            "pipeline_size": m["batch"],
        },
        ratio={"relay_over_raw_publish": ratio(relay_rate, raw_rate)},
        target=f"relay >= {TARGET_EVENTS_PER_S:,.0f} events/s",
        passed=ok,
        rows=[
            Row(
                label=f"relay drain, {events:,}-event backlog",
                figure=f"{relay_rate:,.0f} events/s",
                baseline=f"{raw_rate:,.0f} msg/s raw pipelined PUBLISH ({message_bytes} B)",
                ratio=ratio(relay_rate, raw_rate),
                target=f">= {TARGET_EVENTS_PER_S:,.0f} events/s",
                result=verdict(ok),
            )
        ],
        checks={
            "outbox_undelivered_after": left,
            "relay_published": m["relay_published"],
            "subscriber_received_relay": m["relay_received"],
            "subscriber_received_raw": m["raw_received"],
        },
        notes=[
            "relay timed from start() (connect, LISTEN, sweep) until every row was marked "
            f"delivered; default RelayConfig (batch {m['batch']}, one publish script call per "
            "batch)",
            "one Redis subscriber in another process counted every message on both sides",
        ],
    )
