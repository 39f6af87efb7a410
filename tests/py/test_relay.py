"""The outbox relay (SPEC section 7) against real PostgreSQL and Redis.

Every test uses its own database (cloned from a migrated template) and its own channel
prefix, so relays of different tests never see each other's events. Fault tests that stop
a server start their own throwaway one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from fix_tcp_proxy import proxy_for
from ql3 import devservers
from ql3.logs import JsonLogFormatter
from ql3.migrate import migrate
from ql3.relay import (
    CHECK_APPLICATION_NAME,
    LISTEN_APPLICATION_NAME,
    WORK_APPLICATION_NAME,
    Relay,
    RelayConfig,
    config_from_args,
    event_message,
    redact_url,
    register,
)

EVENT_FIELDS = {
    "seq",
    "event_id",
    "event_type",
    "project_id",
    "contract_family",
    "contract_id",
    "old_revision_id",
    "new_revision_id",
    "pointer_version",
    "created_at",
}


async def database_epoch(conn: psycopg.AsyncConnection[Any]) -> str:
    """The failover epoch the database reports (D48)."""
    cur = await conn.execute("SELECT ql3.failover_epoch()")
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


RFC3339_MICROS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


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
    """A directory the postgres system user can enter (pytest's tmp_path is 0700 root)."""
    root = Path(tempfile.mkdtemp(prefix="ql3-relay-test-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def as_role(dsn: str, role: str) -> str:
    """The DSN with the session role set at connection start (superuser -> role)."""
    params = conninfo_to_dict(dsn)
    params["options"] = f"-c role={role}"
    return make_conninfo(**params)  # type: ignore[arg-type]


def unreachable(dsn: str) -> str:
    """``dsn`` pointed at a free local port, where nobody listens."""
    params = conninfo_to_dict(dsn)
    params.update(host="127.0.0.1", port=str(devservers.free_port()))
    return make_conninfo(**params)  # type: ignore[arg-type]


def sample(relay: Relay, name: str, **labels: str) -> float:
    value = relay.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def pg_reconnects(relay: Relay) -> float:
    return sample(relay, "ql3_relay_reconnects_total", target="postgres")


def run(scenario: Coroutine[Any, Any, None], timeout: float = 60.0) -> None:
    """asyncio.run with a deadline, so a hung scenario fails instead of stalling CI."""
    asyncio.run(asyncio.wait_for(scenario, timeout))


async def until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll pred until true; fail with what after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def activate(
    conn: psycopg.AsyncConnection[Any],
    project: str,
    contract: str,
    body: dict[str, Any],
    family: str = "policy_routing",
) -> dict[str, Any]:
    """put_revision + activate_revision; the outbox row it wrote."""
    cur = await conn.execute(
        "SELECT revision_id FROM ql3.put_revision(%s, %s, %s, %s::jsonb, 'test')",
        (project, family, contract, Jsonb(body)),
    )
    row = await cur.fetchone()
    assert row is not None
    cur = await conn.execute(
        "SELECT seq, pointer_version FROM ql3.activate_revision(%s, %s, %s, %s, 'test')",
        (project, family, contract, row[0]),
    )
    event = await cur.fetchone()
    assert event is not None and event[0] is not None
    return {"seq": int(event[0]), "pointer_version": int(event[1]), "revision_id": str(row[0])}


async def backlog(dsn: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT undelivered FROM ql3.outbox_backlog()")
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def until_backlog_empty(dsn: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while await backlog(dsn) != 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"backlog not drained after {timeout}s")
        await asyncio.sleep(0.02)


async def backend_pids(conn: psycopg.AsyncConnection[Any], application_name: str) -> set[int]:
    """The backends of this test's database opened under an application_name."""
    cur = await conn.execute(
        "SELECT pid FROM pg_stat_activity"
        " WHERE application_name = %s AND datname = current_database()",
        (application_name,),
    )
    return {int(row[0]) for row in await cur.fetchall()}


async def terminate_listen_backend(conn: psycopg.AsyncConnection[Any]) -> int:
    """Kill the relay's LISTEN backend (and only it); its pid."""
    (pid,) = await backend_pids(conn, "ql3-relay-listen")
    cur = await conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    row = await cur.fetchone()
    assert row is not None and row[0] is True
    return pid


async def until_new_listen_backend(
    conn: psycopg.AsyncConnection[Any], old: int, timeout: float
) -> int:
    """Wait for a LISTEN backend other than old (the relay's re-LISTEN); its pid."""
    deadline = time.monotonic() + timeout
    while True:
        pids = await backend_pids(conn, "ql3-relay-listen")
        if pids and old not in pids:
            (pid,) = pids
            return pid
        if time.monotonic() > deadline:
            raise AssertionError(f"no new LISTEN backend after {timeout}s (now {pids})")
        await asyncio.sleep(0.02)


class Subscriber:
    """Collects every event and heartbeat published under a prefix."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self.events: list[dict[str, Any]] = []
        self.heartbeats: list[dict[str, Any]] = []
        self.raw: list[tuple[str, bytes]] = []
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    async def __aenter__(self) -> Subscriber:
        self._client = aioredis.Redis.from_url(self.url)
        pubsub = self._client.pubsub()
        await pubsub.psubscribe(f"{self.prefix}:*")
        confirmation = await pubsub.get_message(timeout=5.0)
        assert confirmation is not None and confirmation["type"] == "psubscribe"
        self._task = asyncio.create_task(self._read(pubsub))
        return self

    async def _read(self, pubsub: Any) -> None:
        try:
            while not self._closing:  # a flag too: redis-py can swallow a cancellation
                message = await pubsub.get_message(timeout=0.2)
                if message is None or message["type"] != "pmessage":
                    continue
                channel = message["channel"].decode()
                self.raw.append((channel, message["data"]))
                doc = json.loads(message["data"])
                if channel == f"{self.prefix}:__heartbeat__":
                    self.heartbeats.append(doc)
                else:
                    assert channel == f"{self.prefix}:{doc['project_id']}"
                    self.events.append(doc)
        finally:
            await pubsub.aclose()

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.aclose()

    def seqs(self) -> set[int]:
        return {int(e["seq"]) for e in self.events}


async def activate_and_see_it_soon(
    conn: psycopg.AsyncConnection[Any], sub: Subscriber, body: dict[str, Any]
) -> None:
    """Activate, then wait for its event: within 2 s, so a NOTIFY woke the relay (the
    tests that use this poll once a minute)."""
    started = time.monotonic()
    event = await activate(conn, "p", "c", body)
    await until(lambda: event["seq"] in sub.seqs(), 5, "the event")
    assert time.monotonic() - started < 2.0


@contextlib.asynccontextmanager
async def running(relay: Relay) -> AsyncIterator[Relay]:
    await relay.start()
    try:
        await relay.wait_ready()
        yield relay
    finally:
        await relay.stop()


def config(dsn: str, redis_url: str, prefix: str, **kw: Any) -> RelayConfig:
    base: dict[str, Any] = {
        "heartbeat_interval": 0.1,
        "backoff_initial": 0.02,
        "backoff_max": 0.3,
    }
    base.update(kw)
    return RelayConfig(dsn=dsn, redis_url=redis_url, channel_prefix=prefix, **base)


def spawn_relay(
    dsn: str, redis_url: str, prefix: str, log_path: Path, *args: str, **env: str
) -> subprocess.Popen[bytes]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QL3_RELAY_")}
    environ.update(env)
    command = [
        sys.executable, "-m", "ql3.relay", "--dsn", dsn, "--redis-url", redis_url,
        "--channel-prefix", prefix, "--metrics-port", "-1", "--heartbeat-interval", "0.2",
        *args,
    ]  # fmt: skip
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, env=environ, stdout=log, stderr=log)


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def refused_configuration(*args: str, **env: str) -> str:
    """Run ``ql3 relay`` on a configuration it must refuse; the error it logged."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QL3_")}
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-m", "ql3.relay", "--metrics-port", "-1", *args],
        env=environ, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    line = json.loads(done.stderr.strip().splitlines()[-1])
    assert line["event"] == "bad_configuration", line
    return str(line["error"])


# -- delivery ------------------------------------------------------------------------------


def test_every_activation_is_published_once_in_seq_order_as_the_relay_role(
    db: str, redis_url: str, prefix: str
) -> None:
    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
            running(Relay(config(as_role(db, "ql3_relay"), redis_url, prefix))) as relay,
        ):
            written = [
                await activate(conn, f"proj-{i % 3}", f"contract-{i % 4}", {"n": i})
                for i in range(30)
            ]
            await until(lambda: len(sub.events) >= 30, 10, "30 events")
            await until_backlog_empty(db, 5)
            assert [e["seq"] for e in sub.events] == [w["seq"] for w in written]
            assert relay.published == 30
            epoch = await database_epoch(conn)
            for event, w in zip(sub.events, written, strict=True):
                assert set(event) == EVENT_FIELDS | {"failover_epoch"}
                assert event["failover_epoch"] == epoch  # D48
                assert event["event_type"] == "revision_activated"
                assert event["new_revision_id"] == w["revision_id"]
                assert event["pointer_version"] == w["pointer_version"]
                assert RFC3339_MICROS.match(event["created_at"])
                uuid.UUID(event["event_id"])

    run(scenario())


def test_notify_wakes_the_relay_long_before_the_poll(db: str, redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
            running(Relay(config(db, redis_url, prefix, poll_interval=60.0))),
        ):
            for i in range(3):
                await activate_and_see_it_soon(conn, sub, {"n": i})

    run(scenario())


def test_poll_delivers_events_whose_notification_never_came(
    db: str, redis_url: str, prefix: str
) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            await conn.execute(
                "ALTER TABLE ql3.contract_outbox DISABLE TRIGGER contract_outbox_notify"
            )
            async with (
                Subscriber(redis_url, prefix) as sub,
                running(Relay(config(db, redis_url, prefix, poll_interval=0.2))),
            ):
                event = await activate(conn, "p", "c", {"quiet": True})
                await until(lambda: sub.seqs() == {event["seq"]}, 5, "the polled event")

    run(scenario())


def test_without_a_listen_connection_the_poll_delivers_and_health_says_not_listening(
    db: str, redis_url: str, prefix: str
) -> None:
    nowhere = unreachable(db)

    async def scenario() -> None:
        relay = Relay(config(db, redis_url, prefix, listen_dsn=nowhere, poll_interval=0.2))
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
        ):
            await relay.start()
            try:
                event = await activate(conn, "p", "c", {"n": 0})
                await until(lambda: sub.seqs() == {event["seq"]}, 5, "the polled event")
                # The subscriber can hear the event before the batch's COMMIT ends the cycle.
                await until(lambda: relay.health()["status"] == "ok", 5, "a finished cycle")
                health = relay.health()
                assert (health["status"], health["listening"]) == ("ok", False)
                assert sample(relay, "ql3_relay_listening") == 0
            finally:
                await relay.stop()

    run(scenario())


def test_sweep_at_start_delivers_events_written_while_no_relay_ran(
    db: str, redis_url: str, prefix: str
) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            written = {(await activate(conn, "p", f"c{i}", {"i": i}))["seq"] for i in range(25)}
            async with (
                Subscriber(redis_url, prefix) as sub,
                running(Relay(config(db, redis_url, prefix, batch=10, poll_interval=60.0))),
            ):
                await until(lambda: sub.seqs() == written, 5, "the swept backlog")
            assert await backlog(db) == 0

    run(scenario())


def test_run_once_claims_publishes_and_marks_one_batch(
    db: str, redis_url: str, prefix: str
) -> None:
    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
        ):
            written = [(await activate(conn, "p", f"c{i}", {"i": i}))["seq"] for i in range(5)]
            relay = Relay(config(db, redis_url, prefix, batch=3))
            try:
                assert [await relay.run_once() for _ in range(3)] == [3, 2, 0]
            finally:
                await relay.stop()
            assert relay.delivered_seq == written[-1]
            assert await backlog(db) == 0
            await until(lambda: [e["seq"] for e in sub.events] == written, 5, "five events")

    run(scenario())


def test_two_relays_at_once_lose_nothing(db: str, redis_url: str, prefix: str) -> None:
    async def writer(n: int) -> list[int]:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            return [(await activate(conn, f"p{n}", f"c{i % 5}", {"w": n, "i": i}))["seq"]
                    for i in range(60)]  # fmt: skip

    async def scenario() -> None:
        async with (
            Subscriber(redis_url, prefix) as sub,
            running(Relay(config(db, redis_url, prefix, batch=7, relay_id="a"))) as a,
            running(Relay(config(db, redis_url, prefix, batch=7, relay_id="b"))) as b,
        ):
            results = await asyncio.gather(*(writer(n) for n in range(4)))
            written = {seq for seqs in results for seq in seqs}
            await until(lambda: sub.seqs() == written, 15, "every event from two relays")
            await until_backlog_empty(db, 5)
            assert a.published + b.published >= len(written) == 240

    run(scenario())


def test_heartbeat_carries_the_highest_delivered_seq(db: str, redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
            running(Relay(config(db, redis_url, prefix, relay_id="hb"))),
        ):
            last = (await activate(conn, "p", "c", {"v": 1}))["seq"]
            await until(lambda: any(h["seq"] >= last for h in sub.heartbeats), 5, "a heartbeat")
            beat = sub.heartbeats[-1]
            assert beat["type"] == "heartbeat" and beat["relay_id"] == "hb"
            assert RFC3339_MICROS.match(beat["at"])
            assert beat["failover_epoch"] == await database_epoch(conn)  # D48

    run(scenario())


def test_metrics_and_healthz_are_served_over_http(db: str, redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
            running(Relay(config(db, redis_url, prefix, metrics_port=0, poll_interval=0.1))) as r,
        ):
            await activate(conn, "p", "c", {"v": 1})
            await until(lambda: len(sub.events) == 1, 5, "the event")
            assert r.metrics_port is not None
            await until(lambda: r.health()["status"] == "ok", 5, "a healthy relay")
            await until(lambda: r.published == 1, 5, "the delivery to be committed")
            await until(lambda: r.backlog.get("undelivered") == 0, 5, "the backlog gauge")
            status, body = await http_get(r.metrics_port, "/healthz")
            assert status == 200 and json.loads(body)["status"] == "ok"
            status, text = await http_get(r.metrics_port, "/metrics")
            assert status == 200
            for series in (
                "ql3_relay_backlog 0.0",
                "ql3_relay_oldest_undelivered_age_seconds 0.0",
                "ql3_relay_published_total 1.0",
                'ql3_relay_failures_total{target="redis"} 0.0',
                'ql3_relay_reconnects_total{target="postgres"} 0.0',
            ):
                assert series in text, series
            status, _ = await http_get(r.metrics_port, "/nope")
            assert status == 404

    run(scenario())


def test_healthz_is_503_while_redis_is_unreachable(db: str, prefix: str) -> None:
    nowhere = f"redis://127.0.0.1:{devservers.free_port()}/0"

    async def scenario() -> None:
        relay = Relay(config(db, nowhere, prefix, metrics_port=0, redis_timeout=0.5))
        async with running(relay) as r:
            assert r.metrics_port is not None
            await until(lambda: r.health()["postgres"], 5, "a claim from PostgreSQL")
            # An idle relay first tries Redis with a heartbeat (null until then).
            await until(lambda: r.health()["redis"] is not None, 5, "a call to Redis")
            status, body = await http_get(r.metrics_port, "/healthz")
            report = json.loads(body)
            assert status == 503
            assert (report["status"], report["postgres"], report["redis"]) == (
                "unhealthy",
                True,
                False,
            )

    run(scenario())


def test_healthz_reports_redis_as_unknown_while_postgres_was_never_reached(
    db: str, redis_url: str, prefix: str
) -> None:
    nowhere = unreachable(db)

    async def scenario() -> None:
        relay = Relay(config(nowhere, redis_url, prefix, metrics_port=0))
        await relay.start()
        try:
            await until(
                lambda: sample(relay, "ql3_relay_failures_total", target="postgres") >= 1,
                5,
                "a failed connection to PostgreSQL",
            )
            assert relay.metrics_port is not None
            status, body = await http_get(relay.metrics_port, "/healthz")
            report = json.loads(body)
            assert status == 503
            assert (report["status"], report["postgres"], report["redis"]) == (
                "unhealthy",
                False,
                None,  # never checked: Redis is only tried once PostgreSQL answers
            )
        finally:
            await relay.stop()

    run(scenario())


def test_password_protected_redis_works(db: str, prefix: str, scratch: Path) -> None:
    port = devservers.free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--requirepass", "s3cr:t/pw", "--dir", str(scratch)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://:s3cr%3At%2Fpw@127.0.0.1:{port}/0"

    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(url, prefix) as sub,
            running(Relay(config(db, url, prefix))),
        ):
            event = await activate(conn, "p", "c", {"v": 1})
            await until(lambda: sub.seqs() == {event["seq"]}, 5, "the event")

    try:
        devservers.wait_port(port, 10.0)
        run(scenario())
    finally:
        proc.kill()
        proc.wait()


def test_tls_redis_works_with_rediss_urls(db: str, prefix: str, scratch: Path) -> None:
    cert, key = scratch / "cert.pem", scratch / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = devservers.free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
         "--tls-auth-clients", "no", "--save", "", "--dir", str(scratch)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"

    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(url, prefix) as sub,
            running(Relay(config(db, url, prefix))),
        ):
            event = await activate(conn, "p", "c", {"v": 1})
            await until(lambda: sub.seqs() == {event["seq"]}, 5, "the event over TLS")

    try:
        devservers.wait_port(port, 10.0)
        run(scenario())
    finally:
        proc.kill()
        proc.wait()
        # asyncio can leave a TLS transport mid-shutdown when its loop ends; collect it
        # here, where its ResourceWarning is expected, not in whichever test runs next.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


# -- faults --------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_mid_batch_is_redelivered_by_the_next_relay(
    db: str, redis_url: str, prefix: str, scratch: Path
) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            written = [(await activate(conn, "p", f"c{i}", {"i": i}))["seq"] for i in range(20)]
        async with Subscriber(redis_url, prefix) as sub:
            proc = spawn_relay(
                db, redis_url, prefix, scratch / "relay.log", "--batch", "20",
                QL3_RELAY_TEST_PAUSE_MID_BATCH="60",
            )  # fmt: skip
            try:
                await until(lambda: len(sub.events) >= 10, 20, "half a batch published")
            finally:
                proc.kill()
                proc.wait()
            assert sorted(sub.seqs()) == written[:10]
            assert await backlog(db) == 20  # nothing was committed
            async with running(Relay(config(db, redis_url, prefix))):
                await until(lambda: sub.seqs() == set(written), 10, "the batch delivered again")
                await until_backlog_empty(db, 5)
            counts = [sum(1 for e in sub.events if e["seq"] == s) for s in written]
            assert counts == [2] * 10 + [1] * 10  # duplicates are allowed; losses are not

    run(scenario())


@pytest.mark.slow
def test_sigterm_drains_the_batch_in_flight_and_exits_zero(
    db: str, redis_url: str, prefix: str, scratch: Path
) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            written = [(await activate(conn, "p", f"c{i}", {"i": i}))["seq"] for i in range(20)]
        async with Subscriber(redis_url, prefix) as sub:
            proc = spawn_relay(
                db, redis_url, prefix, scratch / "relay.log", "--batch", "20",
                QL3_RELAY_TEST_PAUSE_MID_BATCH="1",
            )  # fmt: skip
            try:
                await until(lambda: len(sub.events) >= 10, 20, "half a batch published")
                proc.send_signal(signal.SIGTERM)
                await until(lambda: proc.poll() is not None, 15, "the relay to exit")
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            assert proc.returncode == 0, (scratch / "relay.log").read_text()
            assert await backlog(db) == 0
            assert [e["seq"] for e in sub.events] == written
        lines = [json.loads(x) for x in (scratch / "relay.log").read_text().splitlines()]
        assert {"stop_requested", "relay_stopped"} <= {line["event"] for line in lines}

    run(scenario())


@pytest.mark.slow
def test_redis_outage_records_failures_keeps_rows_and_delivers_after_restart(
    db: str, prefix: str, scratch: Path
) -> None:
    rd = devservers.start_redis(scratch)

    async def failed_rows() -> list[dict[str, Any]]:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(
                "SELECT seq, delivered_at, relay_attempts, last_error FROM ql3.contract_outbox"
                " ORDER BY seq"
            )
            return await cur.fetchall()

    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            running(Relay(config(db, rd.url, prefix, poll_interval=0.1))) as relay,
        ):
            rd.stop()
            written = [(await activate(conn, "p", f"c{i}", {"i": i}))["seq"] for i in range(3)]
            deadline = time.monotonic() + 10
            while True:
                rows = await failed_rows()
                if all(r["relay_attempts"] >= 2 and r["last_error"] for r in rows):
                    break
                assert time.monotonic() < deadline, rows
                await asyncio.sleep(0.05)
            assert all(r["delivered_at"] is None for r in rows)
            assert relay.health()["redis"] is False
            assert sample(relay, "ql3_relay_failures_total", target="redis") >= 2
            rd.start()
            await until_backlog_empty(db, 10)
            rows = await failed_rows()
            assert [r["seq"] for r in rows] == written
            assert all(r["last_error"] is None and r["delivered_at"] for r in rows)
            async with Subscriber(rd.url, prefix) as sub:
                event = await activate(conn, "p", "after", {"v": 1})
                await until(lambda: sub.seqs() == {event["seq"]}, 5, "an event after restart")
            assert sample(relay, "ql3_relay_reconnects_total", target="redis") >= 1

    try:
        run(scenario())
    finally:
        rd.stop()


@pytest.mark.slow
def test_postgres_restart_under_the_relay(prefix: str, redis_url: str, scratch: Path) -> None:
    pg = devservers.start_postgres(scratch)
    try:
        dsn = devservers.create_database(pg, "relay_restart")
        migrate(dsn)

        async def scenario() -> None:
            async with (
                Subscriber(redis_url, prefix) as sub,
                running(Relay(config(dsn, redis_url, prefix, poll_interval=0.2))) as relay,
            ):
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                    before = {(await activate(conn, "p", "c", {"i": i}))["seq"] for i in range(3)}
                await until(lambda: sub.seqs() == before, 5, "events before the restart")
                await asyncio.to_thread(pg.stop)
                await until(lambda: not relay.health()["postgres"], 10, "the relay to notice")
                await asyncio.to_thread(pg.start)
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                    after = {(await activate(conn, "p", "c", {"j": i}))["seq"] for i in range(3)}
                await until(lambda: sub.seqs() == before | after, 15, "events after the restart")
                await until_backlog_empty(dsn, 5)
                assert sample(relay, "ql3_relay_reconnects_total", target="postgres") >= 1

        run(scenario())
    finally:
        pg.stop()


def test_losing_only_the_listen_connection_relistens_and_keeps_the_work_connections(
    db: str, redis_url: str, prefix: str
) -> None:
    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
            # No poll to speak of: only a NOTIFY or the sweep after re-LISTEN delivers.
            running(Relay(config(db, redis_url, prefix, poll_interval=60.0))) as relay,
        ):
            work = await backend_pids(conn, "ql3-relay")
            assert len(work) == 2
            old = await terminate_listen_backend(conn)
            first = await activate(conn, "p", "c", {"n": 0})
            await until(lambda: sub.seqs() == {first["seq"]}, 5, "the event after the kill")
            await until_new_listen_backend(conn, old, 5)
            for i in range(1, 4):
                await activate_and_see_it_soon(conn, sub, {"n": i})
            assert len(sub.events) == len(sub.seqs()) == 4
            assert await backend_pids(conn, "ql3-relay") == work
            assert pg_reconnects(relay) == 1
            assert sample(relay, "ql3_relay_failures_total", target="postgres") == 0
            assert relay.health()["postgres"] is True

    run(scenario())


def test_losing_the_listen_connection_mid_batch_neither_aborts_nor_redoes_the_batch(
    db: str, redis_url: str, prefix: str
) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            written = [(await activate(conn, "p", f"c{i}", {"i": i}))["seq"] for i in range(20)]
            relay = Relay(config(db, redis_url, prefix, batch=20, pause_mid_batch=2.0))
            async with Subscriber(redis_url, prefix) as sub:
                await relay.start()
                try:
                    await until(lambda: len(sub.events) >= 10, 10, "half a batch published")
                    work = await backend_pids(conn, "ql3-relay")
                    old = await terminate_listen_backend(conn)
                    await until(lambda: sub.seqs() == set(written), 10, "the rest of the batch")
                    await until_new_listen_backend(conn, old, 5)
                    await until_backlog_empty(db, 5)
                    assert [e["seq"] for e in sub.events] == written  # once each, in order
                    assert await backend_pids(conn, "ql3-relay") == work
                    assert sample(relay, "ql3_relay_failures_total", target="postgres") == 0
                    # The backend shows before its LISTEN, which the reconnect count follows.
                    await until(lambda: pg_reconnects(relay) >= 1, 5, "the re-LISTEN")
                    assert pg_reconnects(relay) == 1
                finally:
                    await relay.stop()

    run(scenario())


def test_a_silently_cut_listen_connection_fails_its_probe_and_is_opened_again(
    db: str, redis_url: str, prefix: str
) -> None:
    proxy = proxy_for(db)

    async def scenario() -> None:
        relay_config = config(
            db,
            redis_url,
            prefix,
            listen_dsn=proxy.dsn(db),
            poll_interval=60.0,  # without the probe, the event below would wait a minute
            listen_probe_interval=0.5,
        )
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
            running(Relay(relay_config)) as relay,
        ):
            [old] = await backend_pids(conn, LISTEN_APPLICATION_NAME)
            proxy.freeze()  # no FIN, no RST: the LISTEN connection just stops hearing
            first = await activate(conn, "p", "c", {"n": 0})
            await until(lambda: sub.seqs() == {first["seq"]}, 10, "the event after the cut")
            await until_new_listen_backend(conn, old, 5)
            await until(lambda: pg_reconnects(relay) >= 1, 5, "the re-LISTEN")
            await activate_and_see_it_soon(conn, sub, {"n": 1})
            assert pg_reconnects(relay) == 1
            assert sample(relay, "ql3_relay_failures_total", target="postgres") == 0
            assert relay.health()["listening"] is True
            assert sample(relay, "ql3_relay_listening") == 1

    try:
        run(scenario())
    finally:
        proxy.close()


def test_the_delivery_check_connects_under_a_name_of_its_own(
    db: str, redis_url: str, prefix: str
) -> None:
    """pg_stat_activity tells the relay's connections apart: its two work connections, its
    LISTEN connection, and the short-lived one each delivery check sends its NOTIFY on (so
    a test or an operator counting work connections does not catch a check's)."""

    names: list[str] = []

    async def scenario() -> None:
        relay = Relay(config(db, redis_url, prefix))
        connect = relay._connect

        async def recording(conninfo: str, application_name: str, options: str = "") -> Any:
            names.append(application_name)
            return await connect(conninfo, application_name, options)

        relay._connect = recording  # type: ignore[method-assign]
        async with running(relay):  # ready once the first delivery check has decided
            pass

    run(scenario())
    assert names.count(WORK_APPLICATION_NAME) == 2, names
    assert names.count(LISTEN_APPLICATION_NAME) == 1, names
    assert names.count(CHECK_APPLICATION_NAME) >= 1, names
    assert set(names) == {WORK_APPLICATION_NAME, LISTEN_APPLICATION_NAME, CHECK_APPLICATION_NAME}


def test_work_connections_keep_the_dsn_options_and_set_the_idle_timeout_at_startup(
    db: str, redis_url: str, prefix: str
) -> None:
    async def scenario() -> None:
        relay = Relay(config(as_role(db, "ql3_relay"), redis_url, prefix))
        try:
            await relay._connect_pg()
            for conn in (relay._work, relay._work2):
                assert conn is not None
                cur = await conn.execute(
                    "SELECT current_user, current_setting('idle_in_transaction_session_timeout')"
                )
                assert await cur.fetchone() == ("ql3_relay", "1min")
        finally:
            await relay.stop()

    run(scenario())


# -- configuration, command line, logs -----------------------------------------------------


def test_flags_win_over_environment_which_wins_over_defaults() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    register(sub)
    env = {
        "QL3_DSN": "postgresql://env/db",
        "QL3_REDIS_URL": "redis://env:6379/0",
        "QL3_RELAY_CHANNEL_PREFIX": "env:prefix",
        "QL3_RELAY_BATCH": "42",
        "QL3_RELAY_METRICS_PORT": "9999",
    }
    args = parser.parse_args(["relay", "--batch", "7", "--redis-url", "rediss://flag:6380/1"])
    cfg = config_from_args(args, env)
    assert (cfg.dsn, cfg.redis_url, cfg.channel_prefix) == (
        "postgresql://env/db",
        "rediss://flag:6380/1",
        "env:prefix",
    )
    assert (cfg.batch, cfg.metrics_port, cfg.poll_interval) == (7, 9999, 1.0)
    assert callable(args.func)
    defaults = config_from_args(
        parser.parse_args(["relay"]), {"QL3_DSN": "dbname=x", "QL3_REDIS_URL": "redis://y"}
    )
    assert defaults.channel_prefix == "platform:contract:invalidate"
    assert (defaults.batch, defaults.metrics_port) == (1000, 9464)
    with pytest.raises(ValueError, match="QL3_REDIS_URL"):
        config_from_args(parser.parse_args(["relay"]), {"QL3_DSN": "x"})
    with pytest.raises(ValueError, match="batch"):
        config_from_args(parser.parse_args(["relay", "--batch", "0"]), env)


def test_a_malformed_redis_url_or_dsn_is_refused_when_the_configuration_is_built() -> None:
    good: dict[str, Any] = {"dsn": "dbname=x", "redis_url": "redis://127.0.0.1:6379/0"}
    for setting, message in (
        ({"redis_url": "notaurl"}, "redis_url: 'notaurl' is not a Redis URL"),
        ({"redis_url": "redis://:pw@h:abc/0"}, r"'redis://:\*\*\*@h:abc/0' is not a Redis URL"),
        ({"dsn": "host='x"}, "dsn: QL3_INVALID_ARGUMENT: malformed connection string"),
        ({"listen_dsn": "# comment"}, "listen_dsn: QL3_INVALID_ARGUMENT: malformed connection"),
    ):
        with pytest.raises(ValueError, match=message):
            RelayConfig(**{**good, **setting})
    for url in ("redis://h/0", "rediss://h:6380/1?ssl_cert_reqs=none", "unix:///run/redis.sock"):
        assert RelayConfig(dsn="postgresql://h/db", redis_url=url).redis_url == url


def test_relay_refuses_a_malformed_redis_url_or_dsn_with_bad_configuration() -> None:
    dsn = "dbname=never_reached"
    error = refused_configuration("--dsn", dsn, "--redis-url", "notaurl")
    assert error.startswith("redis_url: 'notaurl' is not a Redis URL: "), error
    error = refused_configuration("--dsn", dsn, "--redis-url", "redis://h:abc/0")
    assert error.startswith("redis_url: 'redis://h:abc/0' is not a Redis URL"), error
    error = refused_configuration("--dsn", "host='x", "--redis-url", "redis://h/0")
    assert error.startswith("dsn: QL3_INVALID_ARGUMENT: malformed connection string"), error
    # A systemd EnvironmentFile line ``QL3_RELAY_LISTEN_DSN=   # comment``.
    error = refused_configuration(
        "--dsn", dsn, "--redis-url", "redis://h/0", QL3_RELAY_LISTEN_DSN="# comment"
    )
    assert error.startswith("listen_dsn: QL3_INVALID_ARGUMENT: malformed connection"), error


def test_a_bad_number_names_the_variable_or_flag_it_came_from() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    env = {"QL3_DSN": "dbname=x", "QL3_REDIS_URL": "redis://h/0"}
    for var, text, what in (
        ("QL3_RELAY_BATCH", "abc", "an integer"),
        ("QL3_RELAY_METRICS_PORT", "1.5", "an integer"),
        ("QL3_RELAY_POLL_INTERVAL", "soon", "a number"),
        ("QL3_RELAY_HEARTBEAT_INTERVAL", "nan", "a finite number"),
        ("QL3_RELAY_POSTGRES_TIMEOUT", "inf", "a finite number"),
        ("QL3_RELAY_BACKOFF_MAX", "-inf", "a finite number"),
    ):
        message = f"{var}={text!r} is not {what}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            config_from_args(parser.parse_args(["relay"]), {**env, var: text})
    args = parser.parse_args(["relay", "--listen-probe-interval", "nan"])
    with pytest.raises(ValueError, match=r"^--listen-probe-interval='nan' is not a finite number$"):
        config_from_args(args, env)
    for setting in ("poll_interval", "heartbeat_interval", "postgres_timeout", "stop_grace"):
        for value in (float("nan"), float("inf")):
            bad: dict[str, Any] = {setting: value}
            with pytest.raises(ValueError, match="finite and positive"):
                RelayConfig(dsn="dbname=x", redis_url="redis://h/0", **bad)
    error = refused_configuration("--dsn", "dbname=x", "--redis-url", "redis://h/0",
                                  QL3_RELAY_BATCH="abc")  # fmt: skip
    assert error == "QL3_RELAY_BATCH='abc' is not an integer"


def test_passwords_never_reach_the_logs() -> None:
    assert redact_url("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:hunter2@h/0") == "rediss://user:***@h/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


def test_passwords_in_the_query_string_are_redacted_and_ipv6_hosts_keep_their_brackets() -> None:
    assert redact_url("redis://host:6379/0?password=s3cret") == "redis://host:6379/0?password=***"
    assert (
        redact_url("rediss://h/0?ssl_ca_certs=/etc/ca.pem&ssl_password=s3cret&PASSWORD=x")
        == "rediss://h/0?ssl_ca_certs=/etc/ca.pem&ssl_password=***&PASSWORD=***"
    )
    assert redact_url("redis://:pw@[::1]:6379/0") == "redis://:***@[::1]:6379/0"
    assert redact_url("redis://u:pw@[fe80::1%25eth0]/0") == "redis://u:***@[fe80::1%25eth0]/0"
    assert redact_url("redis://[::1]:6379/0?db=1") == "redis://[::1]:6379/0?db=1"
    assert redact_url("unix:///run/redis.sock?password=s3cret&db=2") == (
        "unix:///run/redis.sock?password=***&db=2"
    )


def test_log_lines_are_json_with_the_structured_fields() -> None:
    record = logging.LogRecord("ql3.relay", logging.WARNING, __file__, 1, "redis_backoff", (), None)
    record.ql3 = {"attempt": 3, "error": "ConnectionError"}
    doc = json.loads(JsonLogFormatter().format(record))
    assert doc["event"] == "redis_backoff" and doc["level"] == "warning"
    assert doc["attempt"] == 3 and RFC3339_MICROS.match(doc["ts"])


def test_event_message_matches_the_outbox_row() -> None:
    from datetime import UTC, datetime

    row = {
        "seq": 9,
        "event_id": uuid.UUID(int=1),
        "event_type": "revision_revoked",
        "project_id": "p",
        "contract_family": "policy_routing",
        "contract_id": "c",
        "old_revision_id": None,
        "new_revision_id": uuid.UUID(int=2),
        "pointer_version": 4,
        "created_at": datetime(2026, 12, 2, 12, 0, tzinfo=UTC),
        "delivered_at": None,
    }
    message = event_message(row)
    assert set(message) == EVENT_FIELDS
    assert message["created_at"] == "2026-12-02T12:00:00.000000Z"
    assert message["old_revision_id"] is None
    assert message["new_revision_id"] == str(uuid.UUID(int=2))
