"""Streams whose prompt is token ids are resumed like text prompts (found by ``benchmarks.chaos``: every one
of its completions has a token-id prompt, and a D killed mid-stream failed them, "could not be resumed",
with the other D up). Fake engines on real HTTP (``test_support.fake_vllm``)."""

from __future__ import annotations

import pytest

from test_support.fake_vllm import generate
from tests.router.conftest import MODEL
from tests.router.sse import payloads, text_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("prefills", [0, 1], ids=["d-alone", "p-to-d"])
async def test_a_token_id_prompt_stream_whose_decode_dies_is_resumed_token_exactly(
    make_cluster, prefills: int
) -> None:
    c = await make_cluster(n_decode=2, n_prefill=prefills)
    c.decode[0].die_after_tokens = 3
    c.state.balancer.decode.workers[1].active = 5  # D1 looks busier: D0 is picked first
    prompt = list(range(100, 140))  # 40 ids: past the threshold, so P->D where there is a P
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "stream": True}
    r = await c.router.post("/v1/completions", json=body)
    raw = await r.read()
    assert r.status == 200
    assert not any(isinstance(p, dict) and "error" in p for p in payloads(raw)), raw
    assert text_of(raw) == "".join(generate(" ".join(map(str, prompt)), 10))  # nothing lost or repeated
    (cont,) = c.decode[1].requests
    delivered = [int(t[2:]) for t in generate(" ".join(map(str, prompt)), 10)][: 10 - cont["max_tokens"]]
    # the prompt's ids as the worker reported them (the fake's: word positions) + the delivered ids
    assert cont["prompt"] == [*range(len(prompt)), *delivered]
    assert b'token_ids":[' not in raw  # asked for by the router, hidden from the client again
