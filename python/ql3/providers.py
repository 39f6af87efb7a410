"""An OpenAI-compatible chat-completions adapter on httpx (Ollama speaks the same API).

Why it is built this way:

- **No retries below the gateway.** The transport is ``httpx.AsyncHTTPTransport(retries=0)``
  and nothing here repeats a request: a repeated model call can bill twice and answer
  differently, so only ``ql3.gateway`` decides what happens after a failure (SPEC 9.6).
- **No timeouts of its own but the connect timeout.** The caller's deadline bounds the
  call (the gateway wraps every await in ``asyncio.timeout_at``); a read timeout here would
  turn "the deadline passed" into an unrelated transport error.
- **Errors say how much is known.** ``ProviderError`` is a definite answer (an HTTP error
  status with a body, or an error event in a stream); ``ProviderUnreachable`` means the
  request was never sent (connection refused, connect timeout). Everything else raised
  here (a dropped connection, a truncated stream, an unparsable 200) means the provider
  may or may not have run the request: the gateway records it as ``lost``.
- **Endpoints come from a contract.** ``platform_resource/ollama_topology`` of project
  ``__platform__`` lists the endpoints and the models each serves (``Topology``). It is read
  through the revision cache on every call, so a new active revision is used from the
  next call on, and ``on_change`` retires the HTTP connections of the old topology: calls
  in flight finish on the old client, which is closed when the last one ends.

The topology body (validated by ``Topology.from_body``)::

    {"endpoints": [{"name": "gpu-a", "base_url": "http://10.0.0.5:11434/v1",
                    "models": ["qwen2.5:7b", "llama3.1:8b"]}]}

``name`` is 1..128 characters (it is recorded as the invocation's ``provider``),
``base_url`` is http(s) and ends where ``/chat/completions`` is appended (Ollama: ``/v1``),
``models`` is a non-empty list of model names. Endpoint names are unique; unknown fields
are refused, so a typo cannot silently route nowhere.

The topology, route, answer, stream and error types are ``ql3.provider_types`` (no
httpx: ``ql3.gateway`` imports them from there), re-exported here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Final, Protocol

import httpx

from ql3 import arguments
from ql3.invocations import Usage, output_digest
from ql3.provider_types import (
    MAX_ERROR_BODY,
    TOPOLOGY_CONTRACT,
    TOPOLOGY_FAMILY,
    TOPOLOGY_PROJECT,
    Endpoint,
    ProviderError,
    ProviderProtocolError,
    ProviderResponse,
    ProviderUnreachable,
    Route,
    StreamDelta,
    StreamEvent,
    Topology,
    TopologySource,
    encode_chat_request,
    topology_body,
)

log = logging.getLogger("ql3.providers")


def _log(level: int, event: str, **fields: Any) -> None:
    log.log(level, event, extra={"ql3": fields})


# -- what the adapter reads through the revision cache ------------------------------------


class _Revision(Protocol):
    @property
    def project_id(self) -> str: ...
    @property
    def revision_id(self) -> str: ...
    @property
    def body(self) -> dict[str, Any]: ...


# -- the adapter --------------------------------------------------------------------------


def _usage(doc: object) -> Usage | None:
    """Usage from an OpenAI ``usage`` object; fields that are not counts stay unknown."""
    if not isinstance(doc, Mapping):
        return None
    prompt, completion = _count(doc.get("prompt_tokens")), _count(doc.get("completion_tokens"))
    if prompt is None and completion is None:
        return None
    return Usage(input_tokens=prompt, output_tokens=completion)


def _count(value: object) -> int | None:
    """A token count, or None (unknown) for anything that is not one."""
    if type(value) is int and 0 <= value <= 2**53 - 1:  # bool is not a count
        return value
    return None


def _first_choice(doc: Mapping[str, Any]) -> Mapping[str, Any] | None:
    choices = doc.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return choices[0]
    return None


def _parse_completion(raw: bytes) -> tuple[str, str | None, Usage | None]:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ProviderProtocolError(f"the response is not JSON: {raw[:200]!r}") from exc
    if not isinstance(doc, Mapping):
        raise ProviderProtocolError("the response is not a JSON object")
    choice = _first_choice(doc)
    message = None if choice is None else choice.get("message")
    if not isinstance(message, Mapping):
        raise ProviderProtocolError("the response has no choices[0].message")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ProviderProtocolError("choices[0].message.content is not a string")
    assert choice is not None
    finish = choice.get("finish_reason")
    return content or "", finish if isinstance(finish, str) else None, _usage(doc.get("usage"))


_MAX_CACHED_TARGETS: Final = 256


class _Client:
    """One generation of HTTP connections; closed when retired and no call uses it.

    ``send`` hands the request straight to the transport, with exactly the headers
    ``httpx.AsyncClient`` would send for it (``Host``, the client's defaults, ours,
    ``Content-Length``) and the same timeout, and without the per-request work the adapter
    does not use: the URL is parsed and the headers merged once per target, no auth, no
    redirects, no event hooks, and no cookie jar keeping what a provider sets (a model call
    carries no session state). With ``trust_env`` (.netrc credentials) the request goes
    through the client's own pipeline instead.
    """

    def __init__(
        self, client: httpx.AsyncClient, transport: httpx.AsyncBaseTransport, *, direct: bool
    ) -> None:
        self.http = client
        self.transport = transport
        self.direct = direct
        self.users = 0
        self.retired = False
        self._targets: dict[tuple[str, str], tuple[httpx.URL, list[tuple[bytes, bytes]]]] = {}
        self._extensions = {"timeout": client.timeout.as_dict()}

    def _target(self, url: str, accept: str) -> tuple[httpx.URL, list[tuple[bytes, bytes]]]:
        key = (url, accept)
        found = self._targets.get(key)
        if found is None:
            if len(self._targets) >= _MAX_CACHED_TARGETS:
                self._targets.clear()
            parsed = httpx.URL(url)
            headers = {"content-type": "application/json", "accept": accept}
            # The headers of this request as the client builds it, but for its length.
            built = self.http.build_request("POST", parsed, headers=headers, content=b"")
            fixed = [(k, v) for k, v in built.headers.raw if k.lower() != b"content-length"]
            found = self._targets[key] = (parsed, fixed)
        return found

    async def send(self, url: str, body: bytes, accept: str) -> httpx.Response:
        """POST ``body`` as JSON; the response, its body not read yet (``aclose`` it).

        A connection that could not be made (refused, or the connect timeout: nothing was
        sent) raises ``ProviderUnreachable``.
        """
        try:
            return await self._send(url, body, accept)
        except httpx.ConnectError as exc:
            raise ProviderUnreachable(f"{url}: {exc}") from exc
        except httpx.ConnectTimeout as exc:
            raise ProviderUnreachable(f"{url}: connect timeout") from exc

    async def _send(self, url: str, body: bytes, accept: str) -> httpx.Response:
        if not self.direct:
            request = self.http.build_request(
                "POST",
                url,
                content=body,
                headers={"content-type": "application/json", "accept": accept},
            )
            return await self.http.send(request, stream=True)
        parsed, fixed = self._target(url, accept)
        request = httpx.Request(
            "POST",
            parsed,
            headers=[*fixed, (b"Content-Length", str(len(body)).encode())],
            stream=httpx.ByteStream(body),
            extensions=self._extensions,
        )
        response = await self.transport.handle_async_request(request)
        response.request = request
        return response


class OpenAICompatibleProvider:
    """Chat completions against the endpoints of the ``ollama_topology`` contract.

    ``transport_factory`` replaces the real transport (benchmarks pass
    ``ql3.stub_provider.instant_transport``); its transport must not retry either.
    ``trust_env`` is off by default so that proxy variables cannot reroute the calls.
    """

    def __init__(
        self,
        topology: TopologySource,
        *,
        connect_timeout: float = 5.0,
        limits: httpx.Limits | None = None,
        transport_factory: Callable[[], httpx.AsyncBaseTransport] | None = None,
        trust_env: bool = False,
    ) -> None:
        self._source = topology
        self._connect_timeout = arguments.check_seconds("connect_timeout", connect_timeout)
        self._limits = limits or httpx.Limits(max_connections=100, max_keepalive_connections=20)
        self._transport_factory = transport_factory
        self._trust_env = trust_env
        self._current: _Client | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._parsed: dict[str, Topology] = {}
        # The routes of the latest parsed topology, by (model, endpoint); built once each.
        self._routes: dict[tuple[str, str | None], Route] = {}
        self.resets = 0
        """How many times the connections were retired (a topology change, or ``reset``)."""
        topology.on_change(TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT, self._on_topology_change)

    # -- topology -----------------------------------------------------------------------

    async def topology(self) -> Topology:
        """The active topology, as the revision cache serves it now."""
        revision = await self._source.get_effective(
            TOPOLOGY_PROJECT, TOPOLOGY_FAMILY, TOPOLOGY_CONTRACT
        )
        revision_id = str(revision.revision_id)
        parsed = self._parsed.get(revision_id)
        if parsed is None:
            parsed = Topology.from_body(revision.body, revision_id=revision_id)
            self._parsed = {revision_id: parsed}  # keep only the latest, and its routes
            self._routes = {}
        return parsed

    async def route(self, model: str, endpoint: str | None = None) -> Route:
        """Where a call of ``model`` goes (optionally pinned to one endpoint by name)."""
        topology = await self.topology()  # the one self._routes belongs to
        route = self._routes.get((model, endpoint))
        if route is None:
            chosen = topology.endpoint_for(model, endpoint)  # NotFound is not kept
            route = self._routes[(model, endpoint)] = Route(
                provider=chosen.name,
                model=model,
                url=chosen.chat_url,
                topology_revision_id=topology.revision_id,
            )
        return route

    def _on_topology_change(self, revision: _Revision) -> None:
        if revision.project_id != TOPOLOGY_PROJECT:
            return
        _log(logging.INFO, "provider_topology_changed", revision_id=str(revision.revision_id))
        self.reset()

    # -- connections --------------------------------------------------------------------

    def _new_client(self) -> _Client:
        transport = (
            self._transport_factory()
            if self._transport_factory is not None
            else httpx.AsyncHTTPTransport(retries=0, limits=self._limits, trust_env=False)
        )
        timeout = httpx.Timeout(connect=self._connect_timeout, read=None, write=None, pool=None)
        http = httpx.AsyncClient(transport=transport, timeout=timeout, trust_env=self._trust_env)
        return _Client(http, transport, direct=not self._trust_env)

    def reset(self) -> None:
        """Retire the current connections: new calls open new ones, calls in flight end
        on the old client, which is closed after them."""
        old, self._current = self._current, None
        self.resets += 1
        if old is not None:
            old.retired = True
            if old.users == 0:
                self._close_later(old)

    def _close_later(self, client: _Client) -> None:
        task = asyncio.get_running_loop().create_task(client.http.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _acquire(self) -> _Client:
        if self._current is None:
            self._current = self._new_client()
        client = self._current
        client.users += 1
        return client

    def _release(self, client: _Client) -> None:
        client.users -= 1
        if client.retired and client.users == 0:
            self._close_later(client)

    async def aclose(self) -> None:
        """Close every connection (the adapter can be used again afterwards)."""
        self.reset()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    # -- requests -----------------------------------------------------------------------

    @staticmethod
    def encode_request(
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: bool,
        options: Mapping[str, Any] | None = None,
    ) -> bytes:
        """The exact request body sent (and digested): ``encode_chat_request``."""
        return encode_chat_request(model, messages, stream=stream, options=options)

    async def complete(self, route: Route, body: bytes) -> ProviderResponse:
        """One non-streaming call."""
        client = self._acquire()
        try:
            response = await client.send(route.url, body, _ACCEPT_JSON)
            try:
                raw = await _read_body(response)
            finally:
                await response.aclose()
        finally:
            self._release(client)
        size, digest = len(raw), output_digest(raw)
        _raise_for_status(response.status_code, raw, size, digest)
        text, finish, usage = _parse_completion(raw)
        return ProviderResponse(
            text=text, finish_reason=finish, usage=usage, output_bytes=size, output_digest=digest
        )

    async def stream(self, route: Route, body: bytes) -> AsyncIterator[StreamEvent]:
        """One streaming call: ``StreamDelta`` items, then the whole ``ProviderResponse``.

        Asks for ``stream_options.include_usage`` (the request body carries it); a stream
        that ends without ``data: [DONE]`` raises ``ProviderProtocolError``.
        """
        client = self._acquire()
        try:
            response = await client.send(route.url, body, _ACCEPT_SSE)
            try:
                async for event in _read_stream(response):
                    yield event
            finally:
                await response.aclose()
        finally:
            self._release(client)


async def _read_body(response: httpx.Response) -> bytes:
    """The whole body as ``response.aread()`` gives it; read straight off the transport's
    stream when there is no ``Content-Encoding`` to undo (nothing to decode then)."""
    stream = response.stream
    # The raw header names: ``in response.headers`` would decode every header first.
    encoded = any(name.lower() == b"content-encoding" for name, _ in response.headers.raw)
    if encoded or not isinstance(stream, httpx.AsyncByteStream):
        return await response.aread()
    return b"".join([chunk async for chunk in stream])


_ACCEPT_JSON: Final = "application/json"
_ACCEPT_SSE: Final = "text/event-stream"

_UNKNOWN_STATUSES: Final = frozenset({502, 504, 520, 524})
"""Answers of an intermediary about the upstream (bad gateway, gateway timeout, and
Cloudflare's 520 "unknown error" and 524 "a timeout occurred", both sent after the request
reached the origin): the model server may have run the request, so they are not a definite
failure (D34)."""


def _raise_for_status(status: int, raw: bytes, size: int, digest: str) -> None:
    if status < 400:
        if status != 200:
            raise ProviderProtocolError(f"unexpected HTTP status {status}")
        return
    if not raw or status in _UNKNOWN_STATUSES:
        raise ProviderProtocolError(f"HTTP {status} without a definite answer ({size} bytes)")
    raise ProviderError(status, raw[:MAX_ERROR_BODY], output_bytes=size, output_digest=digest)


def _sse_data(line: bytes, pending: list[bytes]) -> bytes | None:
    """The data of the SSE event that ``line`` completes, else None; ``pending`` keeps the
    data lines of the open event."""
    line = line.rstrip(b"\r")
    if not line:
        if not pending:
            return None
        data = b"\n".join(pending)
        pending.clear()
        return data
    if not line.startswith(b":"):  # a comment (keep-alive) carries nothing
        field, _, value = line.partition(b":")
        if field == b"data":
            pending.append(value[1:] if value.startswith(b" ") else value)
    return None


async def _read_stream(response: httpx.Response) -> AsyncIterator[StreamEvent]:
    hasher = hashlib.sha256()
    size = 0
    if response.status_code != 200:
        raw = await response.aread()
        _raise_for_status(response.status_code, raw, len(raw), output_digest(raw))
    buffer = b""
    pending: list[bytes] = []
    text: list[str] = []
    finish: str | None = None
    usage: Usage | None = None
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            # Digested and counted line by line as the events are read, so the receipt
            # does not depend on how the bytes were chunked, and ends with [DONE]'s event.
            hasher.update(line + b"\n")
            size += len(line) + 1
            data = _sse_data(line, pending)
            if data is None:
                continue
            if data.strip() == b"[DONE]":
                # Whatever follows [DONE] is not part of the answer; the digest covers
                # the body up to the end of its event.
                yield ProviderResponse(
                    text="".join(text),
                    finish_reason=finish,
                    usage=usage,
                    output_bytes=size,
                    output_digest=hasher.hexdigest(),
                )
                return
            try:
                doc = json.loads(data)
            except ValueError as exc:
                raise ProviderProtocolError(f"a stream event is not JSON: {data[:200]!r}") from exc
            if not isinstance(doc, Mapping):
                raise ProviderProtocolError("a stream event is not a JSON object")
            if "error" in doc:  # a definite error event: the body so far is the answer
                raise ProviderError(
                    200, data[:MAX_ERROR_BODY], output_bytes=size, output_digest=hasher.hexdigest()
                )
            if doc.get("usage") is not None:
                usage = _usage(doc["usage"]) or usage
            choice = _first_choice(doc)
            if choice is None:
                continue
            if isinstance(choice.get("finish_reason"), str):
                finish = choice["finish_reason"]
            delta = choice.get("delta")
            content = delta.get("content") if isinstance(delta, Mapping) else None
            if isinstance(content, str) and content:
                text.append(content)
                yield StreamDelta(content)
    raise ProviderProtocolError("the stream ended without data: [DONE]")


__all__ = [
    "MAX_ERROR_BODY",
    "TOPOLOGY_CONTRACT",
    "TOPOLOGY_FAMILY",
    "TOPOLOGY_PROJECT",
    "Endpoint",
    "OpenAICompatibleProvider",
    "ProviderError",
    "ProviderProtocolError",
    "ProviderResponse",
    "ProviderUnreachable",
    "Route",
    "StreamDelta",
    "StreamEvent",
    "Topology",
    "TopologySource",
    "encode_chat_request",
    "topology_body",
]
