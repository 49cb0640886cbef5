"""Health checks travel over the legs' keep-alive pool: they keep a connection to each worker alive for the
next request, and every way a check can fail (status, refused, silent worker) is a plain ``False``."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from pd_disagg.servers import free_port
from router import http1
from router.http1 import Pool
from router.upstream import check_health
from test_support.fake_vllm import FakeEngine
from tests.router.conftest import MODEL, short_prompt


async def test_a_request_after_a_quiet_spell_reuses_the_connection_health_checks_kept(
    make_cluster, monkeypatch
) -> None:
    monkeypatch.setattr(http1, "IDLE_S", 0.3)  # pooled connections older than this are not reused
    peers: dict[str, set[int]] = {"health": set(), "completions": set()}
    health, completions = FakeEngine._health, FakeEngine._completions

    async def spy_health(self: FakeEngine, request: web.Request) -> web.StreamResponse:
        peers["health"].add(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return await health(self, request)

    async def spy_completions(self: FakeEngine, request: web.Request) -> web.StreamResponse:
        peers["completions"].add(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return await completions(self, request)

    monkeypatch.setattr(FakeEngine, "_health", spy_health)
    monkeypatch.setattr(FakeEngine, "_completions", spy_completions)
    c = await make_cluster(n_prefill=0, n_decode=1)  # health checks every 0.2 s
    body = {"model": MODEL, "prompt": short_prompt(), "max_tokens": 2}
    for _ in range(2):
        assert (await c.router.post("/v1/completions", json=body)).status == 200
        await asyncio.sleep(1.0)  # > IDLE_S: without the checks, the pooled connection would have expired
    assert len(peers["health"]) >= 1
    assert peers["completions"] <= peers["health"]  # no connection of its own: the checks' warm one


async def test_check_health_is_false_on_a_bad_status_a_refused_connection_and_a_silent_worker() -> None:
    engine = FakeEngine(model=MODEL)
    runner = web.AppRunner(engine.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never answers
    silent_port = silent.sockets[0].getsockname()[1]
    pool = Pool(connect_timeout_s=1.0)
    try:
        assert await check_health(pool, f"http://127.0.0.1:{port}", 1.0)
        engine.healthy = False
        assert not await check_health(pool, f"http://127.0.0.1:{port}", 1.0)  # 503
        engine.healthy = True
        assert await check_health(pool, f"http://127.0.0.1:{port}", 1.0)  # the pool still works after a 503
        assert not await check_health(pool, f"http://127.0.0.1:{free_port()}", 1.0)  # refused
        start = time.monotonic()
        assert not await check_health(pool, f"http://127.0.0.1:{silent_port}", 0.3)
        assert time.monotonic() - start < 1.0  # bounded by the check's timeout
    finally:
        pool.close()
        silent.close()
        await runner.cleanup()
