"""pd-router in front of PDConnector (a real router process, our push flow): which path a request takes,
streamed completions and chat, and first-token seeding of D with the token P sampled (through pd-router, and
a seeded D's own answer, asked directly as pd-router asks it).

Every P/D request's transfer is checked (``pd_checks.Transfers``). Runs on the package's cluster and router
(conftest.py) in the default configuration.
"""

from __future__ import annotations

from typing import Any

import pytest

from integration_tests.pd_checks import blocks_idle, blocks_to_load, metric
from integration_tests.pd_connector.cluster import (
    CHUNK,
    MAX_TOKENS,
    ROUTER_THRESHOLD,
    Cluster,
    body,
    stream_through_router,
    through_router,
    token_ids,
    tokens,
)
from pd_disagg import pd_client
from tests.polling import wait_until


def test_router_sends_long_prompts_p_to_d_and_short_ones_to_d(pd: Cluster, router: str) -> None:
    """Through pd-router: a long prompt is disaggregated (its KV pushed by P), a short one prefills on D
    (nothing moves); both give the colocated greedy tokens."""
    long_prompt, short_prompt = tokens(ROUTER_THRESHOLD + 150, seed=5150), tokens(ROUTER_THRESHOLD // 2, 5032)
    transfers = pd.transfers()
    route, answer = through_router(router, body(long_prompt))
    assert (route, token_ids(answer)) == ("disagg", pd.reference(long_prompt))
    transfers.check(1, blocks=blocks_to_load(len(long_prompt)))
    sent = metric(pd.p_url, "vllm:pd_connector_bytes_sent_total")
    route, answer = through_router(router, body(short_prompt))
    assert (route, token_ids(answer)) == ("local", pd.reference(short_prompt))
    assert metric(pd.p_url, "vllm:pd_connector_bytes_sent_total") == sent, "the local path moves no KV"


@pytest.mark.parametrize("n", [ROUTER_THRESHOLD + 326, ROUTER_THRESHOLD + 7])
def test_router_streams_disaggregated_completions(pd: Cluster, router: str, n: int) -> None:
    """A streamed long prompt through pd-router: P->D, the colocated tokens, a final chunk and [DONE].

    (A 390-token prompt once got no [DONE] here.) Tokens are not required to arrive one per event: vLLM's
    front end merges the deltas it has not sent yet, which happens on this two-core machine because vLLM's
    CPU workers spin-wait for about a second after each step and starve the front-end processes.
    """
    prompt = tokens(n, seed=6000 + n)
    reference = pd.reference(prompt)
    transfers = pd.transfers()
    route, chunks = stream_through_router(router, "/v1/completions", body(prompt, stream=True))
    assert route == "disagg"
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    assert streamed == reference
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    transfers.check(1, blocks=blocks_to_load(n))


def _disaggregated_stream_with_usage(router: str, path: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """``payload`` streamed through pd-router with a usage chunk at the end; it went P->D; its chunks."""
    route, chunks = stream_through_router(
        router, path, {**payload, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert route == "disagg"
    return chunks


def _generated_on_d(pd: Cluster) -> float:
    """Output tokens D's front end counted (every token it streamed)."""
    return metric(pd.d_url, "vllm:generation_tokens_total")


def test_router_streams_disaggregated_chat(pd: Cluster, router: str) -> None:
    """A streamed chat request long enough for P->D: the streamed deltas add up to the colocated (plain,
    unstreamed request to P) greedy text, and the stream ends with usage and [DONE], as vLLM's own does.

    How many events the text arrives in is vLLM's business, not the router's: its front end merges deltas it
    has not sent yet, which on this two-core machine happens whenever the CPU workers starve it (a CI run
    once got 12 tokens in 2 events). That the router relays each upstream event as it comes is tested
    against a paced upstream in tests/router/test_relay.py.
    """
    payload = {
        "model": "tiny",
        "messages": [{"role": "user", "content": " ".join(f"word{i}" for i in range(120))}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    colocated = pd_client.post_json(pd.p_url + "/v1/chat/completions", payload)
    transfers = pd.transfers()
    chunks = _disaggregated_stream_with_usage(router, "/v1/chat/completions", payload)
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    prompt_tokens = colocated["usage"]["prompt_tokens"]
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_tokens >= ROUTER_THRESHOLD
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0].get("role") == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == colocated["choices"][0]["message"]["content"]
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    transfers.check(1, blocks=blocks_to_load(prompt_tokens))


def _sampled_through_router(
    pd: Cluster, router: str, prompt: list[int], sampling: dict[str, Any]
) -> tuple[int, float, list[dict[str, Any]]]:
    """``prompt`` with ``sampling`` streamed through pd-router, P->D, after P alone sampled its first token
    for it: (P's token, D's generated-token count before, the stream's chunks). The transfer happened
    (exact bytes, one load, nothing failed or recomputed) and the client's first token is P's."""
    request = body(prompt, **sampling)
    p_token = token_ids(pd_client.post_json(pd.p_url + "/v1/completions", {**request, "max_tokens": 1}))[0]
    transfers, generated = pd.transfers(), _generated_on_d(pd)
    chunks = _disaggregated_stream_with_usage(router, "/v1/completions", request)
    transfers.check(1, blocks=blocks_to_load(len(prompt)))
    first = next(t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or [])
    assert first == p_token, "the client's first token is the one P sampled"
    return p_token, generated, chunks


def test_router_seeds_decode_with_prefills_sampled_first_token(pd: Cluster, router: str) -> None:
    """A sampled streamed request (temperature 0.8, fixed seed, logprobs) through pd-router, P->D: the first
    token comes from P's answer (it alone has the token's logprobs).

    The client's first token is P's: P alone, asked the same request for one token, samples the same one
    (vLLM seeds a fresh generator per request, so the same prompt and seed give the same first draw). D then
    continues from that token instead of sampling a first token of its own: its tokens equal those of a
    colocated request whose prompt is the prompt plus P's token, with the same seed. That is what vLLM's
    per-request generator makes comparable: D's generator is fresh when it samples the second token, as the
    colocated one is when it samples the first token after prompt + P's token (the CPU sampler draws one seed
    per sampling step from it), so both use the generator's first draw. (It is not the colocated stream of
    the prompt alone, whose second token comes from the generator's second draw.) The first token keeps its
    logprobs (from P's answer), the usage counts every token, and the transfer happened (exact bytes, one
    load, nothing failed or recomputed: an unseeded or recomputing D would sample its own first token).

    The prompt fits in one of P's prefill steps (``CHUNK`` tokens), and the colocated reference (one token
    longer) hits P's prefix cache for all but its last token: vLLM 0.32's CPU model runner kills the engine
    on a seeded request whose prefill is chunked ("RuntimeError: CPU Generator does not use offset", when it
    rewinds the generator after discarding a partial chunk's sample).
    """
    prompt = tokens(CHUNK, seed=7100)
    assert len(prompt) >= ROUTER_THRESHOLD  # P->D through the router
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 1234, "logprobs": 2}
    p_token, generated, chunks = _sampled_through_router(pd, router, prompt, sampling)
    choices = [choice for c in chunks for choice in c["choices"]]
    streamed = [t for choice in choices for t in choice.get("token_ids") or []]
    assert choices[0]["token_ids"] == [p_token]
    wait_until(lambda: _generated_on_d(pd) >= generated + MAX_TOKENS - 1, 10, "D's token count")
    assert _generated_on_d(pd) == generated + MAX_TOKENS - 1, "P's answer carried the first token"
    lp = choices[0]["logprobs"]
    assert lp["tokens"] and isinstance(lp["token_logprobs"][0], float) and len(lp["top_logprobs"][0]) >= 2
    assert all(choice["logprobs"] is not None for choice in choices if choice.get("token_ids"))
    continued = pd_client.post_json(
        pd.p_url + "/v1/completions", body([*prompt, p_token], MAX_TOKENS - 1, **sampling)
    )
    assert streamed[1:] == token_ids(continued), "D continued from P's token, as prompt + token would"
    assert len(streamed) == MAX_TOKENS and chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert chunks[-1]["usage"]["prompt_tokens"] == len(prompt)
    assert len({c["id"] for c in chunks}) == 1, "one stream: P's id on D's events too"


def test_decode_streams_prefills_sampled_first_token_itself(pd: Cluster, router: str) -> None:
    """The same without logprobs: pd-router asks D to stream P's token too (``pd_stream_first_token``), and
    whichever of P's answer and D's first token event comes first is the client's first token (D's copy is
    cut out when P's came first). The client's first token is P's either way, D continues from it (as
    prompt + P's token would, same seed), the usage counts every token once, and D's stream carried P's
    token: D's front end counted every token of the stream (where P's answer alone carries it, D counts one
    fewer). The transfer happened (exact bytes, one load, nothing failed or recomputed). Prompt of one
    prefill step, as above."""
    prompt = tokens(CHUNK, seed=7200)
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 4321}
    p_token, generated, chunks = _sampled_through_router(pd, router, prompt, sampling)
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    wait_until(lambda: _generated_on_d(pd) >= generated + MAX_TOKENS, 10, "D's token count")
    assert _generated_on_d(pd) == generated + MAX_TOKENS, "D's stream carried P's token too"
    continued = pd_client.post_json(
        pd.p_url + "/v1/completions", body([*prompt, p_token], MAX_TOKENS - 1, **sampling)
    )
    assert streamed[1:] == token_ids(continued), "D continued from P's token, as prompt + token would"
    usage = chunks[-1]["usage"]
    assert len(streamed) == MAX_TOKENS == usage["completion_tokens"] and usage["prompt_tokens"] == len(prompt)
    assert len({c["id"] for c in chunks}) == 1


@pytest.mark.parametrize("where", ["later", "in_first_token"])
def test_stop_strings_are_seeded_and_cut_by_decodes_api_server(pd: Cluster, router: str, where: str) -> None:
    """A sampled stream with a stop string through pd-router, P->D: seeded, with D's stream alone bringing P's
    token (D's API server checks stop strings on the text, P's token's included; P's answer does not race
    it). The stream is the sequence seeding gives (P's token, then what prompt + P's token continues with,
    same seed: an unseeded D would sample a second token of its own) cut where the stop string first occurs,
    finish_reason "stop": later in the text, or inside P's token (then no text at all). The transfer
    happened (exact bytes, one load, nothing failed or recomputed). Prompt of one prefill step (see
    ``test_router_seeds_decode_with_prefills_sampled_first_token``)."""
    prompt = tokens(CHUNK, seed=7720 if where == "later" else 7721)  # no other test uses 7720-7721
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 2468}
    alone = pd_client.post_json(pd.p_url + "/v1/completions", body(prompt, 1, **sampling))
    p_token, head = token_ids(alone)[0], alone["choices"][0]["text"]
    after = pd_client.post_json(
        pd.p_url + "/v1/completions", body([*prompt, p_token], MAX_TOKENS - 1, **sampling)
    )
    tail = after["choices"][0]["text"]
    stop = head if where == "in_first_token" else tail[2:5]
    assert stop.strip() and stop in head + tail, (head, tail)
    expected = (head + tail)[: (head + tail).index(stop)]
    transfers = pd.transfers()
    chunks = _disaggregated_stream_with_usage(
        router, "/v1/completions", body(prompt, **sampling, stop=[stop])
    )
    transfers.check(1, blocks=blocks_to_load(len(prompt)))
    choices = [choice for c in chunks for choice in c["choices"]]
    assert "".join(choice["text"] for choice in choices) == expected
    assert choices[-1]["finish_reason"] == "stop"
    streamed = [t for choice in choices for t in choice.get("token_ids") or []]
    if where == "later":
        assert streamed[0] == p_token and streamed[1:] == token_ids(after)[: len(streamed) - 1], (
            "D continued from P's token"
        )
    assert chunks[-1]["usage"]["prompt_tokens"] == len(prompt)


@pytest.mark.parametrize(
    ("ending", "finish"), [("stop_token_ids", "stop"), ("max_tokens", "length"), ("", "length")]
)
def test_seeded_decode_answers_prefills_token_and_ends_there_when_it_stops_the_request(
    pd: Cluster, ending: str, finish: str
) -> None:
    """A seeded D asked to carry P's token (sent directly, as pd-router sends its leg): D's answer starts
    with P's token, then continues as a colocated request does. When P's token is itself a stop token, or
    the client asked for one token, D ends the request with it (vLLM checks stops on sampled tokens only, so
    PDConnector checks P's) with vLLM's finish reason, and holds no blocks after. The transfer happened."""
    prompt = tokens(CHUNK, seed=7700 + len(ending))  # no other test of the package uses 7700-7714
    reference = pd.reference(prompt)
    extra = {"stop_token_ids": [reference[0]]} if ending == "stop_token_ids" else {}
    if ending == "max_tokens":
        extra["max_tokens"] = 1
    transfers = pd.transfers()
    answer, p_answer = pd_client.disaggregated(
        pd.p_url, pd.d_url, pd.bootstrap, body(prompt, **extra), seed=True
    )
    assert isinstance(p_answer, dict), p_answer
    transfers.check(1, blocks=blocks_to_load(len(prompt)))
    expected = reference if not ending else reference[:1]
    assert (token_ids(answer), answer["choices"][0]["finish_reason"]) == (expected, finish)
    assert answer["usage"]["completion_tokens"] == len(expected)
    wait_until(lambda: blocks_idle(pd.d_url), 20, "D's blocks released")
