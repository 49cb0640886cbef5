"""Client-supplied transfer fields never reach an engine: the router drops them and sets its own.

``kv_transfer_params`` and SGLang's ``bootstrap_*`` tell an engine to hold blocks, dial a peer or push KV
(docs/architecture.md, trust model), so a client's values must not reach P or D on any path: local or P/D, any
flow, streamed or not, nor a stream resumed on another decode worker. The fake engines record every body
they receive; each test looks for the client's values there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from pd_connector import wire
from router.requests import parse
from router.tokenize import PromptTokenizer
from tests.router.conftest import MODEL, long_prompt, short_prompt
from tests.router.sse import text_of
from tests.router.test_nixl_answer import nixl_answer

#: What a hostile client sends: hold blocks on D, dial its own listener, pair with its own SGLang room.
CLIENT: dict[str, Any] = {
    wire.KV_TRANSFER_PARAMS: {
        "do_remote_decode": True,
        "pd_role": "prefill",
        "pd_transfer_id": "client-chosen",
        "pd_prefill_addr": "10.9.9.9:9",
        "pd_seed_first_token": True,
    },
    "bootstrap_host": "10.9.9.9",
    "bootstrap_port": 9,
    "bootstrap_room": 7,
    "bootstrap_pair_key": "client-chosen",
}
assert set(CLIENT) == wire.TRANSFER_FIELDS  # a new field in the contract needs a client value here


async def test_parse_drops_each_field_and_keeps_clean_bodies_byte_for_byte(tokenizer_dir: Path) -> None:
    tokenizer = PromptTokenizer(str(tokenizer_dir))
    clean = b'{"model": "fake-model",  "prompt": "hi", "max_tokens": 2}'

    async def parsed(raw: bytes):
        return await parse("completions", raw, tokenizer, (MODEL,), 4096, 32)

    assert (await parsed(clean)).raw is clean  # the local path forwards these very bytes
    for name, value in CLIENT.items():
        body = {"model": MODEL, "prompt": "hi", name: value, "max_tokens": 2}
        p = await parsed(msgspec.json.encode(body))
        assert p.dropped == {name}
        assert p.body == msgspec.json.decode(p.raw) == {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    p = await parsed(msgspec.json.encode({"model": MODEL, "prompt": "hi", **CLIENT}))
    assert p.dropped == wire.TRANSFER_FIELDS and set(p.body) == {"model", "prompt"}


def _expected_legs(
    flow: str, route: str, p: list[dict], d: list[dict], seed: bool
) -> tuple[list[dict], list[dict]]:
    """The transfer fields each leg must carry: exactly the router's (found in the bodies), or none. ``seed``:
    the router asks D to continue from P's first token (streamed requests in the vLLM flows), and in pd-push
    to stream that token itself (no logprobs asked)."""
    if route == "local":
        return [], [{}]
    (p_body,), (d_body,) = p, d
    if flow == "pd-push":
        transfer = p_body[wire.KV_TRANSFER_PARAMS]["pd_transfer_id"]
        assert transfer != "client-chosen"
        return (
            [{wire.KV_TRANSFER_PARAMS: wire.encode(wire.PushPrefill(transfer))}],
            [
                {
                    wire.KV_TRANSFER_PARAMS: wire.encode(
                        wire.PushDecode(transfer, "127.0.0.1:7000", "decode", seed, seed)
                    )
                }
            ],
        )
    if flow == "vllm-standard":
        returned = wire.parse_params(d_body[wire.KV_TRANSFER_PARAMS])
        assert isinstance(returned, wire.PrefillReturned)
        assert returned.pd_prefill_addr == "127.0.0.1:7600"  # what P answered, not the client's address
        assert returned.pd_seed_first_token is seed  # the router's decision, never the client's
        return (
            [{wire.KV_TRANSFER_PARAMS: wire.encode(wire.StandardPrefill())}],
            [{wire.KV_TRANSFER_PARAMS: wire.encode(returned)}],
        )
    room = p_body["bootstrap_room"]
    assert room != CLIENT["bootstrap_room"]
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 7000, "bootstrap_room": room}
    return [fields], [fields]


def _transfer_fields(bodies: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k in wire.TRANSFER_FIELDS} for b in bodies]


@pytest.mark.parametrize("flow", ["pd-push", "vllm-standard", "sglang-bootstrap"])
async def test_client_transfer_fields_never_reach_an_engine(make_cluster, flow: str) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1, flow=flow)
    (p_engine,), (d_engine,) = c.prefill, c.decode
    sent = 0
    short_route = "disagg" if flow == "sglang-bootstrap" else "local"  # SGLang's D cannot prefill alone
    for name, value in CLIENT.items():
        for prompt, route in ((short_prompt(), short_route), (long_prompt(), "disagg")):
            for path in ("/v1/completions", "/v1/chat/completions"):
                for stream in (False, True):
                    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "stream": stream, name: value}
                    if path == "/v1/completions":
                        body["prompt"] = prompt
                    else:
                        body["messages"] = [{"role": "user", "content": prompt}]
                    p_seen, d_seen = len(p_engine.requests), len(d_engine.requests)
                    r = await c.router.post(path, json=body)
                    assert r.status == 200, await r.text()
                    sent += 1
                    await r.read()
                    assert r.headers["X-PD-Route"] == route
                    p_new, d_new = p_engine.requests[p_seen:], d_engine.requests[d_seen:]
                    want_p, want_d = _expected_legs(flow, route, p_new, d_new, stream)
                    assert _transfer_fields(p_new) == want_p, (name, route, path, stream)
                    assert _transfer_fields(d_new) == want_d, (name, route, path, stream)
    metrics = await (await c.router.get("/metrics")).text()
    assert f"pd_router_client_transfer_fields_dropped_total {float(sent)}" in metrics


async def test_a_resumed_stream_carries_no_client_transfer_fields(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=2)
    c.decode[0].die_after_tokens = 2
    c.state.balancer.decode.workers[1].active = 5  # pretend D1 is busier, so D0 is picked first
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 5, "stream": True, **CLIENT}
    r = await c.router.post("/v1/completions", json=body)
    assert r.status == 200 and text_of(await r.read()) == " w64 w65 w66 w67 w68"
    (cont,) = c.decode[1].requests
    assert wire.TRANSFER_FIELDS.isdisjoint(cont)


async def test_a_body_without_transfer_fields_reaches_decode_byte_for_byte(make_cluster) -> None:
    c = await make_cluster(n_decode=1)
    raw = b'{ "max_tokens": 2,\n "model": "fake-model", "prompt": "hello world", "my_extra": [1] }'
    r = await c.router.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
    assert r.status == 200 and r.headers["X-PD-Route"] == "local"
    assert c.decode[0].raw_requests == [raw]


@pytest.mark.parametrize(
    "answer",
    [
        {"remote_engine_id": "nixl", "remote_block_ids": [0], "do_remote_prefill": True},  # NIXL's, malformed
        nixl_answer("10.9.9.9"),  # NixlConnector's, naming a host that is not the prefill worker's
        {"do_remote_prefill": True, "pd_transfer_id": "t", "pd_prefill_addr": "not an address"},
        {"do_remote_decode": True},  # asks D to hold its blocks for a remote decode
    ],
)
async def test_vllm_standard_refuses_a_prefill_answer_that_is_not_ours(make_cluster, answer) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1, flow="vllm-standard")
    c.prefill[0].kv_answer = answer
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
    )
    # the answer counts as P's failure: D prefills itself, without transfer params
    assert r.status == 200 and r.headers["X-PD-Route"] == "local"
    (d,) = c.decode[0].requests
    assert wire.KV_TRANSFER_PARAMS not in d
    metrics = (await (await c.router.get("/metrics")).text()).splitlines()
    (failed,) = [
        m for m in metrics if m.startswith("pd_router_worker_errors_total{") and 'role="prefill"' in m
    ]
    assert 'kind="protocol"' in failed and failed.endswith(" 1.0")


async def test_vllm_standard_forwards_only_the_contract_fields_of_the_prefill_answer(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1, flow="vllm-standard")
    ours = wire.encode(wire.PrefillReturned("p-req-1", "127.0.0.1:7600"))
    c.prefill[0].kv_answer = {**ours, "remote_host": "10.9.9.9", "remote_port": 9, "extra": "x"}
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
    )
    assert r.status == 200 and r.headers["X-PD-Route"] == "disagg"
    (d,) = c.decode[0].requests
    assert d[wire.KV_TRANSFER_PARAMS] == ours
