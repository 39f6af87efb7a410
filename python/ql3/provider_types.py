"""The provider-neutral half of the model gateway's provider side: the topology contract,
routes, answers, stream events, errors and the request encoding.

``ql3.gateway`` needs these and nothing of HTTP, so it imports this module and runs
without httpx (an install without the ``gateway`` extra, e.g. the SQLite edge shim with
AI and a provider of the application's own). The HTTP adapter, ``OpenAICompatibleProvider``,
is ``ql3.providers`` (the ``gateway`` extra), which re-exports every name here.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

from ql3 import errors
from ql3.invocations import Usage

TOPOLOGY_PROJECT: Final = "__platform__"
TOPOLOGY_FAMILY: Final = "platform_resource"
TOPOLOGY_CONTRACT: Final = "ollama_topology"

MAX_ERROR_BODY: Final = 64 * 1024
"""Bytes of an error response kept for the exception (the digest covers all of it)."""


class TopologySource(Protocol):
    """Where the topology comes from: ``ql3.cache.RevisionCache`` satisfies it."""

    async def get_effective(
        self, project_id: str, contract_family: str, contract_id: str
    ) -> Any: ...

    def on_change(
        self, contract_family: str, contract_id: str, fn: Callable[[Any], Awaitable[None] | None]
    ) -> None: ...


def _invalid(reason: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"QL3_INVALID_ARGUMENT: ollama_topology: {reason}")


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """One OpenAI-compatible server and the models it serves."""

    name: str
    base_url: str
    models: tuple[str, ...]

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The endpoints of one ``ollama_topology`` revision."""

    revision_id: str
    endpoints: tuple[Endpoint, ...]

    @classmethod
    def from_body(cls, body: Mapping[str, Any], *, revision_id: str) -> Topology:
        """Validates a topology body; ``InvalidArgument`` names the first problem."""
        if not isinstance(body, Mapping) or set(body) != {"endpoints"}:
            raise _invalid('the body must be {"endpoints": [...]} and nothing else')
        items = body["endpoints"]
        if not isinstance(items, list) or not items:
            raise _invalid("endpoints must be a non-empty list")
        endpoints: list[Endpoint] = []
        for i, item in enumerate(items):
            where = f"endpoints[{i}]"
            if not isinstance(item, Mapping) or set(item) != {"name", "base_url", "models"}:
                raise _invalid(f"{where} must have exactly name, base_url and models")
            name, base_url, models = item["name"], item["base_url"], item["models"]
            if not isinstance(name, str) or not 1 <= len(name) <= 128:
                raise _invalid(f"{where}.name must be 1..128 characters")
            if any(e.name == name for e in endpoints):
                raise _invalid(f"endpoint name {name!r} appears twice")
            if not isinstance(base_url, str):
                raise _invalid(f"{where}.base_url must be a string")
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise _invalid(f"{where}.base_url must be an http(s) URL, not {base_url!r:.80}")
            if (
                not isinstance(models, list)
                or not models
                or not all(isinstance(m, str) and 1 <= len(m) <= 128 for m in models)
            ):
                raise _invalid(f"{where}.models must be a non-empty list of model names")
            endpoints.append(Endpoint(name=name, base_url=base_url, models=tuple(models)))
        return cls(revision_id=revision_id, endpoints=tuple(endpoints))

    def endpoint_for(self, model: str, endpoint: str | None = None) -> Endpoint:
        """The named endpoint, or the first that serves ``model``; ``NotFound`` otherwise."""
        for candidate in self.endpoints:
            if endpoint is not None and candidate.name != endpoint:
                continue
            if model in candidate.models:
                return candidate
        where = f"endpoint {endpoint!r}" if endpoint is not None else "any endpoint"
        raise errors.NotFound(
            f"QL3_NOT_FOUND: model {model!r} is not served by {where} of ollama_topology "
            f"revision {self.revision_id}"
        )


def topology_body(endpoints: Sequence[tuple[str, str, Sequence[str]]]) -> dict[str, Any]:
    """A topology body from ``(name, base_url, models)`` triples."""
    return {
        "endpoints": [
            {"name": name, "base_url": base_url, "models": list(models)}
            for name, base_url, models in endpoints
        ]
    }


# -- what a call returns ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Route:
    """Where one call goes; ``provider`` (the endpoint name) is recorded at admission."""

    provider: str
    model: str
    url: str
    topology_revision_id: str


@dataclass(frozen=True, kw_only=True)
class ProviderResponse:
    """A complete answer. ``output_bytes``/``output_digest`` cover the response body as
    received (the JSON document, or the whole SSE stream up to ``[DONE]``)."""

    text: str
    finish_reason: str | None
    usage: Usage | None
    output_bytes: int
    output_digest: str


@dataclass(frozen=True)
class StreamDelta:
    """A piece of generated text."""

    text: str


StreamEvent = StreamDelta | ProviderResponse
"""A stream yields deltas, then one ``ProviderResponse`` (its text is the whole answer)."""


class ProviderError(Exception):
    """A definite error answer: the provider did not produce a result for this request.

    ``status`` is the HTTP status (200 for an error event inside a stream); ``body`` the
    first ``MAX_ERROR_BODY`` bytes of the error body (of the error event in a stream);
    ``output_bytes``/``output_digest`` cover the whole response body received.
    """

    def __init__(self, status: int, body: bytes, *, output_bytes: int, output_digest: str):
        excerpt = body[:200].decode("utf-8", "replace")
        super().__init__(f"provider answered HTTP {status}: {excerpt}")
        self.status = status
        self.body = body
        self.output_bytes = output_bytes
        self.output_digest = output_digest


class ProviderUnreachable(Exception):
    """The request was never sent: the connection could not be opened."""


class ProviderProtocolError(Exception):
    """The answer was cut short or malformed: whether the model ran is unknown."""


# -- what is sent ----------------------------------------------------------------------------


def encode_chat_request(
    model: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    stream: bool,
    options: Mapping[str, Any] | None = None,
) -> bytes:
    """The exact request body sent (and digested): compact UTF-8 JSON of an OpenAI chat
    completion request.

    ``options`` are further OpenAI parameters (``temperature``, ``max_tokens``...); they
    may not set ``model``, ``messages``, ``stream`` or ``stream_options``.
    """
    if options is not None and not isinstance(options, Mapping):
        raise errors.InvalidArgument(
            f"QL3_INVALID_ARGUMENT: options must be an object, not {type(options).__name__}"
        )
    extra = dict(options or {})
    reserved = {"model", "messages", "stream", "stream_options"} & set(extra)
    if reserved:
        raise errors.InvalidArgument(
            f"QL3_INVALID_ARGUMENT: options may not set {', '.join(sorted(reserved))}"
        )
    if (
        not isinstance(messages, Sequence)
        or isinstance(messages, str | bytes)
        or not all(isinstance(m, Mapping) for m in messages)
    ):
        raise errors.InvalidArgument("QL3_INVALID_ARGUMENT: messages must be a list of objects")
    doc: dict[str, Any] = {"model": model, "messages": [dict(m) for m in messages], **extra}
    doc["stream"] = stream
    if stream:
        doc["stream_options"] = {"include_usage": True}
    try:
        text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError (a lone surrogate) too
        raise errors.InvalidArgument(
            f"QL3_INVALID_ARGUMENT: the request is not JSON: {exc}"
        ) from exc


__all__ = [
    "MAX_ERROR_BODY",
    "TOPOLOGY_CONTRACT",
    "TOPOLOGY_FAMILY",
    "TOPOLOGY_PROJECT",
    "Endpoint",
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
