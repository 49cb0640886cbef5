"""The profiler against an in-process server that speaks vLLM's OpenAI streaming protocol (SSE chunks).

Timing assertions are lower bounds only (the fake sleeps at least that long); the real server is profiled in
integration_tests/test_planner.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from rich.console import Console

from planner.profiler import ProfilerConfig, ProfilerError, measure_profile

TOKEN_DELAY_S = 0.002
PREFILL_S_PER_TOKEN = 0.0001


def _fake_app(fail: bool = False) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if fail or body["model"] != "fake-model" or not all(isinstance(t, int) for t in body["prompt"]):
            return web.json_response({"error": {"message": "bad request"}}, status=400)
        assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(PREFILL_S_PER_TOKEN * len(body["prompt"]))
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(TOKEN_DELAY_S)
            chunk = {
                "id": "c",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "x", "finish_reason": None}],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": body["max_tokens"],
            "total_tokens": 0,
        }
        await response.write(f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


@contextlib.asynccontextmanager
async def _serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _config(endpoint: str) -> ProfilerConfig:
    return ProfilerConfig(
        endpoint=endpoint, isl=200, ttft_samples=2, prefill_requests=4, prefill_concurrency=2,
        decode_batches=(4, 1, 2), decode_tokens=8, timeout_s=30,
    )  # fmt: skip


async def test_profile_from_a_streaming_server() -> None:
    async with _serve(_fake_app()) as endpoint:
        profile = await measure_profile(_config(endpoint), Console(quiet=True))
    assert [p.batch for p in profile.decode] == [1, 2, 4]
    assert all(p.tpot_s >= TOKEN_DELAY_S for p in profile.decode)
    # prefill sleeps 0.02 s per 200-token prompt, two at a time: at most 2 * 200 / 0.02 tokens/s
    assert 0 < profile.prefill_max_tokens_per_s <= 2 * 200 / (PREFILL_S_PER_TOKEN * 200)
    assert profile.isl == 200
    assert profile.source is not None and "model=fake-model" in profile.source


async def test_server_errors_are_reported() -> None:
    async with _serve(_fake_app(fail=True)) as endpoint:
        with pytest.raises(ProfilerError, match="400"):
            await measure_profile(_config(endpoint), Console(quiet=True))
