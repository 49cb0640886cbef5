"""First-token seeding through the router: the client's first token is P's, D's stream continues after it.

The fake engines speak the protocol (``test_support.fake_vllm``): P answers its one token, and a D asked with
``pd_seed_first_token`` whose P took the leg streams the tokens after P's, as a seeded PDConnector D does, or
every token, P's first, when also asked ``pd_stream_first_token`` (pd-push without logprobs: the router then
takes whichever of the two comes first). Requests that ask logprobs (``_stream_body(..., logprobs=True)``)
take the path where P's answer alone brings the client's first token.
The real engines' side (D continuing from P's token, sampled requests) is proven in
integration_tests/pd_connector/test_through_router.py.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.seeding import NotSeedable, PrefillAnswer, answer_may_lead, applies
from test_support.fake_vllm import generate
from tests.polling import wait_until_async
from tests.router.conftest import MODEL, long_prompt
from tests.router.sse import payloads, text_of


def _stream_body(path: str, logprobs: bool = False, **extra: Any) -> dict[str, Any]:
    """A streamed P/D request; ``logprobs``: asked (the first token then comes from P's answer)."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "stream": True, **extra}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": long_prompt()}]
    else:
        body["prompt"] = long_prompt()
    if logprobs:
        body["logprobs"] = True if "chat" in path else 1
    return body


def _expected(path: str, n: int) -> str:
    return "".join(generate(long_prompt() + (" " if "chat" in path else ""), n))


@pytest.mark.parametrize(
    ("flow", "logprobs"), [("pd-push", False), ("pd-push", True), ("vllm-standard", False)]
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_first_token_is_prefills_and_decode_continues_after_it(
    make_cluster, flow: str, logprobs: bool, path: str
) -> None:
    """P's token first, then D's, one stream (one id, one role chunk, usage of all). In pd-push without
    logprobs D's own stream carries P's token too (here P's answer, in hand before the fake D's stream
    opens, comes first); otherwise (logprobs asked, or vllm-standard, where P's answer is in hand before D
    is asked) P's answer alone brings it."""
    c = await make_cluster(n_prefill=1, n_decode=1, flow=flow)
    body = _stream_body(path, logprobs, stream_options={"include_usage": True})
    r = await c.router.post(path, json=body)
    raw = await r.read()
    assert r.status == 200 and r.headers["X-PD-Route"] == "disagg"
    assert text_of(raw) == _expected(path, 4)
    (p,), (d,) = c.prefill[0].requests, c.decode[0].requests
    assert d["kv_transfer_params"]["pd_seed_first_token"] is True
    streams_first = flow == "pd-push" and not logprobs
    assert d["kv_transfer_params"].get("pd_stream_first_token", False) is streams_first
    assert p["max_tokens"] == 1 and d["max_tokens"] == 4  # D counts P's token as its first output
    chunks = [x for x in payloads(raw) if isinstance(x, dict)]
    assert len({x["id"] for x in chunks}) == 1 and len({x["created"] for x in chunks}) == 1
    content = [x for x in chunks if x["choices"]]
    first = content[1 if "chat" in path else 0]["choices"][0]
    assert (first["delta"]["content"] if "chat" in path else first["text"]) == _expected(path, 1)
    if "chat" in path:
        assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert sum("role" in x["choices"][0].get("delta", {}) for x in content) == 1
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] == 64
    assert usage["total_tokens"] == 68
    assert b'token_ids":[' not in raw  # asked of both legs for the router's count, hidden from the client


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stream_d_leads_does_not_wait_for_prefills_answer(make_cluster, path: str) -> None:
    """P's KV and token reached D, but P's answer is slow to come back (P's front end busy): the client gets
    the whole stream from D meanwhile, and P's leg, no longer needed, is closed when the stream ends."""
    c = await make_cluster(n_prefill=1, n_decode=1)
    c.prefill[0].first_token_delay_s = 60  # P's answer, after its KV went to D
    body = _stream_body(path, stream_options={"include_usage": True})
    r = await c.router.post(path, json=body)
    raw = await r.read()
    assert r.status == 200 and text_of(raw) == _expected(path, 4) and payloads(raw)[-1] == "[DONE]"
    assert c.prefill[0].finished == 0, "P has not answered"
    await wait_until_async(lambda: c.prefill[0].abandoned == 1, 5, "P's leg closed")
    metrics = await (await c.router.get("/metrics")).text()
    assert 'pd_router_prefill_failures_total{flow="pd-push"}' not in metrics


@pytest.mark.parametrize("winner", ["prefill", "decode"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_the_first_of_prefills_answer_and_decodes_stream_is_the_first_token(
    make_cluster, path: str, winner: str
) -> None:
    """D streams P's token too (pd-push, no logprobs): whichever of P's answer and D's first token event
    reaches the router first is the client's first token, and the stream is the same either way: every
    token once, in order, one id and role chunk, the usage of every token. P first: D's copy of P's token
    is cut out of its stream (``decode_continued`` is stamped when D's stream joins)."""
    c = await make_cluster(n_prefill=1, n_decode=1)
    if winner == "prefill":
        c.decode[0].token_delay_s = 0.2  # D's stream opens at once, its first token comes later
    else:
        c.prefill[0].first_token_delay_s = 60
    body = _stream_body(path, stream_options={"include_usage": True}, return_token_ids=True)
    r = await c.router.post(path, json=body)
    raw = await r.read()
    assert r.status == 200 and text_of(raw) == _expected(path, 4) and payloads(raw)[-1] == "[DONE]"
    chunks = [x for x in payloads(raw) if isinstance(x, dict)]
    assert [t for x in chunks for ch in x["choices"] for t in ch.get("token_ids") or []] == [64, 65, 66, 67]
    assert len({x["id"] for x in chunks}) == 1 and chunks[-1]["usage"]["completion_tokens"] == 4
    roles = [x for x in chunks if x["choices"] and "role" in x["choices"][0].get("delta", {})]
    assert len(roles) == (1 if "chat" in path else 0)
    (d,) = c.decode[0].requests
    assert d["kv_transfer_params"]["pd_stream_first_token"] is True
    metrics = await (await c.router.get("/metrics")).text()
    joined = 'pd_router_stage_seconds_count{stage="client_first_byte->decode_continued"} 1.0' in metrics
    assert joined is (winner == "prefill")


@pytest.mark.parametrize("logprobs", [False, True])
async def test_client_token_ids_are_the_streams(make_cluster, logprobs: bool) -> None:
    """Token ids the client asked for: every token's once, and the prompt's on the first event only, whether
    D's stream (no logprobs) or P's answer (logprobs) carries the first token."""
    c = await make_cluster(n_prefill=1, n_decode=1)
    body = _stream_body("/v1/completions", logprobs, return_token_ids=True)
    r = await c.router.post("/v1/completions", json=body)
    chunks = [x for x in payloads(await r.read()) if isinstance(x, dict)]
    ids = [t for x in chunks for ch in x["choices"] for t in ch.get("token_ids") or []]
    assert ids == [64, 65, 66, 67]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == list(range(64))  # the first event shows the prompt
    assert all(ch.get("prompt_token_ids") is None for x in chunks[1:] for ch in x["choices"])


@pytest.mark.parametrize("first", ["prefill", "decode"])
async def test_one_token_request_ends_with_prefills_token(make_cluster, first: str) -> None:
    """The client asked one token. P's answer first: it is the whole stream, and D's leg is closed (vLLM
    aborts it). D's stream first (it carries P's token too): it ends after that token (a PDConnector D ends
    the request there: ``compat.hook_step_output``), and P's leg is closed."""
    c = await make_cluster(n_prefill=1, n_decode=1)
    if first == "prefill":
        c.decode[0].token_delay_s = 0.5  # D still computing when P's answer ends the stream
    else:
        c.prefill[0].first_token_delay_s = 60
    body = _stream_body("/v1/completions", max_tokens=1, stream_options={"include_usage": True})
    r = await c.router.post("/v1/completions", json=body)
    raw = await r.read()
    items = payloads(raw)
    assert text_of(raw) == _expected("/v1/completions", 1) and items[-1] == "[DONE]"
    chunks = [x for x in items if isinstance(x, dict)]
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 1
    closed = c.decode[0] if first == "prefill" else c.prefill[0]
    await wait_until_async(lambda: closed.abandoned == 1, 2, "the other leg closed")


@pytest.mark.parametrize("extra", [{}, {"logprobs": 1}, {"stop": [" nowhere"]}])
async def test_failed_prefill_retries_the_attempt_unseeded(make_cluster, extra: dict[str, Any]) -> None:
    """P's leg fails before D's stream started: whether D got P's token is unknown (or, here, D never gets
    it), so the attempt is retried (nothing reached the client), here on D alone as no other P is left;
    also where D's stream alone would bring the token (stop strings), without waiting for D's load."""
    c = await make_cluster(n_prefill=1, n_decode=1)
    c.prefill[0].die_after_tokens = 0  # P's process dies before answering (after taking the leg)
    c.prefill[0].lose_kv = True  # and before its KV and token reached D
    r = await c.router.post("/v1/completions", json=_stream_body("/v1/completions", **extra))
    assert r.status == 200 and text_of(await r.read()) == _expected("/v1/completions", 4)
    first, retry = c.decode[0].requests
    assert first["kv_transfer_params"]["pd_seed_first_token"] is True
    assert "kv_transfer_params" not in retry
    metrics = await (await c.router.get("/metrics")).text()
    assert 'pd_router_prefill_failures_total{flow="pd-push"} 1.0' in metrics


@pytest.mark.parametrize("first", ["prefill", "decode"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_decode_that_lost_prefills_token_is_resumed_after_it(
    make_cluster, path: str, first: str
) -> None:
    """P's KV and token never reached D: D ends the request with vLLM's generation error rather than repeat
    the token. P's answer first (the client has P's token): the router keeps that error from the client and
    resumes the stream after P's token, here on the same D (its error is not held against it), which
    prefills the prompt and the token itself. D's error first (P's answer slow: the client has nothing):
    the attempt is retried, charged to P, here on D alone. Either way the client gets every token once and
    no error."""
    c = await make_cluster(n_prefill=1, n_decode=1)
    c.prefill[0].lose_kv = True
    if first == "decode":
        c.prefill[0].first_token_delay_s = 60
    r = await c.router.post(path, json=_stream_body(path, stream_options={"include_usage": True}))
    raw = await r.read()
    assert r.status == 200 and text_of(raw) == _expected(path, 4)
    assert not any(isinstance(x, dict) and "error" in x for x in payloads(raw))
    seeded, resumed = c.decode[0].requests
    assert seeded["kv_transfer_params"]["pd_seed_first_token"] is True
    assert "kv_transfer_params" not in resumed and resumed["max_tokens"] == (3 if first == "prefill" else 4)
    chunks = [x for x in payloads(raw) if isinstance(x, dict)]
    assert len({x["id"] for x in chunks}) == 1 and chunks[-1]["usage"]["completion_tokens"] == 4
    metrics = await (await c.router.get("/metrics")).text()
    if first == "prefill":  # resumed after the token the client has
        assert "pd_router_decode_resumes_total 1.0" in metrics and 'kind="error_event"' in metrics
    else:  # the client had nothing yet: the attempt is retried, the failure charged to P
        assert "pd_router_decode_resumes_total 0.0" in metrics
        assert 'pd_router_retries_total{role="decode"} 1.0' in metrics
        assert 'pd_router_worker_errors_total{role="decode"' not in metrics


@pytest.mark.parametrize(
    ("flow", "extra"),
    [
        ("pd-push", {"frequency_penalty": 0.5}),
        ("pd-push", {"min_tokens": 2}),
        ("pd-push", {"response_format": {"type": "json_object"}}),
        ("pd-push", {"stop": [" w70"], "logprobs": 1}),  # P's answer alone would carry the token
        ("vllm-standard", {"stop": [" w70"]}),  # D's API server never sees P's token in this flow
    ],
)
async def test_requests_seeding_would_change_are_not_seeded(
    make_cluster, flow: str, extra: dict[str, Any]
) -> None:
    c = await make_cluster(n_prefill=1, n_decode=1, flow=flow)
    r = await c.router.post("/v1/completions", json=_stream_body("/v1/completions", **extra))
    assert r.status == 200 and text_of(await r.read()) == _expected("/v1/completions", 4)
    (d,) = c.decode[0].requests
    assert "pd_seed_first_token" not in d["kv_transfer_params"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stream_with_stop_strings_is_seeded_with_decodes_stream_alone_bringing_the_first_token(
    make_cluster, path: str
) -> None:
    """Stop strings: D's API server checks them on the text, P's token's included, so D's stream alone brings
    the first token even when P's answer is in the router's hands first (D's first token comes 0.2 s
    later): no race, nothing cut, D's stream relayed as it is."""
    c = await make_cluster(n_prefill=1, n_decode=1)
    c.decode[0].token_delay_s = 0.2
    body = _stream_body(path, stop=[" nowhere"], stream_options={"include_usage": True})
    r = await c.router.post(path, json=body)
    raw = await r.read()
    assert r.status == 200 and text_of(raw) == _expected(path, 4) and payloads(raw)[-1] == "[DONE]"
    (d,) = c.decode[0].requests
    assert d["kv_transfer_params"]["pd_seed_first_token"] is True
    assert d["kv_transfer_params"]["pd_stream_first_token"] is True
    metrics = await (await c.router.get("/metrics")).text()
    assert 'pd_router_stage_seconds_count{stage="client_first_byte->decode_continued"}' not in metrics


def test_applies_only_to_streams_d_can_continue() -> None:
    for d_streams in (True, False):
        assert applies({"stream": True, "temperature": 0.7, "seed": 3, "logprobs": 2, "stop": []}, d_streams)
        assert applies(
            {"stream": True, "response_format": {"type": "text"}, "stream_options": {"include_usage": True}},
            d_streams,
        )
        assert not applies({"stream": False}, d_streams)
        assert not applies({"stream": True, "n": 2}, d_streams)
        assert not applies({"stream": True, "tools": [{"type": "function"}]}, d_streams)
        assert not applies({"stream": True, "stream_options": {"continuous_usage_stats": True}}, d_streams)
    # stop strings: only where D's stream carries P's token, which it does not when logprobs are asked
    assert applies({"stream": True, "stop": "x"}, d_streams=True)
    assert not applies({"stream": True, "stop": "x"}, d_streams=False)
    assert not applies({"stream": True, "stop": "x", "logprobs": 1}, d_streams=True)
    assert not answer_may_lead({"stop": ["x"]}) and answer_may_lead({"stop": []}) and answer_may_lead({})


def test_first_events_end_the_stream_on_a_stop_token_and_refuse_what_is_not_an_answer() -> None:
    answer = {
        "id": "cmpl-1",
        "created": 5,
        "model": "m",
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    events, complete = PrefillAnswer.parse(msgspec.json.encode(answer)).first_events(False, 16, True)
    items = payloads(events)
    assert complete and items[-1] == "[DONE]"
    assert items[0]["choices"][0]["finish_reason"] == "stop" and items[1]["usage"]["total_tokens"] == 4
    answer["choices"][0]["finish_reason"] = "abort"
    for bad in (b"not json", b'{"choices": []}', msgspec.json.encode(answer)):
        with pytest.raises(NotSeedable):
            PrefillAnswer.parse(bad)


def test_the_prompt_length_is_the_answers_usage_and_zero_without_one() -> None:
    choices = [{"index": 0, "text": "a", "finish_reason": "length"}]
    answer = {"choices": choices, "usage": {"prompt_tokens": 7}}
    assert PrefillAnswer.parse(msgspec.json.encode(answer)).prompt_tokens() == 7
    usages: list[object] = [None, 5, {"prompt_tokens": "7"}]
    for usage in usages:  # a malformed usage is no count, not a crash
        data = msgspec.json.encode({"choices": choices, "usage": usage})
        assert PrefillAnswer.parse(data).prompt_tokens() == 0
