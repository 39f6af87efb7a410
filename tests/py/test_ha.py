"""Failover under load, through the promotion gate (D51; ``make test-ha``).

A primary and a ``pg_basebackup -R`` streaming replica (tests/py/fix_replication.py),
ql3 migrated with AI. Every component reaches PostgreSQL through one multi-host DSN,
``host=127.0.0.1,127.0.0.1 port=P1,P2 target_session_attrs=read-write``:

- four threads of admit+complete pairs through one ``PgStore`` (every tenth pair is left
  running, as by a worker that died mid-call);
- a thread that puts and activates revisions of three contracts;
- the relay and a ``RevisionCache`` reading those contracts, in an event loop of their own;
- the recovery loop, which settles expired starts as lost/outcome_unknown.

Mid-run ``ql3 verify --snapshot`` is taken (as a ``ql3_reader`` login); the primary is
crashed (``pg_ctl stop -m immediate``), the replica promoted (``pg_ctl promote``) and the
load kept going for a few seconds. Every caller recorded what it was told had committed.

With synchronous replication the test asserts: every acknowledged write is on the new
primary; ``ql3 verify --against`` the snapshot passes (the ledgers a superset, every
outbox row delivered); the cache serves the active revisions and the relay's /healthz
says ok, none of them restarted; no step is left running once the deadlines have passed.

With asynchronous replication and the replica's WAL receiver stopped (SIGSTOP) for a
moment before the crash, the test reports what was lost instead: the README's figure. It
also checks the new primary against a second snapshot, taken of the old primary at the end
of the stall, to show that the gate names what such a promotion lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from fix_invocations import TRACE, admission, completion
from fix_replication import Pair, add_replica, replicated_pair, stopped
from ql3 import cli, errors
from ql3.cache import RevisionCache
from ql3.db import Timeouts
from ql3.invocations import Outcome
from ql3.migrate import migrate
from ql3.recovery import RecoveryConfig, RecoveryLoop
from ql3.relay import Relay, RelayConfig
from ql3.store import PgStore

pytestmark = [pytest.mark.ha, pytest.mark.slow]

DB = "ql3"
READER = "ha_reader"
PROJECT = "proj"
FAMILY = "policy_routing"
KEYS = [(PROJECT, FAMILY, f"ha-{i}") for i in range(3)]
WRITERS = 4
ABANDON_EVERY = 10
DEADLINE_S = 3.0  # each admission's deadline: recovery settles what is left after it
RECOVERY_INTERVAL_S = 0.5
LOAD_BEFORE_SNAPSHOT_S = 3.0
LOAD_BEFORE_CRASH_S = 2.0
STALL_S = 1.5  # asynchronous scenario: the replica's WAL receiver stopped before the crash
LOAD_AFTER_PROMOTION_S = 4.0
CONVERGE_S = 30.0

T = TypeVar("T")


@dataclass
class Acknowledged:
    """What the callers were told had committed, and the errors they saw."""

    runs: set[str] = field(default_factory=set)
    starts: set[str] = field(default_factory=set)
    completions: dict[str, str] = field(default_factory=dict)  # invocation -> outcome
    activations: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    """event_id -> (seq, pointer_version, contract_id) of the outbox row returned."""
    failures: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, exc: errors.Ql3Error) -> None:
        with self.lock:
            self.failures[exc.code] += 1


def pairs(store: PgStore, acked: Acknowledged, stop: threading.Event) -> None:
    """Admit+complete pairs until stopped; every tenth is abandoned after admission."""
    done = 0
    while not stop.is_set():
        try:
            run_id = store.create_run(PROJECT, TRACE)
            with acked.lock:
                acked.runs.add(run_id)
            step_id = store.add_step_run(run_id, "model")
            deadline = datetime.now(UTC) + timedelta(seconds=DEADLINE_S)
            admitted = store.admit_invocation(admission(run_id, step_id, deadline=deadline))
            invocation_id = str(admitted["start"]["invocation_id"])
            with acked.lock:
                acked.starts.add(invocation_id)
            done += 1
            if done % ABANDON_EVERY == 0:
                continue
            completed = store.complete_invocation(
                completion(admitted, Outcome.SUCCEEDED, output=b"reply")
            )
            with acked.lock:
                acked.completions[invocation_id] = str(completed["completion"]["outcome"])
        except errors.Ql3Error as exc:
            acked.error(exc)
            stop.wait(0.05)


def activations(store: PgStore, acked: Acknowledged, stop: threading.Event) -> None:
    """Put and activate a new revision of each contract in turn until stopped."""
    n = 0
    while not stop.is_set():
        n += 1
        key = KEYS[n % len(KEYS)]
        try:
            revision = store.put_revision(*key, {"n": n, "at": time.time()}, "ha-test")
            event = store.activate_revision(*key, revision["revision_id"], "ha-test")
        except errors.Ql3Error as exc:
            acked.error(exc)
            stop.wait(0.05)
            continue
        assert event is not None
        with acked.lock:
            acked.activations[str(event["event_id"])] = (
                int(event["seq"]),
                int(event["pointer_version"]),
                str(event["contract_id"]),
            )
        stop.wait(0.02)


class Watchers:
    """The relay and a worker's ``RevisionCache`` (reading KEYS in a loop), in an event
    loop of their own thread."""

    def __init__(self, dsn: str, redis_url: str) -> None:
        self.dsn = dsn
        self.redis_url = redis_url
        self.prefix = f"ha:{uuid.uuid4().hex[:8]}"
        self.cache_errors: Counter[str] = Counter()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ha-watchers")
        self.thread.start()
        self.relay: Relay | None = None
        self.cache: RevisionCache | None = None
        self.reader: asyncio.Task[None] | None = None

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def start(self) -> None:
        self.relay = Relay(
            RelayConfig(
                dsn=self.dsn,
                redis_url=self.redis_url,
                channel_prefix=self.prefix,
                poll_interval=0.5,
                heartbeat_interval=0.5,
                postgres_timeout=5.0,
                backoff_initial=0.1,
                backoff_max=1.0,
                metrics_port=0,
            )
        )
        await self.relay.start()
        await self.relay.wait_ready(30)
        self.cache = RevisionCache(
            self.dsn,
            self.redis_url,
            channel_prefix=self.prefix,
            max_staleness={FAMILY: 1.0},
            heartbeat_timeout=3.0,
            db_timeout=3.0,
        )
        await self.cache.start()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.cache is not None
        while True:
            for key in KEYS:
                try:
                    await self.cache.get_effective(*key)
                except errors.Ql3Error as exc:
                    self.cache_errors[exc.code] += 1
            await asyncio.sleep(0.05)

    async def served(self) -> dict[tuple[str, str, str], tuple[str, int]]:
        assert self.cache is not None
        found = {}
        for key in KEYS:
            revision = await self.cache.get_effective(*key)
            found[key] = (revision.revision_id, revision.pointer_version)
        return found

    def healthz(self) -> dict[str, Any]:
        assert self.relay is not None and self.relay.metrics_port
        url = f"http://127.0.0.1:{self.relay.metrics_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return dict(json.loads(response.read()))
        except urllib.error.HTTPError as exc:
            with exc:
                return dict(json.loads(exc.read()))

    async def _stop(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader
        if self.cache is not None:
            await self.cache.close()
        if self.relay is not None:
            await self.relay.stop()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@dataclass
class Scenario:
    pair: Pair
    dsn: str  # superuser, multi-host
    reader_dsn: str  # ql3_reader login, multi-host
    snapshot: Path
    acked: Acknowledged
    watchers: Watchers
    recovery: RecoveryLoop
    timeline: dict[str, float]


def eventually(what: str, check: Callable[[], bool], timeout: float = CONVERGE_S) -> float:
    """Seconds until ``check()`` held; AssertionError naming ``what`` after ``timeout``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not reached after {timeout} s")
        time.sleep(0.2)
    return time.monotonic() - started


def query(dsn: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(statement, params).fetchall()


@contextlib.contextmanager
def failover(redis_url: str, tmp_path: Path, *, synchronous: bool) -> Iterator[Scenario]:
    """The whole scenario up to the end of the load after promotion; the checks are the
    caller's, with every component still running."""
    with replicated_pair() as pair:
        pair.primary.execute(f"CREATE DATABASE {DB}")
        migrate(pair.primary.dsn(DB), with_ai=True)
        pair.primary.execute(f"CREATE ROLE {READER} LOGIN IN ROLE ql3_reader")
        add_replica(pair)
        if synchronous:
            pair.make_synchronous()
        dsn = pair.multi_host_dsn(DB)
        reader_dsn = pair.multi_host_dsn(DB, READER)
        timeouts = Timeouts(statement_ms=5000, connect_s=2)
        acked = Acknowledged()
        stop = threading.Event()
        with PgStore(dsn, timeouts=timeouts, max_connections=WRITERS + 2) as store:
            # One activation of each contract first: the cache has something to serve.
            for key in KEYS:
                revision = store.put_revision(*key, {"n": 0}, "ha-test")
                store.activate_revision(*key, revision["revision_id"], "ha-test")
            watchers = Watchers(dsn, redis_url)
            recovery = RecoveryLoop(
                dsn,
                RecoveryConfig(
                    interval=RECOVERY_INTERVAL_S,
                    grace_seconds=0.0,
                    backoff_initial=0.2,
                    backoff_max=1.0,
                    statement_timeout=5.0,
                ),
            )
            threads = [
                threading.Thread(target=pairs, args=(store, acked, stop), name=f"pairs-{i}")
                for i in range(WRITERS)
            ]
            threads.append(
                threading.Thread(target=activations, args=(store, acked, stop), name="activate")
            )
            timeline: dict[str, float] = {}
            try:
                watchers.call(watchers.start())
                recovery.start()
                started = time.monotonic()
                for thread in threads:
                    thread.start()
                time.sleep(LOAD_BEFORE_SNAPSHOT_S)
                snapshot = tmp_path / "before-crash.json"
                code = cli.main(["verify", "--dsn", reader_dsn, "--snapshot", str(snapshot)])
                assert code == 0, "the snapshot before the crash found a violation"
                timeline["snapshot"] = time.monotonic() - started
                time.sleep(LOAD_BEFORE_CRASH_S)
                if synchronous:
                    pair.primary.crash()
                else:
                    with stopped(pair.replica.walreceiver_pid()):
                        timeline["stall"] = time.monotonic() - started
                        time.sleep(STALL_S)
                        # What the primary holds at the end of the stall: the gate's
                        # reference for what the promotion loses.
                        cli.main(["verify", "--dsn", pair.primary.dsn(DB, READER),
                                  "--snapshot", str(tmp_path / "in-stall.json")])  # fmt: skip
                        pair.primary.crash()
                timeline["crash"] = time.monotonic() - started
                pair.replica.promote()
                timeline["promoted"] = time.monotonic() - started
                time.sleep(LOAD_AFTER_PROMOTION_S)
                stop.set()
                for thread in threads:
                    thread.join(30)
                timeline["load_stopped"] = time.monotonic() - started
                yield Scenario(pair, dsn, reader_dsn, snapshot, acked, watchers, recovery, timeline)
            finally:
                stop.set()
                for thread in threads:
                    if thread.is_alive():
                        thread.join(30)
                recovery.stop()
                watchers.close()


def missing_acknowledged(dsn: str, acked: Acknowledged) -> dict[str, Any]:
    """What the callers were told had committed and the new primary does not hold."""
    runs = {
        str(r)
        for (r,) in query(
            dsn, "SELECT run_id FROM ql3.runs WHERE run_id = ANY(%s::uuid[])", [list(acked.runs)]
        )
    }
    starts = {
        str(i)
        for (i,) in query(
            dsn,
            "SELECT invocation_id FROM ql3_ai.model_invocation_starts"
            " WHERE invocation_id = ANY(%s)",
            [list(acked.starts)],
        )
    }
    outcomes = dict(
        query(
            dsn,
            "SELECT invocation_id, outcome FROM ql3_ai.model_invocation_completions"
            " WHERE invocation_id = ANY(%s)",
            [list(acked.completions)],
        )
    )
    outbox = {
        str(event_id): (int(seq), int(version), str(contract))
        for event_id, seq, version, contract in query(
            dsn, "SELECT event_id, seq, pointer_version, contract_id FROM ql3.contract_outbox"
        )
    }
    seqs = {seq for seq, _, _ in outbox.values()}
    versions = {(contract, version) for _, version, contract in outbox.values()}
    lost_activations = [e for e in acked.activations if e not in outbox]
    completions_changed = Counter(
        f"{acked.completions[i]} -> {outcomes.get(i, 'missing')}"
        for i in acked.completions
        if outcomes.get(i) != acked.completions[i]
    )
    return {
        "runs": len(acked.runs - runs),
        "admissions": len(acked.starts - starts),
        "completions": dict(completions_changed),
        "activations": len(lost_activations),
        # A lost activation whose outbox seq, or whose contract's pointer_version, another
        # event holds now: what a relay or a worker that saw the lost one compares with.
        "seqs_reused": sum(1 for e in lost_activations if acked.activations[e][0] in seqs),
        "pointer_versions_reused": sum(
            1
            for e in lost_activations
            if (acked.activations[e][2], acked.activations[e][1]) in versions
        ),
    }


def step_deadlines_settled(dsn: str) -> bool:
    """No step is running: recovery settled every start whose deadline passed."""
    return not query(dsn, "SELECT 1 FROM ql3.step_runs WHERE status = 'running' LIMIT 1")


def active_pointers(dsn: str) -> dict[tuple[str, str, str], tuple[str, int]]:
    rows = query(
        dsn,
        "SELECT project_id, contract_family, contract_id, active_revision_id::text,"
        " pointer_version FROM ql3.active_revisions",
    )
    return {(p, f, c): (str(r), int(v)) for p, f, c, r, v in rows}


def caches_and_relay_heal(run: Scenario, new_primary: str) -> tuple[float, float]:
    """Seconds until the caches that watched the old primary serve the new primary's
    active revisions, and until the relay's /healthz is ok again."""
    pointers = active_pointers(new_primary)
    served = eventually(
        "the cache serves the new primary's active revisions",
        lambda: run.watchers.call(run.watchers.served()) == {key: pointers[key] for key in KEYS},
    )
    healthy = eventually("relay /healthz ok", lambda: run.watchers.healthz()["status"] == "ok")
    return served, healthy


def test_synchronous_failover_loses_no_acknowledged_write(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    with failover(redis_url, tmp_path, synchronous=True) as run:
        new_primary = run.pair.replica.dsn(DB)
        assert run.pair.replica.execute("SELECT pg_is_in_recovery()") == [(False,)]
        acked = run.acked
        assert len(acked.completions) > 50 and len(acked.activations) > 10, acked.failures

        settled = eventually(
            "every in-flight invocation settled by recovery",
            lambda: step_deadlines_settled(new_primary),
        )
        assert run.recovery.recovered > 0  # the abandoned pairs, at least
        delivered = eventually(
            "every outbox row delivered",
            lambda: (
                not query(
                    new_primary, "SELECT 1 FROM ql3.contract_outbox WHERE delivered_at IS NULL"
                )
            ),
        )
        served, healthy = caches_and_relay_heal(run, new_primary)

        lost = missing_acknowledged(new_primary, acked)
        assert lost == {
            "runs": 0,
            "admissions": 0,
            "completions": {},
            "activations": 0,
            "seqs_reused": 0,
            "pointer_versions_reused": 0,
        }
        # Every acknowledged start has its completion (the acknowledged one, or recovery's).
        unsettled = query(
            new_primary,
            "SELECT count(*) FROM ql3_ai.model_invocation_starts s WHERE NOT EXISTS"
            " (SELECT 1 FROM ql3_ai.model_invocation_completions c"
            "   WHERE c.invocation_id = s.invocation_id)",
        )
        assert unsettled == [(0,)]

        capsys.readouterr()
        code = cli.main(
            ["verify", "--dsn", run.reader_dsn, "--against", str(run.snapshot),
             "--require-delivered"]
        )  # fmt: skip
        verdict = json.loads(capsys.readouterr().out)
        assert code == 0, (verdict["differences"], verdict["violations"])
        with capsys.disabled():
            print(
                f"\nsynchronous failover: {len(acked.starts)} admissions, "
                f"{len(acked.completions)} completions, {len(acked.activations)} activations "
                f"acknowledged, none lost; caller errors {dict(acked.failures)}; cache errors "
                f"{dict(run.watchers.cache_errors)}; settled {settled:.1f} s, delivered "
                f"{delivered:.1f} s, cache {served:.1f} s, relay {healthy:.1f} s after the "
                f"load; timeline {run.timeline}; total {time.monotonic() - started:.0f} s"
            )


def test_asynchronous_failover_after_a_stall_reports_what_it_lost(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with failover(redis_url, tmp_path, synchronous=False) as run:
        new_primary = run.pair.replica.dsn(DB)
        assert run.pair.replica.execute("SELECT pg_is_in_recovery()") == [(False,)]
        with contextlib.suppress(AssertionError):
            eventually("settled", lambda: step_deadlines_settled(new_primary), timeout=15)
        lost = missing_acknowledged(new_primary, run.acked)
        # Whatever the promotion lost, the caches heal without a restart, even where a
        # pointer_version went backwards (the failover epoch, D48).
        served, healthy = caches_and_relay_heal(run, new_primary)
        verdicts = {}
        for name, path in (
            ("before_stall", run.snapshot),
            ("in_stall", tmp_path / "in-stall.json"),
        ):
            capsys.readouterr()
            code = cli.main(["verify", "--dsn", run.reader_dsn, "--against", str(path)])
            verdict = json.loads(capsys.readouterr().out)
            verdicts[name] = {
                "exit": code,
                "differences": len(verdict["differences"]),
                "first": [d[:200] for d in verdict["differences"][:4]],
                "violations": [v[:200] for v in verdict["violations"][:3]],
            }
        report = {
            "acknowledged": {
                "runs": len(run.acked.runs),
                "admissions": len(run.acked.starts),
                "completions": len(run.acked.completions),
                "activations": len(run.acked.activations),
            },
            "lost": lost,
            "verify_against": verdicts,
            "timeline": run.timeline,
            "cache_served_after_s": round(served, 1),
            "relay_healthy_after_s": round(healthy, 1),
        }
        (tmp_path / "async-report.json").write_text(json.dumps(report, indent=2))
        with capsys.disabled():
            stall = run.timeline["crash"] - run.timeline["stall"]
            print(f"\nasynchronous failover after a {stall:.1f} s stall: {json.dumps(report)}")
