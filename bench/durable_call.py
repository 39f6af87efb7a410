"""Durable model calls/s as a user makes them, against DBOS Transact doing the same work.

Issue 23: the pairs benchmark drives admit+complete with pgbench, a C client; this one
measures what a Python application runs. A **durable model call** is
``ModelGateway.invoke`` over ``AsyncPgStore`` with an instant in-process provider
(``OpenAICompatibleProvider`` with ``ql3.stub_provider.instant_transport``, the set-up of
``bench.gateway_overhead``: topology and policy contracts active, policy and topology from a
live ``RevisionCache`` kept in normal mode by a relay in this process). Three ql3 sides:

- **new run** (judged): every call starts its own run. With ``ModelCall.in_new_run`` (D59)
  the gateway creates the run, its model step and the Start receipt in one transaction
  (``admit_in_new_run``), then completes: 2 transactions per call.
- **4 transactions** (diagnostic): what an application wrote before D59, ``create_run`` +
  ``add_step_run`` + ``invoke`` on the same store, 4 transactions per call. Without
  ``in_new_run`` in the package (or its SQL function in the database), this path is the
  judged one and this row is absent.
- **pre-created step**: ready model steps created in bulk before the timed window
  (``bench.gateway_overhead.ready_steps``), the timed part ``invoke`` alone.

The baseline, **DBOS Transact** (the ``bench`` extra), does the same durable work through
its Python API: one workflow whose one ``@DBOS.step()`` encodes the same request, asks the
same provider class with the same instant transport for the same answer (same request and
response bytes) and returns what the gateway keeps of it (text, finish reason, usage,
output size and digest); DBOS records the workflow, its input and the step's output in its
system database, a fresh database on the same PostgreSQL server for every run. DBOS is a
process-wide singleton with threads of its own, so it runs in a child process
(``python -m bench.durable_call --dbos-child ...``, one JSON line on stdout), with a 1 s
warm-up; it is reported as "not measured: <reason>" when it cannot run here.

Every side is driven by C concurrent callers (asyncio tasks on one event loop for ql3;
for DBOS, ``DBOS_API``: threads through its synchronous API, each thread with an event
loop and a provider of its own, which on this machine ran more workflows/s than asyncio
tasks through its async API, whose every system-database write goes through
``asyncio.to_thread``), each making one call after the other for S seconds; calls/s =
calls finished / elapsed. The sides run back to back in rounds, the order reversed every
other round; figures are medians over the rounds and each ratio the median of the
per-round ratios. Target: new-run calls/s >= 3 x DBOS workflows/s at 1 and at 8 callers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from bench import dbos_pairs
from bench.common import (
    REPO_ROOT,
    Result,
    Row,
    Settings,
    against,
    fresh_database,
    median,
    verdict,
    with_dbname,
)
from ql3.gateway import ModelCall, ModelGateway, deadline_in
from ql3.providers import (
    TOPOLOGY_CONTRACT,
    TOPOLOGY_FAMILY,
    TOPOLOGY_PROJECT,
    OpenAICompatibleProvider,
    topology_body,
)
from ql3.stub_provider import instant_transport

CALLER_COUNTS = (1, 8)
ROUNDS = 5
ROUND_SECONDS = 4
WARMUP_SECONDS = 1.0
TARGET_DBOS_RATIO = 3.0
PROJECT = "bench"  # bench.gateway_overhead's contracts
POLICY = "bench-policy"
MODEL = "bench-model"
TRACE = "trace-bench"
MESSAGES: tuple[dict[str, str], ...] = ({"role": "user", "content": "Say hello."},)
INSTANT_ENDPOINT = ("instant", "http://instant.invalid/v1", [MODEL])
STORE_CONNECTIONS = max(CALLER_COUNTS)  # AsyncPgStore's pool (its default, 8)
NEW_RUN, FOUR_TX, PRECREATED, DBOS = "new_run", "four_transactions", "precreated", "dbos"
# DBOS's fastest API here (see the module docstring): "threads" or "async".
DBOS_API = "threads"


def instant_provider(topology: Any) -> OpenAICompatibleProvider:
    """The provider both sides call: the OpenAI-compatible adapter over the instant
    in-process transport, its topology from ``topology`` (the gateway's revision cache, or
    ``StaticTopology`` in the DBOS child)."""
    return OpenAICompatibleProvider(topology, transport_factory=instant_transport)


@dataclass(frozen=True)
class _Revision:
    project_id: str
    contract_family: str
    contract_id: str
    revision_id: str
    body: dict[str, Any]


class StaticTopology:
    """The topology the gateway's cache serves, fixed in memory (the DBOS side has no
    revision cache; a dictionary lookup is less work than the cache's hit)."""

    def __init__(self) -> None:
        self.revision = _Revision(
            TOPOLOGY_PROJECT,
            TOPOLOGY_FAMILY,
            TOPOLOGY_CONTRACT,
            str(uuid.uuid4()),
            topology_body([INSTANT_ENDPOINT]),
        )

    async def get_effective(self, project_id: str, family: str, contract_id: str) -> Any:
        return self.revision

    def on_change(self, family: str, contract_id: str, fn: Callable[[Any], Any]) -> None:
        return None


async def provider_call(provider: OpenAICompatibleProvider) -> dict[str, Any]:
    """One call of the instant provider as the DBOS step makes it: the request encoded as
    the gateway encodes it, routed, answered; what the gateway keeps of the answer."""
    body = provider.encode_request(MODEL, MESSAGES, stream=False)
    route = await provider.route(MODEL)
    response = await provider.complete(route, body)
    return {
        "text": response.text,
        "finish_reason": response.finish_reason,
        "usage": None if response.usage is None else dataclasses.asdict(response.usage),
        "output_bytes": response.output_bytes,
        "output_digest": response.output_digest,
    }


# -- the ql3 sides ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One side's run in a round: its rate and the calls it finished; for a ql3 side, the
    CPU seconds this process and the PostgreSQL server's processes used meanwhile (None
    where /proc cannot tell)."""

    per_s: float
    count: int
    client_cpu: float | None = None
    postgres_cpu: float | None = None


def server_pids(dsn: str) -> list[int]:
    """The PostgreSQL server's processes (the postmaster's children, which include this
    run's backends and the WAL writer), if the server runs on this machine; else []."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    try:
        postmaster = int(_stat(int(row[0]))[1])
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if int(_stat(int(entry))[1]) == postmaster:
                        pids.append(int(entry))
                except (OSError, IndexError, ValueError):
                    continue
        return pids
    except (OSError, IndexError, ValueError):
        return []


def cpu_by_pid(pids: Sequence[int]) -> dict[int, float]:
    """User + system CPU seconds so far of each of ``pids`` still running."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = _stat(pid)
            out[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return out


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float | None:
    """CPU seconds used between two ``cpu_by_pid`` readings by the processes in both."""
    both = before.keys() & after.keys()
    return sum(after[p] - before[p] for p in both) if both else None


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()


async def drive(callers: int, seconds: float, once: Callable[[int], Awaitable[None]]) -> Sample:
    """``callers`` asyncio tasks, each calling ``once(caller)`` one call after the other
    until ``seconds`` have passed; calls finished / elapsed."""
    counts = [0] * callers
    started = time.perf_counter()
    until = started + seconds

    async def caller(n: int) -> None:
        while time.perf_counter() < until:
            await once(n)
            counts[n] += 1

    await asyncio.gather(*(caller(n) for n in range(callers)))
    elapsed = time.perf_counter() - started
    return Sample(round(sum(counts) / elapsed, 1), sum(counts))


def new_run_supported(dsn: str) -> str | None:
    """None when the gateway can start a run in its admission (D59), else why not."""
    from ql3.store_async import AsyncPgStore

    if not hasattr(ModelCall, "in_new_run") or not hasattr(AsyncPgStore, "admit_in_new_run"):
        return "this ql3 has no ModelCall.in_new_run / AsyncPgStore.admit_in_new_run"
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT to_regprocedure('ql3_ai.admit_in_new_run(jsonb)')").fetchone()
    if row is None or row[0] is None:
        return "the database has no ql3_ai.admit_in_new_run(jsonb)"
    return None


def _check_succeeded(result: Any) -> None:
    if result.completion["outcome"] != "succeeded":
        raise RuntimeError(f"gateway: {result.completion['outcome']}")


class Ql3Sides:
    """The gateway over one ``AsyncPgStore``; one coroutine per ql3 side."""

    def __init__(self, dsn: str, store: Any, gateway: ModelGateway, new_run: bool) -> None:
        self.dsn = dsn
        self.store = store
        self.gateway = gateway
        self.new_run = new_run
        self.ready: list[list[tuple[str, str]]] = []  # per caller, pre-created steps
        self.calls = 0  # every call made (warm-ups included), checked against the receipts

    async def one_new_run(self, caller: int) -> None:
        await self._invoke(ModelCall.in_new_run(**self._fields()))

    async def one_four_transactions(self, caller: int) -> None:
        run_id = await self.store.create_run(PROJECT, TRACE)
        step_run_id = await self.store.add_step_run(run_id, "model")
        await self._invoke(ModelCall(run_id=run_id, step_run_id=step_run_id, **self._fields()))

    async def one_precreated(self, caller: int) -> None:
        mine = self.ready[caller]
        if not mine:
            raise RuntimeError("pre-created steps ran out: the batch was sized too small")
        run_id, step_run_id = mine.pop()
        await self._invoke(ModelCall(run_id=run_id, step_run_id=step_run_id, **self._fields()))

    @staticmethod
    def _fields() -> dict[str, Any]:
        """What every call of the benchmark shares (a fresh deadline each time)."""
        return {
            "project_id": PROJECT,
            "trace_id": TRACE,
            "policy_id": POLICY,
            "messages": MESSAGES,
            "deadline_at": deadline_in(60),
        }

    async def _invoke(self, call: ModelCall) -> None:
        _check_succeeded(await self.gateway.invoke(call))
        self.calls += 1

    async def prepare(self, callers: int, per_caller: int) -> None:
        """``per_caller`` ready model steps for each caller, outside the timed window."""
        from bench.gateway_overhead import ready_steps

        steps = await asyncio.to_thread(ready_steps, self.dsn, callers * per_caller)
        self.ready = [steps[n::callers] for n in range(callers)]

    def sides(self) -> dict[str, Callable[[int], Awaitable[None]]]:
        out: dict[str, Callable[[int], Awaitable[None]]] = {}
        if self.new_run:
            out[NEW_RUN] = self.one_new_run
        out[FOUR_TX] = self.one_four_transactions
        out[PRECREATED] = self.one_precreated
        return out


Rounds = dict[int, dict[str, list[Sample | None]]]  # callers -> side -> sample per round


class DbosSide:
    """The DBOS side: a child process per run, until one cannot be measured (``reason``
    says why; every later round skips it)."""

    def __init__(self, base_dsn: str) -> None:
        self.base_dsn = base_dsn
        self.reason: str | None = dbos_pairs.available()

    def run(self, callers: int, seconds: float) -> Sample | None:
        if self.reason is not None:
            return None
        try:
            doc = dbos_measure(self.base_dsn, callers, seconds)
        except dbos_pairs.NotMeasured as exc:
            self.reason = str(exc)
            return None
        return Sample(float(doc["per_s"]), int(doc["workflows"]))


@dataclass
class Measured:
    """What ``measure`` found: samples per caller count, side and round; the ql3 calls
    made in all (warm-ups included); why DBOS or the one-transaction new run was not
    measured, if it was not."""

    rounds: Rounds
    calls: int
    dbos_reason: str | None
    new_run_reason: str | None


async def measure(settings: Settings, dsn: str, rounds: int, seconds: float) -> Measured:
    """Every side at every caller count, in rounds."""
    from bench.cache_reads import wait_mode
    from bench.gateway_overhead import set_up_contracts
    from ql3.cache import RevisionCache
    from ql3.relay import Relay, RelayConfig
    from ql3.store import PgStore
    from ql3.store_async import AsyncPgStore

    prefix = f"bench:{uuid.uuid4().hex[:8]}"
    relay = Relay(RelayConfig(dsn=dsn, redis_url=settings.redis_url, channel_prefix=prefix))
    await relay.start()
    await relay.wait_ready()
    dbos = DbosSide(settings.base_dsn)
    out: Rounds = {}
    try:
        with PgStore(dsn) as setup:
            await asyncio.to_thread(set_up_contracts, setup)
        async with (
            RevisionCache(dsn, settings.redis_url, channel_prefix=prefix) as cache,
            AsyncPgStore(dsn, max_connections=STORE_CONNECTIONS) as store,
        ):
            await wait_mode(cache, "normal")
            await asyncio.sleep(0.2)  # going normal re-verifies entries in the background
            new_run_reason = new_run_supported(dsn)
            async with ModelGateway(store, cache, instant_provider(cache)) as gateway:
                ql3 = Ql3Sides(dsn, store, gateway, new_run_reason is None)
                for callers in CALLER_COUNTS:
                    out[callers] = await _rounds(ql3, dbos, callers, rounds, seconds)
    finally:
        await relay.stop()
    return Measured(out, ql3.calls, dbos.reason, new_run_reason)


async def _rounds(
    ql3: Ql3Sides, dbos: DbosSide, callers: int, rounds: int, seconds: float
) -> dict[str, list[Sample | None]]:
    sides = ql3.sides()
    rate = 0.0
    for name, once in sides.items():  # warm-up (plans, buffers); sizes the ready batches
        if name == PRECREATED:
            await ql3.prepare(callers, 1000)
        warm = await drive(callers, WARMUP_SECONDS, once)
        rate = max(rate, warm.per_s)
    per_caller = math.ceil(rate / callers * seconds * 3) + 200

    async def ql3_side(name: str) -> Sample:
        if name == PRECREATED:
            await ql3.prepare(callers, per_caller)
        pids = await asyncio.to_thread(server_pids, ql3.dsn)
        client, server = time.process_time(), cpu_by_pid(pids)
        done = await drive(callers, seconds, sides[name])
        client_cpu, server_cpu = time.process_time() - client, cpu_between(server, cpu_by_pid(pids))
        return dataclasses.replace(done, client_cpu=client_cpu, postgres_cpu=server_cpu)

    order = [*sides, DBOS]
    per: dict[str, list[Sample | None]] = {name: [] for name in order}
    for n in range(rounds):
        for name in order if n % 2 == 0 else list(reversed(order)):
            if name == DBOS:
                per[name].append(await asyncio.to_thread(dbos.run, callers, seconds))
            else:
                per[name].append(await ql3_side(name))
    return per


def check_receipts(dsn: str, calls: int) -> dict[str, int]:
    """Every ql3 call wrote its Start and its succeeded Completion; raises otherwise."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM ql3_ai.model_invocation_starts),"
            " (SELECT count(*) FROM ql3_ai.model_invocation_completions"
            "   WHERE outcome = 'succeeded'),"
            " (SELECT count(*) FROM ql3.step_runs WHERE status = 'succeeded')"
        ).fetchone()
    assert row is not None
    starts, completions, steps = (int(x) for x in row)
    if not starts == completions == steps == calls:
        raise RuntimeError(
            f"{calls} calls made, but {starts} starts, {completions} succeeded completions"
            f" and {steps} succeeded steps recorded"
        )
    return {"ql3_calls": calls, "starts": starts, "succeeded_completions": completions}


# -- DBOS, in a child process -----------------------------------------------------------------


def dbos_measure(base_dsn: str, callers: int, seconds: float) -> dict[str, Any]:
    """DBOS workflows/s with ``callers`` callers in a fresh system database (dropped after)."""
    dbname = f"bench_dbos_calls_{os.getpid()}_{callers}"
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{dbname}"')
    try:
        url = dbos_pairs.sqlalchemy_url(with_dbname(base_dsn, dbname))
        cmd = [sys.executable, "-m", "bench.durable_call", "--dbos-child", "--url", url,
               "--callers", str(callers), "--seconds", str(seconds), "--api", DBOS_API]  # fmt: skip
        limit = seconds * 4 + 120
        try:
            done = subprocess.run(
                cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=limit, check=False
            )
        except subprocess.TimeoutExpired:
            raise dbos_pairs.NotMeasured(
                f"the DBOS child did not finish within {limit:.0f} s"
            ) from None
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise dbos_pairs.NotMeasured(f"the DBOS run failed ({done.returncode}): {tail[:300]}")
        doc: dict[str, Any] = json.loads(lines[-1])
        return doc
    finally:
        with psycopg.connect(base_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def _dbos_child(url: str, callers: int, seconds: float, api: str) -> dict[str, Any]:
    import logging

    from dbos import DBOS, DBOSConfig

    local = threading.local()  # threads: each caller thread's loop and provider

    def thread_provider() -> tuple[asyncio.AbstractEventLoop, OpenAICompatibleProvider]:
        if not hasattr(local, "loop"):
            local.loop = asyncio.new_event_loop()
            local.provider = instant_provider(StaticTopology())
        return local.loop, local.provider

    @DBOS.step()
    def model_step(model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        loop, provider = thread_provider()
        return loop.run_until_complete(provider_call(provider))

    @DBOS.workflow()
    def durable_call(model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        return model_step(model, messages)

    shared = instant_provider(StaticTopology())  # async: one provider on the one loop

    @DBOS.step()
    async def model_step_async(model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        return await provider_call(shared)

    @DBOS.workflow()
    async def durable_call_async(model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        return await model_step_async(model, messages)

    config: DBOSConfig = {
        "name": "ql3-bench-calls",
        "system_database_url": url,
        "sys_db_pool_size": callers + 4,
        "log_level": "WARNING",
        "enable_otlp": False,
    }
    DBOS(config=config)
    DBOS.launch()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    messages = [dict(m) for m in MESSAGES]
    libpq_url = url.replace("postgresql+psycopg://", "postgresql://")
    try:
        if api == "async":

            async def phases() -> tuple[float, int]:
                async def once(_: int) -> None:
                    result = await durable_call_async(MODEL, messages)
                    if result["output_bytes"] <= 0:
                        raise RuntimeError("the workflow returned no answer")

                await drive(callers, WARMUP_SECONDS, once)
                done = await drive(callers, seconds, once)
                return done.count / done.per_s if done.per_s else seconds, done.count

            elapsed, workflows = asyncio.run(phases())
        else:
            counts = [0] * callers
            errors: list[BaseException] = []

            def loop(slot: int, until: float, record: bool) -> None:
                try:
                    while time.perf_counter() < until:
                        if durable_call(MODEL, messages)["output_bytes"] <= 0:
                            raise RuntimeError("the workflow returned no answer")
                        if record:
                            counts[slot] += 1
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)

            dbos_pairs.timed_threads(loop, callers, WARMUP_SECONDS, False, errors)
            elapsed = dbos_pairs.timed_threads(loop, callers, seconds, True, errors)
            workflows = sum(counts)
    finally:
        DBOS.destroy()
    total = dbos_pairs.checked_system_database(libpq_url, workflows)
    return {
        "callers": callers,
        "api": api,
        "seconds": round(elapsed, 3),
        "workflows": workflows,
        "per_s": round(workflows / elapsed, 1),
        "recorded_workflows": total,
    }


# -- the benchmark ------------------------------------------------------------------------------


SIDE_LABELS = {
    NEW_RUN: "gateway on AsyncPgStore, new run each call",
    FOUR_TX: (
        "gateway on AsyncPgStore, new run each call by create_run + add_step_run + invoke"
        " (4 transactions)"
    ),
    PRECREATED: "pre-created step",
}


def _every_round(samples: list[Sample | None]) -> list[Sample] | None:
    done = [s for s in samples if s is not None]
    return done if len(done) == len(samples) else None


def _cpu_per_call(samples: list[Sample | None]) -> tuple[float | None, float | None]:
    """Median over the rounds of the CPU µs per call of this process and of PostgreSQL."""

    def per_call(pick: Callable[[Sample], float | None]) -> float | None:
        values = [
            v / s.count * 1e6
            for s in samples
            if s is not None and s.count and (v := pick(s)) is not None
        ]
        return round(median(values), 1) if values else None

    return per_call(lambda s: s.client_cpu), per_call(lambda s: s.postgres_cpu)


def _cpu_text(client_us: float | None, server_us: float | None) -> str:
    """ "C + P µs (N calls per core-second)", "n/a" for what was not measured."""
    if client_us is None:
        return "n/a"
    if server_us is None:
        return f"{client_us:.0f} µs + n/a"
    total = client_us + server_us
    return f"{client_us:.0f} + {server_us:.0f} µs ({1e6 / total:,.0f} calls per core-second)"


def run(settings: Settings) -> Result:
    rounds, seconds = (1, 2.0) if settings.quick else (ROUNDS, float(ROUND_SECONDS))
    figures: dict[str, Any] = {}
    baseline: dict[str, float] = {}
    ratios: dict[str, float] = {}
    checks: dict[str, Any] = {}
    rows: list[Row] = []
    passed: bool | None = True
    with fresh_database(settings.base_dsn, "durable_call") as dsn:
        found = asyncio.run(measure(settings, dsn, rounds, seconds))
        checks.update(check_receipts(dsn, found.calls))
    judged = NEW_RUN if found.new_run_reason is None else FOUR_TX
    for callers, per in found.rounds.items():
        key = f"{callers}_callers"
        plural = "s" if callers > 1 else ""
        dbos_runs = _every_round(per[DBOS])
        dbos_per_s: float | None = None
        if dbos_runs is not None:
            dbos_per_s = median([r.per_s for r in dbos_runs])
            baseline[f"dbos_workflows_per_s_{key}"] = round(dbos_per_s, 1)
            checks[f"dbos_workflows_{key}"] = sum(r.count for r in dbos_runs)
        for side in (judged, *(s for s in (FOUR_TX, PRECREATED) if s != judged)):
            side_runs = _every_round(per[side])
            assert side_runs is not None  # a ql3 side raises instead
            per_s = median([r.per_s for r in side_runs])
            figures[f"{side}_calls_per_s_{key}"] = round(per_s, 1)
            checks[f"{side}_calls_{key}"] = sum(r.count for r in side_runs)
            label = SIDE_LABELS[NEW_RUN if side == judged else side]
            if side == judged and judged == FOUR_TX:
                label += " (create_run + add_step_run + invoke: no in_new_run here)"
            figure = f"{per_s:,.0f} /s"
            ok: bool | None = None
            side_ratio: float | None = None
            if dbos_runs is not None and dbos_per_s is not None:
                over = against([q.per_s for q in side_runs], [d.per_s for d in dbos_runs])
                side_ratio = over.ratio
                figures[f"{side}_over_dbos_by_round_{key}"] = over.by_round
                ratios[f"{side}_over_dbos_{key}"] = side_ratio
                figure = over.text
                if side == judged:
                    ok = side_ratio >= TARGET_DBOS_RATIO
                    passed = passed and ok
            elif side == judged:
                passed = None
            rows.append(
                Row(
                    label=f"durable model call/s, {callers} caller{plural}, {label}",
                    figure=figure,
                    baseline=(
                        f"{dbos_per_s:,.0f} /s DBOS one-step workflows, same provider"
                        if dbos_per_s is not None
                        else f"DBOS not measured: {found.dbos_reason}"
                    ),
                    ratio=side_ratio,
                    target=(
                        (f"ratio >= {TARGET_DBOS_RATIO:g}" if dbos_per_s is not None else "none")
                        if side == judged
                        else "(diagnostic)"
                    ),
                    result=verdict(ok) if side == judged else "n/a",
                )
            )
        cpu = {side: _cpu_per_call(per[side]) for side in (judged, PRECREATED)}

        for side, (client_us, server_us) in cpu.items():
            figures[f"{side}_client_cpu_us_per_call_{key}"] = client_us
            figures[f"{side}_postgres_cpu_us_per_call_{key}"] = server_us
        rows.append(
            Row(
                label=(
                    f"CPU per durable call, {callers} caller{plural}, new run each call:"
                    " gateway process + PostgreSQL server"
                ),
                figure=_cpu_text(*cpu[judged]),
                baseline=f"{_cpu_text(*cpu[PRECREATED])} pre-created step",
                ratio=None,
                target="(diagnostic)",
                result="n/a",
            )
        )
    figures["judged_side"] = judged
    return Result(
        name="durable_call",
        figures=figures,
        baseline=baseline,
        ratio=ratios,
        target=(
            f"durable model calls/s, a new run each call, >= {TARGET_DBOS_RATIO:g} x DBOS one-step"
            f" workflows/s at {' and '.join(str(c) for c in CALLER_COUNTS)} callers (when DBOS"
            " is measured)"
        ),
        passed=passed,
        rows=rows,
        checks=checks,
        notes=[
            f"each side: C concurrent callers for {seconds:g} s, {rounds} round(s) with the"
            f" sides back to back, the order reversed every other round, after"
            f" {WARMUP_SECONDS:g} s warm-ups; figures are medians over the rounds, ratios the"
            " medians of the per-round ratios",
            "ql3: ModelGateway.invoke over AsyncPgStore (pool of"
            f" {STORE_CONNECTIONS}), C asyncio tasks on one loop, policy and topology from a live"
            " RevisionCache (normal mode, relay in the process), provider"
            " OpenAICompatibleProvider with ql3.stub_provider.instant_transport; every call"
            " checked to have succeeded, and the receipts counted (check ql3_calls)",
            (
                "new run: ModelCall.in_new_run, run + step + Start in one transaction"
                " (admit_in_new_run, D59), then the completion; the 4-transaction row is"
                " create_run + add_step_run + invoke on the same store"
                if judged == NEW_RUN
                else "new run: create_run + add_step_run + invoke (4 transactions); the"
                f" one-transaction path was not measured: {found.new_run_reason}"
            ),
            "pre-created step: ready steps inserted in bulk before each timed window",
            "CPU per call (diagnostic): CPU seconds of this process (the gateway's, with the"
            " cache and the in-process relay) and of the PostgreSQL server's processes (the"
            " postmaster's children, read from /proc: the backends and the WAL writer) over a"
            " side's timed window, per call, median over the rounds; calls per core-second ="
            " 1e6 / their sum",
            (
                f"DBOS Transact {dbos_pairs.version()}: one workflow with one @DBOS.step() that"
                " encodes the same request and calls the same provider class with the same"
                " instant transport (same request and response bytes) and returns the text,"
                " finish reason, usage, output size and digest; C"
                + (
                    " threads through its synchronous API, each with its own event loop and"
                    " provider"
                    if DBOS_API == "threads"
                    else " asyncio tasks through its async API"
                )
                + f"; a child process per run, a fresh system database on the same server,"
                f" {WARMUP_SECONDS:g} s warm-up; checked: one SUCCESS workflow and one step"
                " output per workflow"
                if found.dbos_reason is None
                else f"DBOS comparison not measured: {found.dbos_reason}"
            ),
        ],
    )


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.durable_call", description=__doc__)
    parser.add_argument("--dbos-child", action="store_true", required=True)
    parser.add_argument("--url", required=True, help="SQLAlchemy URL of the system database")
    parser.add_argument("--callers", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--api", choices=("threads", "async"), default=DBOS_API)
    args = parser.parse_args(argv)
    print(json.dumps(_dbos_child(args.url, args.callers, args.seconds, args.api)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
