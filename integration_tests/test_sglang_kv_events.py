"""KV-aware routing on SGLang's own KV events (issue 21): two SGLang prefill servers and one decode server
(the ``pd`` transfer backend, tiny model) behind pd-router, whose view of one P comes from the KV events that
P publishes (``--kv-events-config``, ZMQ) and of the other from the router's routing history alone.

A prompt sent to the publishing P and D directly, never through the router, is in the router's view from
SGLang's events alone (SGLang names 1-token pages by its own chained SHA-256; the router regroups them into
its 16-token blocks from the token ids); a longer prompt that starts with it then goes through the router
to that P, which sends its KV to D (the other P sends nothing) and finds the prefix in its radix cache.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from integration_tests.pd_checks import metric
from integration_tests.sglang_checks import CHUNK_TOKENS, MAX_NEW_TOKENS, assert_drained, bootstrap
from integration_tests.sglang_client import generate_pd
from pd_disagg.engines import base_url, router_server, sglang_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port
from tests.polling import wait_until

BLOCK = 16  # the router's block size; SGLang's pages are 1 token
ENV = {"PD_SGLANG_TRANSPORT": "tcp", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30"}
#: ~150 tokens, never sent before this module: the prefix the router learns from SGLang's events.
PREFIX = "".join(f"entry_{i} = lookup(entry_{i - 1}, {i * 5})\n" for i in range(1, 16))


@pytest.fixture(scope="module")
def cluster(start_servers, tiny_model: Path, log_dir: Path, tmp_path_factory) -> dict[str, Any]:
    """P0 (no events), P1 (publishing KV events) and D; pd-router over them with KV-aware routing."""
    ports = {name: free_port() for name in ("p1", "events")}
    events = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ports['events']}", "bind": True}

    def prefill(name: str, core: int, extra: tuple[str, ...] = ()) -> ManagedServer:
        return sglang_server(
            tiny_model,
            log_dir=log_dir,
            name=f"sglang-kv-{name}",
            cpu_core=core,
            disaggregation_mode="prefill",
            bootstrap_port=ports[name],
            extra_args=("--chunked-prefill-size", str(CHUNK_TOKENS), "--enable-metrics", *extra),
            env=ENV,
        )

    # P1 binds the events port late in its start-up, and SGLang servers pick their own internal ports while
    # they start: started together, P0 or D once took that port first (CI: "Address already in use"). So
    # P1 starts alone, and the others (and P0's bootstrap port) are picked once it holds its ports.
    p1 = prefill("p1", 1, ("--kv-events-config", json.dumps(events)))
    start_servers(p1)
    ports["p0"] = free_port()
    p0 = prefill("p0", 0)
    decode = sglang_server(
        tiny_model, log_dir=log_dir, name="sglang-kv-d", cpu_core=0, disaggregation_mode="decode", env=ENV
    )
    start_servers(p0, decode)
    config = write_router_config(
        tmp_path_factory.mktemp("sglang-kv") / "router.toml",
        flow="sglang-bootstrap",
        sections={
            "model": {"path": str(tiny_model), "served_names": ["m"]},
            "policy": {"threshold_tokens": 0},  # SGLang's D cannot prefill alone
            "kv_routing": {"block_size": BLOCK},
            "health": {"interval_s": 0.5, "timeout_s": 5},
        },
        prefill=[
            {"url": base_url(p0), "engine": "sglang", "bootstrap_port": ports["p0"]},
            {
                "url": base_url(p1),
                "engine": "sglang",
                "bootstrap_port": ports["p1"],
                "kv_events": events["endpoint"],
            },
        ],
        decode=[{"url": base_url(decode), "engine": "sglang"}],
    )
    (router,) = start_servers(
        router_server(config, log_dir=log_dir, port=free_port(), name="pd-router-sglang-kv")
    )
    return {"p": [p0, p1], "d": decode, "bootstrap": [ports["p0"], ports["p1"]], "router": base_url(router)}


def _completion(router: str, prompt: str) -> str:
    payload = {"model": "m", "prompt": prompt, "max_tokens": MAX_NEW_TOKENS, "temperature": 0}
    request = urllib.request.Request(
        router + "/v1/completions", json.dumps(payload).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return resp.headers["X-PD-Route"]


def test_the_router_learns_sglangs_prefix_from_its_events_and_routes_to_it(cluster: dict[str, Any]) -> None:
    (p0, p1), decode, router = cluster["p"], cluster["d"], cluster["router"]
    p1_url = base_url(p1)

    def direct(prompt: str) -> int:
        """``prompt`` to P1 and D, not through the router; returns its prompt tokens."""
        p, d = generate_pd(
            p1_url, base_url(decode), bootstrap(cluster["bootstrap"][1]), prompt, MAX_NEW_TOKENS
        )
        assert p.ok and d.ok, (p, d)
        return int(p.body["meta_info"]["prompt_tokens"])

    def batches() -> float:
        return metric(router, "pd_router_kv_event_batches_total", {"url": p1_url, "result": "batch"})

    # The router's subscription reaches P1's publisher at some point after both started: prompts it never
    # saw go to P1 until one of their batches arrives (SGLang publishes after each scheduler step).
    warmups = iter(range(100))
    wait_until(
        lambda: direct(f"warm_{next(warmups)} = 1\n") > 0 and batches() > 0, 60, "P1's events at the router"
    )
    blocks = metric(router, "pd_router_prefix_index_blocks")
    tokens = direct(PREFIX)
    wait_until(
        lambda: metric(router, "pd_router_prefix_index_blocks") - blocks >= tokens // BLOCK,
        10,
        "the prefix's blocks in the router's view",
    )
    assert metric(router, "pd_router_kv_event_batches_total", {"result": "gap"}) == 0

    def counters() -> list[float]:
        """Each P's KV bytes sent, and P1's prompt tokens found in its radix cache."""
        sent = [metric(base_url(p), "sglang:pd_connector_bytes_sent_total") for p in (p0, p1)]
        return [*sent, metric(p1_url, "sglang:cached_tokens_total")]

    before = counters()
    assert _completion(router, PREFIX + "entry_16 = lookup(entry_15, 80)\n") == "disagg"

    def grew() -> list[float]:
        return [now - then for now, then in zip(counters(), before, strict=True)]

    wait_until(lambda: grew()[1] > 0, 10, "P1's transfer on its /metrics")
    sent_p0, _, cached = grew()
    assert sent_p0 == 0  # the other P did not serve it
    assert cached >= tokens // BLOCK * BLOCK  # P1 found the prefix in its radix cache
    for server in (*cluster["p"], decode):
        assert_drained(server)
