"""The router benchmark's floor: ``benchmarks.byte_relay`` (the real module, on uvloop, as the benchmark runs
it) passes bytes both ways unchanged and closes the client when the upstream cannot be reached."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

from aiohttp import ClientSession, ClientTimeout
from aiohttp.test_utils import TestServer

from pd_disagg.servers import free_port
from test_support.fake_vllm import FakeEngine
from tests.polling import wait_until_async


@contextlib.asynccontextmanager
async def _relay(upstream_port: int):
    port = free_port()
    relay = subprocess.Popen([sys.executable, "-m", "benchmarks.byte_relay", str(port), str(upstream_port)])
    try:

        async def listens() -> bool:
            assert relay.poll() is None, "the relay exited"
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            writer.close()
            return True

        await wait_until_async(listens, 10, "the relay to listen")
        yield port
    finally:
        relay.kill()
        relay.wait(10)


async def test_a_streamed_completion_through_the_relay_equals_the_direct_one() -> None:
    server = TestServer(FakeEngine(token_delay_s=0.001).app())
    await server.start_server()
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 16, "stream": True}
    try:
        async with _relay(server.port) as port, ClientSession(timeout=ClientTimeout(total=10)) as s:  # type: ignore[arg-type]
            async with s.post(f"http://127.0.0.1:{server.port}/v1/completions", json=body) as r:
                direct = await r.read()
            for _ in range(2):  # keep-alive: the second request reuses the relayed connection
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200
                    relayed = await r.read()
                assert relayed.count(b"data: ") == direct.count(b"data: ") == 17  # 16 token events, [DONE]
                assert relayed.endswith(b"data: [DONE]\n\n")
    finally:
        await server.close()


async def test_client_is_closed_when_the_upstream_is_unreachable() -> None:
    async with _relay(free_port()) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            received = await asyncio.wait_for(reader.read(), 5)
        except ConnectionResetError:  # closed with our request unread: the kernel resets instead of FIN
            received = b""
        assert received == b""  # closed, nothing sent
        writer.close()
