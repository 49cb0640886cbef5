"""The lean front (router/front.py) on raw sockets: what it serves itself, what it hands to aiohttp, HTTP edge cases.

The router runs behind the front with fake vLLM engines (``make_cluster``); requests are written byte for
byte so keep-alive, pipelining, split reads, HTTP/1.0 and ``Expect`` are exercised as a client sends them.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httptools
import pytest
from aiohttp.test_utils import TestServer

from router import front, front_runner
from tests.router.conftest import MODEL, RouterServer, short_prompt
from tests.router.sse import payloads, text_of


@dataclass
class _Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class _Conn:
    """One client connection: write raw requests, read parsed responses, see whether the router closed it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._done: list[_Answer] = []
        self._current = _Answer()
        self._parser = httptools.HttpResponseParser(self)
        self._name = b""
        self.closed = False

    @classmethod
    async def open(cls, port: int) -> _Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def answers(self, n: int) -> list[_Answer]:
        async with asyncio.timeout(10):
            while len(self._done) < n:
                data = await self.reader.read(65536)
                if not data:  # a body without length or chunks ends here (HTTP/1.0)
                    self.closed = True
                    if self._current.status:
                        self.on_message_complete()
                    break
                self._parser.feed_data(data)
        out, self._done = self._done[:n], self._done[n:]
        return out

    async def body_started(self) -> None:
        """Read until the answer in progress has some body (a stream's first event)."""
        async with asyncio.timeout(10):
            while not self._current.body:
                self._parser.feed_data(await self.reader.read(65536))

    async def wait_closed(self) -> bool:
        async with asyncio.timeout(10):
            self.closed = self.closed or await self.reader.read(65536) == b""
        return self.closed

    def close(self) -> None:
        self.writer.close()

    # httptools callbacks
    def on_status(self, status: bytes) -> None:
        self._current.status = self._parser.get_status_code()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._current.body += body

    def on_message_complete(self) -> None:
        if self._current.status != 100:  # an interim answer: the real one follows
            self._done.append(self._current)
        self._current = _Answer()


def _post(path: str, body: dict[str, Any] | bytes, *extra: str, version: str = "1.1") -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [f"POST {path} HTTP/{version}", "Host: x", "Content-Type: application/json", *extra]
    if not any(h.lower().startswith("transfer-encoding") for h in extra):
        lines.append(f"Content-Length: {len(raw)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + raw


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def _completion(stream: bool = False, max_tokens: int = 5) -> dict[str, Any]:
    return {"model": MODEL, "prompt": short_prompt(), "max_tokens": max_tokens, "stream": stream}


@pytest.fixture
def router_server() -> type[TestServer]:
    """These tests are about the front: the router is always served behind it."""
    return RouterServer


@pytest.fixture
def handovers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the connections the front hands to aiohttp."""
    calls: list[int] = []
    original = front_runner.Front.aiohttp_protocol

    def counted(self: front_runner.Front) -> Any:
        calls.append(1)
        return original(self)

    monkeypatch.setattr(front_runner.Front, "aiohttp_protocol", counted)
    return calls


async def _router(make_cluster: Any, **overrides: Any) -> tuple[Any, int]:
    c = await make_cluster(n_decode=1, **overrides)
    port = c.router.server.port
    assert port is not None
    return c, port


async def test_completions_are_served_by_the_front_with_keep_alive(make_cluster, handovers) -> None:
    c, port = await _router(make_cluster)
    conn = await _Conn.open(port)
    conn.send(_post("/v1/completions", _completion()))
    [unary] = await conn.answers(1)
    conn.send(
        _post(
            "/v1/chat/completions?x=1",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "stream": True,
            },
        )
    )
    [streamed] = await conn.answers(1)
    conn.close()
    assert unary.status == 200 and json.loads(unary.body)["choices"][0]["text"]
    assert unary.headers["content-type"] == "application/json" and unary.headers["x-pd-route"] == "local"
    assert "date" in unary.headers and int(unary.headers["content-length"]) == len(unary.body)
    assert streamed.status == 200 and streamed.headers["transfer-encoding"] == "chunked"
    assert streamed.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert payloads(streamed.body)[-1] == "[DONE]" and text_of(streamed.body)
    assert not conn.closed and handovers == []
    registry = c.state.metrics.registry
    for path in ("/v1/completions", "/v1/chat/completions"):
        labels = {"endpoint": path, "status": "200"}
        assert registry.get_sample_value("pd_router_responses_total", labels) == 1


async def test_other_requests_hand_the_connection_to_aiohttp(make_cluster, handovers) -> None:
    _, port = await _router(make_cluster)
    first = await _Conn.open(port)  # the first request is not a completion: aiohttp serves it all
    first.send(_get("/v1/models"))
    first.send(_post("/v1/completions", _completion()))
    models, unary = await first.answers(2)
    first.close()
    assert models.status == 200 and json.loads(models.body)["data"][0]["id"] == MODEL
    assert unary.status == 200 and json.loads(unary.body)["choices"][0]["text"]
    later = await _Conn.open(port)  # lean first, then a metrics scrape on the same connection
    later.send(_post("/v1/completions", _completion()))
    [lean] = await later.answers(1)
    later.send(_get("/metrics"))
    [metrics] = await later.answers(1)
    later.send(_post("/v1/completions", _completion(stream=True)))
    [streamed] = await later.answers(1)
    later.close()
    assert lean.status == 200 and metrics.status == 200 and b"pd_router" in metrics.body
    assert streamed.status == 200 and payloads(streamed.body)[-1] == "[DONE]"
    assert handovers == [1, 1]
    unknown = await _Conn.open(port)
    unknown.send(_get("/v1/completions"))  # the wrong method is aiohttp's 405 in OpenAI's shape
    [wrong] = await unknown.answers(1)
    unknown.close()
    assert wrong.status == 405 and json.loads(wrong.body)["error"]["code"] == 405


async def test_a_request_line_split_over_reads_is_still_served_here(make_cluster, handovers) -> None:
    _, port = await _router(make_cluster)
    conn = await _Conn.open(port)
    raw = _post("/v1/completions", _completion())
    for piece in (raw[:3], raw[3:11], raw[11:40], raw[40:]):
        conn.send(piece)
        await conn.writer.drain()
        await asyncio.sleep(0.02)
    [answer] = await conn.answers(1)
    conn.close()
    assert answer.status == 200 and handovers == []


async def test_pipelined_completions_are_answered_in_order(make_cluster) -> None:
    _, port = await _router(make_cluster)
    conn = await _Conn.open(port)
    conn.send(
        _post("/v1/completions", _completion(max_tokens=3)) + _post("/v1/completions", _completion(True, 2))
    )
    unary, streamed = await conn.answers(2)
    assert unary.headers["content-type"] == "application/json"
    assert streamed.headers["content-type"].startswith("text/event-stream")
    conn.send(_post("/v1/completions", _completion()) + _get("/health"))  # cannot be handed over mid-read
    completed, refused = await conn.answers(2)
    assert completed.status == 200 and refused.status == 400
    assert "pipelined" in json.loads(refused.body)["error"]["message"]
    assert await conn.wait_closed()


async def test_expect_100_continue(make_cluster) -> None:
    _, port = await _router(make_cluster)
    conn = await _Conn.open(port)
    body = json.dumps(_completion()).encode()
    head = _post("/v1/completions", body, "Expect: 100-continue")[: -len(body)]
    conn.send(head)
    interim = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    conn.send(body)
    [answer] = await conn.answers(1)
    conn.close()
    assert answer.status == 200


async def test_bodies_over_the_limit_get_413_and_the_connection_closes(make_cluster) -> None:
    c, port = await _router(make_cluster, server__max_body_bytes=1000)
    declared = await _Conn.open(port)  # refused on its Content-Length, before the body is read
    declared.send(_post("/v1/completions", b"x" * 10, "Content-Length: 5000")[:-10])
    [answer] = await declared.answers(1)
    assert answer.status == 413 and "exceeds 1000 bytes" in json.loads(answer.body)["error"]["message"]
    assert await declared.wait_closed()
    chunked = await _Conn.open(port)  # no length up front: refused when the chunks pass the limit
    chunked.send(_post("/v1/completions", b"", "Transfer-Encoding: chunked"))
    for _ in range(3):
        chunked.send(b"258\r\n" + b"x" * 600 + b"\r\n")
    [answer] = await chunked.answers(1)
    assert answer.status == 413 and await chunked.wait_closed()
    labels = {"endpoint": "/v1/completions", "status": "413"}
    assert c.state.metrics.registry.get_sample_value("pd_router_responses_total", labels) == 2


async def test_a_chunked_request_body_is_served(make_cluster) -> None:
    _, port = await _router(make_cluster)
    conn = await _Conn.open(port)
    body = json.dumps(_completion()).encode()
    half = len(body) // 2
    chunks = b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
    conn.send(_post("/v1/completions", chunks, "Transfer-Encoding: chunked"))
    [answer] = await conn.answers(1)
    conn.close()
    assert answer.status == 200 and json.loads(answer.body)["choices"][0]["text"]


async def test_http10_streams_unframed_and_closes(make_cluster) -> None:
    _, port = await _router(make_cluster)
    conn = await _Conn.open(port)
    conn.send(_post("/v1/completions", _completion(stream=True), version="1.0"))
    [answer] = await conn.answers(1)
    assert answer.status == 200 and "transfer-encoding" not in answer.headers
    assert answer.headers["connection"] == "close"
    assert payloads(answer.body)[-1] == "[DONE]" and text_of(answer.body)
    assert await conn.wait_closed()


async def test_malformed_http_gets_400_and_the_server_keeps_serving(make_cluster) -> None:
    _, port = await _router(make_cluster)
    bad = await _Conn.open(port)
    bad.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
    [answer] = await bad.answers(1)
    assert answer.status == 400 and "malformed HTTP request" in json.loads(answer.body)["error"]["message"]
    assert await bad.wait_closed()
    good = await _Conn.open(port)
    good.send(_post("/v1/completions", _completion()))
    [ok] = await good.answers(1)
    good.close()
    assert ok.status == 200


async def test_api_key_is_checked_on_the_front(make_cluster) -> None:
    _, port = await _router(make_cluster, server__api_keys=["sk-right"])
    conn = await _Conn.open(port)
    conn.send(_post("/v1/completions", _completion(), "Authorization: Bearer sk-wrong"))
    [refused] = await conn.answers(1)
    conn.send(_post("/v1/completions", _completion(), "Authorization: Bearer sk-right"))
    [served] = await conn.answers(1)
    conn.close()
    assert refused.status == 401 and served.status == 200


async def test_idle_keep_alive_connections_are_closed(make_cluster) -> None:
    _, port = await _router(make_cluster, server__keepalive_s=0.2)
    conn = await _Conn.open(port)
    conn.send(_post("/v1/completions", _completion()))
    [answer] = await conn.answers(1)
    assert answer.status == 200
    assert await conn.wait_closed()


def test_served_here_decides_on_the_request_line_only() -> None:
    assert front._served_here(b"POST /v1/completions HTTP/1.1") is True
    assert front._served_here(b"POST /v1/chat/completions?stream=1 HTTP/1.1") is True
    assert front._served_here(b"POST /v1/c") is None  # either endpoint: wait for more bytes
    assert front._served_here(b"POST /v1/completions") is None
    assert front._served_here(b"POST /v1/completionsX HTTP/1.1") is False
    assert front._served_here(b"GET /v1/completions HTTP/1.1") is False
    assert front._served_here(b"PUT") is False


async def test_shutdown_lets_a_stream_in_flight_finish_and_closes_idle_connections(make_cluster) -> None:
    c, port = await _router(make_cluster)
    c.decode[0].token_delay_s = 0.02
    idle = await _Conn.open(port)
    idle.send(_post("/v1/completions", _completion()))
    assert [a.status for a in await idle.answers(1)] == [200]
    busy = await _Conn.open(port)
    busy.send(_post("/v1/completions", _completion(stream=True, max_tokens=20)))
    await busy.body_started()
    closing = asyncio.create_task(c.router.server.close())
    assert await idle.wait_closed()
    [answer] = await busy.answers(1)
    assert answer.status == 200
    assert payloads(answer.body)[-1] == "[DONE]" and len(payloads(answer.body)) == 21
    assert await busy.wait_closed()
    await asyncio.wait_for(closing, 10)
