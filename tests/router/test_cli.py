"""``pd-router`` as a process (``python -m router.cli``): it serves through the front, and SIGTERM lets a
stream in flight finish before the process exits."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from pd_disagg.servers import free_port
from test_support.fake_vllm import FakeEngine
from tests.polling import wait_until_async
from tests.router.conftest import MODEL, short_prompt
from tests.router.sse import payloads


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    fake = FakeEngine(model=MODEL, token_delay_s=0.02)
    server = TestServer(fake.app())
    await server.start_server()
    yield fake, str(server.make_url("")).rstrip("/")
    await server.close()


@contextlib.asynccontextmanager
async def _router(
    tmp_path: Path, tokenizer_dir: Path, upstream: str, server: str = ""
) -> AsyncIterator[tuple[subprocess.Popen[bytes], int]]:
    """A ready ``pd-router`` process and its port; killed on the way out if the test left it running."""
    port = free_port()
    config = tmp_path / "router.toml"
    config.write_text(
        f'[model]\npath = "{MODEL}"\ntokenizer = "{tokenizer_dir}"\nmax_model_len = 4096\n'
        f'[[decode]]\nurl = "{upstream}"\n[server]\nport = {port}\n{server}'
    )
    proc = subprocess.Popen([sys.executable, "-m", "router.cli", "--config", str(config)])
    try:
        await _until_ready(proc, port)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def _until_ready(proc: subprocess.Popen[bytes], port: int) -> None:
    """Until ``/ready`` answers 200 (start-up runs a first health round); fails at once if the process exits."""
    async with aiohttp.ClientSession() as session:

        async def ready() -> bool:
            assert proc.poll() is None, "pd-router exited"
            try:
                async with session.get(f"http://127.0.0.1:{port}/ready") as r:
                    return r.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await wait_until_async(ready, 15, "pd-router to be ready")


async def test_sigterm_lets_the_stream_in_flight_finish(tmp_path: Path, tokenizer_dir: Path, engine) -> None:
    fake, upstream = engine
    async with _router(tmp_path, tokenizer_dir, upstream) as (proc, port):
        body = {"model": MODEL, "prompt": short_prompt(), "max_tokens": 25, "stream": True}
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
            assert r.status == 200 and r.headers["X-PD-Route"] == "local"
            assert "Server" not in r.headers  # the front answered (aiohttp's server names itself)
            first = await r.content.readuntil(b"\n\n")  # the stream is under way
            proc.send_signal(signal.SIGTERM)
            rest = await r.read()
        events = payloads(first + rest)
        assert events[-1] == "[DONE]" and len(events) == 26  # 25 tokens, none lost to the shutdown
        assert await asyncio.to_thread(proc.wait, 10) == 0
        assert fake.finished == 1 and fake.abandoned == 0


async def test_sigterm_on_an_idle_router_exits_at_once(tmp_path: Path, tokenizer_dir: Path, engine) -> None:
    _, upstream = engine
    async with _router(tmp_path, tokenizer_dir, upstream) as (proc, _):
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 10) == 0


async def test_a_stream_longer_than_the_shutdown_timeout_is_cut(
    tmp_path: Path, tokenizer_dir: Path, engine
) -> None:
    fake, upstream = engine
    async with _router(tmp_path, tokenizer_dir, upstream, "shutdown_timeout_s = 0.3\n") as (proc, port):
        body = {"model": MODEL, "prompt": short_prompt(), "max_tokens": 500, "stream": True}  # ~10 s
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
            await r.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(aiohttp.ClientPayloadError):  # the chunked body never ends properly
                await r.read()
        assert await asyncio.to_thread(proc.wait, 10) == 0
        # the decode leg was closed, so the worker abandons it
        await wait_until_async(lambda: fake.abandoned > 0, 5, "the worker to abandon the cut stream")
        assert fake.abandoned == 1 and fake.finished == 0
