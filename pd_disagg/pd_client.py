"""A minimal client of the P/D flows as docs/wire-contract.md defines them, for tests and benchmarks (harness process).

Not the router: no load balancing, retries or streaming. It speaks exactly what the router sends, so tests
can prove the connector without depending on the router: ``disaggregated`` sends both legs concurrently
(our push flow), ``vllm_standard`` runs vLLM's P-then-D flow with the ``kv_transfer_params`` P returns.
"""

from __future__ import annotations

import json
import threading
import urllib.request
import uuid
from typing import Any

from pd_connector import wire


def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """POST ``body`` as JSON, return the decoded JSON answer (raises ``urllib.error.HTTPError`` on 4xx/5xx)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        result: dict[str, Any] = json.load(resp)
        return result


def prefill_body(body: dict[str, Any], params: wire.Params) -> dict[str, Any]:
    """P's leg: same body, one token, not streamed, with the transfer parameters."""
    return {**body, "max_tokens": 1, "stream": False, wire.KV_TRANSFER_PARAMS: wire.encode(params)}


def decode_body(body: dict[str, Any], transfer_id: str, bootstrap: str, seed: bool = False) -> dict[str, Any]:
    """D's leg in our push flow: the body with the transfer id and P's side channel; ``seed``: D continues
    from P's first token and its answer carries that token (what pd-router asks on a seeded stream without
    logprobs: ``pd_seed_first_token`` and ``pd_stream_first_token``)."""
    params = wire.PushDecode(transfer_id, bootstrap, pd_seed_first_token=seed, pd_stream_first_token=seed)
    return {**body, wire.KV_TRANSFER_PARAMS: wire.encode(params)}


def disaggregated(
    prefill_url: str,
    decode_url: str,
    bootstrap: str,
    body: dict[str, Any],
    path: str = "/v1/completions",
    transfer_id: str | None = None,
    timeout_s: float = 120.0,
    corrupt: bool = False,
    seed: bool = False,
) -> tuple[dict[str, Any], dict[str, Any] | BaseException]:
    """Our push flow: P and D legs sent concurrently; returns ``(D's answer, P's answer or its error)``.

    ``corrupt`` asks P to zero the KV it pushes (honoured only by a P with ``test_allow_corruption``);
    ``seed``: D continues from P's first token (``decode_body``).
    """
    transfer_id = transfer_id or uuid.uuid4().hex
    p_result: list[dict[str, Any] | BaseException] = []

    def prefill() -> None:
        try:
            p_body = prefill_body(body, wire.PushPrefill(transfer_id, pd_test_corrupt=corrupt))
            p_result.append(post_json(prefill_url + path, p_body, timeout_s))
        except BaseException as exc:  # reported to the caller, who decides
            p_result.append(exc)

    thread = threading.Thread(target=prefill, daemon=True)
    thread.start()
    try:
        answer = post_json(decode_url + path, decode_body(body, transfer_id, bootstrap, seed), timeout_s)
    finally:
        thread.join(timeout_s)
    return answer, p_result[0] if p_result else TimeoutError("P leg did not return")


def standard_prefill(
    prefill_url: str, body: dict[str, Any], path: str = "/v1/completions", timeout_s: float = 120.0
) -> dict[str, Any]:
    """First leg of vLLM's standard flow: P with ``do_remote_decode``; returns the params D needs."""
    p_answer = post_json(prefill_url + path, prefill_body(body, wire.StandardPrefill()), timeout_s)
    params = wire.parse_params(p_answer.get(wire.KV_TRANSFER_PARAMS))
    if not isinstance(params, wire.PrefillReturned):
        raise RuntimeError(f"P returned no prefill parameters for D: {p_answer}")
    return wire.encode(params)


def vllm_standard(
    prefill_url: str,
    decode_url: str,
    body: dict[str, Any],
    path: str = "/v1/completions",
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """vLLM's standard flow: P first with ``do_remote_decode``, then D with the params P returned."""
    params = standard_prefill(prefill_url, body, path, timeout_s)
    return post_json(decode_url + path, {**body, wire.KV_TRANSFER_PARAMS: params}, timeout_s)
