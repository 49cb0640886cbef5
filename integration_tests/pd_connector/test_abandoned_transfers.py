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
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from integration_tests.pd_checks import FAILURES, blocks_idle, blocks_to_load, metric, wait_until
from integration_tests.pd_connector.cluster import D_LOAD_TIMEOUT_S, LEASE_S, Cluster, body, token_ids, tokens
from pd_connector import wire
from pd_disagg import pd_client


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
