"""Several P and several D: two prefill and two decode vLLM servers with PDConnector behind pd-router, in our
push flow and in vLLM's standard (P-then-D) flow, with every engine at its defaults (prefix caching on).

The case that once gave wrong tokens with ``pd_connector_failures_total`` at 0: one long prompt sent to the
cluster once, then six copies at once. P answers the copies from its prefix cache; the D that had seen the
prompt loaded only its tail and was right, the other got the blocks P had not pushed as holes. Here every
copy must give the colocated tokens, every P->D request must complete its load on either D, and nothing may
fail or be recomputed. Four engine servers share the two cores (one P and one D per core). They move KV over
``ucx`` (UCX shared memory, copied by ucxx's progress thread while the workers run Python); tcp is the other
modules' data plane, cma the tensor-parallel module's.

KV-aware routing (issue 21) runs on the same servers behind a third router (``kv``): a chat's later turns go to
the decode server that holds the conversation, stay there alone when little is new, and go P->D with only
the blocks that server lacks when much is new. The per-flow routers route on load alone
(``kv_routing.enabled = false``): their tests send copies of one prompt to exercise P's prefix cache. A fourth
router (``lend``) lends short prompts to an idle P while its one D is busy (``policy.lend_max_active``).
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from integration_tests.pd_checks import BLOCK_TOKENS, Transfers, blocks_idle, blocks_to_load, metric
from pd_disagg import pd_client
from pd_disagg.engines import base_url, router_server, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port
from tests.polling import wait_until

MAX_MODEL_LEN = 1024
THRESHOLD = 64
# The kv router's: a chat turn that adds a short answer and question to a cached conversation (the router's
# view misses up to a block of the last prompt's tail) stays well below it; a long new message does not.
KV_THRESHOLD = 96
SECRET = "topology-secret"
FLOWS = ("pd-push", "vllm-standard")


def _engine(
    model: Path, log_dir: Path, role: str, index: int, side_channel_port: int, p_addrs: list[str]
) -> ManagedServer:
    extra: dict[str, Any] = {"secret": SECRET, "load_timeout_s": 30.0, "transport": "ucx"}
    if role == "prefill":
        extra |= {"side_channel_port": side_channel_port, "lease_s": 30.0}
    else:
        extra |= {"allowed_prefill_addrs": p_addrs}
    return vllm_server(
        model,
        log_dir=log_dir,
        name=f"topo-{role}{index}",
        cpu_core=index,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        extra_args=["--served-model-name", "tiny", "--max-num-batched-tokens", "128"],
        kv_transfer_config={
            "kv_connector": "PDConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
    )


@pytest.fixture(scope="module")
def cluster(start_servers, tiny_model: Path, log_dir: Path, tmp_path_factory) -> dict[str, Any]:
    """Two P, two D, and one pd-router per flow over all four."""
    ports = [free_port(), free_port()]
    p_addrs = [f"127.0.0.1:{p}" for p in ports]
    prefills = [_engine(tiny_model, log_dir, "prefill", i, ports[i], p_addrs) for i in range(2)]
    decodes = [_engine(tiny_model, log_dir, "decode", i, 0, p_addrs) for i in range(2)]
    start_servers(*prefills, *decodes)
    for server in (*prefills, *decodes):
        assert "data plane ucx" in server.log_tail(400), server.name
    routers = {}
    kv_off: dict[str, Any] = {"enabled": False}
    kv_on: dict[str, Any] = {"block_size": BLOCK_TOKENS}
    for name, flow, policy, kv, ds in (
        *((f, f, {"threshold_tokens": THRESHOLD}, kv_off, decodes) for f in FLOWS),
        ("kv", "pd-push", {"threshold_tokens": KV_THRESHOLD}, kv_on, decodes),
        ("lend", "pd-push", {"threshold_tokens": THRESHOLD, "lend_max_active": 4}, kv_off, decodes[:1]),
    ):
        config = write_router_config(
            tmp_path_factory.mktemp(name) / "router.toml",
            flow=flow,
            sections={
                "model": {"path": str(tiny_model), "served_names": ["tiny"], "max_model_len": MAX_MODEL_LEN},
                "policy": policy,
                "kv_routing": kv,
                "health": {"interval_s": 0.5},
            },
            prefill=[{"url": base_url(p), "bootstrap": a} for p, a in zip(prefills, p_addrs, strict=True)],
            decode=[{"url": base_url(d)} for d in ds],
        )
        (router,) = start_servers(
            router_server(config, log_dir=log_dir, port=free_port(), name=f"topo-{name}")
        )
        routers[name] = base_url(router)
    return {
        "p": [base_url(p) for p in prefills],
        "d": [base_url(d) for d in decodes],
        "routers": routers,
    }


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1900) for _ in range(n)]


def _body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }


def _routed(router: str, payload: dict[str, Any]) -> tuple[str, list[int]]:
    """POST through pd-router; returns (X-PD-Route, the generated token ids)."""
    request = pd_client.urllib.request.Request(
        router + "/v1/completions", json.dumps(payload).encode(), {"content-type": "application/json"}
    )
    with pd_client.urllib.request.urlopen(request, timeout=180) as resp:
        route = resp.headers.get("X-PD-Route", "")
        return route, list(json.load(resp)["choices"][0]["token_ids"])


def _colocated(cluster: dict[str, Any], prompt: list[int]) -> list[int]:
    return list(
        pd_client.post_json(cluster["d"][0] + "/v1/completions", _body(prompt))["choices"][0]["token_ids"]
    )


@pytest.mark.parametrize("flow", FLOWS)
def test_copies_of_a_prompt_some_prefill_has_cached(cluster: dict[str, Any], flow: str) -> None:
    prompt = _prompt(700, seed=30_000 + FLOWS.index(flow))
    router = cluster["routers"][flow]
    transfers = Transfers(cluster["p"], cluster["d"])
    first = _routed(router, _body(prompt))
    with ThreadPoolExecutor(6) as pool:
        copies = list(pool.map(lambda _: _routed(router, _body(prompt)), range(6)))
    assert {route for route, _ in [first, *copies]} == {"disagg"}
    transfers.check(7)
    reference = _colocated(cluster, prompt)
    assert [tokens for _, tokens in [first, *copies]] == [reference] * 7


@pytest.mark.parametrize("flow", FLOWS)
def test_mixed_load_across_two_prefills_and_two_decodes(cluster: dict[str, Any], flow: str) -> None:
    """24 prompts of mixed lengths at once, half streamed: each is answered with the colocated tokens, every
    long one completes its load (on either D), no block stays held on any engine."""
    rng = random.Random(31_000 + FLOWS.index(flow))
    prompts = [
        _prompt(rng.choice([20, 90, 300, 800]), seed=32_000 + 100 * FLOWS.index(flow) + i) for i in range(24)
    ]
    router = cluster["routers"][flow]
    transfers = Transfers(cluster["p"], cluster["d"])

    def one(i: int) -> tuple[str, list[int]]:
        if i % 2:
            return _routed(router, _body(prompts[i]))
        return _routed_stream(router, _body(prompts[i], stream=True))

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24)))
    disagg = sum(route == "disagg" for route, _ in results)
    assert disagg == sum(len(p) >= THRESHOLD for p in prompts)
    transfers.check(disagg, local_tokens=sum(len(p) for p in prompts if len(p) < THRESHOLD))
    assert [tokens for _, tokens in results] == [_colocated(cluster, p) for p in prompts]
    for url in cluster["p"] + cluster["d"]:
        wait_until(lambda url=url: blocks_idle(url), 30, f"no block held on {url}")


def _routed_stream(router: str, payload: dict[str, Any]) -> tuple[str, list[int]]:
    """Stream through pd-router; returns (X-PD-Route, the token ids of every event)."""
    request = pd_client.urllib.request.Request(
        router + "/v1/completions", json.dumps(payload).encode(), {"content-type": "application/json"}
    )
    with pd_client.urllib.request.urlopen(request, timeout=180) as resp:
        route = resp.headers.get("X-PD-Route", "")
        raw = resp.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    return route, [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]


def test_a_short_prompt_lent_to_an_idle_prefill_is_served_there_alone(cluster: dict[str, Any]) -> None:
    """The lend router (``policy.lend_max_active``; both P, only the first D): while a stream holds that D, a
    short prompt goes to an idle P (reason ``lent``) and is served there alone, as D would: the colocated
    tokens, no transfer, no block left held on any engine."""
    router, ps, ds = cluster["routers"]["lend"], cluster["p"], cluster["d"]
    busy, short = _prompt(20, seed=34_000), _prompt(20, seed=34_001)
    served, transfers = _served(ps), Transfers(ps, ds)
    request = pd_client.urllib.request.Request(
        router + "/v1/completions",
        json.dumps(_body(busy, stream=True, max_tokens=200, ignore_eos=True)).encode(),
        {"content-type": "application/json"},
    )
    with pd_client.urllib.request.urlopen(request, timeout=180) as resp:
        assert resp.headers.get("X-PD-Route") == "local"
        assert resp.readline().startswith(b"data: ")  # D streams it: D has one request, each P none
        route, tokens = _routed(router, _body(short))
        resp.read()
    assert route == "local"
    assert metric(router, "pd_router_requests_total", {"reason": "lent"}) == 1
    assert sum(_served(ps)) - sum(served) == 1, "one P served the short prompt"
    transfers.check(0, local_tokens=len(busy))
    assert tokens == _colocated(cluster, short)
    for url in ps + ds:
        wait_until(lambda url=url: blocks_idle(url), 30, f"no block held on {url}")


def _chat(url: str, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
    """A greedy chat turn (10 tokens, with token ids); returns (X-PD-Route, the response)."""
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 10,
        "temperature": 0,
        "return_token_ids": True,
    }
    request = pd_client.urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with pd_client.urllib.request.urlopen(request, timeout=180) as resp:
        return resp.headers.get("X-PD-Route", ""), json.load(resp)


def _served(urls: list[str]) -> list[float]:
    return [metric(u, "vllm:request_success_total") for u in urls]


def test_a_conversation_follows_its_prefix_cache(cluster: dict[str, Any]) -> None:
    """Turn 1 (long, new): P->D on some D. Turn 2 (+ the answer and a short question): that D alone, from its
    prefix cache, no transfer. Turn 3 (+ a long message): P->D on that D again, P pushing only the blocks D
    lacks (its prefix-cache hit sets the transfer's start). Every turn's tokens equal a colocated server's."""
    router, ds = cluster["routers"]["kv"], cluster["d"]
    rng = random.Random(33_000)

    def words(n: int) -> str:
        return " ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(5)) for _ in range(n))

    def router_metric(name: str, **labels: str) -> float:
        return metric(router, name, labels)

    messages = [{"role": "system", "content": words(120)}, {"role": "user", "content": words(4)}]
    served, transfers = _served(ds), Transfers(cluster["p"], ds)
    route, first = _chat(router, messages)
    assert route == "disagg"
    home = [a - b for a, b in zip(_served(ds), served, strict=True)].index(1)
    len1 = first["usage"]["prompt_tokens"]
    transfers.check(1, blocks=blocks_to_load(len1))
    turns = [(list(messages), first)]

    def next_turn(previous: dict[str, Any], user_words: int) -> tuple[str, dict[str, Any], Transfers, float]:
        """The answer so far and a new user message through the router: its route and answer, the transfer
        snapshot taken before it and the prefix-cache hits it made on turn 1's D, which must have served it."""
        messages.append({"role": "assistant", "content": previous["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": words(user_words)})
        served, transfers = _served(ds), Transfers(cluster["p"], ds)
        hits_before = metric(ds[home], "vllm:prefix_cache_hits_total")
        route, answer = _chat(router, messages)
        assert [a - b for a, b in zip(_served(ds), served, strict=True)] == [
            i == home for i in range(len(ds))
        ]
        return route, answer, transfers, metric(ds[home], "vllm:prefix_cache_hits_total") - hits_before

    route, second, transfers, hit = next_turn(first, 2)
    assert route == "local"
    assert hit >= len1 // BLOCK_TOKENS * BLOCK_TOKENS
    assert (
        transfers.now().sent == transfers.before.sent
        and transfers.now().received == transfers.before.received
    )
    assert router_metric("pd_router_requests_total", reason="cached", route="local") == 1
    # the router's view: turn 1's full blocks (its chat rendering is a prefix of turn 2's, token for token)
    assert (
        router_metric("pd_router_prefix_hit_tokens_total", route="local")
        == len1 // BLOCK_TOKENS * BLOCK_TOKENS
    )
    turns.append((list(messages), second))

    route, third, transfers, hit = next_turn(second, 60)
    assert route == "disagg"
    len2, len3 = second["usage"]["prompt_tokens"], third["usage"]["prompt_tokens"]
    assert hit >= len2 // BLOCK_TOKENS * BLOCK_TOKENS  # at least turn 2's prompt, which D computed itself
    transfers.check(1, blocks=blocks_to_load(len3, int(hit)))  # only what D lacked moved
    assert router_metric("pd_router_decode_placements_total", reason="prefix") == 2
    turns.append((list(messages), third))

    for sent, answer in turns:
        _, colocated = _chat(ds[1 - home], sent)
        assert answer["choices"][0]["token_ids"] == colocated["choices"][0]["token_ids"]
