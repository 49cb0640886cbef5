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


def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """POST ``body`` as JSON, return the decoded JSON answer (raises ``urllib.error.HTTPError`` on 4xx/5xx)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        result: dict[str, Any] = json.load(resp)
        return result


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """P's leg: same body, one token, not streamed, with the transfer parameters."""
    return {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}


def disaggregated(
    prefill_url: str,
    decode_url: str,
    bootstrap: str,
    body: dict[str, Any],
    path: str = "/v1/completions",
    transfer_id: str | None = None,
    timeout_s: float = 120.0,
    prefill_extra: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | BaseException]:
    """Our push flow: P and D legs sent concurrently; returns ``(D's answer, P's answer or its error)``.

    ``prefill_extra`` adds keys to P's ``kv_transfer_params`` (tests use ``pd_test_corrupt``).
    """
    transfer_id = transfer_id or uuid.uuid4().hex
    p_result: list[dict[str, Any] | BaseException] = []

    def prefill() -> None:
        try:
            p_result.append(
                post_json(
                    prefill_url + path,
                    prefill_body(
                        body, {"pd_transfer_id": transfer_id, "pd_role": "prefill", **(prefill_extra or {})}
                    ),
                    timeout_s,
                )
            )
        except BaseException as exc:  # reported to the caller, who decides
            p_result.append(exc)

    thread = threading.Thread(target=prefill, daemon=True)
    thread.start()
    d_body = {
        **body,
        "kv_transfer_params": {
            "pd_transfer_id": transfer_id,
            "pd_role": "decode",
            "pd_prefill_addr": bootstrap,
        },
    }
    try:
        answer = post_json(decode_url + path, d_body, timeout_s)
    finally:
        thread.join(timeout_s)
    return answer, p_result[0] if p_result else TimeoutError("P leg did not return")


def standard_prefill(
    prefill_url: str, body: dict[str, Any], path: str = "/v1/completions", timeout_s: float = 120.0
) -> dict[str, Any]:
    """First leg of vLLM's standard flow: P with ``do_remote_decode``; returns the params D needs."""
    p_answer = post_json(
        prefill_url + path,
        prefill_body(
            body,
            {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        ),
        timeout_s,
    )
    params = p_answer.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"P returned no kv_transfer_params: {p_answer}")
    return dict(params)


def vllm_standard(
    prefill_url: str,
    decode_url: str,
    body: dict[str, Any],
    path: str = "/v1/completions",
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """vLLM's standard flow: P first with ``do_remote_decode``, then D with the params P returned."""
    params = standard_prefill(prefill_url, body, path, timeout_s)
    return post_json(decode_url + path, {**body, "kv_transfer_params": params}, timeout_s)
