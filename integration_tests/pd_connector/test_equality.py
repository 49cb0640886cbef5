"""PDConnector moves exactly what D needs: P/D outputs equal colocated ones, and the transfer happened.

Every test proves the transfer (``pd_checks.Transfers``: exact bytes on both sides, one completed load per
request, nothing failed, refused or recomputed), because a failed load is recomputed and gives the same
tokens; a negative control shows D decodes from the bytes it received. Runs on the package's cluster
(conftest.py) in its default configuration.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from integration_tests.pd_checks import blocks_idle, blocks_to_load, decode_hit_after_seen, metric
from integration_tests.pd_connector.cluster import PROMPT_LENGTHS, Cluster, body, token_ids, tokens
from pd_disagg import pd_client
from tests.polling import wait_until


def test_disaggregated_equals_colocated(pd: Cluster) -> None:
    """Every prompt size, chunked on P. P computed each prompt before (the reference), so its prefix cache
    covers the prompt and D has none of it: P must push its cached blocks too. The second round hits D's
    cache and loads only the tail. Each round moves exactly the blocks D asked for, and nothing is recomputed."""
    prompts = [tokens(n, seed=n) for n in PROMPT_LENGTHS]
    references = [pd.reference(p) for p in prompts]
    for round_, cached in enumerate((False, True)):
        transfers = pd.transfers()
        for prompt, reference in zip(prompts, references, strict=True):
            assert pd.disaggregated(prompt) == reference, f"{len(prompt)} tokens, round {round_}"
        hits = [decode_hit_after_seen(len(p)) if cached else 0 for p in prompts]
        blocks = sum(blocks_to_load(len(p), h) for p, h in zip(prompts, hits, strict=True))
        transfers.check(len(prompts), blocks=blocks)
    wait_until(lambda: blocks_idle(pd.p_url) and blocks_idle(pd.d_url), 15, "blocks freed")


def test_prefill_prefix_cache_hit_reaches_a_decode_without_it(pd: Cluster) -> None:
    """P holds the first 320 tokens of the prompt (sent to P alone before), D holds nothing: D must receive
    all of it, P's cached part included, and decode the colocated tokens (a hole once made D decode garbage)."""
    prompt = tokens(700, seed=20_000)
    pd.reference(prompt[:320])
    hits = metric(pd.p_url, "vllm:prefix_cache_hits_total")
    transfers = pd.transfers()
    answer = pd.disaggregated(prompt)
    assert metric(pd.p_url, "vllm:prefix_cache_hits_total") - hits >= 320, "P's prefill hit its cache"
    transfers.check(1, blocks=blocks_to_load(len(prompt)))
    assert answer == pd.reference(prompt)


def test_vllm_standard_flow(pd: Cluster) -> None:
    """vLLM's own proxy flow: P first (max_tokens=1), then D with the kv_transfer_params P returned."""
    for n in (40, 300):
        prompt = tokens(n, seed=1000 + n)
        reference = pd.reference(prompt)
        transfers = pd.transfers()
        assert token_ids(pd_client.vllm_standard(pd.p_url, pd.d_url, body(prompt))) == reference
        transfers.check(1, blocks=blocks_to_load(n))


def test_sixteen_concurrent_requests(pd: Cluster) -> None:
    prompts = [tokens(60 + 37 * i, seed=2000 + i) for i in range(16)]
    references = [pd.reference(p) for p in prompts]
    transfers = pd.transfers()
    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(pd.disaggregated, prompts))
    assert outputs == references
    transfers.check(16, blocks=sum(blocks_to_load(len(p)) for p in prompts))
    wait_until(lambda: blocks_idle(pd.p_url) and blocks_idle(pd.d_url), 15, "blocks freed")


def test_identical_prompts_at_once_share_prefills_cache(pd: Cluster) -> None:
    """Six copies of one long prompt at once: P's chunked prefills of the later copies hit blocks the first
    one cached, D's loads do not; every copy gets the colocated tokens and a complete transfer."""
    prompt = tokens(600, seed=21_000)
    transfers = pd.transfers()
    with ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(pd.disaggregated, [prompt] * 6))
    assert outputs == [pd.reference(prompt)] * 6
    transfers.check(6)


@pytest.mark.parametrize("shape", ["n=2", "prompt list"])
def test_several_sequences_share_one_transfer_id_safely(pd: Cluster, shape: str) -> None:
    """``n > 1`` and prompt lists reach the engines as several requests with the same kv_transfer_params:
    the first transfers, the others are refused on P and on D (counted) and run locally, so every choice
    gets its colocated tokens and no block is held. (pd-router sends such requests down the local path.) n=2
    samples with top_k=1: vLLM refuses n > 1 for greedy requests, and a seed kills vLLM 0.32's CPU sampler."""
    prompt = tokens(330, seed=22_000 + len(shape))
    if shape == "n=2":
        request = {**body(prompt), "n": 2, "temperature": 1.0, "top_k": 1}
        expected = [pd.reference(prompt)] * 2
    else:
        other = tokens(200, seed=22_100)
        request = body([prompt, other])  # type: ignore[arg-type]
        expected = [pd.reference(prompt), pd.reference(other)]
    before = pd.transfers().before
    answer, p_answer = pd_client.disaggregated(pd.p_url, pd.d_url, pd.bootstrap, request)
    assert isinstance(p_answer, dict), p_answer
    assert [list(c["token_ids"]) for c in sorted(answer["choices"], key=lambda c: c["index"])] == expected
    wait_until(lambda: pd.transfers().before.loaded == before.loaded + 1, 15, "one completed load")
    now = pd.transfers().before
    assert (now.failures, now.refused) == (before.failures, before.refused + 2), (
        "the copies refused, none failed"
    )
    wait_until(lambda: blocks_idle(pd.p_url) and blocks_idle(pd.d_url), 15, "no block held")


def test_decode_metrics_show_external_transfer(pd: Cluster) -> None:
    """D counts the prompt as external (P2P) cache hits, and the connector's histograms saw the transfer."""
    d_hits = metric(pd.d_url, "vllm:external_prefix_cache_hits_total")
    loads = metric(pd.d_url, "vllm:pd_connector_load_seconds_count")
    prompt = tokens(500, seed=3000)
    reference = pd.reference(prompt)
    transfers = pd.transfers()
    assert pd.disaggregated(prompt) == reference
    transfers.check(1, blocks=blocks_to_load(len(prompt)))
    assert metric(pd.d_url, "vllm:external_prefix_cache_hits_total") - d_hits >= len(prompt) - 1
    assert metric(pd.d_url, "vllm:pd_connector_load_seconds_count") == loads + 1


def test_corrupted_transfer_changes_output(pd: Cluster) -> None:
    """Negative control: P zeroes the KV it pushes (test-only flag) and D's output changes, so D really
    decodes from the transferred bytes. (P and D keep the zeroed blocks cached: these prompts serve only here,
    and the reference is taken first.)"""
    for n in (100, 257, 600):
        prompt = tokens(n, seed=9000 + n)
        reference = pd.reference(prompt)
        transfers = pd.transfers()
        assert pd.disaggregated(prompt, corrupt=True) != reference, f"{n} tokens"
        transfers.check(1)
