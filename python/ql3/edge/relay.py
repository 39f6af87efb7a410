"""``EdgeRelay``: the outbox relay of an ``EdgeStore``, in process (SPEC sections 7 and 10).

It delivers outbox rows, in seq order and at least once, to local subscribers (callbacks
in this process) and, when a Redis URL is given or ``QL3_REDIS_URL`` is set, to Redis on
the channels and with the JSON of the PostgreSQL relay (``ql3.channels.event_message``), so
workers listening on ``platform:contract:invalidate:<project_id>`` cannot tell the two
apart. A store COMMIT that wrote outbox rows wakes it at once (the twin of NOTIFY); a poll
every ``poll_interval`` seconds covers everything else.

Rows are read, delivered, then marked delivered in a short write transaction: the write
lock is never held across a callback or a network round trip. A crash between delivery
and the mark delivers again (at least once); a failed delivery is recorded on the rows
(``relay_attempts``, ``last_error``) and retried after a capped exponential backoff.

Local subscribers follow the outbox by seq with a cursor of this relay's own, not by the
rows' delivered mark: with a relay in each of several processes on one file, the marks
are shared (Redis needs each row once), but every process's subscribers must hear every
row (D39). The cursor starts before the first undelivered row (or at the top when none
is), so rows committed before the relay started are not lost to its subscribers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ql3 import arguments, channels
from ql3.edge.db import Row, utc_text
from ql3.logs import backoff_delay, describe_error

if TYPE_CHECKING:
    import redis

    from ql3.edge.store import EdgeStore

log = logging.getLogger("ql3.edge.relay")

Subscriber = Callable[[str, dict[str, Any]], None]
"""``fn(channel, message)``: the Redis channel name and the decoded JSON message."""


class DeliveryFailed(Exception):
    """A batch could not be delivered; its rows were marked failed and stay undelivered."""


class EdgeRelay:
    """Delivers an ``EdgeStore``'s outbox to local subscribers and, optionally, Redis.

    ``redis_url=None`` means ``$QL3_REDIS_URL`` when set; pass ``""`` for local delivery
    only. Use it synchronously (``run_once`` / ``drain`` after a write) or as a background
    thread (``start`` ... ``stop``, or ``with EdgeRelay(store) as relay:``).
    """

    def __init__(
        self,
        store: EdgeStore,
        *,
        redis_url: str | None = None,
        channel_prefix: str | None = None,
        batch: int = 500,
        poll_interval: float = 1.0,
        heartbeat_interval: float = 2.0,
        backoff_initial: float = 0.1,
        backoff_max: float = 10.0,
        redis_timeout: float = 5.0,
    ) -> None:
        arguments.check_count("batch", batch, 1, 10000)
        for name, seconds in (
            ("poll_interval", poll_interval),
            ("heartbeat_interval", heartbeat_interval),
            ("backoff_initial", backoff_initial),
            ("backoff_max", backoff_max),
            ("redis_timeout", redis_timeout),
        ):
            arguments.check_seconds(name, seconds)
        if channel_prefix is not None:
            arguments.check_channel_prefix(channel_prefix)
        self.store = store
        self.redis_url = os.environ.get("QL3_REDIS_URL") if redis_url is None else redis_url
        self.channel_prefix = channel_prefix or channels.DEFAULT_CHANNEL_PREFIX
        self.batch = batch
        self.poll_interval = poll_interval
        self.heartbeat_interval = heartbeat_interval
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.redis_timeout = redis_timeout
        self.relay_id = f"edge-{os.getpid()}-{id(self):x}"
        self.delivered_seq = 0
        self.published = 0
        self.failures = 0
        self.last_error: str | None = None
        self._subscribers: list[tuple[Subscriber, frozenset[str] | None]] = []
        self._redis: redis.Redis | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cycle = threading.Lock()
        first = store.claim_outbox(1)
        self._local_seq = (
            int(first[0]["seq"]) - 1 if first else int(store.outbox_backlog()["max_seq"])
        )
        self._unlisten = store.on_outbox_commit(self._wake.set)

    # -- subscribers ------------------------------------------------------------------

    def subscribe(
        self, fn: Subscriber, projects: Iterable[str] | None = None
    ) -> Callable[[], None]:
        """Deliver events (of ``projects``, default all) to ``fn``; returns an unsubscribe.

        ``fn`` runs in the delivering thread and must be quick; an exception from it fails
        the batch, which is then delivered again later (to every subscriber: at least once).
        """
        wanted = arguments.check_projects(projects)
        entry = (fn, None if wanted is None else frozenset(wanted))
        self._subscribers.append(entry)

        def unsubscribe() -> None:
            if entry in self._subscribers:
                self._subscribers.remove(entry)

        return unsubscribe

    def channel(self, project_id: str) -> str:
        """The channel the events of ``project_id`` are published on."""
        channel: str = channels.project_channel(self.channel_prefix, project_id)
        return channel

    # -- delivery ---------------------------------------------------------------------

    def run_once(self) -> int:
        """Read, deliver and mark one batch; the number of events delivered.

        Raises ``DeliveryFailed`` after recording the failure on the rows.
        """
        with self._cycle:
            local = self.store.outbox_after(self._local_seq, self.batch)
            if local:
                self._attempt(local, self._deliver_locally)
                self._local_seq = int(local[-1]["seq"])
            rows = self.store.claim_outbox(self.batch)
            if rows:
                if self.redis_url:
                    self._attempt(rows, self._publish)
                seqs = [int(row["seq"]) for row in rows]
                self.store.mark_outbox_delivered(seqs)
                self.delivered_seq = max(self.delivered_seq, max(seqs))
                self.published += len(rows)
            self.last_error = None
            return max(len(local), len(rows))

    def _attempt(self, rows: Sequence[Row], deliver: Callable[[Sequence[Row]], None]) -> None:
        """Deliver rows, or record the failure on those still undelivered and raise."""
        try:
            deliver(rows)
        except Exception as exc:
            self.failures += 1
            self.last_error = describe_error(exc)
            self.store.mark_outbox_failed([int(row["seq"]) for row in rows], self.last_error)
            log.warning("edge relay delivery failed: %s", self.last_error)
            raise DeliveryFailed(self.last_error) from exc

    def drain(self) -> int:
        """Deliver batches until the outbox is empty; the number of events delivered."""
        total = 0
        while True:
            count = self.run_once()
            total += count
            if count < self.batch:
                return total

    def _messages(self, rows: Sequence[Row]) -> list[tuple[str, dict[str, Any]]]:
        return [(self.channel(row["project_id"]), channels.event_message(row)) for row in rows]

    def _deliver_locally(self, rows: Sequence[Row]) -> None:
        messages = self._messages(rows)
        for fn, projects in list(self._subscribers):
            for (channel, message), row in zip(messages, rows, strict=True):
                if projects is None or row["project_id"] in projects:
                    fn(channel, message)

    def _publish(self, rows: Sequence[Row]) -> None:
        with self._client().pipeline(transaction=False) as pipe:
            for channel, message in self._messages(rows):
                pipe.publish(channel, json.dumps(message))
            pipe.execute()

    def _client(self) -> redis.Redis:
        if self._redis is None:
            import redis as redis_sync
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            assert self.redis_url
            self._redis = redis_sync.Redis.from_url(
                self.redis_url,
                socket_connect_timeout=self.redis_timeout,
                socket_timeout=self.redis_timeout,
                retry=Retry(NoBackoff(), 0),
            )
        return self._redis

    def _heartbeat(self) -> None:
        if not self.redis_url:
            return
        payload = {
            "type": "heartbeat",
            "relay_id": self.relay_id,
            "seq": self.delivered_seq,
            "at": utc_text(datetime.now(UTC)),
        }
        channel = channels.heartbeat_channel(self.channel_prefix)
        try:
            self._client().publish(channel, json.dumps(payload))
        except Exception as exc:  # a missed heartbeat is what workers are told to detect
            log.warning("edge relay heartbeat failed: %s", describe_error(exc))

    # -- background thread ------------------------------------------------------------

    def start(self) -> None:
        """Deliver in a background thread until ``stop``."""
        if self._thread is None:
            self._stop.clear()
            self._wake.set()  # sweep at start: anything committed before we were here
            self._thread = threading.Thread(target=self._loop, name="ql3-edge-relay", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the batch in flight and stop the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        self.stop()
        self._unlisten()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                self._redis.close()
            self._redis = None

    def __enter__(self) -> EdgeRelay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        failures = 0
        next_heartbeat = 0.0
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.drain()
                failures = 0
            except Exception as exc:
                failures += 1
                if not isinstance(exc, DeliveryFailed):
                    log.warning("edge relay cycle failed: %s", describe_error(exc))
                delay = backoff_delay(failures, initial=self.backoff_initial, cap=self.backoff_max)
                self._stop.wait(delay)
                continue
            now = time.monotonic()
            if now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + self.heartbeat_interval
            self._wake.wait(min(self.poll_interval, self.heartbeat_interval))

    def health(self) -> dict[str, Any]:
        return {
            "relay_id": self.relay_id,
            "running": self._thread is not None and self._thread.is_alive(),
            "redis": bool(self.redis_url),
            "delivered_seq": self.delivered_seq,
            "published": self.published,
            "failures": self.failures,
            "last_error": self.last_error,
            "backlog": self.store.outbox_backlog(),
        }
