"""Flow ``sglang-bootstrap``: every request goes P->D, since SGLang's decode servers cannot prefill alone.

No local path (short prompts, no usable P, saturated P, a failed P leg, a resumed stream): without a prefill
worker the client gets a 503 once none came back within ``unavailable_wait_s``, with every one saturated a
429 after the queue timeout, and a decode worker never gets a request without its bootstrap fields.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.polling import wait_until_async
from tests.router.conftest import MODEL, long_prompt, short_prompt
from tests.router.sse import text_of

FLOW = "sglang-bootstrap"
_ROOM = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def _paired(p: dict, d: dict) -> bool:
    return all(k in d for k in _ROOM) and [p[k] for k in _ROOM] == [d[k] for k in _ROOM]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_short_prompt_goes_prefill_then_decode(make_cluster, path: str) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1, flow=FLOW)
    body: dict = {"model": MODEL, "max_tokens": 2}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = short_prompt()
    r = await c.router.post(path, json=body)
    assert r.status == 200 and r.headers["X-PD-Route"] == "disagg"
    (p,), (d,) = c.prefill[0].requests, c.decode[0].requests
    assert _paired(p, d) and p["max_tokens"] == 1
    metrics = await (await c.router.get("/metrics")).text()
    assert f'pd_router_requests_total{{endpoint="{path}",reason="disagg_only",route="disagg"}} 1.0' in metrics


async def test_no_usable_prefill_worker_is_a_503_once_none_came_back(make_cluster) -> None:
    c = await make_cluster(
        n_prefill=1, n_decode=1, flow=FLOW, server__retry_after_s=4, policy__unavailable_wait_s=0.3
    )
    r = await c.router.post("/admin/workers/drain", json={"role": "prefill", "url": c.url(c.prefill[0])})
    assert r.status == 200
    start = time.monotonic()
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
    )
    assert time.monotonic() - start >= 0.3  # it waited for a P to come back, then gave up
    assert r.status == 503 and r.headers["Retry-After"] == "4"
    assert (await r.json())["error"]["message"] == "no healthy prefill worker is available"
    assert c.decode[0].requests == []
    metrics = await (await c.router.get("/metrics")).text()
    assert 'reason="no_prefill",route="rejected"} 1.0' in metrics


async def test_saturated_prefill_workers_are_waited_for_then_429(make_cluster) -> None:
    c = await make_cluster(
        n_prefill=1, n_decode=1, flow=FLOW, policy__queue_timeout_s=0.2, server__retry_after_s=3
    )
    c.state.balancer.prefill.workers[0].outstanding_tokens = 10**6  # P is saturated, D idle
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": short_prompt(), "max_tokens": 2}
    )
    assert r.status == 429 and r.headers["Retry-After"] == "3"
    assert (await r.json())["error"]["message"] == "every prefill worker is at capacity"
    assert c.decode[0].requests == [] and c.prefill[0].requests == []


async def test_a_request_waiting_for_prefill_goes_on_when_a_prefill_worker_frees_up(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1, flow=FLOW, policy__queue_timeout_s=20.0)
    worker = c.state.balancer.prefill.workers[0]
    worker.outstanding_tokens = 10**6
    waiting = asyncio.ensure_future(
        c.router.post("/v1/completions", json={"model": MODEL, "prompt": short_prompt(), "max_tokens": 2})
    )
    await wait_until_async(
        lambda: c.state.proxy is not None and c.state.proxy.pending == 1, 2, "the queued request"
    )
    assert not waiting.done()
    worker.outstanding_tokens = 0
    c.state.balancer.prefill.notify()  # what a finished prefill leg does
    r = await waiting
    assert r.status == 200 and r.headers["X-PD-Route"] == "disagg"


@pytest.mark.parametrize(
    ("fan_out", "param"),
    [
        ({"n": 2}, "n"),
        ({"prompt": [short_prompt(), short_prompt()]}, "prompt"),
        ({"use_beam_search": True}, None),
    ],
)
async def test_several_sequences_are_refused(make_cluster, fan_out: dict, param: str | None) -> None:
    """The other flows send them to D alone; here D cannot serve them, and SGLang pairs n samples with one room."""
    c = await make_cluster(n_prefill=1, n_decode=1, flow=FLOW)
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": short_prompt(), "max_tokens": 2, **fan_out}
    )
    assert r.status == 400
    error = (await r.json())["error"]
    assert "one sequence per request" in error["message"] and error["param"] == (param or "use_beam_search")
    assert c.prefill[0].requests == [] and c.decode[0].requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_failing_prefill_workers_never_leave_decode_alone(make_cluster, stream: bool) -> None:
    c = await make_cluster(n_prefill=2, n_decode=1, flow=FLOW)
    for p in c.prefill:
        p.fail_status = 500
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2, "stream": stream}
    )
    assert r.status == 502  # each P tried once, then no P is left to try: never D alone
    assert len(c.prefill[0].requests) == len(c.prefill[1].requests) == 1
    assert all(all(k in d for k in _ROOM) for d in c.decode[0].requests)
    assert c.decode[0].finished == 0


async def test_a_broken_stream_resumes_prefill_then_decode(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=2, flow=FLOW)
    c.decode[0].die_after_tokens = 2
    c.state.balancer.decode.workers[1].active = 5  # pretend D1 is busier, so D0 is picked first
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 5, "stream": True}
    r = await c.router.post("/v1/completions", json=body)
    assert r.status == 200 and text_of(await r.read()) == " w64 w65 w66 w67 w68"
    first_p, resumed_p = c.prefill[0].requests
    (first_d,), (resumed_d,) = c.decode[0].requests, c.decode[1].requests
    assert _paired(first_p, first_d) and _paired(resumed_p, resumed_d)
    assert resumed_d["bootstrap_room"] != first_d["bootstrap_room"]
    assert resumed_p["max_tokens"] == 1 and resumed_d["max_tokens"] == 3
