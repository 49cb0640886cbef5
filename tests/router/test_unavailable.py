"""A request that finds no usable worker of a role it needs waits for one to come back
(``policy.unavailable_wait_s``) instead of failing at once, with fake engines on real HTTP.

The router's health checks are driven by hand here (``interval_s`` 600, ``checker.run_once``), so when a
worker is taken out and brought back is the test's choice, not a timer's.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from test_support.fake_vllm import generate
from tests.polling import wait_until_async
from tests.router.conftest import MODEL, short_prompt
from tests.router.sse import text_of

BODY = {"model": MODEL, "prompt": short_prompt(), "max_tokens": 2}
HAND_CHECKED = {"health__unhealthy_after": 1, "health__interval_s": 600.0}


async def _waiting(c) -> float:
    text = await (await c.router.get("/metrics")).text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("pd_router_waiting ")
    )


async def test_a_request_waits_for_its_decode_worker_to_come_back_and_is_served(make_cluster) -> None:
    c = await make_cluster(n_decode=1, **HAND_CHECKED)
    (d,) = c.decode
    d.healthy = False
    await c.state.checker.run_once()  # D is taken out
    answer = asyncio.create_task(c.router.post("/v1/completions", json=BODY))
    await wait_until_async(lambda: _waiting(c), 5, "the request to wait for a decode worker")
    assert not answer.done() and d.requests == []
    d.healthy = True
    await c.state.checker.run_once()  # D is back
    r = await answer
    assert r.status == 200 and len(d.requests) == 1
    assert await _waiting(c) == 0


@pytest.mark.parametrize("wait_s", [0.3, 0.0])
async def test_a_request_gets_503_when_no_decode_worker_came_back_in_time(
    make_cluster, wait_s: float
) -> None:
    """After ``unavailable_wait_s``; at once with 0 (the 10 s default would have waited)."""
    c = await make_cluster(n_decode=1, policy__unavailable_wait_s=wait_s, **HAND_CHECKED)
    c.decode[0].healthy = False
    await c.state.checker.run_once()
    start = time.monotonic()
    r = await c.router.post("/v1/completions", json=BODY)
    assert wait_s <= time.monotonic() - start < wait_s + 5.0
    assert r.status == 503
    assert (await r.json())["error"]["message"] == "no healthy decode worker is available"
    assert await _waiting(c) == 0


async def test_a_retry_returns_to_the_worker_that_failed_it_once_that_worker_came_back(make_cluster) -> None:
    """The one D fails the first attempt and is taken out during the backoff: the retry waits for it, and
    goes back to it once its health checks brought it back."""
    c = await make_cluster(
        n_decode=1, retry__backoff_base_s=0.5, retry__backoff_max_s=0.5, retry__jitter=0.0, **HAND_CHECKED
    )
    (d,) = c.decode
    d.fail_status = 500
    answer = asyncio.create_task(c.router.post("/v1/completions", json=BODY))
    await wait_until_async(lambda: len(d.requests) == 1, 5, "the first attempt")
    d.healthy = False
    await c.state.checker.run_once()  # within the 0.5 s backoff: D is out when the retry looks for a worker
    await wait_until_async(lambda: _waiting(c), 5, "the retry to wait for a decode worker")
    d.fail_status, d.healthy = 0, True
    await c.state.checker.run_once()
    r = await answer
    assert r.status == 200 and len(d.requests) == 2


async def test_no_wait_when_every_worker_failed_the_request_and_none_is_away(make_cluster) -> None:
    """A D that fails requests but passes its health checks will not come back: the client gets the failure
    at once, not after ``unavailable_wait_s``."""
    c = await make_cluster(n_decode=1, policy__unavailable_wait_s=30.0, **HAND_CHECKED)
    c.decode[0].fail_status = 500
    start = time.monotonic()
    r = await c.router.post("/v1/completions", json=BODY)
    assert r.status == 502 and time.monotonic() - start < 10.0
    assert len(c.decode[0].requests) == 1


async def test_a_broken_stream_waits_for_its_decode_worker_to_come_back_and_resumes_there(
    make_cluster,
) -> None:
    """The one D breaks a stream after 2 tokens, having been taken out meanwhile: the resume waits for it and
    continues the stream there once it is back, without a token lost or repeated."""
    c = await make_cluster(n_decode=1, **HAND_CHECKED)
    (d,) = c.decode
    d.die_after_tokens, d.token_delay_s = 2, 0.2
    body = {"model": MODEL, "prompt": "a b", "max_tokens": 5, "stream": True}
    answer = asyncio.create_task(c.router.post("/v1/completions", json=body))
    await wait_until_async(lambda: len(d.requests) == 1, 5, "the stream to start")
    d.healthy = False
    await c.state.checker.run_once()  # D is out before it breaks the stream (2 tokens, 0.4 s)
    await wait_until_async(lambda: _waiting(c), 5, "the resume to wait for a decode worker")
    d.die_after_tokens, d.token_delay_s, d.healthy = -1, 0.0, True
    await c.state.checker.run_once()
    r = await answer
    raw = await r.read()
    assert r.status == 200 and text_of(raw) == "".join(generate("a b", 5))
    assert len(d.requests) == 2  # the stream, then its continuation
