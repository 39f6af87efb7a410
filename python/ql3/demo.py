"""``make demo``: ql3's main job end to end, narrated step by step.

With no arguments everything runs on a temporary SQLite file through the edge shim
(``ql3.edge``), with no server at all: contract revisions are put and activated, the
outbox relay invalidates a worker's revision cache, model calls go through the gateway to
a stub provider (a success, a provider failure, a deadline, and a caller abort that becomes
``lost``), a human resolves the lost call, and the usage ledger is summed. The stub is an
OpenAI-compatible HTTP server on 127.0.0.1 behind the HTTP adapter when httpx is installed
(the ``gateway`` extra); on a bare ``pip install ql3`` it is an in-process provider with the
same behaviours, so the SQLite demo needs no extra at all.

``--dsn`` runs the same narrative on PostgreSQL through ``PgStore``, with the real outbox
relay and ``RevisionCache`` over Redis (``--redis-url``, else ``$QL3_REDIS_URL``, else a
throwaway ``redis-server``); it needs the server extras: ``pip install 'ql3[all]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

from ql3 import errors
from ql3.gateway import (
    ChatProvider,
    GatewayError,
    GatewayHooks,
    ModelCall,
    ModelGateway,
    ModelInvocationReplayBlocked,
    deadline_in,
)
from ql3.invocations import (
    Decision,
    Usage,
    admission_command,
    output_digest,
    request_digest,
    resolution_command,
)
from ql3.provider_types import (
    TOPOLOGY_CONTRACT,
    TOPOLOGY_FAMILY,
    TOPOLOGY_PROJECT,
    ProviderError,
    ProviderProtocolError,
    ProviderResponse,
    Route,
    StreamDelta,
    StreamEvent,
    Topology,
    encode_chat_request,
    topology_body,
)

if TYPE_CHECKING:
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
    where: list[str]
    """The ``ql3`` command's flags for this store: ``--sqlite PATH`` or ``--dsn DSN``."""


# -- the stub provider's behaviour, chosen by the last user message --------------------------------

Behaviour = Literal["answer", "fail", "slow"]
OVERLOADED: Final = {"error": {"message": "the model is overloaded"}}
HANG_SECONDS: Final = 30.0


def behaviour(doc: Mapping[str, Any] | None) -> tuple[Behaviour, str]:
    """What the stub does with a request, and the text of its last message."""
    messages = (doc or {}).get("messages") or [{}]
    text = str(messages[-1].get("content", ""))
    if text.startswith("fail"):
        return "fail", text
    if text.startswith("slow"):
        return "slow", text
    return "answer", text


def reply(model: str, text: str) -> str:
    return f"(stub {model}) you said: {text}"


def script(exchange: StubExchange) -> None:
    action, text = behaviour(exchange.request.doc)
    if action == "fail":
        exchange.send_json(503, OVERLOADED)
    elif action == "slow":
        exchange.hang(HANG_SECONDS)
    else:
        exchange.send_completion(reply(exchange.request.model, text))


class StubSide(Protocol):
    """The demo's model provider: where the topology points, and what it has received."""

    base_url: str
    description: str | None
    """One narrated line saying what the provider is, or None (the HTTP stub, as ever)."""

    @property
    def calls(self) -> int: ...

    def wait_for_calls(self, count: int, timeout: float = 10.0) -> bool: ...

    def adapter(self, cache: Cache) -> ChatProvider:
        """The ``ChatProvider`` the gateway calls, reading the topology from ``cache``."""
        ...


class HttpStub:
    """The stub HTTP server (``ql3.stub_provider``) behind the HTTP adapter: needs httpx."""

    description: str | None = None

    def __init__(self, stub: StubProvider) -> None:
        self.stub = stub
        self.base_url = stub.base_url

    @property
    def calls(self) -> int:
        return self.stub.calls

    def wait_for_calls(self, count: int, timeout: float = 10.0) -> bool:
        return self.stub.wait_for_calls(count, timeout)

    def adapter(self, cache: Cache) -> ChatProvider:
        from ql3.providers import OpenAICompatibleProvider

        return OpenAICompatibleProvider(cache)


class InProcessProvider:
    """A ``ChatProvider`` in this process with the HTTP stub's behaviours, for an install
    without httpx: an answer with usage, a definite HTTP 503, and a request that hangs
    (past a deadline, or until the caller gives up). It routes by the topology contract
    like the HTTP adapter (its endpoint's URL is never dialled) and digests the JSON
    document it answers with, so the receipts have the same shape."""

    base_url = "http://in-process.invalid/v1"

    def __init__(self, why: str) -> None:
        self.description: str | None = (
            f"provider: an in-process stand-in for the stub HTTP server ({why})"
        )
        self._cache: Cache | None = None
        self._requests = 0
        self._lock = threading.Condition()

    @property
    def calls(self) -> int:
        with self._lock:
            return self._requests

    def wait_for_calls(self, count: int, timeout: float = 10.0) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self._requests >= count, timeout)

    def adapter(self, cache: Cache) -> ChatProvider:
        self._cache = cache
        return self

    async def route(self, model: str, endpoint: str | None = None) -> Route:
        assert self._cache is not None, "adapter(cache) first"
        revision = await self._cache.get_effective(
            TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT
        )
        topology = Topology.from_body(revision.body, revision_id=str(revision.revision_id))
        chosen = topology.endpoint_for(model, endpoint)
        return Route(
            provider=chosen.name,
            model=model,
            url=chosen.chat_url,
            topology_revision_id=topology.revision_id,
        )

    @staticmethod
    def encode_request(
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: bool,
        options: Mapping[str, Any] | None = None,
    ) -> bytes:
        return encode_chat_request(model, messages, stream=stream, options=options)

    async def _answer(self, route: Route, body: bytes) -> ProviderResponse:
        doc = json.loads(body)
        with self._lock:
            self._requests += 1
            self._lock.notify_all()
        action, text = behaviour(doc)
        if action == "fail":
            raw = json.dumps(OVERLOADED).encode()
            raise ProviderError(503, raw, output_bytes=len(raw), output_digest=output_digest(raw))
        if action == "slow":
            await asyncio.sleep(HANG_SECONDS)
            raise ProviderProtocolError("the stand-in hung up without an answer")
        answer = reply(route.model, text)
        prompt = sum(len(str(m.get("content", "")).split()) for m in doc["messages"])
        document = {
            "object": "chat.completion",
            "model": route.model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": answer},
                 "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": prompt, "completion_tokens": len(answer.split())},
        }  # fmt: skip
        raw = json.dumps(document).encode()
        return ProviderResponse(
            text=answer,
            finish_reason="stop",
            usage=Usage(input_tokens=prompt, output_tokens=len(answer.split())),
            output_bytes=len(raw),
            output_digest=output_digest(raw),
        )

    async def complete(self, route: Route, body: bytes) -> ProviderResponse:
        return await self._answer(route, body)

    async def stream(self, route: Route, body: bytes) -> AsyncIterator[StreamEvent]:
        response = await self._answer(route, body)
        for word in response.text.split(" "):
            yield StreamDelta(word + " ")
        yield response

    async def aclose(self) -> None:
        pass


def httpx_installed() -> bool:
    return importlib.util.find_spec("httpx") is not None


@contextlib.contextmanager
def provider_for_demo(kind: str) -> Iterator[StubSide]:
    """The HTTP stub when httpx is installed (``kind`` "auto" or "http"), else in process."""
    if kind == "in-process":
        yield InProcessProvider("--provider in-process")
        return
    if kind == "auto" and not httpx_installed():
        yield InProcessProvider(
            "httpx is not installed; pip install 'ql3[gateway]' for the HTTP adapter"
        )
        return
    from ql3.stub_provider import StubProvider

    with StubProvider(script=script) as stub:
        yield HttpStub(stub)


SERVER_MODULES: Final = ("psycopg", "psycopg_pool", "redis", "prometheus_client")


def missing_server_modules() -> list[str]:
    """What ``--dsn`` needs that this install lacks (the server extras)."""
    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


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
        yield Backend(
            f"SQLite ({journal_mode}) {path}", store, cache, applied, ["--sqlite", str(path)]
        )
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
        yield Backend(name, store, cache, applied, ["--dsn", dsn])
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


async def narrate(backend: Backend, stub: StubSide) -> None:
    store, cache = backend.store, backend.cache
    say(f"store: {backend.name}")
    note(f"migrations applied: {', '.join(backend.migrations) or 'none (already up to date)'}")
    if stub.description:
        note(stub.description)

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
    provider = stub.adapter(cache)
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

    await operate_from_the_command_line(backend, run_id)

    summary = store.usage_summary(PROJECT)
    say("usage summary (unknown cost counted apart, never as 0)", summary)
    say("outbox backlog", store.outbox_backlog())


def ql3_command(where: list[str], *argv: str) -> int:
    """Run one ``ql3`` command in process, shown first as a user would type it (a DSN as
    ``$QL3_DSN``, which may hold a password)."""
    from ql3 import cli

    flags = ["--dsn", "$QL3_DSN"] if where[0] == "--dsn" else where
    shown = shlex.join(["ql3", *argv, *flags]).replace("'$QL3_DSN'", "$QL3_DSN")
    print(f"\n   $ {shown}", flush=True)
    return cli.main([*argv, *where])


async def operate_from_the_command_line(backend: Backend, run_id: str) -> None:
    """A worker that crashes after admission leaves a Start receipt and nothing else: once
    its deadline has passed, ``ql3 recover`` settles it as lost, ``ql3 invocations list
    --unresolved`` shows it waiting for a human, and ``ql3 resolve`` decides it."""
    try:
        from ql3 import cli, recovery  # noqa: F401  (what the ql3 command needs)
    except ModuleNotFoundError as exc:
        say(f"the ql3 command needs {exc.name}: pip install 'ql3[relay]' to run it here")
        return
    store = backend.store
    step = store.add_step_run(run_id, "model")
    crashed = f"inv-crashed-{step[:8]}"
    store.admit_invocation(
        admission_command(
            invocation_id=crashed, request_id=f"req-{crashed}", project_id=PROJECT,
            run_id=run_id, step_run_id=step, trace_id=TRACE, expected_step_run_version=1,
            provider="stub", model=QWEN, policy=None, request_digest=request_digest(b"hi"),
            input_bytes=2, deadline_at=deadline_in(0.5),
        )
    )  # fmt: skip
    say(f"a worker admits {crashed} and crashes before the call completes: a Start receipt "
        "and nothing else")  # fmt: skip
    show_step(store, step)
    await asyncio.sleep(0.6)
    note("its deadline has passed; an operator settles, finds and resolves it from the shell:")
    where = backend.where
    for argv in (
        ("recover", "--grace", "0"),
        ("invocations", "list", "--unresolved"),
        ("resolve", crashed, "--decision", "fail", "--user", "carol",
         "--reason", "the worker crashed; the user was told to retry"),
    ):  # fmt: skip
        code = await asyncio.to_thread(ql3_command, where, *argv)
        if code != 0:
            raise RuntimeError(f"ql3 {argv[0]} exited {code}")
    show_step(store, step)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ql3-demo", description=__doc__)
    parser.add_argument("--dsn", help="run on this PostgreSQL database instead of SQLite")
    parser.add_argument("--redis-url", help="Redis for the PostgreSQL relay (with --dsn)")
    parser.add_argument("--sqlite", type=Path, help="keep the SQLite file at this path")
    parser.add_argument("--journal-mode", choices=["wal", "delete"], default="wal")
    parser.add_argument(
        "--provider",
        choices=["auto", "http", "in-process"],
        default="auto",
        help="the stub provider: an HTTP server behind the HTTP adapter (needs httpx), an "
        "in-process stand-in, or auto (HTTP when httpx is installed)",
    )
    parser.add_argument("--verbose", action="store_true", help="show the components' logs")
    args = parser.parse_args(argv)
    if args.dsn and (missing := missing_server_modules()):
        print(
            f"error: ql3 demo --dsn runs on PostgreSQL and Redis and needs the server extras "
            f"({', '.join(missing)} not installed): pip install 'ql3[all]'",
            file=sys.stderr,
        )
        return 2
    if args.provider == "http" and not httpx_installed():
        print(
            "error: ql3 demo --provider http needs httpx: pip install 'ql3[gateway]'",
            file=sys.stderr,
        )
        return 2
    if not args.verbose:
        logging.getLogger("ql3").setLevel(logging.ERROR)
    started = datetime.now().astimezone()
    with provider_for_demo(args.provider) as stub:
        if args.dsn:
            with redis_for_demo(args.redis_url) as redis_url:
                asyncio.run(_run_postgres(args.dsn, redis_url, stub))
        else:
            with _sqlite_path(args.sqlite) as path:
                asyncio.run(_run_sqlite(path, args.journal_mode, stub))
    print(f"\ndemo finished ({(datetime.now().astimezone() - started).total_seconds():.1f} s)")
    return 0


async def _run_sqlite(path: Path, journal_mode: str, stub: StubSide) -> None:
    async with sqlite_backend(path, journal_mode) as backend:
        await narrate(backend, stub)


async def _run_postgres(dsn: str, redis_url: str, stub: StubSide) -> None:
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
