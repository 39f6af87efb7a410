"""The model gateway (SPEC section 9) against real PostgreSQL, Redis and a local HTTP
provider: admission is never raced, every outcome gets its receipt, and the provider is
called only after a ``created`` admission.

The gateway's store connects as the runtime role (``ql3_test_runtime``) under the
application_name ``GATEWAY_APP``, so a test can find and kill exactly its connections;
set-up, inspection and recovery run as the superuser.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from fix_provider import (  # noqa: F401  (provider, provider_b are fixtures)
    MODEL,
    REPLY,
    drop,
    hang,
    provider,
    provider_b,
    slow,
    status,
    stream,
)
from fix_servers import role_dsn
from fix_tcp_proxy import PgProxy, pg_proxy  # noqa: F401  (pg_proxy is a fixture)
from ql3 import errors
from ql3.cache import RevisionCache
from ql3.db import Timeouts
from ql3.devservers import free_port
from ql3.errors import Unavailable
from ql3.gateway import (
    GatewayHooks,
    ModelAuditUnavailable,
    ModelCall,
    ModelDeadlineExceeded,
    ModelGateway,
    ModelInvocationReplayBlocked,
    ModelOutcomeUnknown,
    ModelProviderFailed,
    _Guard,
    _in_own_task,
    _task_to_end,
    deadline_in,
)
from ql3.providers import (
    TOPOLOGY_CONTRACT,
    TOPOLOGY_FAMILY,
    TOPOLOGY_PROJECT,
    OpenAICompatibleProvider,
    topology_body,
)
from ql3.relay import heartbeat_channel
from ql3.store import PgStore
from ql3.store_async import AsyncPgStore
from ql3.stub_provider import StubProvider

PROJECT = "acme"
POLICY = "support-bot"
GATEWAY_APP = "ql3-gateway-under-test"
AnyStore = PgStore | AsyncPgStore
MESSAGES = [{"role": "user", "content": "Tell me about the secret project Bluebird."}]
REPO = Path(__file__).resolve().parents[2]


def run(scenario: Coroutine[Any, Any, None], timeout: float = 30.0) -> None:
    """asyncio.run with a deadline, so a hung scenario fails instead of stalling CI."""
    asyncio.run(asyncio.wait_for(scenario, timeout))


def with_params(dsn: str, **params: str) -> str:
    merged = conninfo_to_dict(dsn)
    merged.update(params)
    return make_conninfo(**merged)  # type: ignore[arg-type]


@dataclass
class World:
    """One migrated database with an active policy and topology, and a ready model step."""

    dsn: str
    runtime_dsn: str
    redis_url: str
    ops: PgStore
    provider: StubProvider
    run_id: str
    step_run_id: str
    policy_revision_id: str
    store_kind: str  # the gateway's store: "threads" (PgStore) or "asyncio" (AsyncPgStore)

    def call(self, **fields: Any) -> ModelCall:
        base = ModelCall(
            project_id=PROJECT,
            run_id=self.run_id,
            step_run_id=self.step_run_id,
            trace_id="trace-1",
            policy_id=POLICY,
            messages=MESSAGES,
            deadline_at=deadline_in(30.0),
        )
        return replace(base, **fields)

    def new_step(self) -> str:
        return self.ops.add_step_run(self.run_id, "model")

    def activate(self, project: str, family: str, contract: str, body: Any) -> str:
        revision = self.ops.put_revision(project, family, contract, body, "test")
        self.ops.activate_revision(project, family, contract, revision["revision_id"], "test")
        return str(revision["revision_id"])

    def query(self, sql: str, *params: Any) -> list[dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.cursor(row_factory=dict_row)
            return list(cur.execute(sql, params).fetchall())

    def start(self, invocation_id: str) -> dict[str, Any] | None:
        rows = self.query(
            "SELECT * FROM ql3_ai.model_invocation_starts WHERE invocation_id = %s", invocation_id
        )
        return rows[0] if rows else None

    def completion(self, invocation_id: str) -> dict[str, Any] | None:
        rows = self.query(
            "SELECT * FROM ql3_ai.model_invocation_completions WHERE invocation_id = %s",
            invocation_id,
        )
        return rows[0] if rows else None

    def step(self, step_run_id: str | None = None) -> dict[str, Any]:
        row = self.ops.step_run(step_run_id or self.step_run_id)
        assert row is not None
        return row

    def unsettled_starts(self) -> int:
        rows = self.query(
            "SELECT count(*) AS n FROM ql3_ai.model_invocation_starts AS s "
            "WHERE NOT EXISTS (SELECT 1 FROM ql3_ai.model_invocation_completions AS c "
            "WHERE c.invocation_id = s.invocation_id)"
        )
        return int(rows[0]["n"])

    def starts(self) -> int:
        return int(self.query("SELECT count(*) AS n FROM ql3_ai.model_invocation_starts")[0]["n"])

    def assert_settled(self, invocation_id: str, outcome: str, result_code: str) -> dict[str, Any]:
        completion = self.completion(invocation_id)
        assert completion is not None, f"no completion for {invocation_id}"
        assert (completion["outcome"], completion["result_code"]) == (outcome, result_code)
        assert self.step()["status"] == outcome
        assert self.unsettled_starts() == 0
        return completion

    def wait_past_deadline(self, invocation_id: str, timeout: float = 10.0) -> None:
        """Until the database clock is past the start's deadline (recovery uses that clock)."""
        started = time.monotonic()
        while not self.query(
            "SELECT now() > deadline_at AS past FROM ql3_ai.model_invocation_starts "
            "WHERE invocation_id = %s",
            invocation_id,
        )[0]["past"]:
            assert time.monotonic() - started < timeout, "deadline never passed"
            time.sleep(0.02)


@pytest.fixture(params=["threads", "asyncio"])
def world(
    request: pytest.FixtureRequest,
    db_dsn: str,
    redis_url: str,
    provider: StubProvider,  # noqa: F811
) -> Iterator[World]:
    """Every gateway test runs over the blocking PgStore (store threads) and over the
    asyncio AsyncPgStore (each invoke as a task of its own, a stream's store calls as
    tasks): the same guarantees either way."""
    with PgStore(db_dsn) as ops:
        topology = topology_body([("stub-a", provider.base_url, [MODEL])])
        revision = ops.put_revision(
            TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, topology, "test"
        )
        ops.activate_revision(
            TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, revision["revision_id"], "test"
        )
        policy = ops.put_revision(
            PROJECT, "policy_routing", POLICY, {"routes": [{"model": MODEL}]}, "test"
        )
        ops.activate_revision(PROJECT, "policy_routing", POLICY, policy["revision_id"], "test")
        run_id = ops.create_run(PROJECT, "trace-1")
        yield World(
            dsn=db_dsn,
            runtime_dsn=with_params(role_dsn(db_dsn, "runtime"), application_name=GATEWAY_APP),
            redis_url=redis_url,
            ops=ops,
            provider=provider,
            run_id=run_id,
            step_run_id=ops.add_step_run(run_id, "model"),
            policy_revision_id=str(policy["revision_id"]),
            store_kind=str(request.param),
        )


@dataclass
class Harness:
    gateway: ModelGateway
    cache: RevisionCache
    adapter: OpenAICompatibleProvider


@contextlib.asynccontextmanager
async def harness(
    world: World,
    *,
    store: AnyStore | None = None,
    timeouts: Timeouts | None = None,
    hooks: GatewayHooks | None = None,
    **cache_options: Any,
) -> AsyncIterator[Harness]:
    """A started revision cache, the HTTP adapter and a gateway over a runtime store."""
    cache = RevisionCache(world.dsn, world.redis_url, **cache_options)
    await cache.start()
    own_store = None
    if store is None:
        own_store = store = make_store(world, world.runtime_dsn, timeouts or Timeouts())
    adapter = OpenAICompatibleProvider(cache)
    gateway = ModelGateway(store, cache, adapter, hooks=hooks)
    try:
        yield Harness(gateway=gateway, cache=cache, adapter=adapter)
    finally:
        await gateway.aclose()
        await cache.close()
        if own_store is not None:
            await close_store(own_store)


def make_store(world: World, dsn: str, timeouts: Timeouts | None = None) -> AnyStore:
    """The gateway's store of the kind this world runs with."""
    if world.store_kind == "asyncio":
        return AsyncPgStore(dsn, timeouts=timeouts)
    return PgStore(dsn, timeouts=timeouts)


async def close_store(store: AnyStore) -> None:
    if isinstance(store, AsyncPgStore):
        await store.close()
    else:
        await asyncio.to_thread(store.close)


async def wait_for_calls(stub: StubProvider, count: int) -> None:
    assert await asyncio.to_thread(stub.wait_for_calls, count, 10.0), "no provider call"


async def wait_for_lock_wait(world: World) -> None:
    """Until the gateway's admission is blocked on a lock."""
    started = time.monotonic()
    while not await asyncio.to_thread(
        world.query,
        "SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
        GATEWAY_APP,
    ):
        assert time.monotonic() - started < 10, "the admission never waited for the lock"
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def step_locked(world: World) -> Iterator[psycopg.Connection[Any]]:
    """Another transaction holds the step row (FOR UPDATE) until the block ends."""
    with psycopg.connect(world.dsn) as conn:
        conn.execute(
            "SELECT 1 FROM ql3.step_runs WHERE step_run_id = %s FOR UPDATE", (world.step_run_id,)
        )
        yield conn
        conn.rollback()


def due_in(call: ModelCall, seconds: float) -> ModelCall:
    """The same call (same invocation_id) with a deadline counted from now: short deadlines
    are set once the harness runs, so a slow start-up cannot eat them."""
    return replace(call, deadline_at=deadline_in(seconds))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- success ------------------------------------------------------------------------------------


def test_success_writes_succeeded_with_usage_and_only_digests_of_the_bodies(world: World) -> None:
    async def scenario() -> None:
        async with harness(world) as h:
            result = await h.gateway.invoke(world.call())
        assert result.text == REPLY
        assert result.usage is not None
        assert (result.usage.input_tokens, result.usage.output_tokens) == (7, 9)
        assert result.policy_revision_id == world.policy_revision_id

    run(scenario())
    assert world.provider.calls == 1
    sent = world.provider.requests[0].body
    [start] = world.query("SELECT * FROM ql3_ai.model_invocation_starts")
    assert start["request_digest"] == sha256(sent)
    assert start["input_bytes"] == len(sent)
    assert str(start["policy_revision_id"]) == world.policy_revision_id
    assert (start["provider"], start["model"]) == ("stub-a", MODEL)
    completion = world.assert_settled(start["invocation_id"], "succeeded", "ok")
    assert (completion["input_tokens"], completion["output_tokens"]) == (7, 9)
    assert completion["cost_micros"] is None  # unknown cost is never a faked 0
    [ledger] = world.query("SELECT * FROM ql3_ai.usage_ledger")
    assert (ledger["provider"], ledger["input_tokens"]) == ("stub-a", 7)
    stored = json.dumps([start["record"], completion["record"]]) + json.dumps(
        world.query("SELECT payload FROM ql3.run_events")
    )
    assert "Bluebird" not in stored and "quick brown fox" not in stored


class CountingStore:
    """The world's store, counting which admission method the gateway calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if name.startswith("admit"):
            self.calls.append(name)
        return method


def test_a_call_in_a_new_run_creates_run_step_and_start_in_one_admission(world: World) -> None:
    call = ModelCall.in_new_run(
        project_id=PROJECT, trace_id="trace-new", policy_id=POLICY, messages=MESSAGES,
        deadline_at=deadline_in(30.0),
    )  # fmt: skip
    assert call.new_run and call.run_id != world.run_id

    counted = CountingStore(make_store(world, world.runtime_dsn))

    async def scenario() -> None:
        try:
            async with harness(world, store=counted) as h:  # type: ignore[arg-type]
                counted.calls.clear()  # ModelGateway() looked at admit_invocation's kind
                result = await h.gateway.invoke(call)
                assert result.text == REPLY
                with pytest.raises(ModelInvocationReplayBlocked):
                    await h.gateway.invoke(call)  # the same call again is a replay
        finally:
            await close_store(counted.inner)

    run(scenario())
    assert counted.calls == ["admit_in_new_run", "admit_in_new_run"]
    assert world.provider.calls == 1
    [run_row] = world.query(
        "SELECT project_id, trace_id, version FROM ql3.runs WHERE run_id = %s", call.run_id
    )
    assert (run_row["project_id"], run_row["trace_id"]) == (PROJECT, "trace-new")
    step = world.step(call.step_run_id)
    assert (step["run_id"], step["kind"], step["status"]) == (call.run_id, "model", "succeeded")
    completion = world.completion(call.invocation_id)
    assert completion is not None and completion["outcome"] == "succeeded"
    assert world.unsettled_starts() == 0


class TwoMethodStore:
    """A store with only the two methods the gateway's protocol requires."""

    def __init__(self, inner: Any) -> None:
        self.admit_invocation = inner.admit_invocation
        self.complete_invocation = inner.complete_invocation


def test_a_new_run_on_a_store_that_cannot_start_one_is_refused_before_anything(
    world: World,
) -> None:
    call = ModelCall.in_new_run(
        project_id=PROJECT, trace_id="trace-none", policy_id=POLICY, messages=MESSAGES,
        deadline_at=deadline_in(30.0),
    )  # fmt: skip
    inner = make_store(world, world.runtime_dsn)

    async def scenario() -> None:
        try:
            async with harness(world, store=TwoMethodStore(inner)) as h:  # type: ignore[arg-type]
                with pytest.raises(errors.InvalidArgument, match="admit_in_new_run"):
                    await h.gateway.invoke(call)
        finally:
            await close_store(inner)

    run(scenario())
    assert world.provider.calls == 0
    assert world.starts() == 0
    assert world.query("SELECT 1 FROM ql3.runs WHERE run_id = %s", call.run_id) == []


def test_a_new_run_refused_by_its_policy_fence_leaves_no_run(world: World) -> None:
    """The admission in a new run fences the policy in its one transaction: a stale
    revision refuses it and the run and step it would have created are not there."""
    call = ModelCall.in_new_run(
        project_id=PROJECT, trace_id="trace-stale", policy_id=POLICY, messages=MESSAGES,
        deadline_at=deadline_in(30.0),
    )  # fmt: skip

    async def scenario() -> None:
        async with harness(world) as h:
            await h.cache.get_effective(PROJECT, "policy_routing", POLICY)  # cached
            world.activate(
                PROJECT, "policy_routing", POLICY, {"routes": [{"model": MODEL}], "v": 2}
            )
            result = await h.gateway.invoke(call)  # stale once, then the new revision
            assert result.policy_revision_id != world.policy_revision_id

    run(scenario())
    starts = world.query(
        "SELECT policy_revision_id::text AS r FROM ql3_ai.model_invocation_starts"
        " WHERE invocation_id = %s", call.invocation_id,
    )  # fmt: skip
    assert len(starts) == 1 and starts[0]["r"] != world.policy_revision_id
    assert len(world.query("SELECT 1 FROM ql3.runs WHERE run_id = %s", call.run_id)) == 1


def test_stream_yields_pieces_and_settles_succeeded(world: World) -> None:
    pieces = ["Once ", "upon ", "a ", "time."]
    world.provider.script = stream(pieces)

    async def scenario() -> None:
        async with harness(world) as h:
            async with h.gateway.stream(world.call()) as chunks:
                received = [piece async for piece in chunks]
            assert received == pieces
            assert chunks.result is not None
            assert chunks.result.text == "Once upon a time."
            assert chunks.result.usage is not None
            world.assert_settled(chunks.result.invocation_id, "succeeded", "ok")

    run(scenario())
    request = json.loads(world.provider.requests[0].body)
    assert request["stream"] is True
    assert request["stream_options"] == {"include_usage": True}


# -- admission ----------------------------------------------------------------------------------


@pytest.mark.parametrize("deadline", [datetime(2999, 1, 1), "2999-01-01T00:00:00Z"])
def test_a_deadline_without_a_time_zone_is_the_calls_own_error_and_admits_nothing(
    world: World, deadline: Any
) -> None:
    async def scenario() -> None:
        async with harness(world) as h:
            with pytest.raises(errors.InvalidArgument):
                await h.gateway.invoke(replace(world.call(), deadline_at=deadline))

    run(scenario())
    assert world.provider.calls == 0
    assert world.starts() == 0


def audit_unavailable_count(phase: str) -> float:
    """The gateway's counter on the default registry (the test process loads
    prometheus_client, so the gateway registered it)."""
    value = REGISTRY.get_sample_value("ql3_gateway_audit_unavailable_total", {"phase": phase})
    assert value is not None, "the counter and its phase series exist before any failure"
    return value


def test_unreachable_database_is_audit_unavailable_and_calls_no_provider(world: World) -> None:
    before = audit_unavailable_count("admission"), audit_unavailable_count("completion")

    async def scenario() -> None:
        closed = make_store(
            world, with_params(world.runtime_dsn, port=str(free_port())), Timeouts(connect_s=1)
        )
        try:
            async with harness(world, store=closed) as h:
                with pytest.raises(ModelAuditUnavailable) as caught:
                    await h.gateway.invoke(world.call())
        finally:
            await close_store(closed)
        assert caught.value.phase == "admission"
        assert caught.value.cause_code == "QL3_UNAVAILABLE"

    run(scenario())
    assert world.provider.calls == 0
    assert world.starts() == 0
    after = audit_unavailable_count("admission"), audit_unavailable_count("completion")
    assert after == (before[0] + 1, before[1]), "one admission failure counted, by its phase"


def test_statement_timeout_in_admission_is_audit_unavailable_and_writes_nothing(
    world: World,
) -> None:
    async def scenario() -> None:
        timeouts = Timeouts(statement_ms=300, lock_ms=10000)
        async with harness(world, timeouts=timeouts) as h:
            with step_locked(world), pytest.raises(ModelAuditUnavailable) as caught:
                await h.gateway.invoke(world.call())
        assert caught.value.cause_code == "QL3_UNAVAILABLE"

    run(scenario())
    assert world.provider.calls == 0
    assert world.starts() == 0
    assert world.step()["status"] == "ready"


def test_replay_of_an_admitted_invocation_is_blocked_without_provider_io(world: World) -> None:
    call = world.call()

    async def scenario() -> None:
        async with harness(world) as h:
            await h.gateway.invoke(call)
            assert world.provider.calls == 1
            with pytest.raises(ModelInvocationReplayBlocked) as caught:
                await h.gateway.invoke(call)
        assert caught.value.start["invocation_id"] == call.invocation_id

    run(scenario())
    assert world.provider.calls == 1


def test_replay_while_the_first_call_runs_is_blocked(world: World) -> None:
    world.provider.script = hang
    call = world.call()

    async def scenario() -> None:
        async with harness(world) as h:
            first = asyncio.create_task(h.gateway.invoke(call))
            await wait_for_calls(world.provider, 1)
            with pytest.raises(ModelInvocationReplayBlocked):
                await h.gateway.invoke(call)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first

    run(scenario())
    assert world.provider.calls == 1
    world.assert_settled(call.invocation_id, "lost", "outcome_unknown")


def test_deadline_passing_while_admission_waits_on_a_lock_writes_timed_out_after_the_commit(
    world: World,
) -> None:
    call = world.call()

    async def scenario() -> None:
        async with harness(world, timeouts=Timeouts(lock_ms=10000)) as h:
            with step_locked(world):
                task = asyncio.create_task(h.gateway.invoke(due_in(call, 0.4)))
                await wait_for_lock_wait(world)
                await asyncio.sleep(0.6)  # the deadline passes while the lock is held
                assert not task.done(), "the admission was raced by the deadline"
                assert world.starts() == 0
            with pytest.raises(ModelDeadlineExceeded) as caught:
                await task
        assert caught.value.completion is not None

    run(scenario())
    assert world.provider.calls == 0
    world.assert_settled(call.invocation_id, "timed_out", "deadline_exceeded_before_call")


def test_caller_cancelled_during_admission_waits_for_it_and_settles_without_provider_io(
    world: World,
) -> None:
    call = world.call()

    async def scenario() -> None:
        async with harness(world, timeouts=Timeouts(lock_ms=10000)) as h:
            with step_locked(world):
                task = asyncio.create_task(h.gateway.invoke(call))
                await wait_for_lock_wait(world)
                task.cancel()
                await asyncio.sleep(0.2)
                assert not task.done(), "the cancellation raced the admission"
            with pytest.raises(asyncio.CancelledError):
                await task

    run(scenario())
    assert world.provider.calls == 0
    world.assert_settled(call.invocation_id, "failed", "cancelled_before_call")


def test_stale_policy_revision_is_reloaded_and_admitted_once_more(world: World) -> None:
    """The cache is healthy (heartbeats) but missed an activation: the database fences it."""
    prefix = f"test-gw:{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        beats = aioredis.Redis.from_url(world.redis_url)
        stop = asyncio.Event()

        async def heartbeat() -> None:
            while not stop.is_set():
                await beats.publish(heartbeat_channel(prefix), json.dumps({"type": "heartbeat"}))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.1)

        beating = asyncio.create_task(heartbeat())
        try:
            async with harness(
                world,
                channel_prefix=prefix,
                heartbeat_timeout=5.0,
                max_staleness={"policy_routing": 300.0, "platform_resource": 300.0},
            ) as h:
                started = time.monotonic()
                while h.cache.mode != "normal":
                    assert time.monotonic() - started < 5, "no heartbeat reached the cache"
                    await asyncio.sleep(0.01)
                cached = await h.cache.get_effective(PROJECT, "policy_routing", POLICY)
                assert cached.revision_id == world.policy_revision_id
                body = {"routes": [{"model": MODEL, "weight": 2}]}
                newer = await asyncio.to_thread(
                    world.activate, PROJECT, "policy_routing", POLICY, body
                )
                stale = await h.cache.get_effective(PROJECT, "policy_routing", POLICY)
                assert stale.revision_id == world.policy_revision_id  # no relay: not told
                result = await h.gateway.invoke(world.call())
                assert result.policy_revision_id == newer
                assert result.start["policy"]["revision_id"] == newer
        finally:
            stop.set()
            await beating
            await beats.aclose()

    run(scenario())
    assert world.provider.calls == 1


def test_caller_cancelled_during_the_completion_write_waits_for_it_then_cancels(
    world: World,
) -> None:
    """The provider has answered; the completion waits on a lock when the caller is
    cancelled: the completion is still written in full, and only then does the
    cancellation reach the caller."""
    call = world.call()
    locked, release = threading.Event(), threading.Event()
    holders: list[threading.Thread] = []

    def hold_the_step() -> None:
        with step_locked(world):
            locked.set()
            release.wait(10)

    async def lock_the_step(command: Mapping[str, Any]) -> None:
        holder = threading.Thread(target=hold_the_step, daemon=True)
        holders.append(holder)
        holder.start()
        assert await asyncio.to_thread(locked.wait, 10)

    async def scenario() -> None:
        hooks = GatewayHooks(before_completion=lock_the_step)
        async with harness(world, timeouts=Timeouts(lock_ms=10000), hooks=hooks) as h:
            task = asyncio.create_task(h.gateway.invoke(call))
            await wait_for_lock_wait(world)
            task.cancel()
            await asyncio.sleep(0.2)
            assert not task.done(), "the cancellation raced the completion"
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task

    try:
        run(scenario())
    finally:
        release.set()
        for holder in holders:
            holder.join(15)
    assert world.provider.calls == 1
    world.assert_settled(call.invocation_id, "succeeded", "ok")


# -- provider outcomes -----------------------------------------------------------------------


CANCEL_AFTER = (0.0, 0.001, 0.002, 0.003, 0.005, 0.008, 0.015, 0.03, 0.045, 0.2)
"""Seconds from a call's start to its caller's cancellation: before the call's first step,
during the policy lookup and the admission, during the provider's 50 ms, and after."""


def test_a_caller_cancelled_at_any_moment_ends_with_every_start_settled_as_what_happened(
    world: World,
) -> None:
    """Calls cancelled after each delay of CANCEL_AFTER, twice, in a shuffled order. Each
    one ends with its answer or with the cancellation, and by then its start (if it was
    admitted) has its completion. The completion says what happened: a call that failed
    before the call never reached the provider, a lost one was cancelled, a succeeded one
    reached it, and a caller that got the answer has a succeeded call."""
    world.provider.script = slow(0.05)
    delays = list(CANCEL_AFTER) * 2
    random.Random(43).shuffle(delays)
    ended: list[tuple[ModelCall, str, dict[str, Any] | None, int]] = []

    async def scenario() -> None:
        async with harness(world) as h:
            for i, delay in enumerate(delays):
                step = await asyncio.to_thread(world.ops.add_step_run, world.run_id, "model")
                message = {"role": "user", "content": f"call {i}"}
                call = world.call(step_run_id=step, messages=[message])
                task = asyncio.create_task(h.gateway.invoke(call))
                await asyncio.sleep(delay)
                task.cancel()
                try:
                    await task
                    how = "answer"
                except asyncio.CancelledError:
                    how = "cancelled"
                completion = await asyncio.to_thread(world.completion, call.invocation_id)
                starts = await asyncio.to_thread(
                    world.query,
                    "SELECT count(*) AS n FROM ql3_ai.model_invocation_starts"
                    " WHERE invocation_id = %s",
                    call.invocation_id,
                )
                ended.append((call, how, completion, int(starts[0]["n"])))

    run(scenario(), timeout=60.0)
    seen = {str(r.doc["messages"][0]["content"]) for r in world.provider.requests if r.doc}
    kinds: set[str] = set()
    for call, how, completion, starts in ended:
        sent = call.messages[0]["content"] in seen
        if completion is None:
            assert (how, sent, starts) == ("cancelled", False, 0), call.invocation_id
            kinds.add("not admitted")
            continue
        outcome, code = str(completion["outcome"]), str(completion["result_code"])
        expected_code = {
            "succeeded": "ok",
            "lost": "outcome_unknown",  # cancelled once the provider call had begun
            "failed": "cancelled_before_call",
        }
        assert expected_code.get(outcome) == code, (outcome, code)
        if outcome == "failed":
            assert (how, sent) == ("cancelled", False), call.invocation_id
        if outcome == "lost":
            assert how == "cancelled", call.invocation_id
        if outcome == "succeeded":
            assert sent, call.invocation_id
        if how == "answer":
            assert outcome == "succeeded", call.invocation_id
        kinds.add(outcome if how == "cancelled" else how)
    assert world.unsettled_starts() == 0
    # The delays reach the provider call and the end at least (the others are timing's).
    assert {"lost", "answer"} <= kinds, kinds


def test_caller_cancel_during_the_provider_call_is_lost_outcome_unknown(world: World) -> None:
    world.provider.script = hang
    call = world.call()

    async def scenario() -> None:
        async with harness(world) as h:
            task = asyncio.create_task(h.gateway.invoke(call))
            await wait_for_calls(world.provider, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(scenario())
    completion = world.assert_settled(call.invocation_id, "lost", "outcome_unknown")
    assert completion["recovered"] is False


def test_stream_consumer_stopping_early_is_lost(world: World) -> None:
    world.provider.script = stream([f"piece{i} " for i in range(20)], delay=0.05)
    call = world.call()

    async def scenario() -> None:
        async with harness(world) as h:
            async with h.gateway.stream(call) as chunks:
                async for piece in chunks:
                    if piece == "piece1 ":
                        break
            assert chunks.result is None

    run(scenario())
    world.assert_settled(call.invocation_id, "lost", "outcome_unknown")


def test_stream_consumer_cancelled_is_lost(world: World) -> None:
    world.provider.script = hang
    call = world.call()

    async def scenario() -> None:
        async with harness(world) as h:

            async def consume() -> None:
                async with h.gateway.stream(call) as chunks:
                    async for _ in chunks:
                        pass

            task = asyncio.create_task(consume())
            await wait_for_calls(world.provider, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(scenario())
    world.assert_settled(call.invocation_id, "lost", "outcome_unknown")


def test_provider_4xx_is_failed_with_the_error_body_digested(world: World) -> None:
    world.provider.script = status(404)
    call = world.call()

    async def scenario() -> None:
        async with harness(world) as h:
            with pytest.raises(ModelProviderFailed) as caught:
                await h.gateway.invoke(call)
        assert caught.value.status == 404
        assert caught.value.completion is not None

    run(scenario())
    completion = world.assert_settled(call.invocation_id, "failed", "provider_http_404")
    assert completion["output_bytes"] > 0
    assert completion["output_digest"] is not None


def test_provider_slower_than_the_deadline_is_timed_out(world: World) -> None:
    world.provider.script = slow(5.0)
    call = world.call()

    async def scenario() -> None:
        async with harness(world) as h:
            with pytest.raises(ModelDeadlineExceeded):
                await h.gateway.invoke(due_in(call, 0.5))

    run(scenario())
    assert world.provider.calls == 1
    world.assert_settled(call.invocation_id, "timed_out", "deadline_exceeded")


def test_connection_lost_after_sending_is_lost(world: World) -> None:
    world.provider.script = drop
    call = world.call()

    async def scenario() -> None:
        async with harness(world) as h:
            with pytest.raises(ModelOutcomeUnknown):
                await h.gateway.invoke(call)

    run(scenario())
    assert world.provider.calls == 1
    world.assert_settled(call.invocation_id, "lost", "outcome_unknown")


# -- receipts that cannot be written -------------------------------------------------------


def test_failed_completion_write_withholds_the_result_and_recovery_settles_lost(
    world: World,
) -> None:
    """The gateway's connection is killed while its completion write runs (a connection
    killed while idle is replaced before use: ql3.db_guard)."""
    call = world.call()
    killed: list[int] = []

    def kill_completion_in_flight(locked: threading.Event) -> None:
        # Hold the step's row lock, so that the completion write waits on it; kill the
        # gateway's backend that waits, then let go.
        with psycopg.connect(world.dsn) as locker:
            locker.execute(
                "SELECT 1 FROM ql3.step_runs WHERE step_run_id = %s FOR UPDATE",
                (world.step_run_id,),
            )
            locked.set()
            deadline = time.monotonic() + 10
            while not killed and time.monotonic() < deadline:
                for row in world.query(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
                    " AND wait_event_type = 'Lock'",
                    GATEWAY_APP,
                ):
                    killed.append(row["pid"])
                    world.query("SELECT pg_terminate_backend(%s, 5000)", row["pid"])
                time.sleep(0.02)
            locker.rollback()

    killers: list[threading.Thread] = []

    async def kill_during_completion(command: Mapping[str, Any]) -> None:
        locked = threading.Event()
        killer = threading.Thread(target=kill_completion_in_flight, args=(locked,), daemon=True)
        killers.append(killer)
        killer.start()
        assert await asyncio.to_thread(locked.wait, 10)

    async def scenario() -> None:
        hooks = GatewayHooks(before_completion=kill_during_completion)
        async with harness(world, hooks=hooks) as h:
            with pytest.raises(ModelAuditUnavailable) as caught:
                await h.gateway.invoke(due_in(call, 1.5))
        assert caught.value.phase == "completion"
        assert not hasattr(caught.value, "text")

    run(scenario())
    for killer in killers:
        killer.join(15)
    assert len(killed) == 1
    assert world.provider.calls == 1
    assert world.completion(call.invocation_id) is None
    assert world.step()["status"] == "running"
    world.wait_past_deadline(call.invocation_id)
    assert world.ops.recover_expired(10, 0.0)["count"] == 1
    completion = world.assert_settled(call.invocation_id, "lost", "outcome_unknown")
    assert completion["recovered"] is True


@pytest.mark.parametrize("pool", ["store_autocommit", "transactional_pool"])
def test_lost_commit_response_is_audit_unavailable_then_existing_then_recovered_as_lost(
    world: World,
    pg_proxy: PgProxy,  # noqa: F811
    pool: str,
) -> None:
    """The store's own pool is autocommit: the admission statement is its transaction, and
    its reply is the answer to its COMMIT. A pool of the caller's sends a real COMMIT."""
    call = world.call()
    dsn = pg_proxy.dsn(world.runtime_dsn)
    marker = b"admit_invocation" if pool == "store_autocommit" else None
    failure: list[ModelAuditUnavailable] = []

    async def proxied_store() -> AnyStore:
        if pool == "store_autocommit":
            return make_store(world, dsn)
        if world.store_kind == "asyncio":
            async_pool = AsyncConnectionPool(dsn, min_size=1, open=False)
            await async_pool.open()
            return AsyncPgStore(async_pool)
        return PgStore(ConnectionPool(dsn, min_size=1, open=True))

    async def scenario() -> None:
        proxied = await proxied_store()
        try:
            async with harness(world, store=proxied) as h:
                timed = due_in(call, 1.0)
                pg_proxy.arm_commit_loss(marker)
                with pytest.raises(ModelAuditUnavailable) as caught:
                    await h.gateway.invoke(timed)
                failure.append(caught.value)
                assert pg_proxy.commit_lost.is_set()
                # The gateway's own durable recheck: the same call is now a replay.
                with pytest.raises(ModelInvocationReplayBlocked):
                    await h.gateway.invoke(timed)
        finally:
            await close_store(proxied)
            if isinstance(proxied.pool, AsyncConnectionPool):
                await proxied.pool.close()
            else:
                proxied.pool.close()

    run(scenario())
    [error] = failure
    assert (error.phase, error.cause_code) == ("admission", "QL3_UNAVAILABLE")
    assert error.cause_outcome == "committed"  # the gateway's replay found it written (D49)
    assert world.provider.calls == 0
    assert world.ops.admit_invocation(error.command)["status"] == "existing"
    assert world.step()["status"] == "running"
    world.wait_past_deadline(call.invocation_id)
    assert world.ops.recover_expired(10, 0.0)["count"] == 1
    completion = world.assert_settled(call.invocation_id, "lost", "outcome_unknown")
    assert completion["recovered"] is True
    assert world.provider.calls == 0


OWN_TASK = "_own_task_ended.<locals>.run"


def own_tasks() -> list[asyncio.Task[Any]]:
    """The tasks the gateway runs a call or a store call in."""
    return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == OWN_TASK]


def test_a_store_call_task_runs_to_its_end_when_its_caller_is_cancelled() -> None:
    """A stream's store call (a task of its own): the caller's cancellation is reported
    with the call's answer, never passed on to the call."""

    async def scenario() -> None:
        gate = asyncio.Event()

        async def call() -> Mapping[str, Any]:
            await gate.wait()
            return {"status": "created"}

        waiting = asyncio.ensure_future(_task_to_end(call()))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.sleep(0.01)
        assert not waiting.done(), "the cancellation reached the store call"
        gate.set()
        done = await waiting
        assert (done.value, done.error, done.cancelled) == ({"status": "created"}, None, True)

    run(scenario())


def test_an_asyncio_store_call_cancelled_from_outside_is_an_unavailable_call() -> None:
    """asyncio.run cancels every task at shutdown, the gateway's store-call tasks too: the
    wait then reports an unknown store outcome (and a cancellation), never a value."""

    async def scenario() -> None:
        call: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(_task_to_end(call))
        await asyncio.sleep(0)
        call.cancel()
        done = await waiting
        assert isinstance(done.error, Unavailable)
        assert (done.value, done.cancelled) == (None, True)

    run(scenario())


def test_a_store_call_task_cancelled_before_it_ran_is_an_unavailable_call() -> None:
    """The same at shutdown, when the store-call task is cancelled before its first step
    (its coroutine never runs): the wait still ends, with an unknown outcome."""

    async def scenario() -> None:
        async def call() -> Mapping[str, Any]:
            return {"status": "created"}

        waiting = asyncio.ensure_future(_task_to_end(call()))
        await asyncio.sleep(0)  # the wait has created the store-call task, not yet started
        [store_task] = own_tasks()
        store_task.cancel()
        done = await waiting
        assert isinstance(done.error, Unavailable)
        assert (done.value, done.cancelled) == (None, True)

    run(scenario())


def test_a_call_in_its_own_task_runs_its_uninterruptible_part_to_the_end_when_cancelled() -> None:
    """A cancelled caller waits for the part of its call that may not be interrupted (a
    store call and what its answer calls for), which sees the cancellation noted; the
    caller gets the cancellation, not the result."""
    seen: list[bool] = []

    async def scenario() -> None:
        gate = asyncio.Event()

        async def body(guard: _Guard) -> str:
            guard.interruptible = False
            await gate.wait()
            seen.append(guard.cancelled)
            return "written"

        caller = asyncio.create_task(_in_own_task(body))
        await asyncio.sleep(0.01)
        caller.cancel()
        await asyncio.sleep(0.01)
        assert not caller.done(), "the cancellation interrupted the call"
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await caller

    run(scenario())
    assert seen == [True]


def test_a_call_in_its_own_task_is_interrupted_where_it_allows_it() -> None:
    interrupted: list[str] = []

    async def scenario() -> None:
        async def body(guard: _Guard) -> str:
            assert guard.interruptible
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                interrupted.append("provider call")
                raise
            return "answer"

        caller = asyncio.create_task(_in_own_task(body))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller

    run(scenario())
    assert interrupted == ["provider call"]


def test_a_call_in_its_own_task_passes_on_its_result_and_its_error() -> None:
    problem = ValueError("the call's own error")

    async def scenario() -> None:
        async def answer(guard: _Guard) -> str:
            return "answer"

        async def fail(guard: _Guard) -> str:
            raise problem

        assert await _in_own_task(answer) == "answer"
        with pytest.raises(ValueError) as caught:
            await _in_own_task(fail)
        assert caught.value is problem

    run(scenario())


def test_a_cancelled_caller_gets_the_cancellation_over_its_calls_error() -> None:
    """The call ended with an error after its caller was cancelled: the caller gets the
    cancellation, and the error is taken from the task (asyncio would otherwise report
    'Task exception was never retrieved')."""
    reported: list[dict[str, Any]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        gate = asyncio.Event()

        async def body(guard: _Guard) -> str:
            guard.interruptible = False
            await gate.wait()
            raise ValueError("the call's own error")

        caller = asyncio.create_task(_in_own_task(body))
        await asyncio.sleep(0.01)
        caller.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        del caller
        gc.collect()

    run(scenario())
    assert reported == []


def test_a_call_task_cancelled_before_it_ran_cancels_its_caller_and_runs_nothing() -> None:
    """At shutdown asyncio.run cancels every task, a call's own task too, maybe before its
    first step: the caller still ends, with the cancellation, and the call's coroutine
    is closed unstarted (no 'never awaited' warning, which the tests turn into errors)."""
    ran: list[bool] = []

    async def scenario() -> None:
        async def body(guard: _Guard) -> str:
            ran.append(True)
            return "answer"

        caller = asyncio.ensure_future(_in_own_task(body))
        await asyncio.sleep(0)  # the caller has created its call's task, not yet started
        [own] = own_tasks()
        own.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller

    run(scenario())
    gc.collect()
    assert ran == []


# -- topology ---------------------------------------------------------------------------------


def test_topology_change_sends_the_next_call_to_the_new_endpoint(
    world: World,
    provider_b: StubProvider,  # noqa: F811
) -> None:
    async def scenario() -> None:
        async with harness(world) as h:
            first = await h.gateway.invoke(world.call())
            assert first.provider == "stub-a"
            resets = h.adapter.resets
            body = topology_body([("stub-b", provider_b.base_url, [MODEL])])
            await asyncio.to_thread(
                world.activate, TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, body
            )
            await h.cache.verify_all()
            assert h.adapter.resets == resets + 1  # on_change retired the old connections
            second = await h.gateway.invoke(world.call(step_run_id=world.new_step()))
            assert (second.provider, second.text) == ("stub-b", "Answered by endpoint B.")

    run(scenario())
    assert (world.provider.calls, provider_b.calls) == (1, 1)


# -- the example --------------------------------------------------------------------------------


def test_example_script_calls_a_stub_model_through_the_gateway(db_dsn: str, redis_url: str) -> None:
    env = dict(os.environ, QL3_DSN=db_dsn, QL3_REDIS_URL=redis_url)
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "call_model.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "succeeded" in done.stdout
    assert "MODEL_INVOCATION_REPLAY_BLOCKED" in done.stdout
