"""Failures of P, D and the client, with fake engines on real HTTP: retries, resume, aborts, overload."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from test_support.fake_vllm import generate
from tests.polling import wait_until_async
from tests.router.conftest import MODEL, long_prompt, short_prompt
from tests.router.sse import payloads, text_of


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def _metrics(c) -> str:
    return await (await c.router.get("/metrics")).text()


async def test_decode_error_before_first_byte_is_retried_elsewhere(make_cluster) -> None:
    c = await make_cluster(n_decode=2, circuit__failure_threshold=2)
    c.decode[0].fail_status = 503
    for _ in range(6):
        r = await c.router.post(
            "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2, "stream": True}
        )
        assert r.status == 200 and text_of(await r.read()) == " w2 w3"
    # D0 failed twice, then its circuit opened and it got nothing more
    assert len(c.decode[0].requests) == 2
    assert len(c.decode[1].requests) == 6
    assert _metric(await _metrics(c), 'pd_router_worker_circuit_open{role="decode"') == 1


async def test_dead_decode_connection_refused_is_retried(make_cluster) -> None:
    c = await make_cluster(n_decode=2)
    await c.kill(c.decode[0])
    for _ in range(4):
        r = await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2})
        assert r.status == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_decode_dies_mid_stream_and_another_continues_it(make_cluster, path: str) -> None:
    c = await make_cluster(n_decode=2, n_prefill=1)
    c.decode[0].die_after_tokens = 3
    c.state.balancer.decode.workers[1].active = 5  # pretend D1 is busier, so D0 is picked first
    body = {"model": MODEL, "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": long_prompt()}]
        expected = "".join(generate(long_prompt() + " ", 10))
    else:
        body["prompt"] = long_prompt()
        expected = "".join(generate(long_prompt(), 10))
    r = await c.router.post(path, json=body)
    raw = await r.read()
    assert r.status == 200
    assert text_of(raw) == expected  # no token lost or repeated
    chunks = [p for p in payloads(raw) if isinstance(p, dict)]
    assert len({p["id"] for p in chunks}) == 1 and len({p["created"] for p in chunks}) == 1
    assert payloads(raw).count("[DONE]") == 1
    roles = [p for p in chunks if p["choices"] and "role" in p["choices"][0].get("delta", {})]
    assert len(roles) == (1 if "chat" in path else 0)
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    # the continuation went to the other D with the text so far and the tokens left, without transfer params:
    # the 3 D0 streamed were delivered, P's first token (seeding) first
    (d0,) = c.decode[0].requests
    assert d0["kv_transfer_params"]["pd_stream_first_token"] is True
    (cont,) = c.decode[1].requests
    assert "kv_transfer_params" not in cont and cont["max_tokens"] == 7
    assert cont["return_token_ids"] is True  # asked for, and hidden from the client again
    assert b'token_ids":[' not in raw
    if "chat" not in path:  # completions resume token-exactly: prompt ids + the 3 delivered ids
        assert cont["prompt"] == [*range(64), 64, 65, 66]
    assert _metric(await _metrics(c), "pd_router_decode_resumes_total") == 1


async def test_stream_ends_with_error_event_when_no_decode_can_resume(make_cluster) -> None:
    c = await make_cluster(n_decode=1)
    c.decode[0].die_after_tokens = 2
    c.decode[0].fail_status = 0
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 5, "stream": True}
    )
    raw = await r.read()
    items = payloads(raw)
    assert items[-1] == "[DONE]" and "error" in items[-2]
    assert text_of(raw) == " w2 w3"


async def test_prefill_failure_lets_decode_recompute_in_pd_push(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1)
    c.prefill[0].fail_status = 500
    c.decode[0].first_token_delay_s = 0.1  # as a real D waits for the KV (then recomputes)
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 3}
    )
    assert r.status == 200 and (await r.json())["choices"][0]["text"] == " w64 w65 w66"
    c.prefill[0].fail_status = 0
    c.prefill[0].die_after_tokens = 0  # P's process dies while the request is in flight
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 3, "stream": True}
    )
    assert r.status == 200 and text_of(await r.read()) == " w64 w65 w66"

    async def both_counted() -> bool:
        return _metric(await _metrics(c), "pd_router_prefill_failures_total") == 2

    await wait_until_async(both_counted, 2, "both prefill failures counted")


async def test_vllm_standard_prefill_failover_then_local(make_cluster) -> None:
    c = await make_cluster(n_prefill=2, n_decode=1, flow="vllm-standard")
    c.prefill[0].fail_status = 500
    c.prefill[1].side_channel = "127.0.0.1:7601"
    c.state.balancer.prefill.workers[1].outstanding_tokens = 1  # P0 is picked first
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
    )
    assert r.status == 200
    assert len(c.prefill[0].requests) == 1 and len(c.prefill[1].requests) == 1
    assert c.decode[0].requests[-1]["kv_transfer_params"]["pd_prefill_addr"] == "127.0.0.1:7601"
    c.prefill[1].fail_status = 500
    c.state.balancer.prefill.workers[1].outstanding_tokens = 0
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
    )
    assert r.status == 200
    assert "kv_transfer_params" not in c.decode[0].requests[-1]  # no P left: D prefilled locally
    assert r.headers["X-PD-Route"] == "local"


async def test_sglang_prefill_failure_aborts_decode_leg_and_retries(make_cluster) -> None:
    c = await make_cluster(n_prefill=2, n_decode=1, flow="sglang-bootstrap")
    c.prefill[0].fail_status = 500
    c.decode[0].first_token_delay_s = 0.3
    c.state.balancer.prefill.workers[1].outstanding_tokens = 1
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2, "stream": True}
    )
    assert r.status == 200 and text_of(await r.read()) == " w64 w65"
    rooms = [d["bootstrap_room"] for d in c.decode[0].requests]
    assert len(rooms) == 2 and rooms[0] != rooms[1]
    assert c.decode[0].requests[1]["bootstrap_port"] == 7001
    assert c.decode[0].abandoned == 1


async def test_client_disconnect_aborts_both_legs(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1)
    c.decode[0].token_delay_s = 0.05
    c.prefill[0].first_token_delay_s = 5.0  # P still busy when the client leaves
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 100, "stream": True}

    async def post() -> None:
        async with aiohttp.ClientSession() as s, s.post(str(c.router.make_url("/v1/completions")), json=body):
            pass  # never reached: the client leaves before P answers (the stream starts with P's token)

    client = asyncio.ensure_future(post())
    await wait_until_async(lambda: bool(c.prefill[0].requests and c.decode[0].requests), 2, "both legs sent")
    client.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await client
    await wait_until_async(
        lambda: bool(c.decode[0].abandoned and c.prefill[0].abandoned and _idle(c)), 2, "both legs aborted"
    )
    assert c.decode[0].abandoned == 1 and c.decode[0].finished == 0
    assert c.prefill[0].abandoned == 1 and c.prefill[0].finished == 0
    assert _idle(c)  # both leases released: the P leg was cancelled too
    assert _metric(await _metrics(c), "pd_router_client_disconnects_total") == 1


def _idle(c) -> bool:
    return all(w.active == 0 and w.outstanding_tokens == 0 for w in c.state.balancer.all_workers())


async def test_overload_gives_429_with_retry_after(make_cluster) -> None:
    c = await make_cluster(n_decode=1, server__max_pending=1, server__retry_after_s=3)
    c.decode[0].first_token_delay_s = 0.5
    slow = asyncio.ensure_future(
        c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
    )
    await wait_until_async(
        lambda: c.state.proxy is not None and c.state.proxy.pending == 1, 2, "the slow one"
    )
    r = await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
    assert r.status == 429 and r.headers["Retry-After"] == "3"
    assert (await r.json())["error"]["type"] == "RateLimitError"
    assert (await slow).status == 200


async def test_saturated_decode_queues_then_429(make_cluster) -> None:
    c = await make_cluster(n_decode=1, policy__decode_max_active=1, policy__queue_timeout_s=0.3)
    c.decode[0].first_token_delay_s = 0.2
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    # two requests, one slot: the second waits for the first and succeeds
    a, b = await asyncio.gather(
        c.router.post("/v1/completions", json=body), c.router.post("/v1/completions", json=body)
    )
    assert (a.status, b.status) == (200, 200)
    c.decode[0].first_token_delay_s = 1.0
    a, b = await asyncio.gather(
        c.router.post("/v1/completions", json=body), c.router.post("/v1/completions", json=body)
    )
    assert sorted([a.status, b.status]) == [200, 429]


async def test_first_byte_timeout_retries_then_502(make_cluster) -> None:
    c = await make_cluster(n_decode=2, timeouts__first_byte_s=0.2, retry__max_attempts=2)
    for d in c.decode:
        d.first_token_delay_s = 1.0
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1, "stream": True}
    )
    assert r.status == 502 and "timed out" in (await r.json())["error"]["message"]


async def test_request_timeout_is_504(make_cluster) -> None:
    c = await make_cluster(n_decode=1, timeouts__request_s=0.3)
    c.decode[0].first_token_delay_s = 2.0
    r = await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
    assert r.status == 504


async def test_health_check_takes_a_dead_decode_out_of_rotation(make_cluster) -> None:
    # checks only when the test runs them (a background round on a loaded machine could race it)
    c = await make_cluster(
        n_decode=2, health__unhealthy_after=1, health__interval_s=600.0, health__timeout_s=5.0
    )
    c.decode[0].healthy = False
    await c.state.checker.run_once()
    for _ in range(5):
        assert (
            await c.router.post(
                "/v1/completions", json={"model": MODEL, "prompt": short_prompt(), "max_tokens": 1}
            )
        ).status == 200
    assert c.decode[0].requests == []
    c.decode[0].healthy = True
    await c.state.checker.run_once()
    assert c.state.balancer.decode.workers[0].healthy
