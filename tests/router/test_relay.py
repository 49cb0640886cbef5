"""The streamed relay's callback path (``Response.divert`` + ``Pump``): framing, slow clients, failures."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import httptools
import pytest

from router import app, front, relay
from router.http1 import Response
from router.metrics import EventHistogram
from router.trace import Stamps
from tests.router.conftest import MODEL, long_prompt, short_prompt
from tests.router.sse import events, normalized


class _Transport:
    """The client side of a ``Pump``: records writes, reports a settable buffer size."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered


class _Upstream:
    """The upstream side of a ``Pump``: counts wake-ups and pause/resume calls."""

    def __init__(self) -> None:
        self.wakes = 0
        self.paused: list[bool] = []

    def wake(self) -> None:
        self.wakes += 1

    def pause_reading(self, paused: bool) -> None:
        self.paused.append(paused)


def _pump(transform=lambda b: b) -> tuple[relay.Pump, _Transport, _Upstream]:
    out, up = _Transport(), _Upstream()
    itl = EventHistogram("gaps", "gaps", "route", (0.1,)).series("local")
    return relay.Pump(out, True, transform, itl, up), out, up  # type: ignore[arg-type]


def test_pump_writes_complete_events_as_chunks_and_keeps_partial_ones() -> None:
    pump, out, up = _pump()
    pump.feed(b"data: 1\n\ndata: 2\n\nda")
    pump.feed(b"ta: 3")
    assert out.written == [b"12\r\ndata: 1\n\ndata: 2\n\n\r\n"]
    pump.feed(b"\n\ndata: [DONE]\n\n")
    assert out.written[1] == b"17\r\ndata: 3\n\ndata: [DONE]\n\n\r\n"
    assert pump.done and up.wakes == 1
    pump.feed(b"data: late\n\n")  # nothing after [DONE]
    assert len(out.written) == 2


def test_pump_stamps_the_first_bytes_of_the_stream_it_continues_once() -> None:
    """A seeded stream's Pump marks ``decode_continued`` when D's first bytes arrive, even an incomplete
    event (they are D's first output), and never again."""
    out, up = _Transport(), _Upstream()
    itl = EventHistogram("gaps", "gaps", "route", (0.1,)).series("local")
    stamps = Stamps(time.monotonic())
    pump = relay.Pump(out, True, lambda b: b, itl, up, stamps)  # type: ignore[arg-type]
    pump.feed(b"data: 2")
    first = stamps.stamps["decode_continued"]
    assert stamps.stamps["received"] <= first
    pump.feed(b"\n\ndata: 3\n\n")
    assert stamps.stamps["decode_continued"] == first and len(out.written) == 1


def test_pump_pauses_the_upstream_while_the_client_is_behind() -> None:
    pump, out, up = _pump()
    out.buffered = relay.HIGH_WATER + 1
    pump.feed(b"data: 1\n\n")
    assert pump.paused and up.paused == [True] and up.wakes == 1
    pump.feed(b"data: 2\n\n")  # already read when reading stopped: written, no second pause
    assert up.paused == [True] and out.written[-1] == b"9\r\ndata: 2\n\n\r\n"
    pump.resume()
    assert not pump.paused and up.paused == [True, False]


def test_pump_keeps_failures_for_the_handler() -> None:
    pump, out, up = _pump()
    out.closing = True
    pump.feed(b"data: 1\n\n")
    assert isinstance(pump.failure, relay.ClientGone) and out.written == []

    def broken(batch: bytes) -> bytes:
        raise ValueError("bad event")

    pump, out, up = _pump(broken)
    pump.feed(b"data: 1\n\n")  # must not raise into the event loop's read callback
    assert isinstance(pump.failure, ValueError) and up.wakes == 1


async def _slow_read(port: int, body: bytes, pause_s: float) -> bytes:
    """POST ``body``, let the answer pile up for ``pause_s`` without reading, then read it all (de-chunked)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body)
    await asyncio.sleep(pause_s)
    chunks: list[bytes] = []
    done = asyncio.Event()

    class Parser:
        def on_body(self, data: bytes) -> None:
            chunks.append(data)

        def on_message_complete(self) -> None:
            done.set()

    parser = httptools.HttpResponseParser(Parser())
    async with asyncio.timeout(30):
        while not done.is_set():
            parser.feed_data(await reader.read(65536))
    writer.close()
    return b"".join(chunks)


def _small_send_buffer(start: Callable[[Any, Mapping[str, str]], Awaitable[None]]) -> Any:
    async def start_small(self: Any, headers: Mapping[str, str]) -> None:
        self.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        await start(self, headers)

    return start_small


async def test_a_slow_client_gets_every_event_and_pauses_the_upstream(make_cluster, monkeypatch) -> None:
    pauses: list[bool] = []
    original = Response.pause_reading

    def spy(self: Response, paused: bool) -> None:
        pauses.append(paused)
        original(self, paused)

    monkeypatch.setattr(Response, "pause_reading", spy)
    # Loopback socket buffers grow to megabytes before the router's own buffer does: keep the router's
    # send buffer small, as a slow network would.
    for stream in (front._Stream, app._AiohttpStream):  # whichever server carries the request
        monkeypatch.setattr(stream, "start", _small_send_buffer(stream.start))
    c = await make_cluster(n_decode=1)
    body = {"model": MODEL, "prompt": short_prompt(), "max_tokens": 1500, "stream": True}
    port = c.router.server.port
    assert port is not None
    via_router = await _slow_read(port, aiohttp.JsonPayload(body)._value, 1.0)
    async with aiohttp.ClientSession() as s, s.post(c.url(c.decode[0]) + "/v1/completions", json=body) as r:
        direct = await r.read()
    assert normalized(via_router) == normalized(direct)
    assert len(events(via_router)) == 1501
    assert pauses[:2] == [True, False]  # reading the worker stopped while the client was behind
    assert all(a != b for a, b in itertools.pairwise(pauses))  # paused and resumed in turn


@pytest.mark.parametrize("flow", ["pd-push", "vllm-standard", "sglang-bootstrap"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_disaggregated_stream_reaches_the_client_event_by_event(
    make_cluster, flow: str, path: str
) -> None:
    """Tokens are relayed as D makes them: a P->D stream whose events reached the client together (the burst
    users saw through pd-router) fails this. D makes one token every 40 ms; the client times each event."""
    c = await make_cluster(n_decode=1, flow=flow)
    gap_s, n = 0.04, 8
    c.decode[0].token_delay_s = gap_s
    body: dict[str, Any] = {"model": MODEL, "max_tokens": n, "stream": True}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": long_prompt()}]
    else:
        body["prompt"] = long_prompt()
    arrivals: list[float] = []
    loop = asyncio.get_running_loop()
    async with c.router.post(path, json=body) as resp:
        assert resp.headers["X-PD-Route"] == "disagg"
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                arrivals.append(loop.time())
    token_events = arrivals[-n:]  # chat streams open with a role-only event
    gaps = [b - a for a, b in itertools.pairwise(token_events)]
    assert len(gaps) == n - 1
    assert min(gaps) > gap_s / 2, f"events arrived together: gaps {[round(g * 1000, 1) for g in gaps]} ms"
