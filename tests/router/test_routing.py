"""The router in front of fake vLLM engines: framing, threshold routing, P/D flows, endpoints, admin API."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from pd_connector import wire
from pd_connector.trace import read_trace
from router.trace import STAGES
from tests.router.conftest import MODEL, long_prompt, short_prompt
from tests.router.sse import events, normalized, payloads, text_of


async def _direct(url: str, path: str, body: dict) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return await r.read()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [True, False])
async def test_response_bytes_equal_calling_decode_directly(make_cluster, path: str, stream: bool) -> None:
    c = await make_cluster(n_decode=1)
    body = {"model": MODEL, "max_tokens": 5, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(
        {"prompt": short_prompt()}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = await c.router.post(path, json=body)
    assert r.status == 200
    via_router = await r.read()
    direct = await _direct(c.url(c.decode[0]), path, body)
    assert normalized(via_router) == normalized(direct)
    if stream:
        assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        assert events(via_router)[-1] == b"data: [DONE]\n\n"
        assert payloads(via_router)[-2]["usage"]["completion_tokens"] == 5


async def test_short_prompt_goes_to_decode_only_unchanged(make_cluster) -> None:
    c = await make_cluster(n_decode=1)
    body = {"model": MODEL, "prompt": short_prompt(), "max_tokens": 3, "temperature": 0, "my_extra": [1]}
    r = await c.router.post("/v1/completions", json=body)
    assert r.status == 200
    assert c.prefill[0].requests == []
    assert c.decode[0].requests == [body]
    assert r.headers["X-PD-Route"] == "local"
    assert 'route="local"' in await (await c.router.get("/metrics")).text()


async def test_long_prompt_pd_push_sends_both_legs_with_one_transfer_id(make_cluster) -> None:
    c = await make_cluster(n_decode=1)
    body = {
        "model": MODEL,
        "prompt": long_prompt(),
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await c.router.post("/v1/completions", json=body)
    raw = await r.read()
    assert r.status == 200 and text_of(raw) == " w64 w65 w66 w67"
    assert r.headers["X-PD-Route"] == "disagg"
    (p,), (d,) = c.prefill[0].requests, c.decode[0].requests
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"]["pd_role"] == "prefill"
    assert d["kv_transfer_params"] == {
        "pd_transfer_id": p["kv_transfer_params"]["pd_transfer_id"],
        "pd_role": "decode",
        "pd_prefill_addr": "127.0.0.1:7000",
        "pd_seed_first_token": True,  # a streamed request: D continues from P's first token
        "pd_stream_first_token": True,  # and streams it (no logprobs asked)
    }
    assert len(p["kv_transfer_params"]["pd_transfer_id"]) == 32
    assert d["stream"] is True and d["max_tokens"] == 4
    metrics = await (await c.router.get("/metrics")).text()
    assert 'pd_router_requests_total{endpoint="/v1/completions",reason="long",route="disagg"} 1.0' in metrics


@pytest.mark.parametrize("flow", ["pd-push", "vllm-standard"])
@pytest.mark.parametrize(
    ("path", "fan_out"),
    [
        ("/v1/completions", {"n": 2}),
        ("/v1/completions", {"prompt": [long_prompt(), long_prompt() + " again"]}),
        ("/v1/completions", {"prompt": [[1] * 64, [2] * 64]}),
        ("/v1/completions", {"use_beam_search": True}),
        ("/v1/chat/completions", {"n": 3}),
    ],
)
async def test_several_sequences_go_local(make_cluster, flow: str, path: str, fan_out: dict) -> None:
    """n > 1, a prompt list or beam search would share one transfer id on P/D: D prefills them itself."""
    c = await make_cluster(n_decode=1, flow=flow)
    body: dict = {"model": MODEL, "max_tokens": 2}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": long_prompt()}]
    else:
        body["prompt"] = long_prompt()
    body.update(fan_out)
    r = await c.router.post(path, json=body)
    assert r.status == 200, await r.text()
    assert r.headers["X-PD-Route"] == "local"
    assert c.prefill[0].requests == [] and c.decode[0].requests == [body]
    metrics = await (await c.router.get("/metrics")).text()
    assert f'pd_router_requests_total{{endpoint="{path}",reason="fan_out",route="local"}} 1.0' in metrics


async def test_chat_max_completion_tokens_is_one_on_prefill(make_cluster) -> None:
    c = await make_cluster(n_decode=1)
    msgs = [{"role": "user", "content": long_prompt()}]
    r = await c.router.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_completion_tokens": 3}
    )
    assert r.status == 200
    (p,) = c.prefill[0].requests
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1


async def _legs_of_one_request(make_cluster, flow: str) -> tuple[dict, dict]:
    """One long completion through a 1 P + 1 D cluster in ``flow``: the bodies P and D received."""
    c = await make_cluster(n_decode=1, flow=flow)
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
    )
    assert r.status == 200
    (p,), (d,) = c.prefill[0].requests, c.decode[0].requests
    return p, d


async def test_vllm_standard_flow_forwards_prefill_params(make_cluster) -> None:
    p, d = await _legs_of_one_request(make_cluster, "vllm-standard")
    assert p["kv_transfer_params"] == wire.encode(wire.StandardPrefill()) and p["max_tokens"] == 1
    returned = wire.parse_params(d["kv_transfer_params"])
    assert isinstance(returned, wire.PrefillReturned) and returned.pd_prefill_addr == "127.0.0.1:7600"
    assert d["kv_transfer_params"] == wire.encode(returned)


async def test_sglang_bootstrap_fields_on_both_legs(make_cluster) -> None:
    p, d = await _legs_of_one_request(make_cluster, "sglang-bootstrap")
    keys = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    assert [p[k] for k in keys] == [d[k] for k in keys] == ["127.0.0.1", 7000, p["bootstrap_room"]]
    assert 0 <= p["bootstrap_room"] < 2**63


async def test_prefill_chosen_by_least_outstanding_tokens(make_cluster) -> None:
    c = await make_cluster(n_prefill=2, n_decode=1)
    c.state.balancer.prefill.workers[0].outstanding_tokens = 10_000  # pretend P0 is busy
    await c.router.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 1})
    assert c.prefill[0].requests == [] and len(c.prefill[1].requests) == 1


async def test_models_health_ready_metrics(make_cluster) -> None:
    c = await make_cluster(n_decode=1)
    models = await (await c.router.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 4096
    assert (await c.router.get("/health")).status == 200
    assert (await c.router.get("/ready")).status == 200
    await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2, "stream": True}
    )
    text = await (await c.router.get("/metrics")).text()
    for name in (
        "pd_router_ttft_seconds_bucket",
        "pd_router_itl_seconds_bucket",
        "pd_router_worker_in_flight",
        "pd_router_worker_errors",
        "pd_router_worker_healthy",
    ):
        assert name in text
    await c.kill(c.decode[0])
    await c.state.checker.run_once()
    await c.state.checker.run_once()
    assert (await c.router.get("/ready")).status == 503


async def test_admin_add_drain_remove(make_cluster) -> None:
    c = await make_cluster(n_decode=2)
    d0, d1 = (c.url(e) for e in c.decode)
    listed = await (await c.router.get("/admin/workers")).json()
    assert {w["url"] for w in listed["workers"] if w["role"] == "decode"} == {d0, d1}
    r = await c.router.post("/admin/workers/drain", json={"role": "decode", "url": d0})
    assert r.status == 200 and (await r.json())["draining"] is True
    for _ in range(4):
        await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
    assert c.decode[0].requests == [] and len(c.decode[1].requests) == 4
    assert (await c.router.delete("/admin/workers", json={"role": "decode", "url": d1})).status == 200
    assert (await c.router.delete("/admin/workers", json={"role": "decode", "url": d1})).status == 404
    r = await c.router.post("/admin/workers/drain", json={"role": "decode", "url": d0, "drain": False})
    assert (await r.json())["draining"] is False
    r = await c.router.post("/admin/workers", json={"role": "decode", "worker": {"url": d1}})
    assert r.status == 201 and (await r.json())["healthy"] is True
    assert (
        await c.router.post("/admin/workers", json={"role": "decode", "worker": {"url": d1}})
    ).status == 409
    bad = await c.router.post("/admin/workers", json={"role": "prefill", "worker": {"url": "http://x:1"}})
    assert bad.status == 400 and "bootstrap" in (await bad.json())["error"]["message"]
    assert (await c.router.post("/admin/workers", json={"role": "both", "worker": {"url": d1}})).status == 400


@pytest.mark.parametrize(
    ("flow", "stream"),
    [
        ("pd-push", False),
        ("pd-push", "decode"),  # seeded, D's stream carries P's token and comes first
        ("pd-push", "answer"),  # seeded, logprobs asked: P's answer is the first token (and D's stream
        # does not carry it)
        ("vllm-standard", False),
        ("vllm-standard", "answer"),
    ],
)
async def test_a_disaggregated_request_is_traced_under_its_transfer_id(
    make_cluster, tmp_path: Path, flow: str, stream: str | bool
) -> None:
    """The router's record of a P->D request joins D's on the transfer id D was given, has every stage in a
    possible order (``decode_continued`` only for a stream whose first token came from P's answer), and its
    spans reach ``pd_router_stage_seconds``; a request to D alone is not traced. A stream D leads needs no P
    answer: P's may come after the stream ended (its leg is then closed), so its stage is optional."""
    trace = tmp_path / "router.jsonl"
    c = await make_cluster(n_decode=1, flow=flow, server__trace_path=str(trace))
    if stream == "decode":
        c.prefill[0].first_token_delay_s = 60  # P's answer after D's stream (and after the request)
    for prompt in (long_prompt(), short_prompt()):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": bool(stream)}
        if stream == "answer":
            body["logprobs"] = 1
        r = await c.router.post("/v1/completions", json=body)
        assert r.status == 200
        await r.read()
    (record,) = read_trace(str(trace))
    d_params = c.decode[0].requests[0]["kv_transfer_params"]
    assert (record.component, record.transfer_id, record.state) == (
        "router",
        d_params["pd_transfer_id"],
        "ok",
    )
    expected = set(STAGES) if stream == "answer" else set(STAGES) - {"decode_continued"}
    if stream == "decode":
        assert set(record.stages) - {"prefill_returned"} == expected - {"prefill_returned"}
    else:
        assert set(record.stages) == expected
    at = record.stages
    assert at["received"] <= at["prefill_sent"] <= at["decode_sent"] <= at["decode_first_event"]
    assert at["prefill_sent"] <= at.get("prefill_returned", at["prefill_sent"])
    assert at["decode_first_event"] <= at["client_first_byte"]
    if stream == "answer":  # D's own stream follows the first event the client got (P's token)
        assert at["client_first_byte"] <= at["decode_continued"]
    if flow == "vllm-standard":  # D's leg waits for P's answer
        assert at["prefill_returned"] <= at["decode_sent"]
    metrics = await (await c.router.get("/metrics")).text()
    assert 'pd_router_stage_seconds_count{stage="received->prefill_sent"} 1.0' in metrics
