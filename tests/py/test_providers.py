"""The OpenAI-compatible adapter and the gateway's policy routing, without a database:
topology and policy bodies, the exact request bytes, SSE parsing, and how much each
provider failure tells (definite, never sent, or unknown)."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from ql3 import errors
from ql3.devservers import free_port
from ql3.gateway import (
    ModelAuditUnavailable,
    ModelCall,
    ModelDeadlineExceeded,
    ModelGateway,
    ModelProviderFailed,
    PolicyRoute,
    choose_route,
    deadline_in,
    policy_routes,
)
from ql3.invocations import format_uuid, output_digest
from ql3.providers import (
    OpenAICompatibleProvider,
    ProviderError,
    ProviderProtocolError,
    ProviderResponse,
    ProviderUnreachable,
    Route,
    StreamDelta,
    StreamEvent,
    Topology,
    topology_body,
)
from ql3.stub_provider import StubRequest, completion_document, instant_transport, sse_events


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 10))


@dataclass(frozen=True)
class Revision:
    project_id: str
    contract_family: str
    contract_id: str
    revision_id: str
    revision_no: int
    body: dict[str, Any]


class Source:
    """An in-memory topology source: what the revision cache serves, set by the test."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.revision = Revision(
            "__platform__", "platform_resource", "ollama_topology", "rev-1", 1, body
        )
        self.callbacks: list[Callable[[Any], Awaitable[None] | None]] = []

    async def get_effective(self, project_id: str, family: str, contract_id: str) -> Revision:
        return self.revision

    def on_change(
        self, family: str, contract_id: str, fn: Callable[[Any], Awaitable[None] | None]
    ) -> None:
        self.callbacks.append(fn)


TOPOLOGY = topology_body(
    [("a", "http://127.0.0.1:1/v1", ["m1"]), ("b", "http://h:2/v1", ["m1", "m2"])]
)
ROUTE = Route(
    provider="a", model="m1", url="http://stub/v1/chat/completions", topology_revision_id="rev-1"
)


def adapter_with(handler: Callable[[httpx.Request], httpx.Response]) -> OpenAICompatibleProvider:
    return OpenAICompatibleProvider(
        Source(TOPOLOGY), transport_factory=lambda: httpx.MockTransport(handler)
    )


def sse_response(chunks: list[bytes]) -> Callable[[httpx.Request], httpx.Response]:
    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return handler


async def collect(adapter: OpenAICompatibleProvider) -> list[StreamEvent]:
    return [event async for event in adapter.stream(ROUTE, b"{}")]


# -- topology -------------------------------------------------------------------------------


def test_topology_routes_a_model_to_the_first_endpoint_serving_it_or_the_named_one() -> None:
    topology = Topology.from_body(TOPOLOGY, revision_id="rev-1")
    assert topology.endpoint_for("m1").name == "a"
    assert topology.endpoint_for("m1", "b").name == "b"
    assert topology.endpoint_for("m2").chat_url == "http://h:2/v1/chat/completions"
    with pytest.raises(errors.NotFound):
        topology.endpoint_for("m3")
    with pytest.raises(errors.NotFound):
        topology.endpoint_for("m2", "a")


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"endpoints": []},
        {"endpoints": [{"name": "a", "base_url": "http://x/v1", "models": ["m"]}], "extra": 1},
        {"endpoints": [{"name": "a", "base_url": "http://x/v1", "models": ["m"], "key": "s"}]},
        {"endpoints": [{"name": "a", "base_url": "ftp://x/v1", "models": ["m"]}]},
        {"endpoints": [{"name": "", "base_url": "http://x/v1", "models": ["m"]}]},
        {"endpoints": [{"name": "a", "base_url": "http://x/v1", "models": []}]},
        topology_body([("a", "http://x/v1", ["m"]), ("a", "http://y/v1", ["m"])]),
    ],
)
def test_topology_bodies_that_could_route_nowhere_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(errors.InvalidArgument):
        Topology.from_body(body, revision_id="rev-1")


# -- policy routing ---------------------------------------------------------------------------


def policy(body: dict[str, Any]) -> Revision:
    return Revision("acme", "policy_routing", "bot", "rev-p", 3, body)


def test_policy_route_is_the_named_model_or_a_weighted_draw_stable_per_invocation() -> None:
    routes = policy_routes(policy({"routes": [{"model": "m1", "weight": 3}, {"model": "m2"}]}))
    assert routes == (
        PolicyRoute(model="m1", weight=3, endpoint=None),
        PolicyRoute(model="m2", weight=1, endpoint=None),
    )
    assert choose_route(routes, "any", "m2").model == "m2"
    draws = [choose_route(routes, f"inv-{i}", None).model for i in range(2000)]
    assert draws == [choose_route(routes, f"inv-{i}", None).model for i in range(2000)]
    assert 0.7 < draws.count("m1") / len(draws) < 0.8
    with pytest.raises(errors.InvalidArgument):
        choose_route(routes, "any", "m3")


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"routes": []},
        {"routes": [{"weight": 1}]},
        {"routes": [{"model": "m", "weight": 0}]},
        {"routes": [{"model": "m", "weight": True}]},
        {"routes": [{"model": "m", "endpoint": 1}]},
    ],
)
def test_policy_without_usable_routes_is_invalid(body: dict[str, Any]) -> None:
    with pytest.raises(errors.InvalidArgument):
        policy_routes(policy(body))


# -- requests ---------------------------------------------------------------------------------


def test_request_body_is_compact_json_and_asks_streams_for_usage() -> None:
    messages = [{"role": "user", "content": "héllo"}]
    plain = OpenAICompatibleProvider.encode_request("m1", messages, stream=False)
    expected = '{"model":"m1","messages":[{"role":"user","content":"héllo"}],"stream":false}'
    assert plain == expected.encode()
    streamed = json.loads(
        OpenAICompatibleProvider.encode_request("m1", messages, stream=True, options={"seed": 1})
    )
    assert streamed["stream_options"] == {"include_usage": True}
    assert streamed["seed"] == 1
    with pytest.raises(errors.InvalidArgument):
        OpenAICompatibleProvider.encode_request(
            "m1", messages, stream=False, options={"model": "x"}
        )
    with pytest.raises(errors.InvalidArgument):
        OpenAICompatibleProvider.encode_request("m1", "hello", stream=False)  # type: ignore[arg-type]


# -- answers ----------------------------------------------------------------------------------


def test_completion_usage_comes_from_the_response_and_the_digest_covers_its_bytes() -> None:
    async def scenario() -> None:
        adapter = OpenAICompatibleProvider(Source(TOPOLOGY), transport_factory=instant_transport)
        body = adapter.encode_request("m1", [{"role": "user", "content": "a b c"}], stream=False)
        response = await adapter.complete(ROUTE, body)
        await adapter.aclose()
        assert response.text.startswith("Hello")
        assert response.usage is not None and response.usage.input_tokens == 3
        assert response.output_bytes > 0 and len(response.output_digest) == 64

    run(scenario())


def test_routes_are_built_once_per_topology_revision() -> None:
    async def scenario() -> None:
        source = Source(TOPOLOGY)
        adapter = OpenAICompatibleProvider(source, transport_factory=instant_transport)
        first = await adapter.route("m1")
        assert (first.provider, first.topology_revision_id) == ("a", "rev-1")
        assert await adapter.route("m1") is first
        assert (await adapter.route("m1", "b")).provider == "b"
        for _ in range(2):  # an unknown model is refused every time, never kept
            with pytest.raises(errors.NotFound):
                await adapter.route("m3")
        source.revision = Revision(
            "__platform__", "platform_resource", "ollama_topology", "rev-2", 2,
            topology_body([("c", "http://c:3/v1", ["m1"])]),
        )  # fmt: skip
        moved = await adapter.route("m1")
        assert (moved.provider, moved.url, moved.topology_revision_id) == (
            "c", "http://c:3/v1/chat/completions", "rev-2",
        )  # fmt: skip
        with pytest.raises(errors.NotFound):
            await adapter.route("m1", "b")  # endpoint b is gone with revision 1
        await adapter.aclose()

    run(scenario())


def test_the_instant_provider_answers_every_body_as_the_stub_server_would() -> None:
    """It keeps its encoded answers (the benchmark's provider must cost the gateway's loop
    nothing): a repeated body gets the same answer, every new body its own, past the
    number of answers it keeps, streamed or not."""

    async def scenario() -> None:
        adapter = OpenAICompatibleProvider(Source(TOPOLOGY), transport_factory=instant_transport)
        for i in [*range(300), 0, 299]:
            words = " ".join(["w"] * (i + 1))
            body = adapter.encode_request("m1", [{"role": "user", "content": words}], stream=False)
            response = await adapter.complete(ROUTE, body)
            assert response.usage is not None and response.usage.input_tokens == i + 1
            assert response.text.startswith("Hello")
        streamed = adapter.encode_request("m1", [{"role": "user", "content": "a b"}], stream=True)
        events = [event async for event in adapter.stream(ROUTE, streamed)]
        final = events[-1]
        assert isinstance(final, ProviderResponse) and final.usage is not None
        assert final.usage.input_tokens == 2
        assert "".join(e.text for e in events if isinstance(e, StreamDelta)) == final.text
        await adapter.aclose()

    run(scenario())


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"prompt_tokens": 3, "completion_tokens": 5}, (3, 5)),
        ({"prompt_tokens": 3}, (3, None)),  # what is not reported stays unknown, never 0
        ({"completion_tokens": 0}, (None, 0)),
        ({"prompt_tokens": True, "completion_tokens": 5}, (None, 5)),  # a bool is no count
        ({"prompt_tokens": -1, "completion_tokens": 2.0}, None),
        ({"prompt_tokens": 2**53, "completion_tokens": "7"}, None),  # beyond 2^53-1
        ({"prompt_tokens": 2**53 - 1}, (2**53 - 1, None)),
        ({}, None),
        ([3, 5], None),
        (None, None),
    ],
)
def test_usage_keeps_only_the_counts_the_provider_reported(
    usage: object, expected: tuple[int | None, int | None] | None
) -> None:
    document = {
        "choices": [{"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
        "usage": usage,
    }

    async def scenario() -> None:
        adapter = adapter_with(lambda request: httpx.Response(200, json=document))
        response = await adapter.complete(ROUTE, b"{}")
        await adapter.aclose()
        got = response.usage
        assert (None if got is None else (got.input_tokens, got.output_tokens)) == expected

    run(scenario())


@pytest.mark.parametrize(
    ("status", "body", "raised"),
    [
        (400, b'{"error": "bad"}', ProviderError),
        (500, b'{"error": "boom"}', ProviderError),
        (400, b"", ProviderProtocolError),  # no answer to go by
        (502, b"<html>bad gateway</html>", ProviderProtocolError),  # the upstream may have run
        (504, b"<html>timeout</html>", ProviderProtocolError),
        (520, b"<html>unknown error</html>", ProviderProtocolError),  # Cloudflare: after sending
        (524, b"<html>a timeout occurred</html>", ProviderProtocolError),
        (522, b"<html>connection timed out</html>", ProviderError),  # never reached the origin
        (200, b"not json", ProviderProtocolError),
        (200, b'{"choices": []}', ProviderProtocolError),
    ],
)
def test_only_a_definite_error_answer_is_a_provider_error(
    status: int, body: bytes, raised: type[Exception]
) -> None:
    async def scenario() -> None:
        adapter = adapter_with(lambda request: httpx.Response(status, content=body))
        with pytest.raises(raised):
            await adapter.complete(ROUTE, b"{}")
        await adapter.aclose()

    run(scenario())


def test_a_refused_connection_is_unreachable_not_unknown() -> None:
    async def scenario() -> None:
        adapter = OpenAICompatibleProvider(Source(TOPOLOGY))
        url = f"http://127.0.0.1:{free_port()}/v1/chat/completions"
        route = Route(provider="a", model="m1", url=url, topology_revision_id="rev-1")
        with pytest.raises(ProviderUnreachable):
            await adapter.complete(route, b"{}")
        await adapter.aclose()

    run(scenario())


def sse_bytes() -> bytes:
    request = StubRequest(path="/v1/chat/completions", body=b"", doc={"model": "m1"})
    return b"".join(sse_events(request, ["Hel", "lo", " wörld"]))


def split_every(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 7, 64, 100000])
def test_sse_stream_is_parsed_across_any_chunk_boundaries(size: int) -> None:
    answer = sse_bytes()  # once: its id and created change from one call to the next

    async def scenario() -> None:
        adapter = adapter_with(sse_response(split_every(answer, size)))
        events = await collect(adapter)
        await adapter.aclose()
        assert [e.text for e in events if isinstance(e, StreamDelta)] == ["Hel", "lo", " wörld"]
        final = events[-1]
        assert isinstance(final, ProviderResponse)
        assert (final.text, final.finish_reason) == ("Hello wörld", "stop")
        assert final.usage is not None and final.usage.output_tokens == 2
        assert final.output_bytes == len(answer)

    run(scenario())


@pytest.mark.parametrize("size", [1, 5, 100000])
def test_a_stream_receipt_covers_the_body_up_to_done_however_it_was_chunked(size: int) -> None:
    """Bytes after the [DONE] event (a keep-alive, say) are not part of the answer, and
    the size and digest do not depend on where the chunks were cut."""
    answer = sse_bytes()
    assert answer.endswith(b"data: [DONE]\n\n")

    async def scenario() -> None:
        adapter = adapter_with(sse_response(split_every(answer + b": keep-alive\n\n", size)))
        final = (await collect(adapter))[-1]
        await adapter.aclose()
        assert isinstance(final, ProviderResponse)
        assert (final.output_bytes, final.output_digest) == (len(answer), output_digest(answer))

    run(scenario())


def test_sse_with_crlf_comments_and_multiline_data() -> None:
    chunk = {"choices": [{"delta": {"content": "x"}, "finish_reason": None}]}
    text = json.dumps(chunk, indent=1).replace("\n", "\r\ndata: ")
    raw = f": keep-alive\r\n\r\ndata: {text}\r\n\r\ndata: [DONE]\r\n\r\n".encode()

    async def scenario() -> None:
        adapter = adapter_with(sse_response([raw]))
        events = await collect(adapter)
        await adapter.aclose()
        assert events[0] == StreamDelta("x")
        assert isinstance(events[-1], ProviderResponse)

    run(scenario())


def test_sse_without_done_is_unknown_and_an_error_event_is_definite() -> None:
    truncated = sse_bytes().replace(b"data: [DONE]\n\n", b"")
    error = b'data: {"error": {"message": "model unloaded"}}\n\n'

    async def scenario() -> None:
        adapter = adapter_with(sse_response([truncated]))
        with pytest.raises(ProviderProtocolError):
            await collect(adapter)
        adapter = adapter_with(sse_response([error]))
        with pytest.raises(ProviderError) as caught:
            await collect(adapter)
        assert caught.value.status == 200
        await adapter.aclose()

    run(scenario())


# -- connections ------------------------------------------------------------------------------


def test_a_topology_change_retires_connections_after_the_calls_in_flight() -> None:
    transports: list[httpx.MockTransport] = []
    release = asyncio.Event()

    async def slow_answer(request: httpx.Request) -> httpx.Response:
        await release.wait()
        stub = StubRequest(path=request.url.path, body=b"", doc={"model": "m1"})
        return httpx.Response(200, json=completion_document(stub, "late but fine"))

    def factory() -> httpx.MockTransport:
        transports.append(httpx.MockTransport(slow_answer))
        return transports[-1]

    source = Source(TOPOLOGY)

    async def scenario() -> None:
        adapter = OpenAICompatibleProvider(source, transport_factory=factory)
        body = adapter.encode_request("m1", [], stream=False)
        in_flight = asyncio.create_task(adapter.complete(ROUTE, body))
        await asyncio.sleep(0.01)
        for callback in source.callbacks:
            callback(source.revision)  # what RevisionCache.on_change does on a new revision
        assert adapter.resets == 1
        release.set()
        assert (await in_flight).text  # finished on the retired client
        await adapter.complete(ROUTE, body)
        assert len(transports) == 2  # the next call opened new connections
        await adapter.aclose()

    run(scenario())


# -- what goes over the wire ------------------------------------------------------------------


def test_the_request_sent_is_what_the_http_client_would_send_and_no_cookie_is_kept() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        doc = completion_document(StubRequest(path="/", body=b"", doc={"model": "m1"}), "hi")
        return httpx.Response(200, json=doc, headers={"set-cookie": "session=abc; Path=/"})

    def factory() -> httpx.MockTransport:
        return httpx.MockTransport(handler)

    async def scenario() -> None:
        body = OpenAICompatibleProvider.encode_request(
            "m1", [{"role": "user", "content": "grüß dich"}], stream=False
        )
        direct = OpenAICompatibleProvider(Source(TOPOLOGY), transport_factory=factory)
        # trust_env (.netrc) sends through httpx.AsyncClient's own pipeline: the reference.
        client = OpenAICompatibleProvider(
            Source(TOPOLOGY), transport_factory=factory, trust_env=True
        )
        await direct.complete(ROUTE, body)
        await client.complete(ROUTE, body)
        await direct.complete(ROUTE, body)
        await direct.aclose()
        await client.aclose()

    run(scenario())
    mine, reference, again = seen
    assert mine.headers.raw == reference.headers.raw
    assert dict(mine.headers)["content-length"] == str(len(mine.content))
    assert mine.content == reference.content
    assert mine.extensions["timeout"] == reference.extensions["timeout"]
    assert "cookie" not in again.headers  # a provider's cookie never rides on the next call


def test_the_digest_covers_the_answer_as_decoded_whether_or_not_it_was_compressed() -> None:
    doc = completion_document(StubRequest(path="/", body=b"", doc={"model": "m1"}), "zipped")
    raw = json.dumps(doc).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), 7):
            yield raw[i : i + 7]

    def plain(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=pieces())

    def gzipped(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=gzip.compress(raw), headers={"content-encoding": "gzip"})

    async def scenario() -> None:
        for handler in (plain, gzipped):
            adapter = adapter_with(handler)
            response = await adapter.complete(ROUTE, b"{}")
            await adapter.aclose()
            assert response.text == "zipped"
            assert response.output_bytes == len(raw)
            assert response.output_digest == hashlib.sha256(raw).hexdigest()

    run(scenario())


# -- the gateway's store threads ------------------------------------------------------------------


class BlockingStore:
    """An InvocationStore whose admission waits for ``release`` (in the gateway's thread)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.admitting = threading.Event()
        self.completions: list[Mapping[str, Any]] = []
        self.threads: set[str] = set()

    def admit_invocation(self, command: Mapping[str, Any]) -> Mapping[str, Any]:
        self.threads.add(threading.current_thread().name)
        self.admitting.set()
        assert self.release.wait(10)
        start = {"invocation_id": command["invocation_id"], "admitted_at": "2000-01-01"}
        return {"status": "created", "start": start, "start_digest": "s" * 64}

    def complete_invocation(self, command: Mapping[str, Any]) -> Mapping[str, Any]:
        self.threads.add(threading.current_thread().name)
        self.completions.append(command)
        completion = {"outcome": command["outcome"], "result_code": command["result_code"]}
        return {"status": "created", "completion": completion, "completion_digest": "c" * 64}


class Policies(Source):
    def __init__(self) -> None:
        super().__init__(TOPOLOGY)
        self.policy = Revision(
            "acme",
            "policy_routing",
            "bot",
            "00000000-0000-4000-8000-000000000001",
            1,
            {"routes": [{"model": "m1"}]},
        )

    async def get_effective(self, project_id: str, family: str, contract_id: str) -> Revision:
        return self.policy if family == "policy_routing" else self.revision

    async def verify_all(self) -> None:
        pass


def a_call() -> ModelCall:
    return ModelCall(
        project_id="acme",
        run_id="00000000-0000-4000-8000-0000000000aa",
        step_run_id="00000000-0000-4000-8000-0000000000bb",
        trace_id="t",
        policy_id="bot",
        messages=[{"role": "user", "content": "hi"}],
        deadline_at=deadline_in(60),
    )


def test_an_admission_runs_to_its_end_through_repeated_cancellations_then_settles() -> None:
    store, policies = BlockingStore(), Policies()
    answer = instant_transport().handler
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        response = answer(request)
        assert isinstance(response, httpx.Response)
        return response

    async def scenario() -> None:
        provider = OpenAICompatibleProvider(
            policies, transport_factory=lambda: httpx.MockTransport(handler)
        )
        async with ModelGateway(store, policies, provider, store_threads=2) as gateway:
            task = asyncio.create_task(gateway.invoke(a_call()))
            assert await asyncio.to_thread(store.admitting.wait, 10)
            for _ in range(3):
                task.cancel()
                await asyncio.sleep(0.01)
                assert not task.done()  # still waiting for the database's answer
            store.release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert [(c["outcome"], c["result_code"]) for c in store.completions] == [
                ("failed", "cancelled_before_call")
            ]
            assert calls == []  # no provider I/O for a call cancelled during admission
            result = await gateway.invoke(a_call())  # the gateway goes on working
            assert result.completion["outcome"] == "succeeded"
            assert len(calls) == 1
        assert store.threads and all(t.startswith("ql3-gateway-store") for t in store.threads)

    run(scenario())


def test_a_gateway_needs_at_least_one_store_thread() -> None:
    policies = Policies()
    provider = OpenAICompatibleProvider(policies, transport_factory=instant_transport)
    with pytest.raises(ValueError, match="store_threads"):
        ModelGateway(BlockingStore(), policies, provider, store_threads=0)


def test_uuids_in_commands_have_one_spelling_however_they_are_given() -> None:
    canonical = "0a1b2c3d-0000-4000-8000-00000000abcd"
    for given in (canonical, canonical.upper(), "{" + canonical + "}", canonical.replace("-", "")):
        assert format_uuid(given) == canonical
    assert format_uuid(uuid.UUID(canonical)) == canonical
    for wrong in ("0a1b2c3d-0000-4000-8000-00000000abc", canonical + "\n", "", "x" * 36):
        with pytest.raises(errors.InvalidArgument):
            format_uuid(wrong)


# -- gateway error paths, without a database -----------------------------------------------------


class InstantStore:
    """An InvocationStore that admits at once (or raises ``admit_error``) and records calls."""

    def __init__(self, admit_error: Exception | None = None) -> None:
        self.admit_error = admit_error
        self.admissions: list[Mapping[str, Any]] = []
        self.completions: list[Mapping[str, Any]] = []

    def admit_invocation(self, command: Mapping[str, Any]) -> Mapping[str, Any]:
        self.admissions.append(command)
        if self.admit_error is not None:
            raise self.admit_error
        start = {"invocation_id": command["invocation_id"], "admitted_at": "2000-01-01"}
        return {"status": "created", "start": start, "start_digest": "s" * 64}

    def complete_invocation(self, command: Mapping[str, Any]) -> Mapping[str, Any]:
        self.completions.append(command)
        completion = {"outcome": command["outcome"], "result_code": command["result_code"]}
        return {"status": "created", "completion": completion, "completion_digest": "c" * 64}


def gateway_with(
    store: InstantStore, handler: Callable[[httpx.Request], httpx.Response]
) -> ModelGateway:
    policies = Policies()
    provider = OpenAICompatibleProvider(
        policies, transport_factory=lambda: httpx.MockTransport(handler)
    )
    return ModelGateway(store, policies, provider, store_threads=1)


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_an_unreachable_provider_is_a_failed_call_with_no_status() -> None:
    store = InstantStore()

    async def scenario() -> None:
        async with gateway_with(store, refuse) as gateway:
            with pytest.raises(ModelProviderFailed) as raised:
                await gateway.invoke(a_call())
        assert raised.value.status is None
        assert [(c["outcome"], c["result_code"]) for c in store.completions] == [
            ("failed", "provider_unreachable")
        ]

    run(scenario())


def test_a_deadline_already_past_admits_nothing_and_calls_no_provider() -> None:
    store, calls = InstantStore(), []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(500)

    async def scenario() -> None:
        call = a_call()
        late = ModelCall(
            **{**call.__dict__, "deadline_at": datetime.now(UTC) - timedelta(seconds=1)}
        )
        async with gateway_with(store, handler) as gateway:
            with pytest.raises(ModelDeadlineExceeded, match="nothing was admitted"):
                await gateway.invoke(late)
        assert (store.admissions, store.completions, calls) == ([], [], [])

    run(scenario())


def test_a_policy_stale_twice_is_audit_unavailable_with_no_provider_call() -> None:
    store, calls = InstantStore(errors.StaleRevision("QL3_STALE_REVISION: moved")), []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(500)

    async def scenario() -> None:
        async with gateway_with(store, handler) as gateway:
            with pytest.raises(ModelAuditUnavailable):
                await gateway.invoke(a_call())
        assert len(store.admissions) == 2  # the policy was reloaded and admitted once more
        assert (store.completions, calls) == ([], [])

    run(scenario())


def test_a_stream_answered_with_an_http_error_is_a_provider_error() -> None:
    async def scenario() -> None:
        adapter = adapter_with(lambda request: httpx.Response(404, content=b'{"error": "no"}'))
        with pytest.raises(ProviderError) as raised:
            await collect(adapter)
        assert raised.value.status == 404
        await adapter.aclose()

    run(scenario())


def test_a_stream_that_cannot_connect_is_unreachable() -> None:
    async def scenario() -> None:
        with pytest.raises(ProviderUnreachable):
            await collect(adapter_with(refuse))

    run(scenario())
