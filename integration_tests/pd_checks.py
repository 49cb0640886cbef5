"""What the P/D integration tests read off real vLLM servers: metrics, idle blocks, proof that KV moved.

Equal tokens alone prove nothing about a transfer: when a load fails, D recomputes the prompt and answers the
same tokens. ``Transfers`` snapshots the counters of a P and a D and then checks what a set of requests must
have done: P sent and D received exactly the bytes of the blocks D asked for, D completed one transfer per
request, D computed no more than the one prompt token vLLM always recomputes to sample, and nothing failed or
was refused. Used in the test process against servers started by ``pd_disagg.engines``; ``metric`` and
``token_stream_body`` (the streamed request whose tokens the scheduler test and benchmark time) also by
benchmarks.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pd_disagg.tiny_model import PRESETS
from tests.polling import wait_until

BLOCK_TOKENS = 32  # every test server runs --block-size 32
#: Bytes of one KV block of the tiny model in float32 (what the tests serve): heads-major CPU blocks move whole.
KV_BLOCK_BYTES = BLOCK_TOKENS * PRESETS["tiny"].kv_bytes_per_token(4)


def metric(url: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples called ``name`` (with ``labels``, if given) on a server's /metrics (0 if absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    want = dict(labels or {})
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in want.items())
    )


def token_stream_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed greedy completion of exactly ``max_tokens`` tokens whose events carry token ids, so each
    token's arrival can be timed."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


def blocks_idle(url: str) -> bool:
    """No request on the server holds KV blocks (what every test that aborts or fails returns to)."""
    return (
        metric(url, "vllm:kv_cache_usage_perc") == 0
        and metric(url, "vllm:num_requests_running") == 0
        and metric(url, "vllm:num_requests_waiting") == 0
    )


def blocks_to_load(prompt_len: int, decode_cached: int = 0) -> int:
    """Blocks D asks P for: from its own prefix-cache hit (``decode_cached`` tokens, block-aligned) to the end."""
    return -(-prompt_len // BLOCK_TOKENS) - decode_cached // BLOCK_TOKENS


def decode_hit_after_seen(prompt_len: int) -> int:
    """D's prefix-cache hit for a prompt it holds in full: vLLM matches at most ``len - 1`` tokens, in blocks."""
    return (prompt_len - 1) // BLOCK_TOKENS * BLOCK_TOKENS


SENT = "vllm:pd_connector_bytes_sent_total"
RECEIVED = "vllm:pd_connector_bytes_received_total"
LOADED = "vllm:pd_connector_transfers_received_total"
FAILURES = "vllm:pd_connector_failures_total"
REFUSED = "vllm:pd_connector_refused_requests_total"
LOCAL_COMPUTE = ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"})


@dataclass(frozen=True)
class _Counts:
    sent: float
    received: float
    loaded: float
    failures: float
    refused: float
    computed: float

    @classmethod
    def read(cls, prefill_urls: list[str], decode_urls: list[str]) -> _Counts:
        def total(urls: list[str], name: str, labels: Mapping[str, str] | None = None) -> float:
            return sum(metric(u, name, labels) for u in urls)

        both = prefill_urls + decode_urls
        return cls(
            sent=total(prefill_urls, SENT),
            received=total(decode_urls, RECEIVED),
            loaded=total(decode_urls, LOADED),
            failures=total(both, FAILURES),
            refused=total(both, REFUSED),
            computed=total(decode_urls, *LOCAL_COMPUTE),
        )


class Transfers:
    """Counters of P and D servers before some requests; ``check`` proves those requests were transferred.

    ``block_bytes``: bytes of one KV block of the served model and dtype (default: the tiny model in float32)."""

    def __init__(
        self,
        prefill_urls: str | list[str],
        decode_urls: str | list[str],
        block_bytes: int = KV_BLOCK_BYTES,
    ) -> None:
        self.prefill = [prefill_urls] if isinstance(prefill_urls, str) else list(prefill_urls)
        self.decode = [decode_urls] if isinstance(decode_urls, str) else list(decode_urls)
        self.block_bytes = block_bytes
        self.before = _Counts.read(self.prefill, self.decode)

    def now(self) -> _Counts:
        return _Counts.read(self.prefill, self.decode)

    def check(
        self,
        requests: int,
        blocks: int | None = None,
        local_tokens: int = 0,
        decode_ranks: int = 1,
        timeout_s: float = 20.0,
    ) -> None:
        """``requests`` loads completed with nothing failed, refused or recomputed; with ``blocks``, P sent
        and D received exactly that many KV blocks (else: equal bytes on both sides, at least a block each).
        ``local_tokens``: prompt tokens D computed meanwhile for requests it served alone (the local path).
        ``decode_ranks``: D's TP size (each D rank counts its own completed load; bytes add up over ranks)."""
        before = self.before
        loads = requests * decode_ranks

        def settled() -> bool:
            now = self.now()
            return (
                now.loaded - before.loaded >= loads
                and now.sent - before.sent == now.received - before.received
            )

        wait_until(settled, timeout_s, f"{loads} completed loads with P's and D's byte counts agreeing")
        now = self.now()
        moved = now.received - before.received
        assert now.loaded - before.loaded == loads, "every request loaded exactly once on every D rank"
        assert now.failures == before.failures, "no transfer failed (a failed load is recomputed)"
        assert now.refused == before.refused, "no request's transfer parameters were refused"
        if blocks is not None:
            assert moved == blocks * self.block_bytes, f"{moved} bytes moved, {blocks} blocks expected"
        else:
            assert moved >= requests * self.block_bytes, f"{moved} bytes for {requests} requests"
        # vLLM samples a fully loaded prompt by recomputing its last token: one token per request, no more.
        computed = now.computed - before.computed
        assert computed <= requests + local_tokens, (
            f"D computed {computed} prompt tokens itself (a recompute)"
        )
