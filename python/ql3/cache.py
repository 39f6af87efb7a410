"""The worker revision cache (SPEC section 8): Redis invalidates, PostgreSQL decides.

Why it is built this way:

- **Subscribe first, then read.** ``start`` waits for Redis to confirm the subscription
  before anything is read from the database, so no activation can slip between the read and
  the subscription. Every later (re)subscription marks all entries unverified: messages
  published while the subscription was down are gone, so each entry is checked against
  its active pointer again (one batched ``ql3.active_pointers`` round trip).
- **Messages are hints ordered by pointer_version.** A message at or below the cached
  pointer_version is ignored (duplicates, reordering across relays); a newer one drops the
  entry and reloads it from the database. A load whose snapshot is older than a hint
  already received is not installed; a load that *started after* the hint arrived and
  still sees an older pointer means the database does not confirm the hint, and the
  database wins (a forged or corrupt message cannot lock a contract out). A lower message
  that arrived after that load was sent is read again, so a forged hint hides no real
  activation (one more read per message: forged messages cannot make it loop).
- **Monotonic.** An entry is only ever replaced by one whose pointer_version is at least
  as high, so a worker never serves a revision older than one it has already served or
  verified, whatever order concurrent loads finish in. A revision refused for its body hash
  stays the key's hint, so an older load finishing later cannot install what it replaced.
- **A read counts as of when it was sent.** Verifications and loads are stamped with the
  time their query was sent, not the time it answered, and one sent before the entries
  were marked unverified (resubscription, end of degraded mode) verifies nothing.
- **Fallback.** An entry older than its family's max staleness (``ql3.contract_families``)
  is re-verified before use; a background pass re-verifies entries at half their budget
  in one round trip, so lost messages are repaired within the budget even for entries
  nobody is using, and ``on_change`` callbacks fire.
- **Degraded mode.** When heartbeats stop (relay dead, Redis partitioned, subscription
  lost) every use verifies against the database first; when they resume the cache goes
  back to normal after re-verifying every entry.
- **Fail closed.** No active revision (never activated, or revoked) raises ``NotFound``;
  a body whose hash does not match ``body_hash`` is refused; an entry that needs
  verification while the database is unreachable raises ``Unavailable``. So does ``start``
  when it cannot read the family budgets (after waiting ``db_timeout`` for a
  connection): a cache that guessed them could serve entries staler than their family
  allows, and nothing is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from redis.asyncio.cluster import ClusterPubSub, RedisCluster

from ql3 import arguments, cache_metrics, canonical, errors, redis_links
from ql3.db import CALL_MARGIN_S, translate
from ql3.db_guard import bounded_async
from ql3.logs import backoff_delay
from ql3.pooler import AsyncConnection, prepare_threshold
from ql3.redis_links import AnyRedis
from ql3.relay import (
    DEFAULT_CHANNEL_PREFIX,
    HEARTBEAT_NAME,
    REDIS_ERRORS,
    heartbeat_channel,
    make_redis,
    project_channel,
    reraise_if_cancelled,
)
from ql3.revisions import BodyHashMismatch, EffectiveRevision
from ql3.safe_text import redact_url

BODY_DOMAIN = canonical.BODY_DOMAIN
DEFAULT_STALENESS = 30.0

log = logging.getLogger("ql3.cache")

Key = tuple[str, str, str]
Mode = Literal["starting", "normal", "degraded", "closed"]
ChangeCallback = Callable[["EffectiveRevision"], "Awaitable[None] | None"]

# Every read also returns the database's failover epoch (D48), on a row of its own when
# nothing else matches, so each answer says which history it comes from.

# One key (the reload a message triggers): one function call in one round trip. A NULL
# revision means none is active; _LOAD_SQL then reads the pointer_version to install.
_LOAD_ONE_SQL = """
SELECT e.epoch, r.revision_id, r.revision_no, r.body, r.body_hash, r.pointer_version
FROM ql3.failover_epoch() AS e (epoch)
LEFT JOIN ql3.active_revision(%s, %s, %s) AS r ON true
"""

_LOAD_SQL = """
SELECT e.epoch, p.project_id, p.contract_family, p.contract_id, p.pointer_version,
       r.revision_id, r.revision_no, r.body, r.body_hash
FROM ql3.failover_epoch() AS e (epoch)
LEFT JOIN ql3.active_pointers(%s::jsonb) AS p ON true
LEFT JOIN LATERAL ql3.active_revision(p.project_id, p.contract_family, p.contract_id) AS r
    ON true
"""

_FAMILIES_SQL = """
SELECT e.epoch, f.contract_family, f.max_staleness_seconds
FROM ql3.failover_epoch() AS e (epoch)
LEFT JOIN ql3.contract_families AS f ON true
"""

_VERIFY_SQL = """
SELECT e.epoch, p.project_id, p.contract_family, p.contract_id, p.revision_id, p.pointer_version
FROM ql3.failover_epoch() AS e (epoch)
LEFT JOIN ql3.active_pointers(%s::jsonb) AS p ON true
"""

# Epochs announced by messages or heartbeats and not yet checked, and those the database
# did not confirm, are kept up to these many: forged ones cannot grow the cache.
_MAX_SUSPECTS = 64
_MAX_REFUTED = 1024


@dataclass(frozen=True, kw_only=True)
class CacheHealth:
    mode: Mode
    subscribed: bool
    entries: int
    last_message_at: datetime | None
    last_heartbeat_at: datetime | None
    last_verification_at: datetime | None
    messages: int
    malformed_messages: int
    reloads: int
    verifications: int
    failover_epoch: str | None = None  # of the database, as last read (D48)
    failover_epoch_changes: int = 0


@dataclass(frozen=True)
class _Revision:
    revision_id: str
    revision_no: int
    body: dict[str, Any]
    body_hash: str


@dataclass
class _Hint:
    """The highest pointer_version announced for a key (message or verification), pending.

    A read sent before ``tick`` may predate it; one sent after and still older means the
    database does not confirm it. ``below`` is (highest lower version, tick of the last
    such message) of messages that came after it: they may be real even if it is not.
    """

    version: int
    tick: int
    below: tuple[int, int] | None = None


@dataclass(frozen=True)
class _Sent:
    """When a read was sent: its answer is only known to hold as of then."""

    tick: int
    mono: float
    wall: float


@dataclass
class _Entry:
    """One key's state: its revision (None = none active) at one pointer_version, in the
    failover epoch it was read in (pointer_versions of two epochs do not compare)."""

    revision: _Revision | None
    pointer_version: int
    epoch: str
    cached_wall: float
    verified_mono: float
    verified_wall: float
    # What get_effective served, with the verified_wall it was made at: a hit returns the
    # same (immutable) object until the entry is verified again.
    served: tuple[float, EffectiveRevision] | None = None


class _ShardSilent(Exception):
    """A Cluster shard's heartbeat went unheard for too long (``_check_shards_heard``)."""


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _oldest(heard: Iterable[float | None]) -> float | None:
    """The oldest of the last heartbeats of every channel, None while one is unheard."""
    oldest: float | None = None
    for at in heard:
        if at is None:
            return None
        oldest = at if oldest is None else min(oldest, at)
    return oldest


def _wall(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def _log(level: int, event: str, **fields: Any) -> None:
    log.log(level, event, extra={"ql3": fields})


class RevisionCache:
    """A worker's local cache of active contract revisions.

    ``async with RevisionCache(dsn, redis_url) as cache: rev = await cache.get_effective(...)``

    ``projects`` limits the subscription to those projects (default: every project, by
    pattern). On a Redis Cluster (``redis+cluster://``) it is required: events travel by
    sharded pub/sub, which has no patterns (D52). ``max_staleness`` overrides the
    per-family budget from ``contract_families`` (seconds; tests shorten it).
    ``heartbeat_timeout`` is how long without a relay heartbeat before the cache degrades
    (keep it at several relay heartbeat intervals).
    ``db_timeout`` bounds the wait for a database connection of the cache's own pool; a
    read that has no answer ``db_timeout`` + 5 seconds after it was sent is given up
    (``Unavailable``, its connection dropped).

    The cache's own pool is autocommit and does not check connections on checkout: every
    read is one statement, so a reload is one round trip, not four (check, BEGIN, query,
    COMMIT). When a read finds its connection broken (killed backend, restarted server)
    the pool drops it, the idle connections are checked, and the read is repeated once,
    so the caller sees the answer, or ``Unavailable`` if the database is really down. A
    pool passed in is used as it is (a non-autocommit one gets a COMMIT per read).
    """

    def __init__(
        self,
        conninfo_or_pool: str | AsyncConnectionPool[Any],
        redis_url: str,
        *,
        channel_prefix: str = DEFAULT_CHANNEL_PREFIX,
        projects: Iterable[str] | None = None,
        max_staleness: Mapping[str, float] | None = None,
        heartbeat_timeout: float = 10.0,
        subscribe_timeout: float = 5.0,
        redis_timeout: float = 5.0,
        db_timeout: float = 5.0,
    ) -> None:
        for name, seconds in (
            ("heartbeat_timeout", heartbeat_timeout),
            ("subscribe_timeout", subscribe_timeout),
            ("redis_timeout", redis_timeout),
            ("db_timeout", db_timeout),
        ):
            arguments.check_seconds(name, seconds)
        overrides = arguments.check_staleness(max_staleness)
        arguments.check_channel_prefix(channel_prefix)
        projects = arguments.check_projects(projects)
        if isinstance(conninfo_or_pool, str):
            self._pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                conninfo_or_pool,
                connection_class=AsyncConnection,  # its failures name its pool's timeout
                min_size=1,
                max_size=4,
                open=False,
                timeout=db_timeout,
                kwargs={
                    "autocommit": True,
                    "prepare_threshold": prepare_threshold(),  # ql3.pooler
                    "connect_timeout": max(2, math.ceil(db_timeout)),
                    "application_name": "ql3-cache",
                },
            )
            self._owns_pool = True
        else:
            self._pool = conninfo_or_pool
            self._owns_pool = False
        # A read that has no answer after this long is given up (ql3.db_guard): a backend
        # that stopped answering must not hold a reload, or a get_effective, forever.
        self._read_limit = db_timeout + CALL_MARGIN_S
        self._redis_url = redis_url
        try:
            self._redis_link = redis_links.parse(redis_url)
        except ValueError as exc:
            raise errors.InvalidArgument(
                f"QL3_INVALID_ARGUMENT: redis_url {redact_url(redis_url)!r}: {exc}"
            ) from None
        if self._redis_link.kind == "cluster" and projects is None:
            raise errors.InvalidArgument(
                "QL3_INVALID_ARGUMENT: a cache on a Redis Cluster needs projects: sharded "
                "pub/sub has no patterns"
            )
        self._prefix = channel_prefix
        self._projects = sorted(set(projects)) if projects is not None else None
        self._overrides = overrides
        self._heartbeat_timeout = heartbeat_timeout
        self._subscribe_timeout = subscribe_timeout
        self._redis_timeout = redis_timeout
        self._heartbeat_channel = heartbeat_channel(channel_prefix)
        # When each heartbeat channel listened to was last heard (monotonic). On a Cluster
        # there is one per shard (D53), and _last_heartbeat_mono is the oldest of them.
        self._heartbeats_heard: dict[str, float | None] = {self._heartbeat_channel: None}

        self._entries: dict[Key, _Entry] = {}
        self._known: set[Key] = set()
        self._hints: dict[Key, _Hint] = {}
        self._load_errors: dict[Key, errors.Ql3Error] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._last_revision_id: dict[Key, str | None] = {}
        self._callbacks: dict[tuple[str, str], list[ChangeCallback]] = {}
        self._family_staleness: dict[str, float] = {}
        self._ticks = itertools.count(1)
        self._unverified_tick = 0  # reads sent before it verify nothing
        # The failover epoch (D48) of the database as of the read sent at _epoch_tick;
        # answers from another epoch sent before then are from a history the cache left.
        self._epoch: str | None = None
        self._epoch_tick = 0
        self._epoch_changes = 0
        self._suspects: dict[str, int] = {}  # announced epoch -> tick it was first seen
        self._refuted: set[str] = set()  # announced, and a later read said otherwise
        self._epoch_check = False  # the verify loop reads the epoch now

        self._mode: Mode = "starting"
        self._started_mono: float | None = None
        self.metrics_label = cache_metrics.label_for(channel_prefix)
        self._subscribed = False
        self._subscribed_event = asyncio.Event()
        self._last_message: float | None = None
        self._last_heartbeat_mono: float | None = None
        self._last_heartbeat_wall: float | None = None
        self._last_verification: float | None = None
        self._messages = 0
        self._malformed = 0
        self._reloads = 0
        self._verifications = 0

        self._reload_queue: set[Key] = set()
        self._reload_wake = asyncio.Event()
        self._verify_wake = asyncio.Event()
        self._redis: AnyRedis | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._callback_tasks: set[asyncio.Future[Any]] = set()

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> RevisionCache:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Subscribe (waiting for Redis to confirm), then read families, then serve.

        Raises ``Unavailable`` (or another ``Ql3Error``) when the family budgets cannot be
        read, after closing what it opened.
        """
        if self._tasks:
            return
        self._started_mono = time.monotonic()
        cache_metrics.watch(self)
        try:
            if self._owns_pool:
                await self._pool.open()
            self._tasks.append(asyncio.create_task(self._subscription_loop(), name="ql3-cache-sub"))
            try:
                await asyncio.wait_for(self._subscribed_event.wait(), self._subscribe_timeout)
            except TimeoutError:
                _log(logging.WARNING, "cache_subscribe_timeout", seconds=self._subscribe_timeout)
            await self._load_families()
        except BaseException:
            await self.close()
            raise
        self._tasks.append(asyncio.create_task(self._reload_loop(), name="ql3-cache-reload"))
        self._tasks.append(asyncio.create_task(self._verify_loop(), name="ql3-cache-verify"))
        self._tasks.append(asyncio.create_task(self._watchdog_loop(), name="ql3-cache-watch"))
        self._set_mode(self._live_mode())

    async def close(self) -> None:
        cache_metrics.unwatch(self)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        callbacks = list(self._callback_tasks)
        for pending in callbacks:
            pending.cancel()
        await asyncio.gather(*callbacks, return_exceptions=True)
        if self._redis is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await self._redis.aclose()
            self._redis = None
        if self._owns_pool:
            await self._pool.close()
        self._subscribed = False
        self._mode = "closed"

    # -- public API --------------------------------------------------------------------

    async def get_effective(
        self, project_id: str, contract_family: str, contract_id: str
    ) -> EffectiveRevision:
        """The active revision of a contract, verified as the mode requires.

        Raises ``NotFound`` when no revision is active (fail closed after a revoke),
        ``BodyHashMismatch`` when the stored body does not match its hash, and
        ``Unavailable`` when a needed verification cannot reach the database.
        """
        key = (project_id, contract_family, contract_id)
        try:
            known = key in self._known
        except TypeError:  # unhashable: not a key at all, as check_contract_key says
            known = False
        if not known:
            arguments.check_contract_key(*key)
            self._known.add(key)
        since = time.monotonic()
        for _ in range(5):
            entry = self._entries.get(key)
            if entry is not None and self._usable(key, entry, since):
                return self._effective(key, entry)
            async with self._lock(key):
                entry = self._entries.get(key)
                if entry is not None and self._usable(key, entry, since):
                    continue
                if entry is not None and not self._hinted_newer(key, entry):
                    await self._verify([key])
                    entry = self._entries.get(key)
                    if entry is not None and self._usable(key, entry, since):
                        continue
                await self._load([key])
                failure = self._load_errors.pop(key, None)
                if failure is not None:
                    raise failure
        raise errors.Unavailable(
            f"QL3_UNAVAILABLE: no consistent revision of {'/'.join(key)} could be read"
        )

    def on_change(self, contract_family: str, contract_id: str, fn: ChangeCallback) -> None:
        """Call ``fn(revision)`` whenever a different revision of that contract is loaded.

        Fires for every project, including the first load of a key. ``fn`` may be a plain
        function or a coroutine function; its exceptions are logged and swallowed.
        """
        self._callbacks.setdefault((contract_family, contract_id), []).append(fn)

    async def verify_all(self) -> None:
        """Re-verify every entry now (one round trip) and reload the ones that moved."""
        keys = list(self._entries)
        if keys:
            changed = await self._verify(keys)
            if changed:
                await self._load(changed)

    def health(self) -> CacheHealth:
        mode = self._live_mode() if self._mode not in ("starting", "closed") else self._mode
        return CacheHealth(
            mode=mode,
            subscribed=self._subscribed,
            entries=len(self._entries),
            last_message_at=_wall(self._last_message),
            last_heartbeat_at=_wall(self._last_heartbeat_wall),
            last_verification_at=_wall(self._last_verification),
            messages=self._messages,
            malformed_messages=self._malformed,
            reloads=self._reloads,
            verifications=self._verifications,
            failover_epoch=self._epoch,
            failover_epoch_changes=self._epoch_changes,
        )

    @property
    def mode(self) -> Mode:
        return self.health().mode

    def metrics_sample(self, now: float) -> tuple[str, float | None, int]:
        """(mode, seconds since the oldest heartbeat channel was heard, entries) for
        ``ql3.cache_metrics`` at monotonic ``now``; the age counts from the start while a
        heartbeat was never heard."""
        heard = self._last_heartbeat_mono
        if heard is None:
            heard = self._started_mono
        age = None if heard is None else max(0.0, now - heard)
        mode = self._live_mode() if self._mode not in ("starting", "closed") else self._mode
        return mode, age, len(self._entries)

    # -- freshness ---------------------------------------------------------------------

    def staleness(self, contract_family: str) -> float:
        """The max staleness budget of a family, in seconds."""
        if contract_family in self._overrides:
            return float(self._overrides[contract_family])
        return self._family_staleness.get(contract_family, DEFAULT_STALENESS)

    def _live_mode(self) -> Mode:
        if not self._subscribed or self._last_heartbeat_mono is None:
            return "degraded"
        if time.monotonic() - self._last_heartbeat_mono > self._heartbeat_timeout:
            return "degraded"
        return "normal"

    def _hinted_newer(self, key: Key, entry: _Entry) -> bool:
        hint = self._hints.get(key)
        return hint is not None and hint.version > entry.pointer_version

    def _usable(self, key: Key, entry: _Entry, since: float) -> bool:
        if entry.epoch != self._epoch or self._hinted_newer(key, entry):
            return False
        if self._live_mode() != "normal":
            return entry.verified_mono >= since
        return time.monotonic() - entry.verified_mono <= self.staleness(key[1])

    def _effective(self, key: Key, entry: _Entry) -> EffectiveRevision:
        rev = entry.revision
        if rev is None:
            raise errors.NotFound(f"QL3_NOT_FOUND: no active revision for {'/'.join(key)}")
        served = entry.served
        if served is not None and served[0] == entry.verified_wall:
            return served[1]
        effective = EffectiveRevision(
            project_id=key[0],
            contract_family=key[1],
            contract_id=key[2],
            revision_id=rev.revision_id,
            revision_no=rev.revision_no,
            body=rev.body,
            body_hash=rev.body_hash,
            pointer_version=entry.pointer_version,
            cached_at=datetime.fromtimestamp(entry.cached_wall, UTC),
            verified_at=datetime.fromtimestamp(entry.verified_wall, UTC),
        )
        entry.served = (entry.verified_wall, effective)
        return effective

    def _lock(self, key: Key) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    # -- database ----------------------------------------------------------------------

    async def _query(self, sql: str, keys: Sequence[Key]) -> list[dict[str, Any]]:
        """Run a ``ql3.active_pointers`` query over keys; its rows."""
        return await self._fetch(sql, (Jsonb([list(k) for k in keys]),))

    async def _fetch(self, sql: str, params: Sequence[Any]) -> list[dict[str, Any]]:
        """One read-only statement; retried once if its connection turned out broken."""
        for attempt in (1, 2):
            conn: psycopg.AsyncConnection[Any] | None = None
            try:
                # getconn/putconn rather than pool.connection(): no context managers and
                # no COMMIT call on an autocommit connection, on the path of every reload.
                conn = await self._pool.getconn()
                try:
                    async with bounded_async(self._read_limit):
                        cur = conn.cursor(row_factory=dict_row)
                        await cur.execute(sql, params)
                        rows: list[dict[str, Any]] = await cur.fetchall()
                        if not conn.autocommit:  # a pool passed in may open transactions
                            await conn.commit()
                except Exception:
                    if not conn.autocommit and not conn.closed:
                        with contextlib.suppress(psycopg.Error):
                            await conn.rollback()
                    raise
                finally:
                    await self._pool.putconn(conn)
                return rows
            except psycopg.Error as exc:
                reraise_if_cancelled()
                if attempt == 1 and conn is not None and conn.broken:
                    # A killed backend or a restarted server: the pool has dropped this
                    # connection; test the idle ones too (after a restart they are all
                    # dead) and repeat the read, which is safe, on a working one.
                    _log(logging.WARNING, "cache_connection_lost", error=str(exc))
                    await self._pool.check()
                    continue
                raise translate(exc, self._pool) from exc
            except TimeoutError as exc:  # the pool found no connection in time
                reraise_if_cancelled()
                raise errors.NotSent(f"QL3_UNAVAILABLE: {exc}") from exc
        raise AssertionError("unreachable")

    async def _load_families(self) -> None:
        """Read every family's max staleness; failures raise (``start`` fails closed)."""
        sent = self._sent()
        try:
            rows = await self._fetch(_FAMILIES_SQL, ())
        except errors.Unavailable as exc:
            raise errors.Unavailable(
                f"QL3_UNAVAILABLE: cannot read the contract family budgets: {exc}"
            ) from exc
        self._accept_epoch(str(rows[0]["epoch"]), sent)
        self._family_staleness = {
            str(r["contract_family"]): float(r["max_staleness_seconds"])
            for r in rows
            if r["contract_family"] is not None
        }

    async def _verify(self, keys: Sequence[Key]) -> list[Key]:
        """Check entries against their active pointers; the keys that moved are dropped."""
        sent = self._sent()
        rows = await self._query(_VERIFY_SQL, keys)
        epoch = str(rows[0]["epoch"])
        if not self._accept_epoch(epoch, sent):
            return []  # answered by the history the cache has left: verifies nothing
        changed: list[Key] = []
        for row in rows:
            if row["project_id"] is None:
                continue  # no keys asked: the row that carries the epoch
            key = (row["project_id"], row["contract_family"], row["contract_id"])
            entry = self._entries.get(key)
            if entry is None:
                continue
            version = int(row["pointer_version"])
            revision_id = None if row["revision_id"] is None else str(row["revision_id"])
            current = None if entry.revision is None else entry.revision.revision_id
            if entry.epoch != epoch:
                # Read in the history before a failover: the database decides, even when
                # its pointer_version is lower (SPEC section 8, D48).
                del self._entries[key]
                changed.append(key)
            elif version == entry.pointer_version and revision_id == current:
                self._stamp(entry, sent)
            elif version > entry.pointer_version:
                # Seen in the database: no load from an older snapshot may undo it.
                del self._entries[key]
                hint = self._hints.get(key)
                if hint is None or hint.version < version:
                    self._hints[key] = _Hint(version, next(self._ticks))
                changed.append(key)
            else:
                _log(
                    logging.WARNING,
                    "cache_database_behind",
                    key=list(key),
                    cached=entry.pointer_version,
                    database=version,
                )
        self._verifications += 1
        self._last_verification = sent.wall
        return changed

    def _sent(self) -> _Sent:
        """Take before sending a read: its answer holds as of this moment, not later."""
        return _Sent(next(self._ticks), time.monotonic(), time.time())

    def _verified_mono(self, sent: _Sent) -> float:
        """What a read sent at ``sent`` verifies: nothing if sent before the entries were
        marked unverified (what it answers may predate a lost message)."""
        return sent.mono if sent.tick > self._unverified_tick else -math.inf

    def _stamp(self, entry: _Entry, sent: _Sent) -> None:
        verified = self._verified_mono(sent)
        if verified > entry.verified_mono:
            entry.verified_mono, entry.verified_wall = verified, sent.wall

    # -- failover epoch (D48) ------------------------------------------------------------

    def _accept_epoch(self, epoch: str, sent: _Sent) -> bool:
        """Whether an answer read in ``epoch`` may be used; a newer read in another epoch
        than the cache's means a failover (or a restore): the cache takes it up."""
        if epoch == self._epoch:
            self._refute_suspects(epoch, sent)
            return True
        if sent.tick < self._epoch_tick:
            return False  # sent before a later read told the current epoch
        previous, self._epoch, self._epoch_tick = self._epoch, epoch, sent.tick
        self._suspects.pop(epoch, None)
        self._refute_suspects(epoch, sent)
        if previous is None:
            return True  # the first read (start)
        self._epoch_changes += 1
        self._refuted.discard(epoch)
        self._refuted.add(previous)  # a relay still on the old primary is not heard
        # Hints order pointer_versions of the old history; entries read in it are not used
        # again before the database is asked (_usable), and the verify loop asks now.
        self._hints.clear()
        for entry in self._entries.values():
            entry.verified_mono = -math.inf
        self._verify_wake.set()
        _log(
            logging.WARNING,
            "cache_failover_epoch_changed",
            previous=previous,
            epoch=epoch,
            entries=len(self._entries),
        )
        return True

    def _refute_suspects(self, epoch: str, sent: _Sent) -> None:
        """Announced epochs that a read sent after them did not confirm are not checked
        again (until the cache's own epoch changes)."""
        for suspect, tick in list(self._suspects.items()):
            if tick < sent.tick:
                del self._suspects[suspect]
                if suspect != epoch:
                    if len(self._refuted) >= _MAX_REFUTED:
                        self._refuted.clear()
                    self._refuted.add(suspect)

    def _same_epoch(self, doc: Mapping[str, Any]) -> bool:
        """Whether a message or heartbeat comes from the epoch the cache reads; one from
        another epoch makes the verify loop ask the database which epoch it is in. A
        message without one (the edge relay's) counts as the cache's own."""
        epoch = doc.get("failover_epoch")
        if epoch is None:
            return True
        if not isinstance(epoch, str) or not epoch:
            raise ValueError("failover_epoch must be a non-empty string")
        if epoch == self._epoch:
            return True
        if (
            epoch not in self._refuted
            and epoch not in self._suspects
            and len(self._suspects) < _MAX_SUSPECTS
        ):
            self._suspects[epoch] = next(self._ticks)
            self._epoch_check = True
            self._verify_wake.set()
        return False

    async def _load(self, keys: Sequence[Key]) -> None:
        """Read the active revisions of keys in one round trip and install what is newer."""
        for key in keys:
            self._load_errors.pop(key, None)
        sent = self._sent()
        epoch, loaded = await self._read_active(keys)  # a failed read raises to the caller
        self._reloads += 1
        if not self._accept_epoch(epoch, sent):
            return  # answered by the history the cache has left: installs nothing
        for key, row in loaded:
            try:
                self._install(key, row, sent, epoch)
            except errors.Ql3Error as exc:
                self._load_errors[key] = exc

    async def _read_active(
        self, keys: Sequence[Key]
    ) -> tuple[str, list[tuple[Key, dict[str, Any]]]]:
        """The failover epoch, and each key with its row: revision columns (NULL if none
        active), pointer_version."""
        if len(keys) == 1:
            rows = await self._fetch(_LOAD_ONE_SQL, keys[0])
            if rows[0]["revision_id"] is not None:
                return str(rows[0]["epoch"]), [(keys[0], rows[0])]
        rows = await self._query(_LOAD_SQL, keys)
        return str(rows[0]["epoch"]), [
            ((r["project_id"], r["contract_family"], r["contract_id"]), r)
            for r in rows
            if r["project_id"] is not None
        ]

    def _install(self, key: Key, row: Mapping[str, Any], sent: _Sent, epoch: str) -> None:
        version = int(row["pointer_version"])
        entry = self._entries.get(key)
        if entry is not None and entry.epoch != epoch:
            # Read before a failover: whatever the database now says replaces it (D48).
            del self._entries[key]
            entry = None
        if entry is not None and version < entry.pointer_version:
            return  # an older snapshot finished late: never go backwards
        hint = self._hints.get(key)
        if hint is not None and version < hint.version:
            if sent.tick < hint.tick:
                return  # read before the hint arrived; the reload it scheduled will follow
            below = hint.below
            if below is not None and sent.tick < below[1] and version < below[0]:
                # The hint is not confirmed, but a lower message came after this read was
                # sent (a real activation the hint hid): read once more for that one.
                self._hints[key] = _Hint(*below)
                self._reload_queue.add(key)
                self._reload_wake.set()
                return
            _log(
                logging.WARNING,
                "cache_hint_not_confirmed",
                key=list(key),
                hinted=hint.version,
                database=version,
            )
        revision: _Revision | None = None
        if row["revision_id"] is not None:
            body = row["body"]
            expected = str(row["body_hash"])
            actual = canonical.digest(BODY_DOMAIN, body) if isinstance(body, dict) else None
            if actual != expected:
                self._entries.pop(key, None)
                # Seen in the database: a load sent earlier must not install the older
                # revision it replaced (the caller gets this refusal instead).
                self._hints[key] = _Hint(version, sent.tick)
                _log(
                    logging.ERROR,
                    "cache_body_hash_mismatch",
                    key=list(key),
                    revision_id=str(row["revision_id"]),
                    expected=expected,
                    actual=actual,
                )
                raise BodyHashMismatch(
                    f"QL3_CONFLICT: revision {row['revision_id']} of {'/'.join(key)} does not "
                    "match its body_hash; refused"
                )
            revision = _Revision(
                revision_id=str(row["revision_id"]),
                revision_no=int(row["revision_no"]),
                body=body,
                body_hash=expected,
            )
        self._hints.pop(key, None)
        same = (
            entry is not None
            and entry.pointer_version == version
            and (entry.revision is None) == (revision is None)
        )
        if same and entry is not None:
            self._stamp(entry, sent)
        else:
            self._entries[key] = _Entry(
                revision=revision,
                pointer_version=version,
                epoch=epoch,
                cached_wall=sent.wall,
                verified_mono=self._verified_mono(sent),
                verified_wall=sent.wall,
            )
        self._load_errors.pop(key, None)
        new_id = None if revision is None else revision.revision_id
        if self._last_revision_id.get(key) != new_id:
            self._last_revision_id[key] = new_id
            if revision is not None:
                if log.isEnabledFor(logging.INFO):
                    _log(
                        logging.INFO,
                        "cache_revision_loaded",
                        key=list(key),
                        revision_id=new_id,
                        pointer_version=version,
                    )
                self._fire(key)

    def _fire(self, key: Key) -> None:
        callbacks = self._callbacks.get((key[1], key[2]))
        entry = self._entries.get(key)
        if not callbacks or entry is None:
            return
        revision = self._effective(key, entry)
        for fn in callbacks:
            try:
                result = fn(revision)
            except Exception:
                log.exception("on_change callback failed", extra={"ql3": {"key": list(key)}})
                continue
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._callback_tasks.add(task)
                task.add_done_callback(self._callback_done)

    def _callback_done(self, task: asyncio.Future[Any]) -> None:
        self._callback_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log(logging.ERROR, "cache_callback_failed", error=repr(task.exception()))

    # -- background tasks --------------------------------------------------------------

    def _set_mode(self, mode: Mode) -> None:
        if mode == self._mode:
            return
        previous, self._mode = self._mode, mode
        _log(
            logging.WARNING if mode == "degraded" else logging.INFO,
            "cache_mode",
            mode=mode,
            previous=previous,
        )
        if previous == "degraded" and mode == "normal":
            self._mark_all_unverified()

    def _mark_all_unverified(self) -> None:
        self._unverified_tick = next(self._ticks)
        for entry in self._entries.values():
            entry.verified_mono = -math.inf
        self._verify_wake.set()

    async def _watchdog_loop(self) -> None:
        period = max(0.02, min(1.0, self._heartbeat_timeout / 4))
        while True:
            reraise_if_cancelled()
            self._set_mode(self._live_mode())
            await asyncio.sleep(period)

    def _verify_period(self) -> float:
        families = {key[1] for key in self._entries} or {"policy_routing"}
        shortest = min(self.staleness(f) for f in families)
        return max(0.02, min(5.0, shortest / 4))

    async def _verify_loop(self) -> None:
        """Keep entries verified at half their budget, so lost messages heal in time."""
        failures = 0
        while True:
            reraise_if_cancelled()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._verify_wake.wait(), self._verify_period())
            self._verify_wake.clear()
            now = time.monotonic()
            due = [
                key
                for key, entry in self._entries.items()
                if now - entry.verified_mono > self.staleness(key[1]) / 2
            ]
            # A message or heartbeat announced another failover epoch: ask the database
            # (the read carries the epoch even with no key due).
            check, self._epoch_check = self._epoch_check, False
            if not due and not check:
                continue
            try:
                changed = await self._verify(due)
                if changed:
                    await self._load(changed)
                failures = 0
            except errors.Ql3Error as exc:
                reraise_if_cancelled()
                self._epoch_check = self._epoch_check or check
                failures += 1
                _log(logging.WARNING, "cache_verify_failed", error=str(exc), attempt=failures)
                await asyncio.sleep(backoff_delay(failures, initial=0.1, cap=5.0))

    async def _reload_loop(self) -> None:
        """Reload keys invalidated by messages, many per round trip."""
        while True:
            reraise_if_cancelled()
            await self._reload_wake.wait()
            self._reload_wake.clear()
            keys, self._reload_queue = sorted(self._reload_queue), set()
            if not keys:
                continue
            try:
                await self._load(keys)
            except errors.Ql3Error as exc:
                reraise_if_cancelled()
                # Entries stay dropped: a get_effective loads (or fails closed) on demand.
                _log(logging.WARNING, "cache_reload_failed", error=str(exc), keys=len(keys))
            for key in keys:
                self._load_errors.pop(key, None)

    def _patterns(self) -> tuple[list[str], list[str]]:
        """(patterns, channels) to subscribe to."""
        if self._projects is None:
            return [f"{self._prefix}:*"], []
        channels = [project_channel(self._prefix, p) for p in self._projects]
        return [], [*channels, self._heartbeat_channel]

    async def _subscription_loop(self) -> None:
        if self._redis_link.kind == "cluster":
            await self._sharded_subscription_loop()
            return
        failures = 0
        patterns, channels = self._patterns()
        expected = len(patterns) + len(channels)
        while True:
            reraise_if_cancelled()
            pubsub = None
            try:
                if self._redis is None:
                    self._redis = make_redis(self._redis_url, timeout=self._redis_timeout)
                pubsub = self._redis.pubsub()
                if patterns:
                    await pubsub.psubscribe(*patterns)
                if channels:
                    await pubsub.subscribe(*channels)
                confirmed = 0
                while True:
                    reraise_if_cancelled()
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    kind = message.get("type")
                    if kind in ("subscribe", "psubscribe"):
                        confirmed += 1
                        if confirmed >= expected:
                            failures = 0
                            self._on_subscribed()
                            confirmed = 0  # a reconnect inside redis-py confirms again
                        continue
                    if kind in ("message", "pmessage"):
                        self._on_message(message.get("channel"), message.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis errors, and bugs: never stop subscribing
                reraise_if_cancelled()
                failures += 1
                self._subscription_lost(exc, failures)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
            await asyncio.sleep(backoff_delay(failures, initial=0.05, cap=2.0))

    def _subscription_lost(self, exc: Exception, failures: int) -> None:
        """Log a lost subscription (a bug with its traceback, a Redis error once per outage)
        and leave normal mode until it is back."""
        if not isinstance(exc, REDIS_ERRORS):
            log.error("cache_subscription_lost", exc_info=exc, extra={"ql3": {"error": repr(exc)}})
        elif self._subscribed or failures == 1:
            _log(logging.WARNING, "cache_subscription_lost", error=str(exc))
        self._subscribed = False
        self._set_mode(self._live_mode())

    async def _sharded_subscription_loop(self) -> None:
        """The subscription on a Redis Cluster (D52, D53): SSUBSCRIBE to each project's
        channel, and to the heartbeat channel of each shard that carries one of them.

        redis-py's ClusterPubSub holds one connection per shard and, after a failover,
        moves a shard's channels to its new master; each channel subscribed again is
        confirmed again, which marks every entry unverified (what that shard published
        meanwhile is lost), as a resubscription to one server does. A shard heard of no
        heartbeat for two heartbeat timeouts gets a whole new client and subscription (a
        fresh slot map), in case the move never happened.
        """
        assert self._projects is not None  # required on a Cluster (__init__)
        channels = [project_channel(self._prefix, p) for p in self._projects]
        failures = 0
        while True:
            reraise_if_cancelled()
            cluster: RedisCluster | None = None
            pubsub: ClusterPubSub | None = None
            try:
                client = make_redis(self._redis_url, timeout=self._redis_timeout)
                assert isinstance(client, RedisCluster)
                cluster = self._redis = client
                await cluster.initialize()
                beats = redis_links.heartbeat_channels_for(cluster, self._prefix, channels)
                self._listen_for_heartbeats(beats)
                wanted = {*channels, *beats}
                pubsub = cluster.pubsub()
                await pubsub.ssubscribe(*sorted(wanted))
                confirmed: set[str] = set()
                since = time.monotonic()
                while True:
                    reraise_if_cancelled()
                    message = await pubsub.get_sharded_message(timeout=1.0)
                    if message is None:
                        if confirmed >= wanted:
                            self._check_shards_heard(since)
                        continue
                    kind = _text(message.get("type"))
                    channel = _text(message.get("channel"))
                    if kind == "smessage":
                        self._on_message(channel, message.get("data"))
                    elif kind == "ssubscribe" and confirmed >= wanted:
                        self._on_subscribed()  # a shard subscribed again (failover)
                    elif kind == "ssubscribe":
                        confirmed.add(channel)
                        if confirmed >= wanted:
                            failures = 0
                            self._on_subscribed()
            except asyncio.CancelledError:
                raise
            except _ShardSilent as exc:
                reraise_if_cancelled()
                _log(logging.WARNING, "cache_shard_silent", error=str(exc))
                self._subscribed = False
                self._set_mode(self._live_mode())
            except Exception as exc:  # Redis errors, and bugs: never stop subscribing
                reraise_if_cancelled()
                failures += 1
                self._subscription_lost(exc, failures)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
                if cluster is not None:
                    self._redis = None
                    with contextlib.suppress(Exception):
                        await cluster.aclose()
            await asyncio.sleep(backoff_delay(failures, initial=0.05, cap=2.0))

    def _listen_for_heartbeats(self, channels: Iterable[str]) -> None:
        """Expect heartbeats on these channels (one per shard), keeping what was heard."""
        heard = self._heartbeats_heard
        self._heartbeats_heard = {channel: heard.get(channel) for channel in channels}
        self._last_heartbeat_mono = _oldest(self._heartbeats_heard.values())

    def _check_shards_heard(self, since: float) -> None:
        """Raise ``_ShardSilent`` when a shard's heartbeat went unheard for two heartbeat
        timeouts since ``since`` (when the subscription was made)."""
        now = time.monotonic()
        for channel, at in self._heartbeats_heard.items():
            if now - max(since, at or since) > 2 * self._heartbeat_timeout:
                raise _ShardSilent(
                    f"no heartbeat on {channel} for {now - max(since, at or since):.1f} s: "
                    "subscribing again with a fresh slot map"
                )

    def _on_subscribed(self) -> None:
        first = not self._subscribed_event.is_set()
        self._subscribed = True
        self._subscribed_event.set()
        _log(logging.INFO, "cache_subscribed", first=first, entries=len(self._entries))
        # Messages published while we were not subscribed are lost: check everything.
        self._mark_all_unverified()

    # -- messages ----------------------------------------------------------------------

    def _on_message(self, channel: object, data: object) -> None:
        now = time.time()
        try:
            channel_name = channel.decode() if isinstance(channel, bytes) else str(channel)
            text = data.decode("utf-8") if isinstance(data, bytes) else str(data)
            doc = json.loads(text)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if channel_name in self._heartbeats_heard:
                if doc.get("type") != "heartbeat":
                    raise ValueError("heartbeat without type heartbeat")
                if not self._same_epoch(doc):
                    return  # a relay on another database than ours: no sign of liveness
                self._heartbeats_heard[channel_name] = time.monotonic()
                self._last_heartbeat_mono = _oldest(self._heartbeats_heard.values())
                self._last_heartbeat_wall = now
                if self._mode == "degraded":
                    self._set_mode(self._live_mode())
                return
            self._on_event(channel_name, doc)
            self._messages += 1
            self._last_message = now
        except Exception as exc:  # any malformed message: too deep (RecursionError) too
            self._malformed += 1
            _log(
                logging.WARNING,
                "cache_malformed_message",
                channel=repr(channel)[:200],
                data=repr(data)[:200],
                error=str(exc),
            )

    def _on_event(self, channel: str, doc: Mapping[str, Any]) -> None:
        project_id = doc["project_id"]
        family = doc["contract_family"]
        contract_id = doc["contract_id"]
        version = doc["pointer_version"]
        for name, value in (
            ("project_id", project_id),
            ("contract_family", family),
            ("contract_id", contract_id),
        ):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError("pointer_version must be a non-negative integer")
        if channel != project_channel(self._prefix, project_id):
            raise ValueError(f"project {project_id!r} published on {channel!r}")
        if not self._same_epoch(doc):
            return  # another history's pointer_version orders nothing here
        key = (project_id, family, contract_id)
        if key not in self._known:
            return
        entry = self._entries.get(key)
        if entry is not None and version <= entry.pointer_version:
            return  # a duplicate or a late message: the cache already has this or newer
        hint = self._hints.get(key)
        if hint is not None and hint.version >= version:
            if version < hint.version:  # may be real even if the hint is not (_install)
                highest = version if hint.below is None else max(version, hint.below[0])
                hint.below = (highest, next(self._ticks))
            return
        self._hints[key] = _Hint(version, next(self._ticks))
        self._entries.pop(key, None)
        self._reload_queue.add(key)
        self._reload_wake.set()


__all__ = [
    "HEARTBEAT_NAME",
    "BodyHashMismatch",
    "CacheHealth",
    "EffectiveRevision",
    "RevisionCache",
]
