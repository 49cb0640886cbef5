"""pd-router records what the autoscaler plans from: each routed request's prompt length and output limit, by
route, in ``pd_router_prompt_tokens`` and ``pd_router_max_tokens`` on ``/metrics`` (a real router in front of
fake engines on real HTTP, tests/router/conftest.py), and the estimate reads them back."""

from __future__ import annotations

import pytest

from pd_disagg.autoscale import prom
from pd_disagg.autoscale.estimate import Window
from tests.router.conftest import (  # noqa: F401  (fixtures, used by name)
    MODEL,
    MakeCluster,
    long_prompt,
    make_cluster,
    router_server,
    short_prompt,
    tokenizer_dir,
)


async def test_prompt_lengths_and_output_limits_are_on_metrics(make_cluster: MakeCluster) -> None:  # noqa: F811
    cluster = await make_cluster(n_prefill=1, n_decode=1)
    window = Window(window_s=60.0, ttft_slo_s=1.0, tpot_slo_s=0.1, min_samples=1)
    before = prom.Scrape.parse(await (await cluster.router.get("/metrics")).text())
    window.add(0.0, before)
    for prompt, max_tokens in ((long_prompt(), 40), (short_prompt(), 4), (short_prompt(), None)):
        body = {"model": MODEL, "prompt": prompt, "stream": True}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        resp = await cluster.router.post("/v1/completions", json=body)
        assert resp.status == 200
        await resp.read()
    scrape = prom.Scrape.parse(await (await cluster.router.get("/metrics")).text())
    disagg = scrape.buckets("pd_router_prompt_tokens", route="disagg")
    local = scrape.buckets("pd_router_prompt_tokens", route="local")
    assert prom.count(disagg) == 1 and prom.count(local) == 2
    assert disagg[64.0] == 1 and disagg[32.0] == 0  # the long prompt: 64 words, 64 tokens
    assert local[16.0] == 2  # "hello world": 2 tokens (or its bound, below the threshold of 32)
    limits = scrape.buckets("pd_router_max_tokens")  # the request without max_tokens is not counted
    assert prom.count(limits) == 2 and limits[16.0] == 1 and limits[32.0] == 1 and limits[64.0] == 2
    estimate = window.add(10.0, scrape)
    assert estimate is not None and estimate.disagg_rate == pytest.approx(0.1)
    assert estimate.prompt is not None and estimate.prompt.median == pytest.approx(64.0)
