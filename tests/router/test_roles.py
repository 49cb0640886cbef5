"""Switching a worker's role through the admin API (``router/roles.py``), against fake vLLM engines.

The switched engine is a fake standing for a ``kv_both`` vLLM engine: the test sets the fake's own ``role``
once the router moved it, as the real engine needs nothing (one connector serves both roles).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.config import ConfigError, parse_config
from test_support.fake_vllm import generate
from tests.polling import wait_until_async
from tests.router.conftest import MODEL, Cluster, long_prompt

BOTH = ["prefill", "decode"]


async def _as_both(c: Cluster, index: int) -> str:
    """Re-register decode engine ``index`` as one that serves both roles; returns its URL."""
    url = c.url(c.decode[index])
    assert (await c.router.delete("/admin/workers", json={"role": "decode", "url": url})).status == 200
    worker = {"url": url, "roles": BOTH}
    r = await c.router.post("/admin/workers", json={"role": "decode", "worker": worker})
    assert r.status == 201, await r.text()
    return url


async def _switch(c: Cluster, **body: Any) -> tuple[int, dict[str, Any]]:
    r = await c.router.post("/admin/workers/role", json=body)
    return r.status, await r.json()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def _in_flight_on(c: Cluster, index: int, n_tokens: int) -> asyncio.Task[Any]:
    """A slow request (``n_tokens`` of 0.1 s each: longer than the test's other requests take on a loaded
    machine) to D alone, on decode engine ``index``, once it is sent."""
    others = [c.url(e) for i, e in enumerate(c.decode) if i != index]
    for url in others:  # the request can only be placed on ``index``
        await c.router.post("/admin/workers/drain", json={"role": "decode", "url": url})
    c.decode[index].token_delay_s = 0.1
    body = {"model": MODEL, "prompt": "a b", "max_tokens": n_tokens}
    task = asyncio.create_task(c.router.post("/v1/completions", json=body))
    worker = c.state.balancer.decode.find(c.url(c.decode[index]))
    assert worker is not None
    await wait_until_async(lambda: worker.active == 1, what="the request on the worker")
    for url in others:
        await c.router.post("/admin/workers/drain", json={"role": "decode", "url": url, "drain": False})
    return task


async def test_a_switch_lets_the_old_roles_legs_finish_and_sends_none_meanwhile(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=2)
    both = await _as_both(c, 0)
    slow = await _in_flight_on(c, 0, n_tokens=30)
    switch = asyncio.create_task(_switch(c, url=both, role="prefill", bootstrap="127.0.0.1:7100"))
    worker = c.state.balancer.decode.find(both)
    assert worker is not None
    await wait_until_async(lambda: worker.switching_to == "prefill", what="the drain")
    listed = await (await c.router.get("/admin/workers")).json()
    assert {"url": both, "draining": True, "switching_to": "prefill"}.items() <= next(
        w for w in listed["workers"] if w["url"] == both
    ).items()
    again = await _switch(c, url=both, role="prefill", bootstrap="127.0.0.1:7100")
    assert again[0] == 409 and "already switching to prefill" in again[1]["error"]["message"]
    sent = len(c.decode[0].requests)
    for _ in range(4):  # while it drains, new requests go to the other decode worker
        r = await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
        assert r.status == 200
    assert len(c.decode[0].requests) == sent and not switch.done()
    answer = await slow  # the leg of the old role finished there, whole
    assert answer.status == 200
    assert (await answer.json())["choices"][0]["text"] == "".join(generate("a b", 30))
    status, moved = await switch
    assert status == 200 and moved["role"] == "prefill" and moved["healthy"] is True
    assert c.state.balancer.decode.find(both) is None and c.state.balancer.prefill.find(both) is not None
    # In its new role it takes prefill legs (the other P drained so that it must).
    c.decode[0].role, c.decode[0].token_delay_s = "prefill", 0.0
    p0 = c.url(c.prefill[0])
    await c.router.post("/admin/workers/drain", json={"role": "prefill", "url": p0})
    before = len(c.decode[0].requests)
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
    )
    assert r.status == 200 and r.headers["x-pd-route"] == "disagg"
    assert len(c.decode[0].requests) == before + 1 and c.decode[0].requests[-1]["max_tokens"] == 1
    metrics = await (await c.router.get("/metrics")).text()
    assert _metric(metrics, 'pd_router_role_switches_total{result="switched",role="prefill"}') == 1
    assert _metric(metrics, "pd_router_role_drain_seconds_count") == 1
    # and back: a P -> D switch needs no bootstrap
    status, back = await _switch(c, url=both, role="decode")
    assert status == 200 and back["role"] == "decode"


async def test_a_drain_that_times_out_leaves_the_worker_in_its_role(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=2)
    both = await _as_both(c, 0)
    slow = await _in_flight_on(c, 0, n_tokens=10)
    status, body = await _switch(c, url=both, role="prefill", bootstrap="h:1", drain_timeout_s=0.2)
    assert status == 409 and "still had 1 decode legs" in body["error"]["message"]
    worker = c.state.balancer.decode.find(both)
    assert worker is not None and not worker.draining and not worker.switching_to
    assert c.state.balancer.prefill.find(both) is None
    assert (await slow).status == 200
    metrics = await (await c.router.get("/metrics")).text()
    assert _metric(metrics, 'pd_router_role_switches_total{result="timeout",role="prefill"}') == 1


async def test_a_worker_that_serves_one_role_is_not_switched(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=2)
    d1 = c.url(c.decode[1])
    status, body = await _switch(c, url=d1, role="prefill", bootstrap="h:1")
    assert status == 409 and "serves ['decode'] only" in body["error"]["message"]
    worker = c.state.balancer.decode.find(d1)
    assert worker is not None and worker.usable() and c.state.balancer.prefill.find(d1) is None


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"role": "both"}, 400, "invalid role switch"),
        ({"role": "prefill", "color": "red"}, 400, "unknown field"),
        ({"role": "prefill"}, 400, "bootstrap"),  # pd-push prefill workers need their side channel
        ({"role": "prefill", "bootstrap": "h:1", "drain_timeout_s": 0}, 400, "drain_timeout_s"),
        ({"role": "prefill", "bootstrap": "h:1", "drain_timeout_s": 21}, 400, "timeouts.request_s"),
        ({"role": "decode"}, 409, "already a decode worker"),
        ({"role": "prefill", "bootstrap": "h:1", "url": "http://nowhere:1"}, 404, "no worker"),
    ],
)
async def test_bad_switches_get_a_clear_error_and_change_nothing(
    make_cluster, body: dict[str, Any], status: int, says: str
) -> None:
    c = await make_cluster(n_prefill=1, n_decode=2)
    both = await _as_both(c, 0)
    r = await c.router.post("/admin/workers/role", json={"url": both, **body})
    assert r.status == status and says in (await r.json())["error"]["message"]
    worker = c.state.balancer.decode.find(both)
    assert worker is not None and worker.usable()


async def test_the_switch_takes_admin_keys_only(make_cluster) -> None:
    c = await make_cluster(n_decode=2, server__api_keys=["client"], server__admin_keys=["admin"])
    d0 = c.url(c.decode[0])
    body = {"url": d0, "role": "prefill", "bootstrap": "h:1"}
    r = await c.router.post("/admin/workers/role", json=body, headers={"Authorization": "Bearer client"})
    assert r.status == 401
    r = await c.router.post("/admin/workers/role", json=body, headers={"Authorization": "Bearer admin"})
    assert r.status == 409  # past the key check: this worker lists no second role


@pytest.mark.parametrize(
    ("worker", "role", "says"),
    [
        ({"url": "http://d:1", "roles": ["prefill"]}, "decode", "roles: lists ['prefill'], not 'decode'"),
        ({"url": "http://d:1", "engine": "sglang", "roles": BOTH}, "decode", "only vLLM engines"),
        ({"url": "http://d:1", "roles": ["both"]}, "decode", "invalid router config"),
    ],
)
def test_roles_the_worker_cannot_have_are_refused_at_start(
    worker: dict[str, Any], role: str, says: str
) -> None:
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        parse_config({"model": {"path": "m"}, role: [worker]})
