"""``make demo``: ql3's main job end to end, narrated step by step.

With no arguments everything runs on a temporary SQLite file through the edge shim
(``ql3.edge``), with no server at all: contract revisions are put and activated, the
outbox relay invalidates a worker's revision cache, model calls go through the gateway to
an in-process stub provider (a success, a provider failure, a deadline, and a caller abort
that becomes ``lost``), a human resolves the lost call, and the usage ledger is summed.

``--dsn`` runs the same narrative on PostgreSQL through ``PgStore``, with the real outbox
relay and ``RevisionCache`` over Redis (``--redis-url``, else ``$QL3_REDIS_URL``, else a
throwaway ``redis-server``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from ql3 import errors
from ql3.gateway import (
    GatewayError,
    GatewayHooks,
    ModelCall,
    ModelGateway,
    ModelInvocationReplayBlocked,
    deadline_in,
)
from ql3.invocations import Decision, resolution_command
from ql3.providers import (
    TOPOLOGY_CONTRACT,
    TOPOLOGY_FAMILY,
    TOPOLOGY_PROJECT,
    OpenAICompatibleProvider,
    topology_body,
)
from ql3.stub_provider import StubExchange, StubProvider

PROJECT, FAMILY, POLICY = "demo", "policy_routing", "support-bot"
TRACE = "trace-demo-1"
QWEN, LLAMA = "qwen2.5:7b", "llama3.1:8b"


def say(step: str, detail: Any = None) -> None:
    print(f"\n== {step}", flush=True)
    if detail is not None:
        print(json.dumps(detail, indent=2, sort_keys=True, default=str), flush=True)


def note(text: str) -> None:
    print(f"   {text}", flush=True)


class Cache(Protocol):
    """What the demo needs of a worker revision cache (both caches have it)."""

    async def get_effective(
        self, project_id: str, contract_family: str, contract_id: str
    ) -> Any: ...

    async def verify_all(self) -> None: ...

    def on_change(
        self, contract_family: str, contract_id: str, fn: Callable[[Any], Any]
    ) -> None: ...


@dataclass
class Backend:
    """One store with its relay and worker cache, whichever database is under them."""

    name: str
    store: Any
    cache: Cache
    migrations: list[str]


# -- the stub provider's behaviour, chosen by the last user message --------------------------------


def script(exchange: StubExchange) -> None:
    messages = (exchange.request.doc or {}).get("messages") or [{}]
    text = str(messages[-1].get("content", ""))
    if text.startswith("fail"):
        exchange.send_json(503, {"error": {"message": "the model is overloaded"}})
    elif text.startswith("slow"):
        exchange.hang(30)
    else:
        exchange.send_completion(f"(stub {exchange.request.model}) you said: {text}")


# -- backends ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def sqlite_backend(path: Path, journal_mode: str) -> AsyncIterator[Backend]:
    from ql3.edge import EdgeRelay, EdgeRevisionCache, EdgeStore

    store = EdgeStore(path, journal_mode, ai=True)  # type: ignore[arg-type]
    relay = EdgeRelay(store, redis_url="", poll_interval=0.5)
    cache = EdgeRevisionCache(store, relay)
    relay.start()
    try:
        applied = [f"{a.stream} {a.file_name}" for a in store.applied]
        yield Backend(f"SQLite ({journal_mode}) {path}", store, cache, applied)
    finally:
        relay.close()
        cache.close()
        store.close()


@contextlib.contextmanager
def redis_for_demo(redis_url: str | None) -> Iterator[str]:
    url = redis_url or os.environ.get("QL3_REDIS_URL")
    if url:
        yield url
        return
    from ql3.devservers import start_redis

    root = Path(tempfile.mkdtemp(prefix="ql3-demo-redis-"))
    server = start_redis(root)
    try:
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.asynccontextmanager
async def postgres_backend(dsn: str, redis_url: str) -> AsyncIterator[Backend]:
    from psycopg.conninfo import conninfo_to_dict

    from ql3.cache import RevisionCache
    from ql3.migrate import migrate
    from ql3.relay import Relay, RelayConfig
    from ql3.store import PgStore

    applied = [f"{a.stream} {a.file_name}" for a in migrate(dsn, with_ai=True)]
    store = PgStore(dsn, max_connections=4)
    relay = Relay(RelayConfig(dsn=dsn, redis_url=redis_url, poll_interval=0.5))
    cache = RevisionCache(dsn, redis_url, heartbeat_timeout=30)
    try:
        await relay.start()
        await relay.wait_ready()
        await cache.start()
        where = conninfo_to_dict(dsn)
        name = f"PostgreSQL {where.get('dbname', '')} on {where.get('host', 'localhost')}"
        yield Backend(name, store, cache, applied)
    finally:
        await cache.close()
        await relay.stop()
        store.close()


# -- the narrative ----------------------------------------------------------------------


async def wait_for(event: threading.Event, what: str, timeout: float = 10.0) -> float:
    """Seconds until ``event`` is set (a worker callback ran), or an error."""
    started = time.monotonic()
    if not await asyncio.to_thread(event.wait, timeout):
        raise RuntimeError(f"timed out waiting for {what}")
    return time.monotonic() - started


def show_step(store: Any, step_run_id: str) -> None:
    step = store.step_run(step_run_id)
    note(
        f"step {step_run_id[:8]}: {step['status']} v{step['version']} attempt "
        f"{step['attempt_count']} result_code={step['result_code']} "
        f"output_ref={step['output_ref']}"
    )


async def narrate(backend: Backend, stub: StubProvider) -> None:
    store, cache = backend.store, backend.cache
    say(f"store: {backend.name}")
    note(f"migrations applied: {', '.join(backend.migrations) or 'none (already up to date)'}")

    # Contracts: the provider topology and two routing policies.
    topology = store.put_revision(
        TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT,
        topology_body([("stub", stub.base_url, [QWEN, LLAMA])]), "ops",
    )  # fmt: skip
    store.activate_revision(
        TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, topology["revision_id"], "ops"
    )
    v1 = store.put_revision(PROJECT, FAMILY, POLICY, {"routes": [{"model": QWEN}]}, "alice")
    v2 = store.put_revision(PROJECT, FAMILY, POLICY, {"routes": [{"model": LLAMA}]}, "alice")
    say(
        "put two immutable policy revisions (and the provider topology)",
        {f"revision {r['revision_no']}": r["body_hash"] for r in (v1, v2)},
    )
    event = store.activate_revision(PROJECT, FAMILY, POLICY, v1["revision_id"], "alice")
    say("activated revision 1: pointer swap and outbox row in one transaction", event)

    loaded: dict[int, threading.Event] = {1: threading.Event(), 2: threading.Event()}

    def worker_saw(revision: Any) -> None:
        if revision.project_id == PROJECT and revision.revision_no in loaded:
            loaded[revision.revision_no].set()

    cache.on_change(FAMILY, POLICY, worker_saw)
    first = await cache.get_effective(PROJECT, FAMILY, POLICY)
    await wait_for(loaded[1], "the first load")
    say(f"a worker cache loaded the policy: revision {first.revision_no}, body {first.body}")

    event = store.activate_revision(
        PROJECT,
        FAMILY,
        POLICY,
        v2["revision_id"],
        "bob",
        expected_active_revision_id=v1["revision_id"],
    )
    assert event is not None
    seconds = await wait_for(loaded[2], "the invalidation")
    now = await cache.get_effective(PROJECT, FAMILY, POLICY)
    say(
        f"activated revision 2 (compare-and-set on revision 1): the relay delivered outbox "
        f"seq {event['seq']} and the worker cache reloaded revision {now.revision_no} in "
        f"{seconds * 1000:.0f} ms"
    )
    try:
        store.activate_revision(
            PROJECT, FAMILY, POLICY, v1["revision_id"], "mallory",
            expected_active_revision_id=v1["revision_id"],
        )  # fmt: skip
    except errors.Conflict as exc:
        note(f"a stale compare-and-set is refused: {exc.code}")

    # Model calls through the gateway, one model step each.
    run_id = store.create_run(PROJECT, TRACE)
    steps = {name: store.add_step_run(run_id, "model") for name in
             ("success", "failure", "timeout", "abort")}  # fmt: skip
    provider = OpenAICompatibleProvider(cache)
    written: dict[str, dict[str, Any]] = {}

    async def keep_completion(command: Mapping[str, Any]) -> None:
        written[str(command["invocation_id"])] = dict(command)

    hooks = GatewayHooks(before_completion=keep_completion)
    async with ModelGateway(store, cache, provider, hooks=hooks) as gateway:

        def call(step: str, text: str, seconds: float = 10.0, version: int = 1) -> ModelCall:
            return ModelCall(
                project_id=PROJECT, run_id=run_id, step_run_id=steps[step], trace_id=TRACE,
                policy_id=POLICY, messages=[{"role": "user", "content": text}],
                deadline_at=deadline_in(seconds), expected_step_run_version=version,
            )  # fmt: skip

        success = call("success", "hello, model")
        result = await gateway.invoke(success)
        say(
            "a call that succeeds: admitted (Start receipt) before the provider saw it, "
            "completed (Completion receipt) before the answer was handed out",
            {"text": result.text, "model": result.model, "usage": result.usage,
             "policy_revision_id": result.policy_revision_id,
             "start_digest": result.start_digest, "completion_digest": result.completion_digest},
        )  # fmt: skip
        show_step(store, steps["success"])
        calls = stub.calls
        try:
            await gateway.invoke(success)
        except ModelInvocationReplayBlocked as exc:
            note(f"calling it again is an exact replay: {exc.code}, provider calls "
                 f"{calls} -> {stub.calls}")  # fmt: skip

        for step, text, seconds, what in (
            ("failure", "fail please", 10.0, "a call the provider refuses (HTTP 503)"),
            ("timeout", "slow answer please", 1.0, "a call that outlives its 1 s deadline"),
        ):
            try:
                await gateway.invoke(call(step, text, seconds))
            except GatewayError as exc:
                say(f"{what}: {exc.code}")
                show_step(store, steps[step])

        abort = asyncio.create_task(gateway.invoke(call("abort", "slow, then I give up", 30.0)))
        await asyncio.to_thread(stub.wait_for_calls, stub.calls + 1, 10.0)
        abort.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await abort
        say("a caller that aborts after the request was sent: the outcome cannot be known")
        show_step(store, steps["abort"])
        note("lost/outcome_unknown is never retried automatically: only a human moves it on")

        # A human resolution of the lost call, then a new attempt on the same step.
        lost = store.step_run(steps["abort"])
        lost_command = written[lost["current_invocation_id"]]
        replay = store.complete_invocation(lost_command)
        note(f"replaying the lost completion the gateway wrote is {replay['status']!r}: "
             f"completion_digest {replay['completion_digest'][:16]}...")  # fmt: skip
        resolved = store.resolve_invocation(
            resolution_command(
                invocation_id=lost["current_invocation_id"],
                completion_digest=replay["completion_digest"],
                decision=Decision.RETRY,
                user_id="carol",
                expected_step_run_version=lost["version"],
                reason="the provider's logs show the request never ran",
            )
        )
        say(
            "carol resolves the lost call: retry (lost -> ready, old result cleared)",
            {k: resolved["resolution"][k] for k in ("decision", "user_id", "to_status",
                                                     "step_run_version", "command_digest")},
        )  # fmt: skip
        show_step(store, steps["abort"])
        version = resolved["resolution"]["step_run_version"]
        retried = await gateway.invoke(call("abort", "second attempt", 10.0, version=version))
        say(f"a new invocation on the same step succeeds: attempt {retried.start['attempt']}")
        show_step(store, steps["abort"])

    summary = store.usage_summary(PROJECT)
    say("usage summary (unknown cost counted apart, never as 0)", summary)
    say("outbox backlog", store.outbox_backlog())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ql3-demo", description=__doc__)
    parser.add_argument("--dsn", help="run on this PostgreSQL database instead of SQLite")
    parser.add_argument("--redis-url", help="Redis for the PostgreSQL relay (with --dsn)")
    parser.add_argument("--sqlite", type=Path, help="keep the SQLite file at this path")
    parser.add_argument("--journal-mode", choices=["wal", "delete"], default="wal")
    parser.add_argument("--verbose", action="store_true", help="show the components' logs")
    args = parser.parse_args(argv)
    if not args.verbose:
        logging.getLogger("ql3").setLevel(logging.ERROR)
    started = datetime.now().astimezone()
    with StubProvider(script=script) as stub:
        if args.dsn:
            with redis_for_demo(args.redis_url) as redis_url:
                asyncio.run(_run_postgres(args.dsn, redis_url, stub))
        else:
            with _sqlite_path(args.sqlite) as path:
                asyncio.run(_run_sqlite(path, args.journal_mode, stub))
    print(f"\ndemo finished ({(datetime.now().astimezone() - started).total_seconds():.1f} s)")
    return 0


async def _run_sqlite(path: Path, journal_mode: str, stub: StubProvider) -> None:
    async with sqlite_backend(path, journal_mode) as backend:
        await narrate(backend, stub)


async def _run_postgres(dsn: str, redis_url: str, stub: StubProvider) -> None:
    async with postgres_backend(dsn, redis_url) as backend:
        await narrate(backend, stub)


@contextlib.contextmanager
def _sqlite_path(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        yield keep
        return
    root = Path(tempfile.mkdtemp(prefix="ql3-demo-"))
    try:
        yield root / "ql3-demo.db"
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
