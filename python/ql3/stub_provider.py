"""A local stub of an OpenAI-compatible chat-completions server, for examples, benchmarks
and tests: ``StubProvider`` is a real HTTP server on 127.0.0.1 (threads, standard library
only), ``instant_transport`` answers the same way in-process without sockets.

``StubProvider(script=fn)`` lets a test decide how each request is answered: ``fn`` gets a
``StubExchange`` and calls one of its ``send_*`` methods, ``drop`` or ``hang``. Without a
script every request is answered at once (JSON, or SSE when the request says
``"stream": true``), with usage. ``calls`` counts the requests that reached the server.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

import httpx

DEFAULT_REPLY: Final = "Hello from the ql3 stub provider."
_ids = itertools.count(1)


@dataclass(frozen=True)
class StubRequest:
    """One request as the stub received it."""

    path: str
    body: bytes
    doc: dict[str, Any] | None

    @property
    def stream(self) -> bool:
        return bool(self.doc and self.doc.get("stream") is True)

    @property
    def model(self) -> str:
        model = self.doc.get("model") if self.doc else None
        return model if isinstance(model, str) else "unknown"


def _words(doc: dict[str, Any] | None) -> int:
    messages = doc.get("messages") if doc else None
    if not isinstance(messages, list):
        return 0
    return sum(
        len(m["content"].split())
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), str)
    )


def _usage(request: StubRequest, reply: str) -> dict[str, int]:
    prompt, completion = _words(request.doc), len(reply.split())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_document(request: StubRequest, reply: str) -> dict[str, Any]:
    """A non-streaming chat completion answering ``request`` with ``reply``."""
    return {
        "id": f"chatcmpl-stub-{next(_ids)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply},
                "finish_reason": "stop",
            }
        ],
        "usage": _usage(request, reply),
    }


def sse_events(request: StubRequest, pieces: Sequence[str], *, usage: bool = True) -> list[bytes]:
    """The SSE events of a streamed answer made of ``pieces``, ending with ``[DONE]``."""
    ident, created = f"chatcmpl-stub-{next(_ids)}", int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": created,
            "model": request.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    docs = [chunk({"role": "assistant", "content": ""}, None)]
    docs += [chunk({"content": piece}, None) for piece in pieces]
    docs.append(chunk({}, "stop"))
    if usage:
        docs.append(
            {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": request.model,
                "choices": [],
                "usage": _usage(request, "".join(pieces)),
            }
        )
    events = [b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n" for d in docs]
    events.append(b"data: [DONE]\n\n")
    return events


def split_reply(reply: str) -> list[str]:
    """``reply`` as stream pieces: one per word, spaces kept."""
    words = reply.split(" ")
    return [w if i == len(words) - 1 else w + " " for i, w in enumerate(words)]


def _parse(path: str, body: bytes) -> StubRequest:
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    return StubRequest(path=path, body=body, doc=doc if isinstance(doc, dict) else None)


class StubExchange:
    """One request and the means to answer it (each method answers exactly once)."""

    def __init__(self, handler: BaseHTTPRequestHandler, request: StubRequest, stub: StubProvider):
        self.handler = handler
        self.request = request
        self.stub = stub

    def send_bytes(self, status: int, body: bytes, content_type: str) -> None:
        h = self.handler
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def send_json(self, status: int, doc: Any) -> None:
        self.send_bytes(status, json.dumps(doc).encode(), "application/json")

    def send_completion(self, reply: str | None = None) -> None:
        """A 200 chat completion (non-streaming) with usage."""
        text = self.stub.reply if reply is None else reply
        self.send_json(200, completion_document(self.request, text))

    def send_stream(
        self, pieces: Sequence[str] | None = None, *, delay: float = 0.0, usage: bool = True
    ) -> None:
        """A 200 SSE stream of ``pieces`` (default: the reply word by word), ``delay``
        seconds apart, then ``[DONE]``. Stops quietly when the client goes away."""
        chosen = split_reply(self.stub.reply) if pieces is None else pieces
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        try:
            for i, event in enumerate(sse_events(self.request, chosen, usage=usage)):
                if delay and i > 0 and self.stub.stopping.wait(delay):
                    return
                h.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            h.wfile.write(b"0\r\n\r\n")
        except OSError:
            h.close_connection = True

    def drop(self) -> None:
        """Close the connection without any answer (after the request was received)."""
        self.handler.close_connection = True
        with contextlib.suppress(OSError):
            self.handler.connection.shutdown(socket.SHUT_RDWR)

    def hang(self, seconds: float = 60.0) -> None:
        """Answer nothing until the stub closes (or ``seconds`` pass), then drop."""
        self.stub.stopping.wait(seconds)
        self.drop()

    def answer(self) -> None:
        """The default: an instant answer in the form the request asked for."""
        if self.request.stream:
            self.send_stream()
        else:
            self.send_completion()


Script = Callable[[StubExchange], None]


class StubProvider:
    """An OpenAI-compatible server on 127.0.0.1 for as long as the ``with`` block lasts.

    ``base_url`` is what a topology endpoint names (it ends in ``/v1``). ``script`` may be
    replaced at any time; it runs in the server's request thread.
    """

    def __init__(
        self, *, script: Script | None = None, reply: str = DEFAULT_REPLY, port: int = 0
    ) -> None:
        self.script = script
        self.reply = reply
        self.stopping = threading.Event()
        self.requests: list[StubRequest] = []
        self._lock = threading.Condition()
        self._connections: set[socket.socket] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler_class())
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def calls(self) -> int:
        """Requests received on ``/chat/completions`` so far."""
        with self._lock:
            return len(self.requests)

    def wait_for_calls(self, count: int, timeout: float = 10.0) -> bool:
        """Block until ``calls >= count``; whether that happened within ``timeout``."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self.requests) >= count, timeout)

    def start(self) -> StubProvider:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        self.stopping.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        with self._lock:
            open_connections = list(self._connections)
        for conn in open_connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._server.server_close()

    def __enter__(self) -> StubProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with stub._lock:
                    stub._connections.add(self.connection)

            def finish(self) -> None:
                with stub._lock:
                    stub._connections.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if not self.path.endswith("/chat/completions"):
                    self.send_error(404)
                    return
                request = _parse(self.path, body)
                with stub._lock:
                    stub.requests.append(request)
                    stub._lock.notify_all()
                exchange = StubExchange(self, request, stub)
                try:
                    (stub.script or StubExchange.answer)(exchange)
                except OSError:
                    self.close_connection = True

        return Handler


def _compact_json(doc: Any) -> bytes:
    """``doc`` as httpx's ``Response(json=doc)`` encodes it."""
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


_MAX_INSTANT_ANSWERS: Final = 256


def instant_transport(reply: str = DEFAULT_REPLY) -> httpx.MockTransport:
    """An in-process transport that answers every chat completion at once (no sockets):
    the provider stub for measuring the gateway's own overhead.

    The answer to a request body is encoded once and kept (a few hundred bodies at most),
    so a repeated request costs a lookup, not the stub's own JSON work: that work runs on
    the caller's event loop and would be counted as the gateway's overhead. A repeated
    request therefore gets the same ``id`` and ``created`` as the first.
    """
    answers: dict[tuple[str, bytes], tuple[bytes, bytes]] = {}

    def answer(path: str, body: bytes) -> tuple[bytes, bytes]:
        parsed = _parse(path, body)
        if parsed.stream:
            return b"text/event-stream", b"".join(sse_events(parsed, split_reply(reply)))
        return b"application/json", _compact_json(completion_document(parsed, reply))

    def handle(request: httpx.Request) -> httpx.Response:
        key = (request.url.path, request.read())
        found = answers.get(key)
        if found is None:
            if len(answers) >= _MAX_INSTANT_ANSWERS:
                answers.clear()
            found = answers[key] = answer(*key)
        content_type, body = found
        # The same response as Response(content=body) (httpx reads that one eagerly, which
        # is the receiver's work): the body as a stream, with its length.
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(body))

    return _InstantTransport(handle)


class _InstantTransport(httpx.MockTransport):
    """``MockTransport`` without its ``await request.aread()``: the handler reads the
    body itself, synchronously (the adapter always sends a byte stream)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = self.handler(request)
        assert isinstance(response, httpx.Response)
        return response


__all__ = [
    "DEFAULT_REPLY",
    "Script",
    "StubExchange",
    "StubProvider",
    "StubRequest",
    "completion_document",
    "instant_transport",
    "split_reply",
    "sse_events",
]
