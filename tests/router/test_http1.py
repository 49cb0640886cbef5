"""The router's upstream HTTP/1.1 client (``router.http1``) against raw loopback servers that write exact bytes.

The servers here are plain asyncio sockets so every framing case (Content-Length, chunked with chunks split
anywhere, close-delimited, Connection: close, broken or malformed answers) is sent byte for byte as a real
server could; the router-level tests (test_routing, test_streaming, test_failover) cover the client against
the fake vLLM engine's aiohttp server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from router import http1
from router.balancer import Worker
from router.config import CircuitConfig, Secret, WorkerConfig
from router.health import CircuitBreaker
from router.http1 import HttpError, Pool
from router.upstream import UpstreamError, post_json
from tests.polling import wait_until_async

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@dataclass
class RawServer:
    """Answers each request with ``script(reader, writer, n)`` (n: the request's number on its connection)."""

    script: Script
    connections: int = 0
    heads: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                self.heads.append(head)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.bodies.append(await reader.readexactly(length))
                await self.script(reader, writer, n)
                n += 1
                if writer.is_closing():
                    break
        except ConnectionError:
            pass
        finally:
            self.closed.set()
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], Awaitable[tuple[RawServer, tuple[str, int, bool]]]]]:
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> tuple[RawServer, tuple[str, int, bool]]:
        raw = RawServer(script)
        server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return raw, Pool.key(f"http://127.0.0.1:{port}")

    yield start
    for server in servers:
        server.close()


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    """The client under test (1 s connect timeout), closed after the test."""
    client = Pool(1.0)
    yield client
    client.close()


def _answer(data: bytes, close: bool = False) -> Script:
    """A server script that answers every request with ``data`` (then closes the connection if ``close``)."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()

    return script


def _head(body: bytes) -> bytes:
    return f"POST /v1/x HTTP/1.1\r\nHost: h\r\nContent-Length: {len(body)}\r\n\r\n".encode()


async def _post(pool: Pool, key: tuple[str, int, bool], body: bytes = b"{}") -> http1.Response:
    return await pool.request(key, _head(body), body)


async def _length_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    body = f'{{"n":{n}}}'.encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()


async def test_content_length_and_connection_reuse(serve, pool: Pool) -> None:
    raw, key = await serve(_length_answer)
    for i in range(3):
        resp = await _post(pool, key, b'{"i":%d}' % i)
        assert resp.status == 200
        assert await resp.read() == b'{"n":%d}' % i
    assert raw.connections == 1  # one keep-alive connection served all three
    assert raw.bodies == [b'{"i":0}', b'{"i":1}', b'{"i":2}']


async def test_chunked_stream_split_anywhere(serve, pool: Pool) -> None:
    events = [b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b"data: [DONE]\n\n"]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(wire), 7):  # chunk framing cut at arbitrary points
            writer.write(wire[i : i + 7])
            await writer.drain()
            await asyncio.sleep(0)

    raw, key = await serve(script)
    resp = await _post(pool, key)
    assert await resp.read_until(b"\n\n") == events[0]
    rest = b""
    while chunk := await resp.read_some():
        rest += chunk
    assert rest == events[1] + events[2]  # decoded: no chunk sizes or CRLFs
    resp.release()
    resp2 = await _post(pool, key)
    assert await resp2.read() == b"".join(events)
    assert raw.connections == 1


async def test_released_at_done_is_reused_once_the_body_ends(serve, pool: Pool) -> None:
    """A stream released after its last event, before the terminating chunk, goes back to the pool."""
    go_on = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        event = b"data: [DONE]\n\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event)
        )
        await writer.drain()
        if n == 0:
            await go_on.wait()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    raw, key = await serve(script)
    resp = await _post(pool, key)
    assert await resp.read_until(b"\n\n") == b"data: [DONE]\n\n"
    resp.release()  # the terminating chunk has not been sent yet
    go_on.set()
    # Pool internals: the connection goes back once the terminating chunk is read.
    await wait_until_async(lambda: bool(pool._idle.get(key)), 2, "the connection back in the pool")
    resp2 = await _post(pool, key)
    assert await resp2.read() == b"data: [DONE]\n\n"
    assert raw.connections == 1


async def test_release_before_the_end_with_more_data_closes(serve, pool: Pool) -> None:
    released = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
        await writer.drain()
        await released.wait()
        writer.write(b"67890")
        await writer.drain()

    raw, key = await serve(script)
    resp = await _post(pool, key)
    assert await resp.read_some() == b"12345"
    resp.release()  # the rest of the body arrives after: nobody reads it, the connection is closed
    released.set()
    await asyncio.wait_for(raw.closed.wait(), 2)
    resp2 = await _post(pool, key)
    assert await resp2.read() == b"1234567890"  # a new connection (its rest comes at once)
    assert raw.connections == 2


async def test_close_delimited_body_and_connection_close(serve, pool: Pool) -> None:
    answered: list[int] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        answered.append(n)
        if len(answered) == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    raw, key = await serve(script)
    assert await (await _post(pool, key)).read() == b"ok"
    assert await (await _post(pool, key)).read() == b"until the end"
    assert raw.connections == 2  # neither connection was kept


async def test_non_200_status_and_body(serve, pool: Pool) -> None:
    _, key = await serve(_answer(b'HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\n{"error":1}'))
    resp = await _post(pool, key)
    assert resp.status == 400 and await resp.read() == b'{"error":1}'


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345", "before the response ended"),
        (b"", "before answering"),
        (b"NOT HTTP AT ALL\r\n\r\n", "malformed"),
    ],
)
async def test_broken_answers_are_protocol_errors(serve, pool: Pool, answer: bytes, message: str) -> None:
    _, key = await serve(_answer(answer, close=True))
    with pytest.raises(HttpError) as info:
        resp = await _post(pool, key)
        await resp.read()
    assert info.value.kind == "protocol" and message in str(info.value)


async def test_connect_refused(pool: Pool) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(HttpError) as info:
        await _post(pool, Pool.key(f"http://127.0.0.1:{port}"))
    assert info.value.kind == "connect"


async def test_close_mid_stream_tells_the_server(serve, pool: Pool) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await reader.read()  # until the client goes away

    raw, key = await serve(script)
    resp = await _post(pool, key)
    assert await resp.read_some() == b"hello"
    resp.close()
    await asyncio.wait_for(raw.closed.wait(), 2)


async def test_large_body_with_backpressure(serve, pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "_HIGH_WATER", 4096)
    payload = bytes(range(256)) * 4096  # 1 MiB
    _, key = await serve(
        _answer(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    )
    resp = await _post(pool, key)
    got = b""
    while chunk := await resp.read_some():
        assert len(chunk) <= 4096 + 65536 * 4  # reading paused near the high-water mark
        got += chunk
        await asyncio.sleep(0)
    assert got == payload


async def test_idle_connections_expire(serve, pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "IDLE_S", 0.0)  # every idle connection is past its time at once
    raw, key = await serve(_length_answer)
    await (await _post(pool, key)).read()
    await (await _post(pool, key)).read()
    assert raw.connections == 2


async def test_upstream_post_sends_the_worker_key_only_to_its_worker(serve, pool: Pool) -> None:
    """``upstream.post_json`` on this client: head, body and Authorization per worker; statuses as errors."""
    raw, (host, port, _) = await serve(_length_answer)

    def worker(key: str) -> Worker:
        cfg = WorkerConfig(url=f"http://{host}:{port}", api_key=Secret(key))
        return Worker(cfg, "decode", CircuitBreaker(CircuitConfig()))

    assert await post_json(pool, worker("sk-worker"), "/v1/completions", b'{"a":1}') == b'{"n":0}'
    assert await post_json(pool, worker(""), "/v1/completions", b'{"a":2}') == b'{"n":1}'
    first, second = raw.heads
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer sk-worker\r\n" in first
    assert b"authorization" not in second.lower()
    assert raw.bodies == [b'{"a":1}', b'{"a":2}']


async def test_upstream_status_and_connect_errors() -> None:
    script = _answer(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
    server = await asyncio.start_server(RawServer(script).handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    w = Worker(WorkerConfig(url=f"http://127.0.0.1:{port}"), "decode", CircuitBreaker(CircuitConfig()))
    pool = Pool(1.0)
    try:
        with pytest.raises(UpstreamError) as info:
            await post_json(pool, w, "/v1/completions", b"{}")
        assert (info.value.kind, info.value.status, info.value.body) == ("status", 503, b"busy")
        assert info.value.worker_fault and info.value.retryable
        server.close()
        await server.wait_closed()
        pool.close()
        pool = Pool(1.0)
        with pytest.raises(UpstreamError) as info:
            await post_json(pool, w, "/v1/completions", b"{}")
        assert info.value.kind == "connect"
    finally:
        server.close()
        pool.close()


async def test_read_until_gives_up_on_a_separator_that_never_comes(
    serve, pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http1, "_HIGH_WATER", 1024)
    _, key = await serve(_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 100000))
    resp = await _post(pool, key)
    with pytest.raises(HttpError) as info:
        await asyncio.wait_for(resp.read_until(b"\n\n"), 2)
    assert info.value.kind == "protocol"
    resp.close()
