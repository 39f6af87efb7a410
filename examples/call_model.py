"""Call a model through the ql3 gateway, against a stub provider started in-process.

    QL3_DSN=postgresql://postgres@localhost/app QL3_REDIS_URL=redis://localhost:6379/0 \\
        .venv/bin/python examples/call_model.py

``QL3_DSN`` names a database migrated with ``ql3 migrate --with-ai``, as a role that may
put and activate revisions, create runs and admit invocations (a superuser, or a login
role in both ``ql3_operator`` and ``ql3_runtime``): the script first does once what an
operator would, then calls the model as a worker. ``QL3_REDIS_URL`` (default
``redis://127.0.0.1:6379/0``) is where the revision cache subscribes for invalidations.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from ql3.cache import RevisionCache
from ql3.gateway import ModelCall, ModelGateway, ModelInvocationReplayBlocked, deadline_in
from ql3.providers import (
    TOPOLOGY_CONTRACT,
    TOPOLOGY_FAMILY,
    TOPOLOGY_PROJECT,
    OpenAICompatibleProvider,
    topology_body,
)
from ql3.store import PgStore
from ql3.stub_provider import StubProvider

PROJECT = "example"
POLICY = "support-bot"
MODEL = "qwen2.5:7b"


def set_up_contracts(store: PgStore, base_url: str) -> None:
    """The operator's part: where models run (topology) and which one to use (policy)."""
    topology = topology_body([("local-stub", base_url, [MODEL])])
    rev = store.put_revision(TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, topology, "ex")
    store.activate_revision(
        TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, rev["revision_id"], "ex"
    )
    policy = {"routes": [{"model": MODEL, "weight": 1}]}
    rev = store.put_revision(PROJECT, "policy_routing", POLICY, policy, "ex")
    store.activate_revision(PROJECT, "policy_routing", POLICY, rev["revision_id"], "ex")


def new_call(store: PgStore, run_id: str, prompt: str) -> ModelCall:
    """A call on a new model step of the run, due within 10 seconds."""
    return ModelCall(
        project_id=PROJECT,
        run_id=run_id,
        step_run_id=store.add_step_run(run_id, "model"),
        trace_id="trace-example",
        policy_id=POLICY,
        messages=[{"role": "user", "content": prompt}],
        deadline_at=deadline_in(10),
    )


async def call_model(gateway: ModelGateway, store: PgStore, run_id: str) -> None:
    # 1. One call: admission, provider call, completion with usage.
    call = new_call(store, run_id, "Say hello.")
    result = await gateway.invoke(call)
    print(f"answer:   {result.text}")
    print(f"usage:    {result.usage}")
    print(f"outcome:  {result.completion['outcome']} (completion {result.completion_digest[:16]})")

    # 2. The same call again is a replay: blocked, the provider is not called again.
    try:
        await gateway.invoke(call)
    except ModelInvocationReplayBlocked as exc:
        print(f"replay:   {exc.code}")

    # 3. Streaming, on another step of the same run.
    print("stream:   ", end="")
    async with gateway.stream(new_call(store, run_id, "Say hello, slowly.")) as pieces:
        async for piece in pieces:
            print(piece, end="", flush=True)
    assert pieces.result is not None
    print(f"\nstreamed: {pieces.result.completion['outcome']}, {pieces.result.usage}")


async def main() -> int:
    dsn = os.environ.get("QL3_DSN")
    if not dsn:
        print("set QL3_DSN to a database migrated with --with-ai", file=sys.stderr)
        return 2
    redis_url = os.environ.get("QL3_REDIS_URL", "redis://127.0.0.1:6379/0")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    # No relay runs here, so the cache has no heartbeats and verifies every read against
    # the database ("degraded" mode): expected, not worth a warning in this example.
    logging.getLogger("ql3.cache").setLevel(logging.ERROR)
    with StubProvider() as stub, PgStore(dsn) as store:
        await asyncio.to_thread(set_up_contracts, store, stub.base_url)
        run_id = await asyncio.to_thread(store.create_run, PROJECT, "trace-example")
        async with (
            RevisionCache(dsn, redis_url) as cache,
            ModelGateway(store, cache, OpenAICompatibleProvider(cache)) as gateway,
        ):
            await call_model(gateway, store, run_id)
        print(f"provider calls: {stub.calls}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
