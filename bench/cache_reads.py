"""RevisionCache read latency: a hit, and a verified read, against a bare ``SELECT 1``.

- hit: a cache in normal mode (a relay in this process sends heartbeats) serving a cached,
  fresh entry; no database round trip (checked: no reload or verification during the run).
- verified read: a cache in degraded mode (subscribed to a prefix no relay heartbeats on),
  which verifies the entry against its active pointer before every use (checked: one
  verification per read). Measured as constructed by default, and with an autocommit pool
  passed in by the caller (diagnostic; the cache's own pool is of the same kind).
- baseline: ``SELECT 1`` on an autocommit psycopg AsyncConnection, same event loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from bench.common import (
    FAMILY,
    PROJECT,
    Result,
    Row,
    Settings,
    contract_pair,
    fresh_database,
    percentile,
    ratio,
    us,
)
from ql3.cache import RevisionCache
from ql3.relay import Relay, RelayConfig

CONTRACT = "reads"
KEY = (PROJECT, FAMILY, CONTRACT)


async def timed(call: Callable[[], Awaitable[Any]], count: int) -> list[float]:
    """Seconds per call, after ``count // 10`` untimed warm-up calls."""
    for _ in range(count // 10):
        await call()
    out: list[float] = []
    for _ in range(count):
        started = time.perf_counter()
        await call()
        out.append(time.perf_counter() - started)
    return out


async def wait_mode(cache: RevisionCache, mode: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while cache.mode != mode:
        if time.monotonic() > deadline:
            raise RuntimeError(f"cache is {cache.mode}, not {mode}, after {timeout} s")
        await asyncio.sleep(0.02)


async def verified_reads(cache: RevisionCache, count: int) -> tuple[list[float], int]:
    """Latencies of reads in degraded mode, and how many verifications they made."""
    await cache.start()
    try:
        await cache.get_effective(*KEY)
        await wait_mode(cache, "degraded")
        before = cache.health().verifications
        lat = await timed(lambda: cache.get_effective(*KEY), count)
        return lat, cache.health().verifications - before
    finally:
        await cache.close()


async def measure(dsn: str, redis_url: str, hits: int, reads: int) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        contract_pair(conn, CONTRACT)
    prefix = f"bench:{uuid.uuid4().hex[:8]}"
    relay = Relay(RelayConfig(dsn=dsn, redis_url=redis_url, channel_prefix=prefix))
    await relay.start()
    await relay.wait_ready()
    try:
        async with RevisionCache(dsn, redis_url, channel_prefix=prefix) as cache:
            await cache.get_effective(*KEY)
            await wait_mode(cache, "normal")
            # Going normal re-verifies every entry in the background: let that finish.
            await asyncio.sleep(0.2)
            await cache.get_effective(*KEY)
            before = cache.health()
            hit = await timed(lambda: cache.get_effective(*KEY), hits)
            after = cache.health()
        round_trips = (after.reloads - before.reloads) + (
            after.verifications - before.verifications
        )

        silent = f"{prefix}:silent"  # no relay heartbeats there: degraded mode
        verified, verifications = await verified_reads(
            RevisionCache(dsn, redis_url, channel_prefix=silent), reads
        )
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            dsn, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
        )
        await pool.open()
        try:
            tuned, tuned_verifications = await verified_reads(
                RevisionCache(pool, redis_url, channel_prefix=silent), reads
            )
        finally:
            await pool.close()
    finally:
        await relay.stop()

    aconn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        select1 = await timed(lambda: aconn.execute("SELECT 1"), reads)
    finally:
        await aconn.close()
    return {
        "hit": hit,
        "hit_round_trips": round_trips,
        "verified": verified,
        "verifications": verifications,
        "tuned": tuned,
        "tuned_verifications": tuned_verifications,
        "select1": select1,
    }


def run(settings: Settings) -> Result:
    hits, reads = (2_000, 300) if settings.quick else (20_000, 3_000)
    with fresh_database(settings.base_dsn, "cache_reads") as dsn:
        m = asyncio.run(measure(dsn, settings.redis_url, hits, reads))
    if m["hit_round_trips"]:
        raise RuntimeError(f"{m['hit_round_trips']} database round trips during the hit run")
    if m["verifications"] < reads or m["tuned_verifications"] < reads:
        raise RuntimeError("a degraded-mode read did not verify against the database")

    def p(name: str, q: float) -> float:
        return us(percentile(m[name], q))

    s50, s99 = p("select1", 50), p("select1", 99)
    base_text = f"{s50:.0f} / {s99:.0f} µs SELECT 1"
    return Result(
        name="cache_reads",
        figures={
            "hits": hits,
            "hit_p50_us": p("hit", 50),
            "hit_p99_us": p("hit", 99),
            "verified_reads": reads,
            "verified_p50_us": p("verified", 50),
            "verified_p99_us": p("verified", 99),
            "autocommit_pool_verified_p50_us": p("tuned", 50),
            "autocommit_pool_verified_p99_us": p("tuned", 99),
        },
        baseline={"select1_p50_us": s50, "select1_p99_us": s99, "select1_runs": reads},
        ratio={
            "hit_p50_over_select1_p50": ratio(p("hit", 50), s50),
            "verified_p50_over_select1_p50": ratio(p("verified", 50), s50),
            "autocommit_pool_verified_p50_over_select1_p50": ratio(p("tuned", 50), s50),
        },
        target=None,
        passed=None,
        rows=[
            Row(
                label="cache hit p50 / p99",
                figure=f"{p('hit', 50):.1f} / {p('hit', 99):.1f} µs",
                baseline=base_text,
                ratio=ratio(p("hit", 50), s50),
                target="(none)",
                result="n/a",
            ),
            Row(
                label="verified read p50 / p99 (degraded mode)",
                figure=f"{p('verified', 50):.0f} / {p('verified', 99):.0f} µs",
                baseline=base_text,
                ratio=ratio(p("verified", 50), s50),
                target="(none)",
                result="n/a",
            ),
            Row(
                label="verified read p50 / p99, on a pool passed in (autocommit)",
                figure=f"{p('tuned', 50):.0f} / {p('tuned', 99):.0f} µs",
                baseline=base_text,
                ratio=ratio(p("tuned", 50), s50),
                target="(diagnostic)",
                result="n/a",
            ),
        ],
        checks={
            "round_trips_during_hits": m["hit_round_trips"],
            "verifications_during_verified_reads": m["verifications"],
        },
        notes=["ratios are p50 over the SELECT 1 p50"],
    )
