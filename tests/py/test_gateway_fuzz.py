"""Random calls through the gateway (SPEC section 9): every call ends as a result, a
gateway error or a ``ql3.errors`` refusal, never a raw exception or a hang; a refusal of
the call itself writes nothing and calls no provider; no start is left without its
completion.

Each example changes up to three fields of a valid ``ModelCall`` (messages and options of
any shape, deadlines naive, past or far, unknown models and policies, identifiers near
their limits or of the wrong type) on a fresh step, through ``invoke`` or ``stream``,
over both store kinds of ``test_gateway``. ``QL3_FUZZ_EXAMPLES=N`` runs more, with a
random seed.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fix_provider import MODEL, provider  # noqa: F401  (provider is a fixture)
from ql3 import errors
from ql3.gateway import GATEWAY_ERRORS, ModelCall
from ql3.store import PgStore
from test_gateway import World, harness
from test_gateway import world as world  # a fixture

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(["", "a" * 129, "\ud800", "\x00", "user", "system", "assistant", MODEL]),
)
anything = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
messages = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x", ""]) | leaves,
                           "content": st.text(max_size=30) | anything}),
    st.dictionaries(st.sampled_from(["role", "content", "name", "extra"]), anything, max_size=4),
    anything,
)  # fmt: skip
option_names = st.sampled_from(["temperature", "max_tokens", "model", "messages", "stream", "x"])
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.one_of(st.lists(messages, max_size=3), anything),
    "options": st.one_of(
        st.none(),
        st.dictionaries(option_names | st.text(max_size=5), anything, max_size=3),
        anything,
    ),
    "deadline_at": st.one_of(
        st.sampled_from(["naive", "past", "far", "year 9999", "min"]), anything
    ),
    "model": st.one_of(st.none(), st.just(MODEL), leaves),
    "policy_id": st.one_of(st.just("support-bot"), leaves),
    "invocation_id": st.one_of(leaves, st.text(min_size=1, max_size=130)),
    "request_id": st.one_of(st.none(), leaves),
    "trace_id": leaves,
    "project_id": leaves,
    "expected_step_run_version": st.one_of(st.integers(-2, 3), leaves),
}
changes = st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: FIELDS[name] for name in names})
)


def _deadline(value: Any) -> Any:
    now = datetime.now(UTC)
    named = {
        "naive": datetime.now() + timedelta(seconds=30),
        "past": now - timedelta(seconds=1),
        "far": now + timedelta(days=3650),
        "year 9999": datetime(9999, 12, 31, tzinfo=UTC),
        "min": datetime.min,
    }
    return named.get(value, value) if isinstance(value, str) else value


async def _outcome(world: World, gateway: Any, call: ModelCall, streaming: bool) -> tuple[str, Any]:
    async def consume() -> list[str]:
        async with gateway.stream(call) as chunks:
            return [piece async for piece in chunks]

    try:
        if streaming:
            return "ok", await asyncio.wait_for(consume(), 20)
        return "ok", await asyncio.wait_for(gateway.invoke(call), 20)
    except GATEWAY_ERRORS as exc:
        return "gateway", exc
    except errors.Ql3Error as exc:
        return "refused", exc
    except TimeoutError as exc:
        return "hung", exc
    except Exception as exc:  # a raw exception is the gateway letting bad input through
        return "raw", exc


@pytest.mark.parametrize("world", ["threads", "asyncio"], indirect=True)
def test_every_call_ends_cleanly_and_a_refused_call_does_nothing(world: World) -> None:
    runner = asyncio.Runner()
    opened = harness(world)
    h = runner.run(opened.__aenter__())
    try:
        # One valid call first, and every blocking pool at its size: psycopg_pool draws
        # from the global random state when it opens a connection (jitter), and a pool
        # thread doing so while hypothesis draws an example looks like a strategy using
        # random (FlakyStrategyDefinition).
        runner.run(h.gateway.invoke(replace(world.call(), step_run_id=world.new_step())))
        world.ops.pool.wait()
        store = getattr(h.gateway, "_store", None)
        if isinstance(store, PgStore):
            store.pool.wait()

        @settings(
            max_examples=int(os.environ.get("QL3_FUZZ_EXAMPLES", "150")),
            deadline=None,
            derandomize="QL3_FUZZ_EXAMPLES" not in os.environ,
            suppress_health_check=list(HealthCheck),
        )
        @given(changed=changes, streaming=st.booleans())
        def one(changed: dict[str, Any], streaming: bool) -> None:
            if "deadline_at" in changed:
                changed["deadline_at"] = _deadline(changed["deadline_at"])
            call = replace(world.call(), step_run_id=world.new_step(), **changed)
            starts, calls = world.starts(), world.provider.calls
            kind, value = runner.run(_outcome(world, h.gateway, call, streaming))
            assert kind not in ("raw", "hung"), (kind, value, changed)
            if kind == "refused":
                assert (world.starts(), world.provider.calls) == (starts, calls), (value, changed)
            assert world.unsettled_starts() == 0, (kind, value, changed)

        one()
    finally:
        runner.run(opened.__aexit__(None, None, None))
        runner.close()


@pytest.mark.parametrize(
    "changed",
    [
        {"messages": 0.0},
        {"messages": "hello"},
        {"options": [True]},
        {"options": 1.5},
        {"messages": [{"role": "user", "content": "lone \ud800 surrogate"}]},
    ],
)
@pytest.mark.parametrize("world", ["asyncio"], indirect=True)
def test_malformed_messages_and_options_are_invalid_argument(
    world: World, changed: dict[str, Any]
) -> None:
    async def scenario() -> None:
        async with harness(world) as h:
            with pytest.raises(errors.InvalidArgument):
                await h.gateway.invoke(replace(world.call(), **changed))
        assert world.starts() == 0 and world.provider.calls == 0

    asyncio.run(asyncio.wait_for(scenario(), 30))
