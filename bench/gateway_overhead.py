"""ModelGateway.invoke latency with an instant provider, against the raw admit+complete pair.

The gateway: ``ModelGateway(store, RevisionCache, OpenAICompatibleProvider(cache,
transport_factory=instant_transport))`` - topology and policy contracts active, the cache
in normal mode (a relay in this process sends heartbeats), the provider answered in-process
at once (no sockets), so what is left is the gateway's own work: policy lookup, request
encoding and digest, admission, the provider adapter, completion. The baseline is the same
two store calls without the gateway, ``admit_invocation`` then ``complete_invocation`` on
the same store (its admission binds no policy: the database's policy fence counts as the
gateway's overhead). Two stores (D24): ``AsyncPgStore`` (judged; the baseline awaits its calls
on the loop) and ``PgStore`` (diagnostic; the gateway runs its calls in its store threads,
the baseline in an executor with as many threads, ``STORE_THREADS``, the size of the
store's pool). Ready model steps are created before the timed windows. The calls of each
client count run in rounds, the two sides back to back in alternating order; overhead =
gateway minus baseline percentile within a round, and every figure is the median over the
rounds (this machine is noisy: one pooled percentile moved by a millisecond from run to
run). Measured with one client and with 8 concurrent clients.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from statistics import median
from typing import Any

import psycopg

from bench.cache_reads import wait_mode
from bench.common import Result, Row, Settings, fresh_database, ms, percentile, ratio, verdict
from bench.edge_pairs import admission_for, check_completed, completion_for
from ql3.cache import RevisionCache
from ql3.gateway import ModelCall, ModelGateway, deadline_in
from ql3.providers import (
    TOPOLOGY_CONTRACT,
    TOPOLOGY_FAMILY,
    TOPOLOGY_PROJECT,
    OpenAICompatibleProvider,
    topology_body,
)
from ql3.relay import Relay, RelayConfig
from ql3.store import PgStore
from ql3.store_async import AsyncPgStore
from ql3.stub_provider import instant_transport

PROJECT = "bench"  # bench.edge_pairs builds its commands for this project too
POLICY = "bench-policy"
MODEL = "bench-model"
CLIENT_COUNTS = (1, 8)
STORE_THREADS = max(CLIENT_COUNTS)  # the store's pool, the gateway's and the baseline's threads
TARGET_P50_MS = 2.0
TARGET_P99_MS = 8.0
WARMUP = 20
ROUNDS = 8  # the machine is noisy: each figure is a median over rounds (D43)
ASYNC, THREADS = "asyncio", "threads"
STORE_LABELS = {ASYNC: "AsyncPgStore", THREADS: "PgStore in store threads"}

Step = tuple[str, str]


def set_up_contracts(store: PgStore) -> None:
    topology = topology_body([("instant", "http://instant.invalid/v1", [MODEL])])
    rev = store.put_revision(TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, topology, "b")
    store.activate_revision(
        TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, rev["revision_id"], "b"
    )
    policy = {"routes": [{"model": MODEL, "weight": 1}]}
    rev = store.put_revision(PROJECT, "policy_routing", POLICY, policy, "b")
    store.activate_revision(PROJECT, "policy_routing", POLICY, rev["revision_id"], "b")


def ready_steps(dsn: str, count: int) -> list[Step]:
    """``count`` ready model steps, one run each, inserted in bulk (as create_run and
    add_step_run leave them)."""
    runs = [(str(uuid.uuid4()), str(uuid.uuid4())) for _ in range(count)]
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO ql3.runs (run_id, project_id, trace_id) VALUES (%s, %s, 'trace-bench')",
            [(run_id, PROJECT) for run_id, _ in runs],
        )
        cur.executemany(
            "INSERT INTO ql3.step_runs (step_run_id, run_id, kind) VALUES (%s, %s, 'model')",
            [(step, run_id) for run_id, step in runs],
        )
    return runs


async def latencies(
    clients: int, steps: list[Step], once: Callable[[Step], Awaitable[None]]
) -> list[float]:
    """``clients`` concurrent loops, each over its share of ``steps``; every latency (s)."""
    out: list[float] = []

    async def client(mine: list[Step]) -> None:
        for step in mine:
            started = time.perf_counter()
            await once(step)
            out.append(time.perf_counter() - started)

    await asyncio.gather(*(client(steps[i::clients]) for i in range(clients)))
    return out


Rounds = dict[int, dict[str, list[list[float]]]]  # clients -> side -> latencies per round


async def measure(dsn: str, redis_url: str, calls: int, rounds: int) -> dict[str, Rounds]:
    """Per store kind, client count and side, the latencies (s) of each round."""
    prefix = f"bench:{uuid.uuid4().hex[:8]}"
    relay = Relay(RelayConfig(dsn=dsn, redis_url=redis_url, channel_prefix=prefix))
    await relay.start()
    await relay.wait_ready()
    try:
        with PgStore(dsn) as setup:
            await asyncio.to_thread(set_up_contracts, setup)
        async with RevisionCache(dsn, redis_url, channel_prefix=prefix) as cache:
            await cache.get_effective(PROJECT, "policy_routing", POLICY)
            await wait_mode(cache, "normal")
            await asyncio.sleep(0.2)  # going normal re-verifies entries in the background
            results: dict[str, Rounds] = {}
            async with AsyncPgStore(dsn, max_connections=STORE_THREADS) as async_store:

                async def async_pair(step: Step) -> None:
                    admitted = await async_store.admit_invocation(
                        admission_for(step[0], step[1], deadline_in(60))
                    )
                    check_completed(await async_store.complete_invocation(completion_for(admitted)))

                results[ASYNC] = await measure_store(
                    dsn, cache, async_store, async_pair, calls, rounds
                )
            with (
                PgStore(dsn, max_connections=STORE_THREADS) as store,
                ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="bench-pair") as threads,
            ):
                loop = asyncio.get_running_loop()

                async def threaded_pair(step: Step) -> None:
                    command = admission_for(step[0], step[1], deadline_in(60))
                    admitted = await loop.run_in_executor(threads, store.admit_invocation, command)
                    completed = await loop.run_in_executor(
                        threads, store.complete_invocation, completion_for(admitted)
                    )
                    check_completed(completed)

                results[THREADS] = await measure_store(
                    dsn, cache, store, threaded_pair, calls, rounds
                )
    finally:
        await relay.stop()
    return results


async def measure_store(
    dsn: str,
    cache: RevisionCache,
    store: PgStore | AsyncPgStore,
    raw_pair: Callable[[Step], Awaitable[None]],
    calls: int,
    rounds: int,
) -> Rounds:
    """The gateway over ``store`` against ``raw_pair`` (the same two calls on the same
    store), in rounds with the two sides back to back in alternating order, so that drift
    on a busy machine hits both sides of a round alike."""
    results: Rounds = {}
    async with ModelGateway(
        store,
        cache,
        OpenAICompatibleProvider(cache, transport_factory=instant_transport),
        store_threads=STORE_THREADS,
    ) as gateway:

        async def via_gateway(step: Step) -> None:
            call = ModelCall(
                project_id=PROJECT,
                run_id=step[0],
                step_run_id=step[1],
                trace_id="trace-bench",
                policy_id=POLICY,
                messages=[{"role": "user", "content": "Say hello."}],
                deadline_at=deadline_in(60),
            )
            result = await gateway.invoke(call)
            if result.completion["outcome"] != "succeeded":
                raise RuntimeError(f"gateway: {result.completion['outcome']}")

        sides: dict[str, Callable[[Step], Awaitable[None]]] = {
            "gateway": via_gateway,
            "baseline": raw_pair,
        }
        for clients in CLIENT_COUNTS:
            per: dict[str, list[list[float]]] = {"baseline": [], "gateway": []}
            for once in sides.values():  # warm-up
                steps = await asyncio.to_thread(ready_steps, dsn, WARMUP * clients)
                await latencies(clients, steps, once)
            for round_no in range(rounds):
                order = ("baseline", "gateway") if round_no % 2 == 0 else ("gateway", "baseline")
                for name in order:
                    steps = await asyncio.to_thread(ready_steps, dsn, calls // rounds)
                    per[name].append(await latencies(clients, steps, sides[name]))
            results[clients] = per
    return results


def run(settings: Settings) -> Result:
    calls = 200 if settings.quick else 4000
    rounds = 2 if settings.quick else ROUNDS
    figures: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    checks: dict[str, int] = {}
    rows: list[Row] = []
    passed = True
    with fresh_database(settings.base_dsn, "gateway") as dsn:
        measured = asyncio.run(measure(dsn, settings.redis_url, calls, rounds))
    for kind, by_clients in measured.items():
        judged = kind == ASYNC
        for clients, per in by_clients.items():
            key = f"{kind}_{clients}_clients"
            clients_label = f"{clients} client{'s' if clients > 1 else ''}, {STORE_LABELS[kind]}"
            checks[f"gateway_calls_{key}"] = sum(len(r) for r in per["gateway"])
            checks[f"baseline_pairs_{key}"] = sum(len(r) for r in per["baseline"])
            for pct, target in (("p50", TARGET_P50_MS), ("p99", TARGET_P99_MS)):
                q = float(pct[1:])
                gw_rounds = [percentile(r, q) for r in per["gateway"]]
                base_rounds = [percentile(r, q) for r in per["baseline"]]
                over_rounds = [g - b for g, b in zip(gw_rounds, base_rounds, strict=True)]
                g, b, over = median(gw_rounds), median(base_rounds), median(over_rounds)
                figures[f"gateway_{pct}_ms_{key}"] = ms(g)
                figures[f"overhead_{pct}_ms_{key}"] = ms(over)
                figures[f"overhead_{pct}_ms_by_round_{key}"] = [ms(x) for x in over_rounds]
                baseline[f"pair_{pct}_ms_{key}"] = ms(b)
                ratios[f"{pct}_{key}"] = ratio(g, b)
                ok = over * 1000.0 <= target
                if judged:
                    passed = passed and ok
                rows.append(
                    Row(
                        label=f"gateway invoke {pct}, instant provider, {clients_label}",
                        figure=(
                            f"{ms(g):.2f} ms (overhead {ms(over):.2f} ms;"
                            f" rounds {ms(min(over_rounds)):.2f} to {ms(max(over_rounds)):.2f})"
                        ),
                        baseline=f"{ms(b):.2f} ms admit+complete, same store",
                        ratio=ratios[f"{pct}_{key}"],
                        target=f"overhead <= {target:g} ms" if judged else "(diagnostic)",
                        result=verdict(ok) if judged else "n/a",
                    )
                )
    return Result(
        name="gateway_overhead",
        figures=figures,
        baseline=baseline,
        ratio=ratios,
        target=(
            f"gateway minus raw pair: p50 <= {TARGET_P50_MS:g} ms and p99 <= {TARGET_P99_MS:g}"
            f" ms, at {' and '.join(str(c) for c in CLIENT_COUNTS)} clients, on AsyncPgStore"
            " (the PgStore-in-threads rows are diagnostic)"
        ),
        passed=passed,
        rows=rows,
        checks=checks,
        notes=[
            f"{calls} calls per side and client count, in {rounds} rounds with the sides back"
            f" to back in alternating order, after {WARMUP} warm-up calls per client; ready"
            " steps created outside the timings",
            "provider: OpenAICompatibleProvider with ql3.stub_provider.instant_transport"
            " (in-process, no sockets); cache in normal mode (relay heartbeats)",
            "each figure is the median over the rounds of that round's percentile; overhead ="
            " the median over the rounds of (gateway percentile - baseline percentile) in the"
            " round, not a per-call difference; the ratio column is gateway / baseline",
        ],
    )
