"""Short requests lent to an idle prefill worker (``policy.lend_max_active``), with fake engines on real HTTP.

P's capacity serves short requests while no long prompt needs it: a short request goes to a prefill worker
that has no prefill leg in flight when it has fewer requests than both ``lend_max_active`` and the least
loaded decode worker. Slow fake engines keep the requests in flight (``token_delay_s``), so what each
worker is running when the next request arrives is the test's choice.
"""

from __future__ import annotations

import asyncio

from pd_connector import wire
from test_support.fake_vllm import generate
from tests.polling import wait_until_async
from tests.router.conftest import MODEL, long_prompt, short_prompt
from tests.router.sse import text_of

SLOW = 0.05  # s per token: a 40-token request stays in flight ~2 s
LENT = 'pd_router_requests_total{endpoint="/v1/completions",reason="lent",route="local"} '


def _body(max_tokens: int, stream: bool = True, prompt: str | None = None) -> dict:
    return {"model": MODEL, "prompt": prompt or short_prompt(), "max_tokens": max_tokens, "stream": stream}


async def _lent(c) -> float:
    text = await (await c.router.get("/metrics")).text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(LENT))


async def test_a_short_request_runs_on_an_idle_prefill_worker_when_every_decode_worker_is_busier(
    make_cluster,
) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1, policy__lend_max_active=1)
    (p,), (d,) = c.prefill, c.decode
    p.token_delay_s = d.token_delay_s = SLOW
    first = asyncio.create_task(c.router.post("/v1/completions", json=_body(40)))
    await wait_until_async(lambda: len(d.requests) == 1, 5, "the first request on D")  # P as idle as D: D
    second = asyncio.create_task(c.router.post("/v1/completions", json=_body(40)))
    await wait_until_async(lambda: len(p.requests) == 1, 5, "the second request lent to P")
    assert wire.KV_TRANSFER_PARAMS not in p.requests[0]  # served by P alone, as D would: no transfer
    third = await c.router.post("/v1/completions", json=_body(2, stream=False))  # P at lend_max_active: D
    assert third.status == 200 and len(d.requests) == 2 and len(p.requests) == 1
    for task in (first, second):
        r = await task
        assert r.status == 200 and r.headers["X-PD-Route"] == "local"
        assert text_of(await r.read()) == "".join(generate(short_prompt(), 40))
    assert await _lent(c) == 1


async def test_no_short_request_is_lent_to_a_prefill_worker_while_it_prefills(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1, policy__lend_max_active=4)
    (p,), (d,) = c.prefill, c.decode
    d.token_delay_s = SLOW
    p.first_token_delay_s = 30.0  # P's leg stays in flight until D's answer ends the request
    chat = asyncio.create_task(c.router.post("/v1/completions", json=_body(40)))
    await wait_until_async(lambda: len(d.requests) == 1, 5, "the first request on D")
    long = asyncio.create_task(c.router.post("/v1/completions", json=_body(40, False, long_prompt())))
    await wait_until_async(lambda: len(p.requests) == 1 and len(d.requests) == 2, 5, "the P/D legs")
    # P: 1 leg (prefilling), D: 2; without the prefill P would be the less loaded
    short = await c.router.post("/v1/completions", json=_body(2, stream=False))
    assert short.status == 200 and len(d.requests) == 3 and len(p.requests) == 1
    r = await long
    assert r.status == 200 and r.headers["X-PD-Route"] == "disagg"
    assert (await chat).status == 200
    assert await _lent(c) == 0


async def test_lending_is_off_by_default(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1)
    (p,), (d,) = c.prefill, c.decode
    d.token_delay_s = SLOW
    first = asyncio.create_task(c.router.post("/v1/completions", json=_body(40)))
    await wait_until_async(lambda: len(d.requests) == 1, 5, "the first request on D")
    second = await c.router.post("/v1/completions", json=_body(2, stream=False))
    assert second.status == 200 and len(d.requests) == 2 and p.requests == []
    assert (await first).status == 200


async def test_a_lent_stream_broken_on_its_prefill_worker_is_resumed_on_a_decode_worker(make_cluster) -> None:
    """A lent request is a local one: when P breaks its stream, a decode worker continues it from the tokens
    the client has (retries and resumes place on decode workers only)."""
    c = await make_cluster(n_prefill=1, n_decode=1, policy__lend_max_active=1)
    (p,), (d,) = c.prefill, c.decode
    c.state.balancer.decode.workers[0].active = 5  # D looks busier than the idle P: the request is lent
    p.die_after_tokens = 3
    r = await c.router.post("/v1/completions", json=_body(10))
    raw = await r.read()
    assert r.status == 200 and r.headers["X-PD-Route"] == "local"
    assert text_of(raw) == "".join(generate(short_prompt(), 10))  # no token lost or repeated
    (lent,) = p.requests
    (cont,) = d.requests
    assert cont["max_tokens"] == 7 and lent["max_tokens"] == 10
    assert await _lent(c) == 1


async def test_with_kv_aware_routing_a_lent_prompt_is_recorded_on_the_prefill_worker_it_ran_on(
    make_cluster,
) -> None:
    """KV-aware routing on: the lent request is placed with reason ``lent`` and its prompt recorded on P,
    whose prefix cache now holds it (a later long prompt sharing it prefers that P)."""
    c = await make_cluster(
        n_prefill=1, n_decode=1, policy__lend_max_active=1, kv_routing__enabled=True, kv_routing__block_size=4
    )
    (p,), (d,) = c.prefill, c.decode
    c.state.balancer.decode.workers[0].active = 5  # D looks busier than the idle P: the request is lent
    prompt = " ".join(
        ["hello world"] * 4
    )  # counted exactly (not provably short by its bytes), under 32 tokens
    r = await c.router.post("/v1/completions", json=_body(2, stream=False, prompt=prompt))
    assert r.status == 200 and len(p.requests) == 1 and d.requests == []
    text = await (await c.router.get("/metrics")).text()
    assert 'pd_router_decode_placements_total{reason="lent"} 1.0' in text
    assert c.state.balancer.prefixes is not None and c.state.balancer.prefixes.blocks() > 0  # recorded on P
