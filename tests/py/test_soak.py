"""A seeded soak of the whole chain under random faults (SPEC sections 3, 4, 7, 8, 9, 11).

For about 20 s, against real PostgreSQL and Redis, these run together:

- a relay as a ``python -m ql3.relay`` subprocess (so it can be SIGKILLed, SIGSTOPped and
  restarted), on a Redis server of the test's own (so it can be restarted);
- three worker caches (``RevisionCache``, shortened budgets) reading four contracts in
  loops: the gateway's policy, a second policy, a channel_event contract and the provider
  topology; every value they serve (``get_effective`` and ``on_change``) is recorded;
- a writer that activates new revisions, re-activates old ones and revokes at random;
- three gateway clients calling ``ModelGateway`` (invoke and stream) under the policy,
  served by worker 0, against the stub provider, which answers, fails, drops, stalls or
  hangs as each call's message asks;
- a fault injector: relay SIGKILL + restart, relay SIGSTOP/SIGCONT, Redis SIGKILL +
  restart, Redis killing every pub/sub connection, a window where the relay publishes
  under another prefix while heartbeats sent by the test keep the workers in normal mode
  (messages lost silently), and PostgreSQL backends of the caches, the relay or the gateway
  terminated.

Then, with every fault repaired, the invariants (each checked from the database and the
records, never from timing alone):

1. the outbox is fully delivered and its pointer history is complete; every served value
   was active no longer than its family budget before it was served (or the call's start
   in degraded mode); every worker serves each contract's final pointer once its budget
   has passed after the last write;
2. per worker and key, the served pointer_version never goes down; every served
   (revision, pointer_version) is what the database's history holds at that version;
3. no worker serves a revoked revision after it has served a pointer_version at or past
   its revocation;
4. every start names a policy revision active at some moment of its admission, and after
   ``recover_expired`` with grace 0 every start has a completion;
5. every call the gateway reported succeeded has that succeeded completion; every
   completion the gateway reported is the one stored; a call refused before admission left
   no start; the provider saw no more requests than there are starts.

``QL3_SOAK_SEED`` picks the seed (the default is fixed), ``QL3_SOAK_SECONDS`` the length.
The seed is in every failure message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from fix_provider import MODEL, REPLY, drop, hang, instant, slow, status
from fix_servers import role_dsn
from ql3 import devservers, errors
from ql3.cache import EffectiveRevision, RevisionCache
from ql3.gateway import (
    GatewayError,
    InvocationResult,
    ModelAuditUnavailable,
    ModelCall,
    ModelGateway,
    deadline_in,
)
from ql3.providers import (
    TOPOLOGY_CONTRACT,
    TOPOLOGY_FAMILY,
    TOPOLOGY_PROJECT,
    OpenAICompatibleProvider,
    topology_body,
)
from ql3.relay import (
    LISTEN_APPLICATION_NAME,
    REDIS_ERRORS,
    WORK_APPLICATION_NAME,
    heartbeat_channel,
    make_redis,
)
from ql3.store_async import AsyncPgStore
from ql3.stub_provider import StubExchange, StubProvider
from test_gateway import with_params
from test_relay import backlog, prefix, scratch, spawn_relay, until_backlog_empty

__all__ = ["prefix", "scratch"]  # fixtures, used by name

SEED = int(os.environ.get("QL3_SOAK_SEED") or "20261202")
SOAK_SECONDS = float(os.environ.get("QL3_SOAK_SECONDS") or "20")

PROJECT = "acme"
POLICY = "support-bot"
Key = tuple[str, str, str]
POLICY_KEY: Key = (PROJECT, "policy_routing", POLICY)
PRICING_KEY: Key = (PROJECT, "policy_routing", "pricing")
INBOX_KEY: Key = (PROJECT, "channel_event", "inbox")
TOPOLOGY_KEY: Key = (TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT)
KEYS = (POLICY_KEY, PRICING_KEY, INBOX_KEY, TOPOLOGY_KEY)
BUDGETS = {"policy_routing": 2.0, "channel_event": 3.0, "platform_resource": 2.0}
WORKERS = 3
CLIENTS = 3
CALL_DEADLINE = 4.0  # seconds: recovery waits for the last one to pass
EPS = 0.1  # seconds of clock slack between the cache's monotonic clock and the wall clock

CACHE_APP = "ql3-cache"
GATEWAY_APP = "ql3-soak-gateway"
OPS_APP = "ql3-soak-ops"  # writer, set-up, inspection: never cut
CUT_TARGETS: dict[str, tuple[str, ...]] = {
    "caches": (CACHE_APP,),
    "relay": (WORK_APPLICATION_NAME, LISTEN_APPLICATION_NAME),
    "gateway": (GATEWAY_APP,),
    "all": (CACHE_APP, WORK_APPLICATION_NAME, LISTEN_APPLICATION_NAME, GATEWAY_APP),
}

BEHAVIOURS = ("instant", "fail", "drop", "slow", "hang")
BEHAVIOUR_WEIGHTS = (80, 8, 6, 5, 1)


def fail(what: str) -> str:
    return f"[seed {SEED}] {what}"


# -- what the workers served --------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """One value a worker served: ``revision_id`` None is a fail-closed NotFound."""

    called: float  # wall clock when the call started (on_change: when it fired)
    at: float  # wall clock when it was served
    revision_id: str | None
    pointer_version: int
    via: str  # get, gateway, on_change, probe


class Worker:
    """A revision cache and the log of everything it served, per key, in order."""

    def __init__(self, index: int, cache: RevisionCache) -> None:
        self.index = index
        self.cache = cache
        self.served: dict[Key, list[Served]] = defaultdict(list)
        self.errors: Counter[str] = Counter()
        for key in KEYS:
            cache.on_change(key[1], key[2], self._changed)

    def _changed(self, revision: EffectiveRevision) -> None:
        key = (revision.project_id, revision.contract_family, revision.contract_id)
        now = time.time()
        self.served[key].append(
            Served(now, now, revision.revision_id, revision.pointer_version, "on_change")
        )

    async def get(self, key: Key, via: str) -> EffectiveRevision:
        called = time.time()
        try:
            revision = await self.cache.get_effective(*key)
        except errors.NotFound:
            # Raised synchronously from the entry get_effective found: it is still there.
            entry = self.cache._entries.get(key)
            if entry is not None and entry.revision is None:
                self.served[key].append(
                    Served(called, time.time(), None, entry.pointer_version, via)
                )
            raise
        except errors.Ql3Error as exc:
            self.errors[type(exc).__name__] += 1
            raise
        self.served[key].append(
            Served(called, time.time(), revision.revision_id, revision.pointer_version, via)
        )
        return revision


class RecordingSource:
    """Worker 0 as the gateway's policy source and the provider's topology source."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def get_effective(
        self, project_id: str, contract_family: str, contract_id: str
    ) -> EffectiveRevision:
        return await self.worker.get((project_id, contract_family, contract_id), "gateway")

    async def verify_all(self) -> None:
        await self.worker.cache.verify_all()

    def on_change(self, contract_family: str, contract_id: str, fn: Callable[[Any], Any]) -> None:
        self.worker.cache.on_change(contract_family, contract_id, fn)


async def read_loop(worker: Worker, rng: random.Random, stop: asyncio.Event) -> None:
    keys = list(KEYS)
    while not stop.is_set():
        rng.shuffle(keys)
        for key in keys:
            with contextlib.suppress(errors.NotFound, errors.Unavailable, errors.DatabaseError):
                await worker.get(key, "get")
        await asyncio.sleep(rng.uniform(0.005, 0.03))


# -- the writer ---------------------------------------------------------------------------


class Writer:
    """Puts, activates and revokes revisions on a connection no fault touches; remembers
    when each outbox row's call returned (its COMMIT had happened by then)."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], base_url: str) -> None:
        self.conn = conn
        self.base_url = base_url
        self.revisions: dict[Key, list[str]] = defaultdict(list)
        self.active: dict[Key, str | None] = {}
        self.revoked: set[str] = set()
        self.returned: dict[int, float] = {}  # outbox seq -> wall clock after the call
        self.counter = 0
        self.actions: Counter[str] = Counter()

    def body(self, key: Key) -> dict[str, Any]:
        self.counter += 1
        n = self.counter
        if key == TOPOLOGY_KEY:  # a topology body allows nothing else: vary the name
            return topology_body([(f"stub-{n}", self.base_url, [MODEL])])
        if key[1] == "policy_routing":
            return {"routes": [{"model": MODEL}], "n": n}
        return {"n": n}

    async def activate_new(self, key: Key) -> None:
        cur = await self.conn.execute(
            "SELECT revision_id::text FROM ql3.put_revision(%s, %s, %s, %s::jsonb, 'soak')",
            (*key, Jsonb(self.body(key))),
        )
        row = await cur.fetchone()
        assert row is not None
        self.revisions[key].append(str(row[0]))
        await self.activate(key, str(row[0]))
        self.actions["activate_new"] += 1

    async def activate(self, key: Key, revision_id: str) -> None:
        cur = await self.conn.execute(
            "SELECT seq, pointer_version FROM ql3.activate_revision(%s, %s, %s, %s::uuid, 'soak')",
            (*key, revision_id),
        )
        row = await cur.fetchone()
        returned = time.time()
        if row is not None and row[0] is not None:
            self.returned[int(row[0])] = returned
        self.active[key] = revision_id

    async def revoke(self, key: Key, revision_id: str) -> None:
        cur = await self.conn.execute(
            "SELECT seq, pointer_version FROM ql3.revoke_revision(%s::uuid, 'soak', 'soak')",
            (revision_id,),
        )
        row = await cur.fetchone()
        returned = time.time()
        assert row is not None and row[0] is not None, fail(
            f"revoke of {revision_id} wrote nothing"
        )
        self.returned[int(row[0])] = returned
        self.revoked.add(revision_id)
        was_active = self.active.get(key) == revision_id
        if was_active:
            self.active[key] = None
        self.actions["revoke_active" if was_active else "revoke_inactive"] += 1

    async def step(self, rng: random.Random) -> None:
        key = rng.choices(KEYS, weights=(45, 20, 20, 15))[0]
        if key == TOPOLOGY_KEY:  # the gateway needs a topology: it only ever changes
            await self.activate_new(key)
            return
        draw = rng.random()
        live = [r for r in self.revisions[key] if r not in self.revoked]
        older = [r for r in live if r != self.active.get(key)]
        if draw < 0.6 or (draw < 0.8 and not older) or (draw >= 0.8 and not live):
            await self.activate_new(key)
        elif draw < 0.8:
            await self.activate(key, rng.choice(older))
            self.actions["reactivate"] += 1
        else:
            current = self.active.get(key)
            target = current if current is not None and rng.random() < 0.7 else rng.choice(live)
            await self.revoke(key, target)


# -- the relay process and the faults -----------------------------------------------------


class Faults:
    """The relay subprocess, the test's own Redis, and the faults injected into both (and
    into PostgreSQL connections)."""

    def __init__(
        self,
        relay_dsn: str,
        rd: devservers.RedisServer,
        prefix: str,
        log: Path,
        ops: psycopg.AsyncConnection[Any],
    ) -> None:
        self.relay_dsn = relay_dsn
        self.rd = rd
        self.prefix = prefix
        self.log = log
        self.ops = ops
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.events: list[tuple[float, str]] = []

    def spawn(self, prefix: str | None = None) -> None:
        assert self.proc is None
        self.proc = spawn_relay(
            self.relay_dsn, self.rd.url, prefix or self.prefix, self.log,
            "--poll-interval", "0.2", "--backoff-max", "0.5", "--postgres-timeout", "5",
        )  # fmt: skip

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        self.paused = False

    def note(self, what: str) -> None:
        self.events.append((time.time(), what))

    async def relay_kill(self, rng: random.Random) -> None:
        self.kill()
        await asyncio.sleep(rng.uniform(0.0, 1.0))
        self.spawn()

    async def relay_pause(self, rng: random.Random) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True
        await asyncio.sleep(rng.uniform(0.5, 2.0))
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    async def redis_restart(self, rng: random.Random) -> None:
        await asyncio.to_thread(self.rd.stop)
        await asyncio.sleep(rng.uniform(0.2, 1.5))
        await asyncio.to_thread(self.rd.start)

    async def pubsub_kill(self, rng: random.Random) -> None:
        client = make_redis(self.rd.url, timeout=2.0)
        try:
            killed = await client.client_kill_filter(_type="pubsub")
            self.note(f"  killed {killed} pub/sub connections")
        finally:
            with contextlib.suppress(*REDIS_ERRORS):
                await client.aclose()

    async def drop_window(self, rng: random.Random) -> None:
        """Every event in the window is delivered where nobody listens, while heartbeats
        keep the workers trusting their subscription: lost messages, silently."""
        self.kill()
        self.spawn(f"{self.prefix}-void")
        # Heartbeats as the relay sends them, from this task until the window ends: no
        # task to cancel, and a socket timeout, so a stalled Redis cannot hold the window.
        client = make_redis(self.rd.url, timeout=1.0)
        beat = {"type": "heartbeat", "relay_id": "soak-fake", "seq": 0, "at": "x"}
        try:
            window_end = time.monotonic() + rng.uniform(1.0, 2.5)
            while time.monotonic() < window_end:
                with contextlib.suppress(*REDIS_ERRORS):
                    await client.publish(heartbeat_channel(self.prefix), json.dumps(beat))
                await asyncio.sleep(0.05)
        finally:
            with contextlib.suppress(*REDIS_ERRORS):
                await client.aclose()
            self.kill()
            self.spawn()

    async def pg_cut(self, rng: random.Random) -> None:
        target = rng.choice(sorted(CUT_TARGETS))
        cur = await self.ops.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND application_name = ANY(%s)",
            (list(CUT_TARGETS[target]),),
        )
        row = await cur.fetchone()
        self.note(f"  terminated {row[0] if row else 0} backends of {target}")

    async def inject(self, rng: random.Random, until: float) -> None:
        kinds: dict[str, Callable[[random.Random], Awaitable[None]]] = {
            "relay_kill": self.relay_kill,
            "relay_pause": self.relay_pause,
            "redis_restart": self.redis_restart,
            "pubsub_kill": self.pubsub_kill,
            "drop_window": self.drop_window,
            "pg_cut": self.pg_cut,
        }
        first = sorted(kinds)
        rng.shuffle(first)  # every kind at least once (when the soak is long enough)
        while time.monotonic() < until:
            await asyncio.sleep(rng.uniform(0.3, 1.2))
            if time.monotonic() >= until:
                break
            kind = first.pop() if first else rng.choice(sorted(kinds))
            self.note(kind)
            await kinds[kind](rng)
        await self.restore()

    async def restore(self) -> None:
        if self.rd.proc is None:
            await asyncio.to_thread(self.rd.start)
        if self.proc is not None and self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            self.spawn()
        self.note("restored")


# -- the gateway clients ------------------------------------------------------------------


@dataclass
class Call:
    invocation_id: str
    step_run_id: str
    behaviour: str
    stream: bool
    started: float
    ended: float = 0.0
    result: InvocationResult | None = None
    error: BaseException | None = None

    @property
    def kind(self) -> str:
        if self.result is not None:
            return "succeeded"
        return type(self.error).__name__


def stub_script(exchange: StubExchange) -> None:
    """Each call's message names its behaviour: ``soak:<behaviour>:<n>``."""
    doc = exchange.request.doc or {}
    messages = doc.get("messages") or [{}]
    content = str(messages[0].get("content", ""))
    behaviour = content.split(":")[1] if content.startswith("soak:") else "instant"
    scripts = {
        "instant": instant,
        "fail": status(500, "the soak's provider failure"),
        "drop": drop,
        "slow": slow(0.3),
        "hang": hang,
    }
    scripts[behaviour](exchange)


async def client(
    index: int,
    rng: random.Random,
    gateway: ModelGateway,
    ops_store: AsyncPgStore,
    until: float,
    calls: list[Call],
) -> None:
    trace = f"soak-trace-{index}"
    run_id = await ops_store.create_run(PROJECT, trace)
    n = 0
    while time.monotonic() < until:
        n += 1
        step = await ops_store.add_step_run(run_id, "model")
        behaviour = rng.choices(BEHAVIOURS, weights=BEHAVIOUR_WEIGHTS)[0]
        stream = rng.random() < 0.25
        call = ModelCall(
            project_id=PROJECT,
            run_id=run_id,
            step_run_id=step,
            trace_id=trace,
            policy_id=POLICY,
            messages=[{"role": "user", "content": f"soak:{behaviour}:{index}-{n}"}],
            deadline_at=deadline_in(CALL_DEADLINE),
        )
        record = Call(call.invocation_id, step, behaviour, stream, time.time())
        calls.append(record)
        try:
            if stream:
                async with gateway.stream(call) as chunks:
                    text = "".join([piece async for piece in chunks])
                record.result = chunks.result
                assert text == REPLY, fail(f"streamed {text!r}")
            else:
                record.result = await gateway.invoke(call)
        except (GatewayError, errors.Ql3Error) as exc:
            record.error = exc
        except Exception as exc:  # anything else is a finding: kept, asserted on later
            record.error = exc
        record.ended = time.time()
        await asyncio.sleep(rng.uniform(0.01, 0.06))


# -- the database's side ------------------------------------------------------------------


async def rows(conn: psycopg.AsyncConnection[Any], sql: str, *params: Any) -> list[dict[str, Any]]:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(sql, params)
    return list(await cur.fetchall())


@dataclass
class Change:
    """One pointer change of one contract, from its outbox row."""

    seq: int
    pointer_version: int
    revision_id: str | None  # active after the change (None: revoked)
    created_at: float  # the activation's transaction start (database clock)
    returned: float  # when the writer's call had returned (its COMMIT was done)


@dataclass
class History:
    changes: dict[Key, list[Change]] = field(default_factory=dict)
    revoked_at: dict[str, int] = field(default_factory=dict)  # revision -> pointer_version

    def active_at(self, key: Key, pointer_version: int) -> str | None:
        return self.changes[key][pointer_version - 1].revision_id

    def superseded(self, key: Key, pointer_version: int) -> float:
        """When the change after pointer_version had surely committed (inf: never)."""
        changes = self.changes[key]
        return changes[pointer_version].returned if pointer_version < len(changes) else float("inf")


async def history(conn: psycopg.AsyncConnection[Any], writer: Writer) -> History:
    """Every pointer change from the outbox; the outbox must be complete for that."""
    found = History()
    by_key: dict[Key, list[Change]] = defaultdict(list)
    for row in await rows(conn, "SELECT * FROM ql3.contract_outbox ORDER BY seq"):
        key = (row["project_id"], row["contract_family"], row["contract_id"])
        new, old = str(row["new_revision_id"]), row["old_revision_id"]
        if row["event_type"] == "revision_revoked":
            found.revoked_at[new] = int(row["pointer_version"])
            if old is None or str(old) != new:
                continue  # it was not active: the pointer did not move
            new_active: str | None = None
        else:
            new_active = new
        seq = int(row["seq"])
        assert seq in writer.returned, fail(f"outbox row {seq} that the writer never wrote")
        by_key[key].append(
            Change(
                seq=seq,
                pointer_version=int(row["pointer_version"]),
                revision_id=new_active,
                created_at=row["created_at"].timestamp(),
                returned=writer.returned[seq],
            )
        )
    pointers = await rows(
        conn,
        "SELECT * FROM ql3.active_pointers(%s::jsonb)",
        Jsonb([list(k) for k in KEYS]),
    )
    for pointer in pointers:
        key = (pointer["project_id"], pointer["contract_family"], pointer["contract_id"])
        changes = sorted(by_key[key], key=lambda c: c.pointer_version)
        versions = [c.pointer_version for c in changes]
        assert versions == list(range(1, len(changes) + 1)), fail(
            f"{key}: the outbox does not hold every pointer change: versions {versions}"
        )
        final = None if pointer["revision_id"] is None else str(pointer["revision_id"])
        assert (final, int(pointer["pointer_version"])) == (
            changes[-1].revision_id,
            len(changes),
        ), fail(f"{key}: the pointer is not where its outbox history ends")
        found.changes[key] = changes
    return found


async def wait_past_deadlines(conn: psycopg.AsyncConnection[Any], timeout: float) -> None:
    """Until the database clock is past every unsettled start's deadline."""
    started = time.monotonic()
    while True:
        (row,) = await rows(
            conn,
            "SELECT coalesce(bool_and(now() > s.deadline_at), true) AS past"
            " FROM ql3_ai.model_invocation_starts AS s WHERE NOT EXISTS (SELECT 1 FROM"
            " ql3_ai.model_invocation_completions AS c WHERE c.invocation_id = s.invocation_id)",
        )
        if row["past"]:
            return
        assert time.monotonic() - started < timeout, fail("start deadlines never passed")
        await asyncio.sleep(0.1)


# -- the checks ---------------------------------------------------------------------------


def check_served(workers: list[Worker], hist: History, quiet: float) -> list[str]:
    """Invariants 1 (staleness, convergence), 2 and 3 over everything the workers served."""
    problems: list[str] = []
    for worker in workers:
        for key, served in worker.served.items():
            budget = BUDGETS[key[1]]
            final = hist.changes[key][-1]
            highest = 0
            for i, s in enumerate(served):
                where = f"worker {worker.index} {'/'.join(key)} #{i} ({s.via})"
                if s.pointer_version < highest:  # 2. monotonic
                    problems.append(
                        f"{where}: served pointer_version {s.pointer_version} after {highest}"
                    )
                truth = hist.active_at(key, s.pointer_version) if s.pointer_version >= 1 else None
                if truth != s.revision_id:  # 2. what the database held at that version
                    problems.append(
                        f"{where}: served {s.revision_id} at pointer_version "
                        f"{s.pointer_version}, where {truth} was active"
                    )
                revoked = hist.revoked_at.get(s.revision_id or "")
                if revoked is not None and highest >= revoked:  # 3. revoked, and it knew
                    problems.append(
                        f"{where}: served revoked {s.revision_id} (revoked at pointer_version "
                        f"{revoked}) after serving pointer_version {highest}"
                    )
                highest = max(highest, s.pointer_version)
                if s.via == "on_change":
                    continue  # fired at the load's answer: no call start to measure from
                # 1. The value was still active at min(call start, served - budget): the
                # change that replaced it committed no earlier than that.
                replaced = hist.superseded(key, s.pointer_version)
                oldest = min(s.called, s.at - budget)
                if replaced + EPS < oldest:
                    problems.append(
                        f"{where}: served pointer_version {s.pointer_version} at {s.at:.3f}, "
                        f"{s.at - replaced:.3f}s after it was replaced (budget {budget}s, "
                        f"call started {s.at - s.called:.3f}s before)"
                    )
                # 1. Once the budget has passed after the last write, only the final pointer.
                if s.called >= quiet + budget + EPS and (
                    s.revision_id,
                    s.pointer_version,
                ) != (final.revision_id, final.pointer_version):
                    problems.append(
                        f"{where}: {s.called - quiet:.3f}s after the last write served "
                        f"pointer_version {s.pointer_version}, not {final.pointer_version}"
                    )
    return problems


def check_starts(starts: list[dict[str, Any]], calls: dict[str, Call], hist: History) -> list[str]:
    """Invariant 4 (first half): each start's policy revision was active during it."""
    problems: list[str] = []
    changes = hist.changes[POLICY_KEY]
    for start in starts:
        invocation_id = str(start["invocation_id"])
        call = calls.get(invocation_id)
        if call is None:
            problems.append(f"start {invocation_id} of no call the clients made")
            continue
        policy = (start["policy_contract_family"], start["policy_contract_id"])
        if policy != POLICY_KEY[1:] or start["policy_revision_id"] is None:
            problems.append(f"start {invocation_id} binds policy {policy!r}")
            continue
        revision = str(start["policy_revision_id"])
        admitted = start["admitted_at"].timestamp()
        # Its policy read happened in [admitted_at, the call's end]; the revision was active
        # in (its activation's transaction start, the next change's return) at most.
        intervals = [
            (c.created_at, hist.superseded(POLICY_KEY, c.pointer_version))
            for c in changes
            if c.revision_id == revision
        ]
        if not any(low < call.ended + EPS and admitted < high + EPS for low, high in intervals):
            shown = ", ".join(f"({lo:.3f}, {hi:.3f})" for lo, hi in intervals) or "never active"
            problems.append(
                f"start {invocation_id} admitted at {admitted:.3f} (call ended "
                f"{call.ended:.3f}) under policy revision {revision}, active only in {shown}"
            )
    return problems


def check_calls(
    calls: list[Call],
    starts: dict[str, dict[str, Any]],
    completions: dict[str, dict[str, Any]],
    steps: dict[str, dict[str, Any]],
) -> list[str]:
    """Invariants 4 (second half) and 5: receipts for every start, nothing lost silently."""
    problems: list[str] = []
    for invocation_id, row in starts.items():
        if invocation_id not in completions:
            problems.append(f"start {invocation_id} has no completion after recovery")
        step = steps[str(row["step_run_id"])]
        settled = completions.get(invocation_id)
        if settled is not None and step["status"] != settled["outcome"]:
            problems.append(
                f"step {row['step_run_id']} is {step['status']}, its invocation "
                f"{settled['outcome']}"
            )
    for call in calls:
        where = f"call {call.invocation_id} ({call.behaviour}, stream={call.stream})"
        start = starts.get(call.invocation_id)
        completion = completions.get(call.invocation_id)
        if call.result is not None:
            if completion is None or completion["outcome"] != "succeeded":
                problems.append(f"{where}: reported succeeded, stored {completion!r:.200}")
            elif completion["completion_digest"] != call.result.completion_digest:
                problems.append(f"{where}: reported another completion than the stored one")
            if start is None or str(start["policy_revision_id"]) != (
                call.result.policy_revision_id
            ):
                problems.append(f"{where}: reported a policy revision its start does not name")
            continue
        error = call.error
        if isinstance(error, GatewayError):
            if error.completion is not None and (
                completion is None
                or (completion["outcome"], completion["result_code"])
                != (error.completion.get("outcome"), error.completion.get("result_code"))
            ):
                problems.append(
                    f"{where}: reported {error.completion!r:.200}, stored {completion!r:.200}"
                )
            if (
                isinstance(error, ModelAuditUnavailable)
                and error.phase == "completion"
                and start is None
            ):
                problems.append(f"{where}: a completion failed for a start that is not there")
            if (
                isinstance(error, ModelAuditUnavailable)
                and start is not None
                and completion is not None
                and error.phase == "admission"
                and not (completion["outcome"] == "lost" and completion["recovered"])
            ):
                problems.append(
                    f"{where}: an admission reported unwritten was settled {completion['outcome']}"
                )
        elif isinstance(error, errors.Ql3Error):
            if start is not None:  # refused before admission: nothing may be written
                problems.append(f"{where}: raised {error!r} yet left a start")
        else:
            problems.append(f"{where}: raised {error!r}, not a gateway or ql3 error")
        step_status = steps[call.step_run_id]["status"]
        if start is None and step_status != "ready":
            problems.append(f"{where}: no start, yet its step is {step_status}")
    return problems


# -- the soak -----------------------------------------------------------------------------


def coroutine_stack(coro: Any) -> str:
    """Where a suspended coroutine waits, innermost last (Task.get_stack shows one frame)."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            lines.append(
                f"\n    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
            )
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return "".join(lines)


def run(scenario: Coroutine[Any, Any, None], timeout: float = 100.0) -> None:
    asyncio.run(asyncio.wait_for(scenario, timeout))


@pytest.mark.slow
def test_soak_under_random_faults_keeps_every_invariant(
    db_dsn: str, prefix: str, scratch: Path
) -> None:
    db = db_dsn
    master = random.Random(SEED)
    rngs = {name: random.Random(master.getrandbits(64)) for name in ("writer", "faults", "readers")}
    client_rngs = [random.Random(master.getrandbits(64)) for _ in range(CLIENTS)]
    rd = devservers.start_redis(scratch)
    provider = StubProvider(reply=REPLY, script=stub_script).start()
    faults: Faults | None = None
    summary: dict[str, Any] = {"seed": SEED}

    async def scenario() -> None:
        nonlocal faults
        ops_dsn = with_params(db, application_name=OPS_APP)
        runtime_dsn = role_dsn(db, "runtime")
        async with (
            await psycopg.AsyncConnection.connect(ops_dsn, autocommit=True) as ops,
            await psycopg.AsyncConnection.connect(ops_dsn, autocommit=True) as writer_conn,
            AsyncPgStore(ops_dsn) as ops_store,
            contextlib.AsyncExitStack() as stack,
        ):
            writer = Writer(writer_conn, provider.base_url)
            for key in KEYS:
                await writer.activate_new(key)
            faults = Faults(role_dsn(db, "relay"), rd, prefix, scratch / "relay.log", ops)
            faults.spawn()

            workers: list[Worker] = []
            for i in range(WORKERS):
                cache = RevisionCache(
                    runtime_dsn, rd.url, channel_prefix=prefix, max_staleness=BUDGETS,
                    heartbeat_timeout=1.0, redis_timeout=1.0,
                )  # fmt: skip
                await stack.enter_async_context(cache)
                workers.append(Worker(i, cache))
            deadline = time.monotonic() + 20
            while not all(w.cache.mode == "normal" for w in workers):
                assert time.monotonic() < deadline, fail("workers never saw a heartbeat")
                await asyncio.sleep(0.05)

            source = RecordingSource(workers[0])
            store = AsyncPgStore(with_params(runtime_dsn, application_name=GATEWAY_APP))
            await stack.enter_async_context(store)
            adapter = OpenAICompatibleProvider(source)
            gateway = ModelGateway(store, source, adapter)
            stack.push_async_callback(gateway.aclose)

            readers_stop = asyncio.Event()
            readers = [
                asyncio.create_task(
                    read_loop(w, random.Random(rngs["readers"].getrandbits(64)), readers_stop)
                )
                for w in workers
            ]
            calls: list[Call] = []
            began = time.monotonic()
            soak_end = began + SOAK_SECONDS

            async def write_loop() -> None:
                while time.monotonic() < soak_end:
                    await asyncio.sleep(rngs["writer"].uniform(0.1, 0.4))
                    await writer.step(rngs["writer"])

            work = [
                asyncio.create_task(write_loop(), name="writer"),
                asyncio.create_task(faults.inject(rngs["faults"], soak_end - 2.5), name="faults"),
                *(
                    asyncio.create_task(
                        client(i, client_rngs[i], gateway, ops_store, soak_end, calls),
                        name=f"client-{i}",
                    )
                    for i in range(CLIENTS)
                ),
            ]
            try:
                # Every task ends by itself soon after soak_end (a call within its deadline,
                # a fault within seconds): one still running long after that is stuck.
                done, pending = await asyncio.wait(work, timeout=SOAK_SECONDS + 30)
                if pending:
                    stuck = []
                    for task in pending:
                        stuck.append(f"{task.get_name()}:{coroutine_stack(task.get_coro())}")
                    unfinished = [c for c in calls if not c.ended]
                    raise AssertionError(
                        fail(f"stuck after the soak: {stuck}; unfinished calls: {unfinished}; "
                             f"faults: {faults.events[-5:]}")
                    )  # fmt: skip
                for task in done:
                    task.result()
            finally:
                for task in work:
                    task.cancel()
                await asyncio.gather(*work, return_exceptions=True)
            quiet = time.time()  # the last write has returned; every fault is repaired
            summary["soak_seconds"] = round(time.monotonic() - began, 1)

            # 1. Delivery: nothing stays in the outbox.
            await until_backlog_empty(db, 30)
            assert await backlog(db) == 0

            # 1. Convergence: once the budget has passed, each worker serves the final pointer.
            hist = await history(ops, writer)
            for worker in workers:
                for key in KEYS:
                    final = hist.changes[key][-1]
                    wait = quiet + BUDGETS[key[1]] + EPS - time.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    give_up = time.monotonic() + 20
                    served: tuple[str | None, int]
                    while True:
                        try:
                            got = await worker.get(key, "probe")
                            served = (got.revision_id, got.pointer_version)
                        except errors.NotFound:
                            last = worker.served[key][-1]
                            assert last.via == "probe", fail(f"{key}: an unrecorded NotFound")
                            served = (None, last.pointer_version)
                        except (errors.Unavailable, errors.DatabaseError):
                            assert time.monotonic() < give_up, fail(f"{key} unreadable")
                            await asyncio.sleep(0.1)
                            continue
                        break
                    assert served == (final.revision_id, final.pointer_version), fail(
                        f"worker {worker.index} serves {served} of {key} after its budget, "
                        f"not ({final.revision_id}, {final.pointer_version})"
                    )
            readers_stop.set()
            await asyncio.gather(*readers)

            # 4. Recovery settles whatever the gateway could not.
            await wait_past_deadlines(ops, CALL_DEADLINE + 10)
            recovered = await ops_store.recover_expired(limit=10000, grace_seconds=0.0)
            summary["recovered"] = recovered["count"]

            start_rows = await rows(ops, "SELECT * FROM ql3_ai.model_invocation_starts")
            completion_rows = await rows(ops, "SELECT * FROM ql3_ai.model_invocation_completions")
            step_rows = await rows(ops, "SELECT * FROM ql3.step_runs")
            starts = {str(r["invocation_id"]): r for r in start_rows}
            completions = {str(r["invocation_id"]): r for r in completion_rows}
            steps = {str(r["step_run_id"]): r for r in step_rows}

            problems = check_served(workers, hist, quiet)
            problems += check_starts(start_rows, {c.invocation_id: c for c in calls}, hist)
            problems += check_calls(calls, starts, completions, steps)
            if provider.calls > len(starts):  # only a created admission reaches the provider
                problems.append(f"{provider.calls} provider requests for {len(starts)} starts")

            summary.update(
                faults=Counter(e for _, e in faults.events if not e.startswith(" ")),
                writes=dict(writer.actions),
                pointer_versions={"/".join(k): len(v) for k, v in hist.changes.items()},
                served=[sum(len(v) for v in w.served.values()) for w in workers],
                worker_errors=[dict(w.errors) for w in workers],
                calls=Counter(c.kind for c in calls),
                outcomes=Counter(r["outcome"] for r in completion_rows),
                starts=len(starts),
                provider_requests=provider.calls,
            )
            print(f"soak summary: {json.dumps(summary, default=str)}")
            if problems:
                events = "\n".join(f"  {t:.3f} {e}" for t, e in faults.events)
                raise AssertionError(
                    fail(f"{len(problems)} invariant violations:\n")
                    + "\n".join(problems[:40])
                    + f"\nfaults:\n{events}\nsummary: {summary}"
                )
            # The run exercised what it claims to (not a timing assertion: counts).
            assert summary["calls"]["succeeded"] >= 5, fail(f"too few calls: {summary}")
            assert len(writer.returned) >= 10, fail(f"too few writes: {summary}")

    try:
        run(scenario())
    finally:
        if faults is not None:
            faults.kill()
        provider.close()
        rd.stop()
