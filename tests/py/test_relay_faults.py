"""The relay under faults the other relay tests do not reach: work connections cut silently
(a partition: no FIN, no RST), Redis down for one relay while another delivers, and what
health and metrics say meanwhile.

Helpers and fixtures come from ``test_relay``; a cut connection goes through the TCP proxy
of ``fix_tcp_proxy``, frozen.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from fix_tcp_proxy import PgProxy, proxy_for
from ql3 import devservers
from ql3.relay import WORK_APPLICATION_NAME, Relay, config_from_args, register
from test_relay import (
    Subscriber,
    activate,
    backlog,
    config,
    db,
    prefix,
    run,
    running,
    sample,
    scratch,
    until,
    until_backlog_empty,
)

__all__ = ["db", "prefix", "scratch"]  # fixtures, used by name


def pg_failures(relay: Relay) -> float:
    return sample(relay, "ql3_relay_failures_total", target="postgres")


def redis_failures(relay: Relay) -> float:
    return sample(relay, "ql3_relay_failures_total", target="redis")


async def stop_while_hung(relay: Relay, proxy: PgProxy, *, stuck_for: float, within: float) -> None:
    """Start the relay, cut its work connections silently, wait until a cycle has been stuck
    for ``stuck_for`` seconds (a cycle runs every 0.1 s), then request a stop: the relay
    must end, cleanly, within ``within`` seconds (and a little slack)."""
    await relay.start()
    await relay.wait_ready()
    proxy.freeze()
    await until(
        lambda: (relay.health()["last_cycle_age_seconds"] or 0.0) > stuck_for,
        5,
        "a cycle stuck on the cut connection",
    )
    assert relay._task is not None
    relay.request_stop()
    done, _ = await asyncio.wait({relay._task}, timeout=within + 2.0)
    assert done, f"the stop request waited longer than {within} s"
    relay._task.result()  # ended cleanly


# -- a silently cut work connection (defect: the relay hung for ever) ----------------------


def test_a_silently_cut_work_connection_is_given_up_after_the_postgres_timeout(
    db: str, redis_url: str, prefix: str
) -> None:
    proxy = proxy_for(db)

    async def scenario() -> None:
        relay_config = config(
            proxy.dsn(db), redis_url, prefix, listen_dsn=db, poll_interval=0.1,
            postgres_timeout=1.0,
        )  # fmt: skip
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
            running(Relay(relay_config)) as relay,
        ):
            proxy.freeze()  # the work connections hear nothing more, and nothing breaks
            event = await activate(conn, "p", "c", {"n": 0})
            await until(lambda: event["seq"] in sub.seqs(), 10, "the event after the cut")
            await until_backlog_empty(db, 5)
            assert pg_failures(relay) >= 1
            assert sample(relay, "ql3_relay_reconnects_total", target="postgres") >= 1
            await until(lambda: relay.health()["status"] == "ok", 5, "a healthy relay again")

    try:
        run(scenario())
    finally:
        proxy.close()


def test_a_stop_request_during_a_hung_cycle_ends_within_the_postgres_timeout(
    db: str, redis_url: str, prefix: str
) -> None:
    proxy = proxy_for(db)
    timeout = 2.0

    async def scenario() -> None:
        relay = Relay(
            config(
                proxy.dsn(db), redis_url, prefix, listen_dsn=db, poll_interval=0.1,
                postgres_timeout=timeout,
            )
        )  # fmt: skip
        try:
            await stop_while_hung(relay, proxy, stuck_for=1.0, within=timeout)
            assert pg_failures(relay) == 1
        finally:
            proxy.close()  # lets an old, hung relay end too
            await relay.stop()

    try:
        run(scenario())
    finally:
        proxy.close()


def test_a_batch_whose_mark_hangs_is_claimed_and_published_again(
    db: str, redis_url: str, prefix: str
) -> None:
    proxy = proxy_for(db)

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            written = [(await activate(conn, "p", f"c{i}", {"i": i}))["seq"] for i in range(10)]
            relay = Relay(
                config(
                    proxy.dsn(db), redis_url, prefix, listen_dsn=db, batch=20,
                    pause_mid_batch=1.0, postgres_timeout=1.0, poll_interval=0.1,
                )
            )  # fmt: skip
            async with Subscriber(redis_url, prefix) as sub:
                await relay.start()
                try:
                    await until(lambda: len(sub.events) >= 5, 10, "half a batch published")
                    proxy.freeze()  # Redis gets the rest; the mark and COMMIT go nowhere
                    await until_backlog_empty(db, 15)
                    await until(lambda: len(sub.events) >= 2 * len(written), 5, "the redo")
                finally:
                    await relay.stop()
            counts = collections.Counter(e["seq"] for e in sub.events)
            assert sorted(counts) == written
            assert all(n >= 2 for n in counts.values()), counts  # at least once: again
            assert pg_failures(relay) >= 1

    try:
        run(scenario())
    finally:
        proxy.close()


def test_postgres_timeout_comes_from_the_flag_or_the_environment() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    env = {"QL3_DSN": "dbname=x", "QL3_REDIS_URL": "redis://y"}
    assert config_from_args(parser.parse_args(["relay"]), env).postgres_timeout == 30.0
    env["QL3_RELAY_POSTGRES_TIMEOUT"] = "12.5"
    assert config_from_args(parser.parse_args(["relay"]), env).postgres_timeout == 12.5
    args = parser.parse_args(["relay", "--postgres-timeout", "3"])
    assert config_from_args(args, env).postgres_timeout == 3.0


def test_relay_connections_carry_tcp_keepalives_unless_the_dsn_sets_its_own(
    db: str, redis_url: str, prefix: str
) -> None:
    async def scenario() -> None:
        relay = Relay(config(db, redis_url, prefix, postgres_timeout=7.0))
        own = make_conninfo(db, keepalives_idle="42")
        for dsn, idle in ((db, "10"), (own, "42")):
            conn = await relay._connect(dsn, WORK_APPLICATION_NAME)
            try:
                params = conn.info.get_parameters()
            finally:
                await conn.close()
            assert params["keepalives_idle"] == idle
            assert params["tcp_user_timeout"] == "7000"
        assert "keepalives_idle" not in conninfo_to_dict(db)

    run(scenario())


# -- health and metrics while Redis is down ------------------------------------------------


def test_backlog_metrics_follow_the_outbox_while_redis_is_down(db: str, prefix: str) -> None:
    nowhere = f"redis://127.0.0.1:{devservers.free_port()}/0"

    async def scenario() -> None:
        relay = Relay(config(db, nowhere, prefix, poll_interval=0.1, redis_timeout=0.5))
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            running(relay),
        ):
            for i in range(3):
                await activate(conn, "p", f"c{i}", {"i": i})
            await until(lambda: sample(relay, "ql3_relay_backlog") == 3, 5, "the backlog gauge")
            await until(
                lambda: sample(relay, "ql3_relay_oldest_undelivered_age_seconds") > 0,
                5,
                "the oldest undelivered age",
            )
            assert relay.health()["backlog"]["undelivered"] == 3
            assert redis_failures(relay) >= 1
            assert await backlog(db) == 3

    run(scenario())


def test_an_idle_relay_notices_that_redis_is_back_after_another_relay_delivered(
    db: str, redis_url: str, prefix: str, scratch: Path
) -> None:
    # The stuck relay's Redis goes down; another relay, on a Redis that works, delivers
    # the row; then the stuck relay's Redis comes back, with nothing left to publish.
    rd = devservers.start_redis(scratch)

    async def scenario() -> None:
        stuck_config = config(db, rd.url, prefix, poll_interval=0.1, relay_id="stuck")
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            running(Relay(stuck_config)) as stuck,
        ):
            rd.stop()
            await activate(conn, "p", "c", {"n": 0})
            await until(lambda: redis_failures(stuck) >= 1, 10, "the publish to fail")
            other_config = config(db, redis_url, prefix, poll_interval=0.1, relay_id="other")
            async with running(Relay(other_config)):
                await until_backlog_empty(db, 10)
            # Idle now, and Redis still down: it keeps finding out, and stays unhealthy.
            seen = redis_failures(stuck)
            await until(lambda: redis_failures(stuck) > seen, 5, "a failed probe while idle")
            assert stuck.health()["status"] == "unhealthy"
            rd.start()
            async with Subscriber(rd.url, prefix) as sub:
                await until(
                    lambda: any(h["relay_id"] == "stuck" for h in sub.heartbeats),
                    5,
                    "a heartbeat from the relay whose publish had failed",
                )
            assert stuck.health()["status"] == "ok"
            assert sample(stuck, "ql3_relay_up") == 1
            assert sample(stuck, "ql3_relay_reconnects_total", target="redis") == 1
            assert stuck.published == 0

    try:
        run(scenario())
    finally:
        rd.stop()


def test_a_stop_request_gives_a_hung_cycle_only_the_stop_grace(
    db: str, redis_url: str, prefix: str
) -> None:
    proxy = proxy_for(db)
    grace = 0.5

    async def scenario() -> None:
        relay = Relay(
            config(
                proxy.dsn(db), redis_url, prefix, listen_dsn=db, poll_interval=0.1,
                postgres_timeout=60.0, stop_grace=grace,
            )
        )  # fmt: skip
        try:
            await stop_while_hung(relay, proxy, stuck_for=0.5, within=grace)
        finally:
            proxy.close()
            await relay.stop()

    try:
        run(scenario())
    finally:
        proxy.close()
