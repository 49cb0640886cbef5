"""P or D killed while a transfer is under way: the other side recovers within its timeout, frees its blocks
and keeps serving; a restarted P serves D again.

Runs on the package's cluster (conftest.py); these tests restart servers, which is why this file runs after
those using the default configuration (see conftest.py).
"""

from __future__ import annotations

import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from integration_tests.pd_checks import FAILURES, blocks_idle, blocks_to_load, metric
from integration_tests.pd_connector.cluster import (
    D_LOAD_TIMEOUT_S,
    LEASE_S,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    Cluster,
    body,
    token_ids,
    tokens,
)
from pd_connector import wire
from pd_disagg import pd_client
from tests.polling import wait_until


def _connections_to(port: int) -> int:
    """Established TCP connections whose local end is ``port`` on this host (accepted or still queued)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                count += fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port
    return count


def _decode_leg(pd: Cluster, prompt: list[int], tid: str) -> dict[str, Any]:
    """D's leg of transfer ``tid`` in our push flow (blocks until D answers)."""
    return pd_client.post_json(
        pd.d_url + "/v1/completions", pd_client.decode_body(body(prompt), tid, pd.bootstrap)
    )


def _prefill_leg(pd: Cluster, prompt: list[int], tid: str) -> dict[str, Any]:
    """P's leg of transfer ``tid`` in our push flow (blocks until P answers)."""
    return pd_client.post_json(
        pd.p_url + "/v1/completions", pd_client.prefill_body(body(prompt), wire.PushPrefill(tid))
    )


def test_prefill_killed_during_a_transfer_then_restarted(cluster: Cluster) -> None:
    """P frozen (SIGSTOP) with both legs sent, then killed: D, waiting for KV or about to dial P, recomputes
    within its timeout; with P gone, a new transfer fails at connect time and D recomputes at once; a P
    restarted on the same side channel serves D again. (A write cut off halfway is the unit tests' case:
    tests/pd_connector/test_control_plane.py kills a prefill process mid-transfer. The reference comes from
    the restarted P.)"""
    pd = cluster.ensure()
    assert pd.prefill is not None
    prompt = tokens(MAX_MODEL_LEN - MAX_TOKENS - 1, seed=8000)
    failures = metric(pd.d_url, FAILURES)
    tid = uuid.uuid4().hex
    p_port = int(pd.p_url.rsplit(":", 1)[1])
    queued = _connections_to(p_port)
    pd.prefill.kill(signal.SIGSTOP)
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        d_leg = pool.submit(_decode_leg, pd, prompt, tid)
        p_leg = pool.submit(_prefill_leg, pd, prompt, tid)
        wait_until(lambda: _connections_to(p_port) > queued, 30, "the P leg queued at the frozen P")
        pd.prefill.kill()
        with pytest.raises(OSError):
            p_leg.result(timeout=60)
        answer = d_leg.result(timeout=120)
    assert time.monotonic() - start < D_LOAD_TIMEOUT_S + 30
    start = time.monotonic()
    again, _ = pd_client.disaggregated(pd.p_url, pd.d_url, pd.bootstrap, body(prompt), timeout_s=60)
    assert time.monotonic() - start < D_LOAD_TIMEOUT_S + 10
    wait_until(lambda: blocks_idle(pd.d_url), 15, "D blocks freed")
    wait_until(lambda: metric(pd.d_url, FAILURES) == failures + 2, 10, "both failed loads counted")
    cluster.ensure()  # P restarts on the same side-channel port; D reconnects to it
    reference = pd.reference(prompt)
    assert token_ids(answer) == token_ids(again) == reference, "both recomputed answers are colocated ones"
    fresh = tokens(300, seed=10000)
    transfers = pd.transfers()
    assert pd.disaggregated(fresh) == pd.reference(fresh)
    transfers.check(1, blocks=blocks_to_load(len(fresh)))


def test_decode_killed_during_a_transfer_leaves_prefill_healthy(cluster: Cluster) -> None:
    """D frozen with its leg queued while P prefills and holds the blocks for it, then killed: P frees them
    within its lease (the destinations never came) and keeps serving."""
    pd = cluster.ensure()
    assert pd.decode is not None
    prompt = tokens(MAX_MODEL_LEN - MAX_TOKENS - 1, seed=6000)
    tid = uuid.uuid4().hex
    pd.decode.kill(signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        d_leg = pool.submit(_decode_leg, pd, prompt, tid)
        p_answer = _prefill_leg(pd, prompt, tid)
        assert p_answer["kv_transfer_params"]["pd_transfer_id"] == tid, "P prefilled and holds the blocks"
        pd.decode.kill()
        with pytest.raises(OSError):
            d_leg.result(timeout=60)
    wait_until(lambda: blocks_idle(pd.p_url), LEASE_S + 20, "P blocks released after D died")
    assert token_ids(pd_client.post_json(pd.p_url + "/v1/completions", body(prompt))) == pd.reference(prompt)
