"""ModelGateway.invoke latency with an instant provider, against the raw admit+complete pair.

The gateway: ``ModelGateway(store, RevisionCache, OpenAICompatibleProvider(cache,
transport_factory=instant_transport))`` - topology and policy contracts active, the cache
in normal mode (a relay in this process sends heartbeats), the provider answered in-process
at once (no sockets), so what is left is the gateway's own work: policy lookup, request
encoding and digest, admission, the provider adapter, completion. The baseline is the same
two store calls without the gateway, ``admit_invocation`` then ``complete_invocation`` on
the same store, under the same policy revision (SPEC 9: every call runs under a policy,
which the admission fences against the active one; D43). A third side, diagnostic, on
``AsyncPgStore`` only: the pair without a policy, so that the fence's own cost is shown
(baseline minus that). Two stores (D24): ``AsyncPgStore`` (judged; the baseline awaits its calls
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
from ql3.gateway import POLICY_FAMILY, ModelCall, ModelGateway, deadline_in
from ql3.invocations import PolicyBinding
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
GATEWAY, BASELINE, UNFENCED = "gateway", "baseline", "unfenced"
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
            await wait_mode(cache, "normal")
            await asyncio.sleep(0.2)  # going normal re-verifies entries in the background
            # The revision the gateway binds (the relay keeps the cache on the active one).
            policy = PolicyBinding.of(await cache.get_effective(PROJECT, POLICY_FAMILY, POLICY))
            results: dict[str, Rounds] = {}
            async with AsyncPgStore(dsn, max_connections=STORE_THREADS) as async_store:

                def pair_on_loop(bound: PolicyBinding | None) -> Callable[[Step], Awaitable[None]]:
                    async def pair(step: Step) -> None:
                        command = admission_for(step[0], step[1], deadline_in(60), bound)
                        admitted = await async_store.admit_invocation(command)
                        completed = await async_store.complete_invocation(completion_for(admitted))
                        check_completed(completed)

                    return pair

                bare = {BASELINE: pair_on_loop(policy), UNFENCED: pair_on_loop(None)}
                results[ASYNC] = await measure_store(dsn, cache, async_store, bare, calls, rounds)
            with (
                PgStore(dsn, max_connections=STORE_THREADS) as store,
                ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="bench-pair") as threads,
            ):
                loop = asyncio.get_running_loop()

                async def threaded_pair(step: Step) -> None:
                    command = admission_for(step[0], step[1], deadline_in(60), policy)
                    admitted = await loop.run_in_executor(threads, store.admit_invocation, command)
                    completed = await loop.run_in_executor(
                        threads, store.complete_invocation, completion_for(admitted)
                    )
                    check_completed(completed)

                results[THREADS] = await measure_store(
                    dsn, cache, store, {BASELINE: threaded_pair}, calls, rounds
                )
    finally:
        await relay.stop()
    return results


async def measure_store(
    dsn: str,
    cache: RevisionCache,
    store: PgStore | AsyncPgStore,
    raw_pairs: dict[str, Callable[[Step], Awaitable[None]]],
    calls: int,
    rounds: int,
) -> Rounds:
    """The gateway over ``store`` against ``raw_pairs`` (the same two calls on the same
    store), in rounds with the sides back to back, the order reversed every other round,
    so that drift on a busy machine hits every side of a round alike."""
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

        sides = {GATEWAY: via_gateway, **raw_pairs}
        for clients in CLIENT_COUNTS:
            per: dict[str, list[list[float]]] = {name: [] for name in sides}
            for once in sides.values():  # warm-up
                steps = await asyncio.to_thread(ready_steps, dsn, WARMUP * clients)
                await latencies(clients, steps, once)
            for round_no in range(rounds):
                order = list(sides) if round_no % 2 == 0 else list(reversed(sides))
                for name in order:
                    steps = await asyncio.to_thread(ready_steps, dsn, calls // rounds)
                    per[name].append(await latencies(clients, steps, sides[name]))
            results[clients] = per
    return results


def check_policies(dsn: str, measured: dict[str, Rounds]) -> dict[str, int]:
    """Every start of the gateway and the baseline bound the policy, and none of the
    unfenced side did (warm-up calls included); raises otherwise."""
    expected = {"starts_with_policy": 0, "starts_without_policy": 0}
    for by_clients in measured.values():
        for clients, per in by_clients.items():
            for side, runs in per.items():
                field = "starts_without_policy" if side == UNFENCED else "starts_with_policy"
                expected[field] += WARMUP * clients + sum(len(r) for r in runs)
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(policy_revision_id), count(*) - count(policy_revision_id)"
            " FROM ql3_ai.model_invocation_starts"
        ).fetchone()
    assert row is not None
    found = {"starts_with_policy": row[0], "starts_without_policy": row[1]}
    if found != expected:
        raise RuntimeError(f"policy bindings of the starts: {found}, expected {expected}")
    return found


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
        checks.update(check_policies(dsn, measured))
    for kind, by_clients in measured.items():
        judged = kind == ASYNC
        for clients, per in by_clients.items():
            key = f"{kind}_{clients}_clients"
            clients_label = f"{clients} client{'s' if clients > 1 else ''}, {STORE_LABELS[kind]}"
            checks[f"gateway_calls_{key}"] = sum(len(r) for r in per[GATEWAY])
            checks[f"baseline_pairs_{key}"] = sum(len(r) for r in per[BASELINE])
            for pct, target in (("p50", TARGET_P50_MS), ("p99", TARGET_P99_MS)):
                q = float(pct[1:])
                gw_rounds = [percentile(r, q) for r in per[GATEWAY]]
                base_rounds = [percentile(r, q) for r in per[BASELINE]]
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
                        baseline=f"{ms(b):.2f} ms admit+complete, same store and policy",
                        ratio=ratios[f"{pct}_{key}"],
                        target=f"overhead <= {target:g} ms" if judged else "(diagnostic)",
                        result=verdict(ok) if judged else "n/a",
                    )
                )
                if UNFENCED in per:
                    unfenced_rounds = [percentile(r, q) for r in per[UNFENCED]]
                    pairs_by_round = zip(base_rounds, unfenced_rounds, strict=True)
                    fence_rounds = [fenced - bare for fenced, bare in pairs_by_round]
                    fence, unfenced = median(fence_rounds), median(unfenced_rounds)
                    checks[f"unfenced_pairs_{key}"] = sum(len(r) for r in per[UNFENCED])
                    baseline[f"unfenced_pair_{pct}_ms_{key}"] = ms(unfenced)
                    figures[f"policy_fence_{pct}_ms_{key}"] = ms(fence)
                    rows.append(
                        Row(
                            label=f"policy fence in the admission {pct}, {clients_label}",
                            figure=(
                                f"{ms(fence):.2f} ms (baseline minus the pair without a policy;"
                                f" rounds {ms(min(fence_rounds)):.2f} to"
                                f" {ms(max(fence_rounds)):.2f})"
                            ),
                            baseline=f"{ms(unfenced):.2f} ms admit+complete without a policy",
                            ratio=ratio(b, unfenced),
                            target="(diagnostic)",
                            result="n/a",
                        )
                    )
    return Result(
        name="gateway_overhead",
        figures=figures,
        baseline=baseline,
        ratio=ratios,
        target=(
            f"gateway minus the raw pair under the same policy: p50 <= {TARGET_P50_MS:g} ms and"
            f" p99 <= {TARGET_P99_MS:g}"
            f" ms, at {' and '.join(str(c) for c in CLIENT_COUNTS)} clients, on AsyncPgStore"
            " (the PgStore-in-threads rows are diagnostic)"
        ),
        passed=passed,
        rows=rows,
        checks=checks,
        notes=[
            f"{calls} calls per side and client count, in {rounds} rounds with the sides back"
            f" to back, the order reversed every other round, after {WARMUP} warm-up calls"
            " per client; ready steps created outside the timings",
            "baseline: the same two store calls under the policy revision the gateway binds"
            " (every start's binding is counted: checks starts_with_policy and"
            " starts_without_policy); the policy fence rows compare it with the pair without"
            " a policy, on AsyncPgStore",
            "provider: OpenAICompatibleProvider with ql3.stub_provider.instant_transport"
            " (in-process, no sockets); cache in normal mode (relay heartbeats)",
            "each figure is the median over the rounds of that round's percentile; overhead ="
            " the median over the rounds of (gateway percentile - baseline percentile) in the"
            " round, not a per-call difference; the ratio column is gateway / baseline (for"
            " the policy fence rows, baseline / the pair without a policy)",
        ],
    )
