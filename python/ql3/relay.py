"""The outbox relay (SPEC section 7): ``ql3.contract_outbox`` rows to Redis pub/sub.

Delivery is at least once. A batch is claimed (``ql3.claim_outbox``, SKIP LOCKED, seq
order), published, and marked delivered in one transaction, so a relay that dies before
COMMIT leaves its rows undelivered and unlocked for the next one; several relays can run
at once and never lose an event (a duplicate is harmless: workers treat messages as hints
ordered by ``pointer_version``). A dedicated autocommit connection LISTENs on
``ql3_contract_outbox`` to wake the loop at once; a poll every ``poll_interval`` seconds
covers notifications lost while disconnected, and every (re)connection starts with a sweep.
The LISTEN connection lives apart from the work connections: when it alone is lost it is
opened again, LISTENs and sweeps on its own, and no batch in flight notices. Every query on
a work connection is bounded by ``postgres_timeout``: one cut silently (a partition: no
FIN, no RST) is then a PostgreSQL failure like any other, and what it had claimed without
committing is claimed again later.

Throughput (a backlog drains at tens of thousands of events a second): the claim returns
text that ``event_payload`` formats without ``json.dumps``; a batch goes to Redis as one
call of a Lua script that PUBLISHes every message in order; and two work connections take
turns, so one batch's mark and COMMIT run in PostgreSQL while the next batch is claimed
and published.

The heartbeat on ``<prefix>:__heartbeat__`` is published only while this relay can claim
from PostgreSQL and publish to Redis, so a worker that stops hearing it knows that its
invalidation feed cannot be trusted (SPEC section 8, degraded mode).

Redis Sentinel and Cluster (``ql3.redis_links``, D52, D53): behind Sentinel nothing
changes but how the master is found. On a Cluster each event is SPUBLISHed on its
project's shard (one pipeline per batch; no script, which could not span slots), and the
heartbeat goes to every master.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from json.encoder import encode_basestring_ascii
from operator import itemgetter
from typing import Any, TypeVar

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge
from psycopg.conninfo import make_conninfo
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from ql3 import pooler, redis_links

# The channels and the message are ql3.channels (shared with the edge relay), re-exported.
from ql3.channels import DEFAULT_CHANNEL_PREFIX as DEFAULT_CHANNEL_PREFIX
from ql3.channels import HEARTBEAT_NAME as HEARTBEAT_NAME
from ql3.channels import event_message as event_message
from ql3.channels import heartbeat_channel as heartbeat_channel
from ql3.channels import project_channel as project_channel
from ql3.channels import rfc3339 as rfc3339
from ql3.db import parse_conninfo, tcp_settings, with_options
from ql3.http_status import StatusServer, serve_status
from ql3.logs import backoff_delay, configure_logging, describe_error
from ql3.safe_text import redact_url as redact_url  # re-exported: it was defined here

NOTIFY_CHANNEL = "ql3_contract_outbox"
DEFAULT_METRICS_PORT = 9464
LISTEN_APPLICATION_NAME = "ql3-relay-listen"
WORK_APPLICATION_NAME = "ql3-relay"
# The short-lived connection of each delivery check (``_check_delivery``), so that the
# two work connections are all that ``pg_stat_activity`` shows as ``ql3-relay``.
CHECK_APPLICATION_NAME = "ql3-relay-check"
# Work connections carry this in their startup packet (no SET round trip): a relay wedged
# mid-batch must not hold its rows for ever.
WORK_OPTIONS = "-c idle_in_transaction_session_timeout=60s"

T = TypeVar("T")

log = logging.getLogger("ql3.relay")

# What a Redis call raises when Redis is unreachable or failing (clients run with retries off).
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)


def reraise_if_cancelled() -> None:
    """Raise CancelledError if the current task is being cancelled.

    Called first in every ``except`` of a background loop: redis-py can turn a cancellation
    into a connection or timeout error, and a loop that swallowed it would never stop.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# The claim, projected to what a message needs: UUIDs and created_at as text made by the
# server (cheaper than Python objects), in the column order ``event_payload`` reads, each
# row with the database's failover epoch (D48). One row with a NULL seq when nothing was
# claimed: an idle relay still learns the epoch its heartbeats carry.
CLAIM_SQL = """
SELECT o.seq, o.event_id::text, o.event_type, o.project_id, o.contract_family, o.contract_id,
       o.old_revision_id::text, o.new_revision_id::text, o.pointer_version,
       to_char(o.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), e.epoch
FROM ql3.failover_epoch() AS e (epoch)
LEFT JOIN ql3.claim_outbox(%s::integer) AS o ON true
"""

ClaimedRow = tuple[int, str, str, str, str, str, str | None, str, int, str, str]


def event_payload(row: ClaimedRow) -> str:
    """``json.dumps(event_message(...))`` of a ``CLAIM_SQL`` row, byte for byte, but cheaper.

    Strings go through the encoder ``json.dumps`` itself uses; UUIDs and the timestamp
    need no escaping.
    """
    seq, event_id, event_type, project, family, contract, old, new, version, created, epoch = row
    enc = encode_basestring_ascii
    old_text = "null" if old is None else f'"{old}"'
    return (
        f'{{"seq": {seq}, "event_id": "{event_id}", "event_type": {enc(event_type)}, '
        f'"project_id": {enc(project)}, "contract_family": {enc(family)}, '
        f'"contract_id": {enc(contract)}, "old_revision_id": {old_text}, '
        f'"new_revision_id": "{new}", "pointer_version": {version}, "created_at": "{created}", '
        f'"failover_epoch": {enc(epoch)}}}'
    )


# One EVALSHA per batch instead of one PUBLISH each: Redis parses one command and sends
# one reply, and runs the PUBLISHes in order with nothing in between. ARGV[1] holds the
# messages, each followed by a newline (JSON text from ``event_payload`` never contains
# one); then (channel, count) pairs say that the next ``count`` messages go to
# ``channel``. Returns how many it published.
PUBLISH_SCRIPT = """
local blob = ARGV[1]
local pos, n = 1, 0
for i = 2, #ARGV, 2 do
    local channel = ARGV[i]
    for _ = 1, tonumber(ARGV[i + 1]) do
        local stop = string.find(blob, '\\n', pos, true)
        if not stop then
            return n
        end
        redis.call('PUBLISH', channel, string.sub(blob, pos, stop - 1))
        pos = stop + 1
        n = n + 1
    end
end
return n
"""


def publish_args(channel_prefix: str, rows: Sequence[ClaimedRow]) -> list[str]:
    """``PUBLISH_SCRIPT``'s ARGV for rows: their messages, then their channels run-length coded."""
    args = ["".join([event_payload(row) + "\n" for row in rows])]
    for project_id, run in itertools.groupby(rows, key=itemgetter(3)):
        args += (project_channel(channel_prefix, project_id), str(sum(1 for _ in run)))
    return args


def make_redis(url: str, *, timeout: float = 5.0) -> redis_links.AnyRedis:
    """A Redis client whose failures surface at once (ql3 does its own backoff).

    Any URL redis-py accepts works: ``redis://:password@host/0``, ``rediss://`` for TLS
    (``?ssl_ca_certs=...`` or ``?ssl_cert_reqs=none`` in the query string), ``unix://``;
    and ``redis+sentinel://host:port[,host:port]/master_name`` and
    ``redis+cluster://host:port[,host:port]`` (``ql3.redis_links``, D52).
    """
    return redis_links.make_client(url, timeout=timeout)


def _log(level: int, event: str, **fields: Any) -> None:
    log.log(level, event, extra={"ql3": fields})


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """Everything the relay needs; ``config_from_args`` fills it from flags and environment."""

    dsn: str
    redis_url: str
    listen_dsn: str | None = None
    channel_prefix: str = DEFAULT_CHANNEL_PREFIX
    batch: int = 1000
    poll_interval: float = 1.0
    heartbeat_interval: float = 2.0
    # A silently cut LISTEN connection (no FIN, no RST) would wait forever: every this many
    # seconds it must answer a SELECT 1 within min(5, interval) seconds or be opened again.
    listen_probe_interval: float = 30.0
    # A work connection cut silently would wait forever too: a claim, mark or backlog query
    # that has no answer after this many seconds is a PostgreSQL failure (the connection is
    # cut and opened again; what it had claimed and not committed is claimed again later).
    postgres_timeout: float = 30.0
    # After a stop request, database work in flight gets at most this long before its
    # connection is cut: a hung batch must not hold a SIGTERM for postgres_timeout.
    stop_grace: float = 5.0
    backoff_initial: float = 0.1
    backoff_max: float = 10.0
    redis_timeout: float = 5.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    relay_id: str = ""
    # Test hook: sleep this long after publishing half of a batch (QL3_RELAY_TEST_PAUSE_MID_BATCH).
    pause_mid_batch: float = 0.0

    def __post_init__(self) -> None:
        # Refused here, not at the first connection: a relay that cannot reach
        # PostgreSQL never opens Redis, and would retry a hopeless DSN for ever.
        for name, conninfo in (("dsn", self.dsn), ("listen_dsn", self.listen_dsn)):
            if conninfo is not None:
                try:
                    parse_conninfo(conninfo)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        try:
            redis_links.parse(self.redis_url)  # also refuses a port that is not 0..65535
        except ValueError as exc:
            raise ValueError(
                f"redis_url: {redact_url(self.redis_url)!r} is not a Redis URL: {exc}"
            ) from None
        if not 1 <= self.batch <= 10000:
            raise ValueError("batch must be 1..10000")
        # Written so that NaN fails too (every comparison with NaN is false).
        intervals = (self.poll_interval, self.heartbeat_interval, self.listen_probe_interval)
        if not all(0 < seconds < math.inf for seconds in intervals):
            raise ValueError(
                "poll, heartbeat and listen probe intervals must be finite and positive"
            )
        timeouts = (self.postgres_timeout, self.stop_grace, self.redis_timeout)
        if not all(0 < seconds < math.inf for seconds in timeouts):
            raise ValueError(
                "postgres and redis timeouts and stop grace must be finite and positive"
            )
        if not all(0 < seconds < math.inf for seconds in (self.backoff_initial, self.backoff_max)):
            raise ValueError("backoff initial and max must be finite and positive")
        if not self.channel_prefix:
            raise ValueError("channel prefix must not be empty")
        if self.metrics_port is not None and self.metrics_port > 65535:
            raise ValueError(
                f"metrics port {self.metrics_port} is not a TCP port (0..65535, or -1 for none)"
            )


class RelayMetrics:
    """The Prometheus series of one relay (own registry, so tests can run several)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.backlog = Gauge("ql3_relay_backlog", "Undelivered outbox rows.", registry=registry)
        self.oldest_age = Gauge(
            "ql3_relay_oldest_undelivered_age_seconds",
            "Age of the oldest undelivered outbox row (0 when none).",
            registry=registry,
        )
        self.max_seq = Gauge(
            "ql3_relay_outbox_max_seq", "Highest seq in the outbox.", registry=registry
        )
        self.delivered_seq = Gauge(
            "ql3_relay_delivered_seq", "Highest seq this relay has delivered.", registry=registry
        )
        self.up = Gauge(
            "ql3_relay_up", "1 while this relay reaches PostgreSQL and Redis.", registry=registry
        )
        self.listening = Gauge(
            "ql3_relay_listening",
            "1 while the LISTEN connection is up and a NOTIFY of the relay's own reached it; "
            "0 means events wait for the poll.",
            registry=registry,
        )
        self.polling = Gauge(
            "ql3_relay_polling",
            "1 while the LISTEN connection is up but a NOTIFY of the relay's own did not "
            "reach it (a transaction pooler on the listen DSN): events wait for the poll.",
            registry=registry,
        )
        self.published = Counter(
            "ql3_relay_published", "Outbox events published to Redis.", registry=registry
        )
        self.failures = Counter(
            "ql3_relay_failures",
            "Failed delivery cycles, by the server that failed.",
            ["target"],
            registry=registry,
        )
        self.reconnects = Counter(
            "ql3_relay_reconnects",
            "Reconnections after a lost connection, by server (for postgres, the work "
            "connections and the LISTEN connection count apart).",
            ["target"],
            registry=registry,
        )
        self.heartbeats = Counter(
            "ql3_relay_heartbeats", "Heartbeats published.", registry=registry
        )
        for target in ("postgres", "redis"):
            self.failures.labels(target=target)
            self.reconnects.labels(target=target)


class RedisUnavailable(Exception):
    """Publishing a batch failed; its rows were marked failed and stay undelivered."""


class _ListenerLost(Exception):
    """The LISTEN connection did not answer its liveness probe in time."""


class PostgresTimeout(psycopg.OperationalError):
    """A relay connection gave no answer in time and was cut (a PostgreSQL failure)."""


def _cut(conn: psycopg.AsyncConnection[Any]) -> None:
    """Shut the connection's socket down under libpq, which then fails the call waiting on
    it at once, as on a lost connection. The descriptor stays libpq's (and the event
    loop's) until the connection is closed."""
    with contextlib.suppress(OSError, psycopg.Error):
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
        with sock:
            sock.shutdown(socket.SHUT_RDWR)


class _Deadline:
    """When a call on a connection is given up: at that moment the connection is cut."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], limit: float) -> None:
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self.started = self._loop.time()
        self.expired = False
        self._at = self.started + limit
        self._handle = self._loop.call_at(self._at, self._expire)

    def _expire(self) -> None:
        self.expired = True
        _cut(self._conn)

    def shorten(self, seconds: float) -> None:
        """Expire within ``seconds`` from now, if that is sooner."""
        at = self._loop.time() + seconds
        if at < self._at:
            self._handle.cancel()
            self._at = at
            self._handle = self._loop.call_at(at, self._expire)

    def cancel(self) -> None:
        self._handle.cancel()


async def bounded(
    conn: psycopg.AsyncConnection[Any],
    call: Awaitable[T],
    limit: float,
    *,
    in_flight: set[_Deadline] | None = None,
) -> T:
    """``call`` on ``conn``, or ``PostgresTimeout`` after ``limit`` seconds without an answer
    (sooner if its deadline, kept in ``in_flight`` meanwhile, is shortened).

    Cancelling a query is no good on a silently cut connection: psycopg then waits for the
    server to confirm the cancel. So at the deadline the socket is cut, and the call fails
    on its own; asyncio's timeout a second later is only a backstop.
    """
    deadline = _Deadline(conn, limit)
    if in_flight is not None:
        in_flight.add(deadline)
    try:
        async with asyncio.timeout(limit + 1.0):
            return await call
    except (psycopg.Error, TimeoutError) as exc:
        if deadline.expired:
            waited = asyncio.get_running_loop().time() - deadline.started
            raise PostgresTimeout(f"no answer from PostgreSQL after {waited:.3g} s") from exc
        raise
    finally:
        deadline.cancel()
        if in_flight is not None:
            in_flight.discard(deadline)


class Relay:
    """One relay process's worth of state; ``run`` until ``request_stop``.

    In-process use (tests): ``await relay.start()`` ... ``await relay.stop()``, or
    ``await relay.run_once()`` for a single claim-publish-mark cycle.
    """

    def __init__(self, config: RelayConfig, *, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.relay_id = config.relay_id or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = RelayMetrics(self.registry)
        self.delivered_seq = 0
        self.published = 0
        self.backlog: dict[str, Any] = {}
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._ready = asyncio.Event()
        # Two work connections take turns in _drain (one batch commits while the next is
        # claimed and published); run_once uses the first.
        self._work: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self._work2: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._listening = False  # LISTEN is up and a NOTIFY of our own came back
        self._polling = False  # LISTEN is up but the check's NOTIFY did not come back
        self._check_channel = f"ql3_relay_check_{uuid.uuid4().hex}"
        self._redis: redis_links.AnyRedis | None = None
        self._publish_script: AsyncScript | None = None
        self._task: asyncio.Task[None] | None = None
        self._http: StatusServer | None = None
        self._pg_connected_once = False
        # None until first tried (/healthz says null): Redis is only tried once PostgreSQL
        # answers, so "false" would blame a server nobody has reached.
        self._pg_ok: bool | None = None
        self._redis_ok: bool | None = None
        self._redis_failing = False
        self._last_cycle_at: float | None = None
        self._last_backlog_at = 0.0
        self._in_flight: set[_Deadline] = set()  # database calls on the work connections
        # The failover epoch of the last claim (D48), which heartbeats carry; None while
        # the work connections are down, when no heartbeat goes out.
        self._epoch: str | None = None
        self.metrics_port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Run the relay in a background task of the running loop."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"ql3-relay-{self.relay_id}")

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until the relay is listening and has swept the outbox once."""
        ready = asyncio.create_task(self._ready.wait())
        waiters: set[asyncio.Future[Any]] = {ready}
        if self._task is not None:
            waiters.add(self._task)
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if self._task is not None and self._task in done:
            self._task.result()
            raise RuntimeError("relay stopped before it was ready")
        if not self._ready.is_set():
            raise TimeoutError(f"relay not ready after {timeout}s")

    def request_stop(self) -> None:
        """Finish the batch in flight, then leave ``run`` (the SIGTERM handler).

        The batch's database work gets ``stop_grace`` seconds at most: a healthy one takes
        milliseconds, a hung one is given up (its rows are claimed again later).
        """
        if not self._stop.is_set():
            _log(logging.INFO, "stop_requested", relay_id=self.relay_id)
        self._stop.set()
        for deadline in list(self._in_flight):
            deadline.shorten(self.config.stop_grace)

    async def stop(self) -> None:
        """Request a stop and wait for ``run`` to return (or close what ``run_once`` opened)."""
        self.request_stop()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._close_connections()

    async def _close_connections(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(BaseException):
                await self._listener
            self._listener = None
        await self._close_pg()
        if self._redis is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await self._redis.aclose()
            self._redis = None
            self._publish_script = None

    async def run(self) -> None:
        """Relay until ``request_stop``: connect, sweep, then wait for NOTIFY or the poll."""
        _log(
            logging.INFO,
            "relay_starting",
            relay_id=self.relay_id,
            redis=redact_url(self.config.redis_url),
            channel_prefix=self.config.channel_prefix,
            batch=self.config.batch,
        )
        await self._open_http()
        heartbeat = asyncio.create_task(self._heartbeat_loop(), name="ql3-relay-heartbeat")
        self._listener = asyncio.create_task(self._listen_loop(), name="ql3-relay-listen")
        try:
            await self._main_loop()
        finally:
            # Stopped by the flag, not by cancel(): redis-py can swallow a cancellation.
            self._stop.set()
            with contextlib.suppress(Exception):
                await heartbeat
            await self._close_connections()
            if self._http is not None:
                await asyncio.to_thread(self._http.close)
                self._http = None
            self.metrics.up.set(0)
            _log(
                logging.INFO,
                "relay_stopped",
                relay_id=self.relay_id,
                delivered_seq=self.delivered_seq,
                published=self.published,
            )

    async def _main_loop(self) -> None:
        pg_failures = 0
        redis_failures = 0
        while not self._stop.is_set():
            try:
                if self._work is None:
                    await self._connect_pg()
                self._wake.clear()
                # This drain is the sweep after a LISTEN whose check is done.
                listened = self._listening or self._polling
                try:
                    await self._drain()
                except RedisUnavailable:
                    # PostgreSQL still answers: the backlog must not freeze during an outage.
                    await self._refresh_backlog()
                    raise
                pg_failures = redis_failures = 0
                await self._refresh_backlog()
                if listened:
                    self._ready.set()
            except psycopg.Error as exc:
                reraise_if_cancelled()
                pg_failures += 1
                self._pg_ok = False
                self.metrics.up.set(0)
                self.metrics.failures.labels(target="postgres").inc()
                _log(
                    logging.WARNING,
                    "postgres_failed",
                    relay_id=self.relay_id,
                    error=describe_error(exc),
                    attempt=pg_failures,
                )
                await self._close_pg()
                await self._sleep(self._backoff(pg_failures))
                continue
            except RedisUnavailable as exc:
                redis_failures += 1
                await self._sleep(self._backoff(redis_failures))
                if redis_failures == 1 or redis_failures % 10 == 0:
                    _log(
                        logging.WARNING,
                        "redis_backoff",
                        relay_id=self.relay_id,
                        error=str(exc),
                        attempt=redis_failures,
                    )
                continue
            await self._wait_for_work()

    def _backoff(self, failures: int) -> float:
        return backoff_delay(
            failures, initial=self.config.backoff_initial, cap=self.config.backoff_max
        )

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake at once on a stop request."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)

    async def _wait_for_work(self) -> None:
        if self._wake.is_set() or self._stop.is_set():
            return
        wake = asyncio.create_task(self._wake.wait())
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait(
                {wake, stop}, timeout=self.config.poll_interval, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            wake.cancel()
            stop.cancel()

    async def _drain(self) -> None:
        """Claim batches until one comes back short (or a stop is requested).

        The two work connections take turns: while one marks its batch delivered and
        commits, the other claims and publishes the next batch. Batches are still published
        one after the other in seq order, and each is marked delivered, in its own
        transaction, only after Redis took all of it.
        """
        conns = (self._work, self._work2)
        settling: asyncio.Task[None] | None = None
        turn = 0
        try:
            while not self._stop.is_set():
                conn = conns[turn]
                assert conn is not None
                turn ^= 1
                rows = await self._claim(conn)
                failure = await self._try_publish(conn, rows)
                if settling is not None:
                    # The previous batch's COMMIT, on the connection the next claim uses.
                    await settling
                    settling = None
                if failure is not None:
                    await self._settle(conn, rows, failure)
                    raise RedisUnavailable(describe_error(failure)) from failure
                if len(rows) < self.config.batch:
                    await self._settle(conn, rows, None)
                    return
                settling = asyncio.create_task(self._settle(conn, rows, None))
            if settling is not None:
                await settling  # a stop request still lets the batch in flight commit
                settling = None
        finally:
            if settling is not None:
                # Leaving on an error: let the other COMMIT end (it is not awaited twice).
                await asyncio.wait({settling})
                if not settling.cancelled():
                    settling.exception()

    # -- connections -------------------------------------------------------------------

    async def _connect(
        self, conninfo: str, application_name: str, options: str = ""
    ) -> psycopg.AsyncConnection[tuple[Any, ...]]:
        """One autocommit relay connection; ``options`` go after the conninfo's own, and
        keepalive settings the conninfo does not make are ours (``ql3.db.KEEPALIVES``;
        tcp_user_timeout follows postgres_timeout)."""
        ours = tcp_settings(conninfo, self.config.postgres_timeout)
        return await pooler.AsyncConnection.connect(
            make_conninfo(conninfo, **ours),
            autocommit=True,
            prepare_threshold=pooler.prepare_threshold(),
            connect_timeout=5,
            application_name=application_name,
            options=with_options(conninfo, options),
        )

    async def _connect_pg(self) -> None:
        """Open the two work connections (the LISTEN connection is ``_listen_loop``'s)."""
        opened: list[psycopg.AsyncConnection[tuple[Any, ...]]] = []
        try:
            for _ in range(2):
                opened.append(
                    await self._connect(self.config.dsn, WORK_APPLICATION_NAME, WORK_OPTIONS)
                )
        except BaseException:
            for conn in opened:
                await conn.close()
            raise
        self._work, self._work2 = opened
        if self._pg_connected_once:
            self.metrics.reconnects.labels(target="postgres").inc()
            _log(logging.INFO, "postgres_reconnected", relay_id=self.relay_id)
        self._pg_connected_once = True
        self._pg_ok = True
        self._wake.set()  # sweep: anything committed while we were away

    async def _listen_loop(self) -> None:
        """Until stop: LISTEN on a connection of its own, and wake the drain on every NOTIFY.

        A lost LISTEN connection is opened again here, with backoff, while the work
        connections go on (the poll delivers meanwhile); each LISTEN wakes a sweep for what
        was committed while nobody listened. It counts as a postgres reconnect, not as a
        failed delivery cycle.
        """
        failures = 0
        listened_before = False
        while not self._stop.is_set():
            conn: psycopg.AsyncConnection[Any] | None = None
            try:
                conn = await self._connect(
                    self.config.listen_dsn or self.config.dsn, LISTEN_APPLICATION_NAME
                )
                await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                await conn.execute(f"LISTEN {self._check_channel}")
                if listened_before:
                    self.metrics.reconnects.labels(target="postgres").inc()
                    _log(logging.INFO, "listen_reconnected", relay_id=self.relay_id)
                listened_before = True
                failures = 0
                await self._check_delivery(conn)
                self._wake.set()
                while not self._stop.is_set():
                    async for n in conn.notifies(timeout=self.config.listen_probe_interval):
                        if n.channel == NOTIFY_CHANNEL:
                            self._wake.set()
                    await self._probe_listen(conn)
                    await self._check_delivery(conn)
            except Exception as exc:
                reraise_if_cancelled()
                failures += 1
                _log(
                    logging.WARNING,
                    "listen_lost" if self._listening or self._polling else "listen_failed",
                    relay_id=self.relay_id,
                    error=describe_error(exc),
                    attempt=failures,
                )
            finally:
                self._set_listening(False, None)
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
            await self._sleep(self._backoff(failures))

    async def _check_delivery(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Sends a NOTIFY of its own, on a new connection to the work DSN (where writers'
        wakes come from), and waits for it on the LISTEN connection. Behind a transaction
        pooler LISTEN registers on a server connection that is lent to someone else as
        soon as the statement ends, and nothing arrives: the relay then says it is polling
        (``/healthz`` ``delivery``, ``ql3_relay_polling``) and logs why. Checked after each
        LISTEN and at every liveness probe, so it also notices a pooler put in later."""
        nonce = uuid.uuid4().hex
        limit = min(5.0, self.config.listen_probe_interval)
        try:
            sender = await self._connect(self.config.dsn, CHECK_APPLICATION_NAME)
            try:
                notify = sender.execute("SELECT pg_notify(%s, %s)", (self._check_channel, nonce))
                await bounded(sender, notify, limit)
            finally:
                await sender.close()
        except (psycopg.Error, OSError) as exc:
            reraise_if_cancelled()  # not sent: the check says nothing either way
            _log(logging.WARNING, "listen_check_failed", relay_id=self.relay_id,
                 error=describe_error(exc))  # fmt: skip
            return
        async for n in conn.notifies(timeout=limit):
            if n.channel == NOTIFY_CHANNEL:
                self._wake.set()
            elif n.payload == nonce:
                self._set_listening(True, None)
                return
        self._set_listening(
            False,
            f"a NOTIFY sent through the work DSN did not reach the LISTEN connection within "
            f"{limit:g} s: connect --listen-dsn directly to PostgreSQL, not through a "
            "transaction pooler",
        )

    def _set_listening(self, listening: bool, polling_reason: str | None) -> None:
        """Records whether NOTIFY reaches this relay; ``polling_reason`` (logged when the
        relay starts or stops relying on the poll) is why it does not."""
        polling = polling_reason is not None
        if polling and not self._polling:
            _log(logging.WARNING, "listen_not_delivering", relay_id=self.relay_id,
                 reason=polling_reason)  # fmt: skip
        elif listening and self._polling:
            _log(logging.INFO, "listen_delivering", relay_id=self.relay_id)
        self._listening = listening
        self._polling = polling
        self.metrics.listening.set(1 if listening else 0)
        self.metrics.polling.set(1 if polling else 0)

    async def _probe_listen(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Raises ``_ListenerLost`` unless the LISTEN connection answers a SELECT 1 in time."""
        limit = min(5.0, self.config.listen_probe_interval)
        try:
            await bounded(conn, conn.execute("SELECT 1"), limit)
        except PostgresTimeout as exc:
            raise _ListenerLost(f"no answer to a liveness probe within {limit:g} s") from exc

    async def _close_pg(self) -> None:
        for conn in (self._work, self._work2):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._work = self._work2 = None
        self._epoch = None  # the next claim may reach another server (a promoted one)

    def _redis_client(self) -> redis_links.AnyRedis:
        if self._redis is None:
            self._redis = make_redis(self.config.redis_url, timeout=self.config.redis_timeout)
        return self._redis

    def _script(self) -> AsyncScript:
        # EVALSHA; redis-py loads the script again on NOSCRIPT (e.g. after a Redis restart).
        if self._publish_script is None:
            self._publish_script = self._redis_client().register_script(PUBLISH_SCRIPT)
        return self._publish_script

    # -- one cycle ---------------------------------------------------------------------

    async def run_once(self) -> int:
        """Claim, publish and mark one batch in one transaction; the number delivered.

        Raises ``RedisUnavailable`` after recording the failure on the rows (committed),
        and psycopg errors when PostgreSQL fails (nothing committed: rows stay claimable).
        """
        if self._work is None:
            await self._connect_pg()
        conn = self._work
        assert conn is not None
        try:
            rows = await self._claim(conn)
            failure = await self._try_publish(conn, rows)
            await self._settle(conn, rows, failure)
        except psycopg.Error:
            await self._close_pg()  # the next call opens new ones
            raise
        if failure is not None:
            raise RedisUnavailable(describe_error(failure)) from failure
        return len(rows)

    async def _claim(self, conn: psycopg.AsyncConnection[Any]) -> list[ClaimedRow]:
        """BEGIN and claim a batch; the transaction stays open until ``_settle``."""

        settings = pooler.local_settings(conn)

        async def begin_and_claim() -> list[ClaimedRow]:
            await conn.execute("BEGIN")
            if settings is not None:  # behind a transaction pooler (ql3.pooler)
                await conn.execute(settings)
            cur = await conn.execute(CLAIM_SQL, (self.config.batch,))
            rows: list[ClaimedRow] = await cur.fetchall()
            self._epoch = rows[0][-1]  # CLAIM_SQL always returns a row
            return [] if rows[0][0] is None else rows

        try:
            return await self._bounded(conn, begin_and_claim())
        except BaseException:
            await self._rollback_quietly(conn)
            raise

    async def _bounded(self, conn: psycopg.AsyncConnection[Any], call: Awaitable[T]) -> T:
        """``call`` on a work connection, bounded by ``postgres_timeout`` (or, once a stop
        is requested, by ``stop_grace``)."""
        limit = self.config.postgres_timeout
        if self._stop.is_set():
            limit = min(limit, self.config.stop_grace)
        return await bounded(conn, call, limit, in_flight=self._in_flight)

    async def _rollback_quietly(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """End a failed batch's transaction if the connection still can (it may be gone)."""
        with contextlib.suppress(Exception):
            await self._bounded(conn, conn.execute("ROLLBACK"))

    async def _try_publish(
        self, conn: psycopg.AsyncConnection[Any], rows: Sequence[ClaimedRow]
    ) -> BaseException | None:
        """Publish a claimed batch; the Redis error if that failed (rows to mark failed)."""
        if not rows and not self._redis_failing:
            return None
        # While failing, even an empty batch goes to Redis: the script, publishing nothing,
        # is the probe that tells an idle relay (another one delivered its rows) that Redis
        # is back. Only a delivery cycle clears the failure, never a heartbeat.
        try:
            await self._publish(rows)
        except REDIS_ERRORS as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                await self._rollback_quietly(conn)
                raise asyncio.CancelledError from exc
            self._redis_ok = False
            self._redis_failing = True
            self.metrics.up.set(0)
            self.metrics.failures.labels(target="redis").inc()
            return exc
        except BaseException:
            await self._rollback_quietly(conn)
            raise
        if self._redis_failing:
            self.metrics.reconnects.labels(target="redis").inc()
            _log(logging.INFO, "redis_recovered", relay_id=self.relay_id)
        self._redis_failing = False
        self._redis_ok = True
        return None

    async def _settle(
        self,
        conn: psycopg.AsyncConnection[Any],
        rows: Sequence[ClaimedRow],
        failure: BaseException | None,
    ) -> None:
        """Mark the claimed rows delivered (failed, given a Redis error) and COMMIT."""

        async def mark_and_commit() -> None:
            if rows:
                seqs = [row[0] for row in rows]
                if failure is None:
                    await conn.execute("SELECT ql3.mark_outbox_delivered(%s::bigint[])", (seqs,))
                else:
                    await conn.execute(
                        "SELECT ql3.mark_outbox_failed(%s::bigint[], %s::text)",
                        (seqs, describe_error(failure)),
                    )
            await conn.execute("COMMIT")

        try:
            await self._bounded(conn, mark_and_commit())
        except BaseException:
            await self._rollback_quietly(conn)
            raise
        self._last_cycle_at = time.monotonic()
        self._pg_ok = True
        if failure is not None:
            return
        if not rows:
            self.metrics.up.set(1 if self._redis_ok else 0)
            return
        self.metrics.up.set(1)
        self.delivered_seq = max(self.delivered_seq, rows[-1][0])  # claimed in seq order
        self.published += len(rows)
        self.metrics.published.inc(len(rows))
        self.metrics.delivered_seq.set(self.delivered_seq)
        _log(
            logging.DEBUG,
            "batch_delivered",
            relay_id=self.relay_id,
            events=len(rows),
            first_seq=rows[0][0],
            last_seq=rows[-1][0],
        )

    async def _publish(self, rows: Sequence[ClaimedRow]) -> None:
        pause = self.config.pause_mid_batch
        if pause > 0 and len(rows) > 1:
            half = len(rows) // 2
            await self._publish_many(rows[:half])
            _log(
                logging.WARNING,
                "test_pause_mid_batch",
                relay_id=self.relay_id,
                published=half,
                batch=len(rows),
                seconds=pause,
            )
            await asyncio.sleep(pause)
            await self._publish_many(rows[half:])
        else:
            await self._publish_many(rows)

    async def _publish_many(self, rows: Sequence[ClaimedRow]) -> None:
        client = self._redis_client()
        if isinstance(client, RedisCluster):
            # No script on a Cluster: one touching channels of several slots is refused.
            # SPUBLISH each event on its project's shard (D52), in order per shard.
            prefix = self.config.channel_prefix
            messages = [(project_channel(prefix, row[3]), event_payload(row)) for row in rows]
            await redis_links.spublish_all(client, messages)
            return
        args = publish_args(self.config.channel_prefix, rows)
        published = await self._script()(args=args)
        if published != len(rows):
            raise RedisError(f"the publish script published {published} of {len(rows)} events")

    async def _refresh_backlog(self) -> None:
        now = time.monotonic()
        conn = self._work
        if conn is None or now - self._last_backlog_at < self.config.poll_interval:
            return
        self._last_backlog_at = now

        async def read_backlog() -> tuple[Any, ...] | None:
            cur = await conn.execute(
                "SELECT undelivered, oldest_age_seconds, max_seq FROM ql3.outbox_backlog()"
            )
            return await cur.fetchone()

        row = await self._bounded(conn, read_backlog())
        if row is None:
            return
        undelivered, oldest_age, max_seq = row
        self.backlog = {
            "undelivered": int(undelivered),
            "oldest_age_seconds": float(oldest_age),
            "max_seq": int(max_seq),
        }
        self.metrics.backlog.set(self.backlog["undelivered"])
        self.metrics.oldest_age.set(self.backlog["oldest_age_seconds"])
        self.metrics.max_seq.set(self.backlog["max_seq"])

    # -- heartbeat, health, metrics ----------------------------------------------------

    def _cycle_recent(self) -> bool:
        if self._last_cycle_at is None:
            return False
        limit = max(5.0, 3 * self.config.poll_interval)
        return time.monotonic() - self._last_cycle_at <= limit

    async def _heartbeat_loop(self) -> None:
        """Until stop: publish a heartbeat every interval while this relay works."""
        channel = heartbeat_channel(self.config.channel_prefix)
        warned = False
        while not self._stop.is_set():
            reraise_if_cancelled()
            epoch = self._epoch
            if self._pg_ok and self._cycle_recent() and not self._redis_failing and epoch:
                payload = {
                    "type": "heartbeat",
                    "relay_id": self.relay_id,
                    "seq": self.delivered_seq,
                    "at": rfc3339(datetime.now(UTC)),
                    "failover_epoch": epoch,  # of the database it claims from (D48)
                }
                try:
                    await self._publish_heartbeat(channel, json.dumps(payload))
                except REDIS_ERRORS as exc:
                    reraise_if_cancelled()
                    self._redis_ok = False
                    if not warned:
                        _log(
                            logging.WARNING,
                            "heartbeat_failed",
                            relay_id=self.relay_id,
                            error=describe_error(exc),
                        )
                    warned = True
                else:
                    if not self._redis_failing:  # a batch may have failed meanwhile
                        self._redis_ok = True
                    warned = False
                    self.metrics.heartbeats.inc()
            await self._sleep(self.config.heartbeat_interval)

    async def _publish_heartbeat(self, channel: str, message: str) -> None:
        """PUBLISH a heartbeat; on a Cluster, SPUBLISH it to every master, on the heartbeat
        channel of its lowest slot, which the caches listening there hear (D53)."""
        client = self._redis_client()
        if not isinstance(client, RedisCluster):
            await client.publish(channel, message)
            return
        await client.initialize()  # a no-op once the slot map is known
        prefix = self.config.channel_prefix
        channels = redis_links.shard_heartbeat_channels(client, prefix)
        await redis_links.spublish_all(client, [(c, message) for c in channels])

    def health(self) -> dict[str, Any]:
        """What /healthz reports; ``status`` is ``ok`` only when both servers work.
        ``postgres`` and ``redis`` are None (JSON null) until the server was first tried.

        ``listening`` false (the LISTEN connection is down, or a NOTIFY of the relay's own
        did not reach it: ``delivery`` is then ``polling``) does not make it unhealthy:
        events still flow, at the poll's pace. Called from the status server's threads: it
        only reads.
        """
        ok = self._pg_ok is True and self._redis_ok is True and self._cycle_recent()
        age = None if self._last_cycle_at is None else time.monotonic() - self._last_cycle_at
        return {
            "status": "ok" if ok else "unhealthy",
            "relay_id": self.relay_id,
            "postgres": self._pg_ok,
            "redis": self._redis_ok,
            "listening": self._listening,
            "delivery": "listen" if self._listening else "polling",
            "last_cycle_age_seconds": age,
            "delivered_seq": self.delivered_seq,
            "published": self.published,
            "backlog": self.backlog,
        }

    async def _open_http(self) -> None:
        self._http = serve_status(
            self.config.metrics_host,
            self.config.metrics_port,
            self.registry,
            self.health,
            name="ql3-relay-http",
            log=log,
            relay_id=self.relay_id,
        )
        self.metrics_port = None if self._http is None else self._http.port


# -- command line ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The relay's flags; each falls back to the environment variable named in its help."""
    a = parser.add_argument
    a("--dsn", help="PostgreSQL conninfo or URL (env QL3_DSN)")
    a(
        "--listen-dsn",
        help="direct (not pooled) conninfo for LISTEN (env QL3_RELAY_LISTEN_DSN; default: --dsn)",
    )
    a(
        "--redis-url",
        help="redis://[:password@]host:port/db, rediss://, "
        "redis+sentinel://host:port[,host:port]/master_name or "
        "redis+cluster://host:port[,host:port] (env QL3_REDIS_URL)",
    )
    a(
        "--channel-prefix",
        help="Redis channel prefix (env QL3_RELAY_CHANNEL_PREFIX; "
        f"default {DEFAULT_CHANNEL_PREFIX})",
    )
    a("--batch", type=int, help="events per claim, 1..10000 (env QL3_RELAY_BATCH; default 1000)")
    a(
        "--poll-interval",
        type=float,
        help="seconds between fallback polls (env QL3_RELAY_POLL_INTERVAL; default 1)",
    )
    a(
        "--heartbeat-interval",
        type=float,
        help="seconds between heartbeats (env QL3_RELAY_HEARTBEAT_INTERVAL; default 2)",
    )
    a(
        "--listen-probe-interval",
        type=float,
        help="seconds between liveness probes of the LISTEN connection "
        "(env QL3_RELAY_LISTEN_PROBE_INTERVAL; default 30)",
    )
    a(
        "--postgres-timeout",
        type=float,
        help="seconds a claim, mark or backlog query may go unanswered before its connection "
        "is given up and opened again (env QL3_RELAY_POSTGRES_TIMEOUT; default 30)",
    )
    a(
        "--backoff-max",
        type=float,
        help="cap of the retry backoff in seconds (env QL3_RELAY_BACKOFF_MAX; default 10)",
    )
    a(
        "--metrics-host",
        help="address of the /metrics and /healthz server "
        "(env QL3_RELAY_METRICS_HOST; default 127.0.0.1)",
    )
    a(
        "--metrics-port",
        type=int,
        help="port of /metrics and /healthz; 0 = any free port, "
        f"-1 = off (env QL3_RELAY_METRICS_PORT; default {DEFAULT_METRICS_PORT})",
    )
    a("--relay-id", help="name in heartbeats and logs (env QL3_RELAY_ID; default host-pid)")
    a("--log-level", help="debug, info, warning, error (env QL3_LOG_LEVEL; default info)")


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RelayConfig:
    """Flags win over environment variables, which win over defaults."""
    env = os.environ if environ is None else environ

    def pick(flag: str, var: str) -> Any:
        value = getattr(args, flag, None)
        if value is not None:
            return value
        text = env.get(var)
        return text if text not in (None, "") else None

    dsn = pick("dsn", "QL3_DSN")
    redis_url = pick("redis_url", "QL3_REDIS_URL")
    if not dsn:
        raise ValueError("no database: pass --dsn or set QL3_DSN")
    if not redis_url:
        raise ValueError("no Redis: pass --redis-url or set QL3_REDIS_URL")

    def number(flag: str, var: str, default: float, kind: type[int] | type[float]) -> Any:
        value = pick(flag, var)
        if value is None:
            return default
        source = f"--{flag.replace('_', '-')}" if getattr(args, flag, None) is not None else var
        what = "an integer" if kind is int else "a number"
        try:
            parsed = kind(value)
        except ValueError:
            raise ValueError(f"{source}={str(value)!r} is not {what}") from None
        if not math.isfinite(parsed):
            raise ValueError(f"{source}={str(value)!r} is not a finite number")
        return parsed

    return RelayConfig(
        dsn=str(dsn),
        redis_url=str(redis_url),
        listen_dsn=pick("listen_dsn", "QL3_RELAY_LISTEN_DSN"),
        channel_prefix=str(
            pick("channel_prefix", "QL3_RELAY_CHANNEL_PREFIX") or DEFAULT_CHANNEL_PREFIX
        ),
        batch=number("batch", "QL3_RELAY_BATCH", 1000, int),
        poll_interval=number("poll_interval", "QL3_RELAY_POLL_INTERVAL", 1.0, float),
        heartbeat_interval=number("heartbeat_interval", "QL3_RELAY_HEARTBEAT_INTERVAL", 2.0, float),
        listen_probe_interval=number(
            "listen_probe_interval", "QL3_RELAY_LISTEN_PROBE_INTERVAL", 30.0, float
        ),
        postgres_timeout=number("postgres_timeout", "QL3_RELAY_POSTGRES_TIMEOUT", 30.0, float),
        backoff_max=number("backoff_max", "QL3_RELAY_BACKOFF_MAX", 10.0, float),
        metrics_host=str(pick("metrics_host", "QL3_RELAY_METRICS_HOST") or "127.0.0.1"),
        metrics_port=number("metrics_port", "QL3_RELAY_METRICS_PORT", DEFAULT_METRICS_PORT, int),
        relay_id=str(pick("relay_id", "QL3_RELAY_ID") or ""),
        pause_mid_batch=float(env.get("QL3_RELAY_TEST_PAUSE_MID_BATCH") or 0.0),
    )


async def serve(config: RelayConfig) -> int:
    """Run one relay until SIGTERM or SIGINT; 0 after a clean drain."""
    relay = Relay(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, relay.request_stop)
    await relay.run()
    return 0


def command(args: argparse.Namespace) -> int:
    """``ql3 relay``: the entry point behind the subcommand."""
    level = getattr(args, "log_level", None) or os.environ.get("QL3_LOG_LEVEL") or "info"
    try:
        configure_logging(level)
    except ValueError as exc:  # said in the relay's own log format, at the default level
        configure_logging("info")
        _log(logging.ERROR, "bad_configuration", error=str(exc))
        return 2
    try:
        config = config_from_args(args)
    except ValueError as exc:
        _log(logging.ERROR, "bad_configuration", error=str(exc))
        return 2
    return asyncio.run(serve(config))


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``relay`` subcommand to ``ql3``'s argparse subparsers (``func`` = command)."""
    parser = subparsers.add_parser(
        "relay",
        help="bridge contract outbox events to Redis pub/sub",
        description="Relay ql3.contract_outbox events to Redis pub/sub (SPEC section 7).",
    )
    add_arguments(parser)
    parser.set_defaults(func=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ql3.relay``: exactly ``ql3 relay`` (its bad input included: an
    ``error: QL3_...`` line, never a traceback)."""
    from ql3 import cli  # cli imports this module to register the command

    return cli.main(["relay", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
