"""Several P and several D: two prefill and two decode vLLM servers with PDConnector behind pd-router, in our
push flow and in vLLM's standard (P-then-D) flow, with every engine at its defaults (prefix caching on).

The case that once gave wrong tokens with ``pd_connector_failures_total`` at 0: one long prompt sent to the
cluster once, then six copies at once. P answers the copies from its prefix cache; the D that had seen the
prompt loaded only its tail and was right, the other got the blocks P had not pushed as holes. Here every
copy must give the colocated tokens, every P->D request must complete its load on either D, and nothing may
fail or be recomputed. Four engine servers share the two cores (one P and one D per core). They move KV over
``ucx`` (UCX shared memory, copied by ucxx's progress thread while the workers run Python); tcp is the other
modules' data plane, cma the tensor-parallel module's.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from integration_tests.pd_checks import Transfers, blocks_idle, wait_until
from pd_disagg import pd_client
from pd_disagg.engines import base_url, router_server, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port

MAX_MODEL_LEN = 1024
THRESHOLD = 64
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
    for flow in FLOWS:
        config = write_router_config(
            tmp_path_factory.mktemp(flow) / "router.toml",
            flow=flow,
            sections={
                "model": {"path": str(tiny_model), "served_names": ["tiny"], "max_model_len": MAX_MODEL_LEN},
                "policy": {"threshold_tokens": THRESHOLD},
                "health": {"interval_s": 0.5},
            },
            prefill=[{"url": base_url(p), "bootstrap": a} for p, a in zip(prefills, p_addrs, strict=True)],
            decode=[{"url": base_url(d)} for d in decodes],
        )
        (router,) = start_servers(
            router_server(config, log_dir=log_dir, port=free_port(), name=f"topo-{flow}")
        )
        routers[flow] = base_url(router)
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
