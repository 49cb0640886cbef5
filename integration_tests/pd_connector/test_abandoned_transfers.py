"""Transfers nobody completes: clients that disconnect mid-request, a prefill whose D never comes (the
lease), a D waiting for KV P never heard of (the load timeout). Blocks are always released, failures counted,
and both servers keep serving.

Runs on the package's cluster (conftest.py) in the default configuration.
"""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.error
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from integration_tests.pd_checks import FAILURES, blocks_idle, blocks_to_load, metric
from integration_tests.pd_connector.cluster import D_LOAD_TIMEOUT_S, LEASE_S, Cluster, body, token_ids, tokens
from pd_connector import wire
from pd_disagg import pd_client
from tests.polling import wait_until


def _abandon(url: str, path: str, payload: dict[str, Any], after_s: float) -> None:
    """Send a request and drop the connection after ``after_s`` (a client disconnect vLLM must abort)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, json.dumps(payload), {"content-type": "application/json"})
    time.sleep(after_s)  # the fault's moment: a random point of the request's life, not a synchronisation
    conn.close()


def test_random_aborts_release_all_blocks(pd: Cluster) -> None:
    """Client disconnects at random points on either or both legs: both servers return to no blocks used."""
    rng = random.Random(7)
    wait_until(lambda: blocks_idle(pd.p_url) and blocks_idle(pd.d_url), 15, "idle before aborts")

    def one(i: int) -> None:
        prompt = tokens(rng.randrange(200, 900), seed=4000 + i)
        transfer_id = uuid.uuid4().hex
        legs = rng.choice(["prefill", "decode", "both"])
        p_body = pd_client.prefill_body(body(prompt), wire.PushPrefill(transfer_id))
        d_body = pd_client.decode_body(body(prompt, max_tokens=200, stream=True), transfer_id, pd.bootstrap)
        delay = rng.uniform(0.0, 0.6)
        with ThreadPoolExecutor(2) as pool:
            if legs in ("prefill", "both"):
                p_done = pool.submit(_abandon, pd.p_url, "/v1/completions", p_body, delay)
            else:
                p_done = pool.submit(pd_client.post_json, pd.p_url + "/v1/completions", p_body)
            d_done = pool.submit(
                _abandon, pd.d_url, "/v1/completions", d_body, delay if legs != "prefill" else delay + 0.5
            )
            p_done.result()
            d_done.result()

    for i in range(8):
        one(i)
    # Aborted P legs free at once; a P whose D vanished waits at most the lease.
    wait_until(lambda: blocks_idle(pd.p_url), LEASE_S + 20, "P blocks back to baseline")
    wait_until(lambda: blocks_idle(pd.d_url), D_LOAD_TIMEOUT_S + 20, "D blocks back to baseline")
    prompt = tokens(150, seed=4999)
    transfers = pd.transfers()
    assert pd.disaggregated(prompt) == pd.reference(prompt), "servers still serve correctly"
    transfers.check(1, blocks=blocks_to_load(len(prompt)))


def test_lease_expiry_frees_prefill_blocks(pd: Cluster) -> None:
    """A prefill whose D never shows up holds its blocks only for the lease, then frees them."""
    wait_until(lambda: blocks_idle(pd.p_url), LEASE_S + 20, "P idle before the test")
    expired = metric(pd.p_url, "vllm:pd_connector_expired_leases_total")
    prompt = tokens(400, seed=5000)
    answer = pd_client.post_json(
        pd.p_url + "/v1/completions", pd_client.prefill_body(body(prompt), wire.PushPrefill(uuid.uuid4().hex))
    )
    assert answer["kv_transfer_params"]["pd_prefill_addr"] == pd.bootstrap
    assert metric(pd.p_url, "vllm:kv_cache_usage_perc") > 0, "blocks held for the missing D"
    took = wait_until(lambda: blocks_idle(pd.p_url), LEASE_S + 15, "lease expiry")
    assert took >= LEASE_S - 1.5
    # Connector stats reach /metrics with the engine's next output: an idle engine needs one more request.
    pd.reference(tokens(3, seed=5001))
    wait_until(
        lambda: metric(pd.p_url, "vllm:pd_connector_expired_leases_total") >= expired + 1,
        10,
        "expired-lease counter",
    )


def test_decode_times_out_when_prefill_never_delivers(pd: Cluster) -> None:
    """D waits for a transfer P never heard of: after its load timeout (or P's lease on the orphaned
    destinations, whichever is shorter) it recomputes (policy recompute), answers correctly, frees its blocks."""
    prompt = tokens(300, seed=7000)
    reference = pd.reference(prompt)
    failures = metric(pd.d_url, FAILURES)
    start = time.monotonic()
    answer = pd_client.post_json(
        pd.d_url + "/v1/completions", pd_client.decode_body(body(prompt), uuid.uuid4().hex, pd.bootstrap)
    )
    took = time.monotonic() - start
    assert token_ids(answer) == reference
    # Whichever ends first: D's load timeout, or P's lease on destinations it was never offered.
    assert min(D_LOAD_TIMEOUT_S, LEASE_S) - 0.5 <= took <= D_LOAD_TIMEOUT_S + 20
    wait_until(lambda: metric(pd.d_url, FAILURES) == failures + 1, 10, "the failure counted")
    wait_until(lambda: blocks_idle(pd.d_url), 10, "D blocks freed")


def test_seeded_decode_after_its_prefill_is_gone(pd: Cluster) -> None:
    """First-token seeding when P answered (the client has its token) but is gone before D loads: D's load fails
    at connect. In vLLM's standard flow P's answer carried the token (``pd_first_token``): D prefills the
    prompt and that token itself and continues after it, so its tokens are the colocated ones after the
    first. In pd-push the token only travels in P's ``Done``, which never came: D ends the request with vLLM's
    generation error (pd-router then resumes the stream after P's token) instead of recomputing, which would
    sample a first token of D's own and repeat the one the client has. D frees its blocks and keeps serving."""
    prompt = tokens(100, seed=7300)
    reference = pd.reference(prompt)
    returned = pd_client.standard_prefill(pd.p_url, body(prompt))
    assert returned["pd_first_token"] == reference[0], "P's answer carries the token it sampled"
    failures = metric(pd.d_url, FAILURES)
    gone = {**returned, "pd_prefill_addr": pd.down_addr, "pd_seed_first_token": True}
    seeded = pd_client.post_json(
        pd.d_url + "/v1/completions", {**body(prompt), wire.KV_TRANSFER_PARAMS: gone}
    )
    assert token_ids(seeded) == reference[1:], "D continued after P's token, which it did not repeat"
    push = wire.PushDecode(uuid.uuid4().hex, pd.down_addr, pd_seed_first_token=True)
    try:
        answer = pd_client.post_json(
            pd.d_url + "/v1/completions", {**body(prompt), wire.KV_TRANSFER_PARAMS: wire.encode(push)}
        )
    except urllib.error.HTTPError as e:
        assert e.code == 500, e.read()
    else:
        raise AssertionError(f"a seeded load without P's token must not be answered: {answer}")
    wait_until(lambda: metric(pd.d_url, FAILURES) == failures + 2, 10, "both failed loads counted")
    wait_until(lambda: blocks_idle(pd.d_url), 10, "D blocks freed")
    assert token_ids(pd_client.post_json(pd.d_url + "/v1/completions", body(prompt))) == reference
    wait_until(lambda: blocks_idle(pd.p_url), LEASE_S + 15, "P's lease on the answered prefill expired")
