"""D with ``kv_load_failure_policy: fail`` and without prefix caching: a load that cannot complete ends the
request with vLLM's generation error (never a hang, never tokens computed without the KV); with no prefix
cache on D every block loads every time and nothing is recomputed.

Runs on the package's cluster (conftest.py) with ``STRICT_DECODE``, a D restart, which is why this file runs
last (see conftest.py).
"""

from __future__ import annotations

import json
import time
import uuid

from integration_tests.pd_checks import FAILURES, blocks_idle, blocks_to_load, metric
from integration_tests.pd_connector.cluster import (
    D_LOAD_TIMEOUT_S,
    LEASE_S,
    PROMPT_LENGTHS,
    STRICT_DECODE,
    Cluster,
    body,
    post,
    tokens,
)
from pd_disagg import pd_client
from tests.polling import wait_until

#: What vLLM 0.32 returns for a request finished with FinishReason.ERROR (GenerationError): no tokens.
VLLM_GENERATION_ERROR = {
    "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
}


def test_fail_policy_ends_request_with_error(cluster: Cluster) -> None:
    """D with ``kv_load_failure_policy: fail``: a load that never arrives ends the request with vLLM's
    generation error (HTTP 500, or a streamed error event then [DONE]) within the load timeout, never a hang
    or tokens computed without the KV; D frees the blocks and keeps serving disaggregated requests."""
    pd = cluster.ensure(STRICT_DECODE)
    failures = metric(pd.d_url, FAILURES)
    # 1) A transfer P never runs: D's destinations wait out P's lease (or D's load timeout) and fail.
    start = time.monotonic()
    status, _, raw = post(
        pd.d_url,
        "/v1/completions",
        pd_client.decode_body(body(tokens(300, seed=11000)), uuid.uuid4().hex, pd.bootstrap),
        timeout_s=D_LOAD_TIMEOUT_S + 20,
    )
    took = time.monotonic() - start
    assert status == 500, raw
    assert json.loads(raw) == VLLM_GENERATION_ERROR
    assert min(D_LOAD_TIMEOUT_S, LEASE_S) - 0.5 <= took <= D_LOAD_TIMEOUT_S + 20
    # 2) Streamed, from an allowed prefill address nobody listens on: the connect fails, the error comes at once.
    start = time.monotonic()
    status, _, raw = post(
        pd.d_url,
        "/v1/completions",
        pd_client.decode_body(body(tokens(200, seed=11001), stream=True), uuid.uuid4().hex, pd.down_addr),
        timeout_s=D_LOAD_TIMEOUT_S + 20,
    )
    events = [e for e in raw.split(b"\n\n") if e]
    assert status == 200, events
    assert events[-1] == b"data: [DONE]", events
    assert [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]] == [VLLM_GENERATION_ERROR], (
        "an error event and no tokens"
    )
    assert time.monotonic() - start < D_LOAD_TIMEOUT_S, "a refused connection fails before the timeout"
    wait_until(lambda: blocks_idle(pd.d_url), 15, "D blocks freed after the failed loads")
    wait_until(lambda: metric(pd.d_url, FAILURES) == failures + 2, 10, "both failures counted")
    prompt = tokens(300, seed=11002)
    transfers = pd.transfers()
    assert pd.disaggregated(prompt) == pd.reference(prompt), "D still serves with a healthy P"
    transfers.check(1, blocks=blocks_to_load(len(prompt)))


def test_disaggregated_equals_colocated_without_decode_prefix_cache(cluster: Cluster) -> None:
    """D without prefix caching loads every block every time; under policy ``fail`` a failed load would be an
    error, and the transfer check proves none was recomputed."""
    pd = cluster.ensure(STRICT_DECODE)
    prompts = [tokens(n, seed=n) for n in PROMPT_LENGTHS]
    references = [pd.reference(p) for p in prompts]
    for round_ in range(2):
        transfers = pd.transfers()
        for prompt, reference in zip(prompts, references, strict=True):
            assert pd.disaggregated(prompt) == reference, f"{len(prompt)} tokens, round {round_}"
        transfers.check(len(prompts), blocks=sum(blocks_to_load(len(p)) for p in prompts))
