"""The model provider of the gateway tests: a real HTTP server on 127.0.0.1 (``StubProvider``)
with scripted behaviours, counting the requests that reach it.

A behaviour is a function of one ``StubExchange``; assign it to ``stub.script``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from ql3.stub_provider import Script, StubExchange, StubProvider

REPLY = "The quick brown fox jumps over the lazy dog."
MODEL = "stub-model"


def instant(exchange: StubExchange) -> None:
    """Answer at once (JSON, or SSE when the request streams)."""
    exchange.answer()


def slow(seconds: float) -> Script:
    """Answer after ``seconds`` (or drop when the stub closes first)."""

    def script(exchange: StubExchange) -> None:
        if exchange.stub.stopping.wait(seconds):
            exchange.drop()
            return
        exchange.answer()

    return script


def status(code: int, message: str = "model 'nope' not found") -> Script:
    """An HTTP error with an OpenAI-style error body."""

    def script(exchange: StubExchange) -> None:
        exchange.send_json(code, {"error": {"message": message, "type": "invalid_request_error"}})

    return script


def stream(pieces: Sequence[str], delay: float = 0.0) -> Script:
    """An SSE stream of ``pieces``, ``delay`` seconds apart, with usage."""

    def script(exchange: StubExchange) -> None:
        exchange.send_stream(pieces, delay=delay)

    return script


def hang(exchange: StubExchange) -> None:
    """Never answer (until the stub closes)."""
    exchange.hang()


def drop(exchange: StubExchange) -> None:
    """Read the request, then close the connection without an answer."""
    exchange.drop()


@pytest.fixture
def provider() -> Iterator[StubProvider]:
    """A stub provider answering instantly until a test scripts it otherwise."""
    with StubProvider(reply=REPLY) as stub:
        yield stub


@pytest.fixture
def provider_b() -> Iterator[StubProvider]:
    """A second, independent stub provider (for topology changes)."""
    with StubProvider(reply="Answered by endpoint B.") as stub:
        yield stub
