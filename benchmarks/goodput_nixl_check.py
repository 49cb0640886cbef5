"""The ``nixl`` system of ``benchmarks.goodput`` moves KV through pd-router: a check run by hand, not in CI.

Starts that system (``benchmarks.goodput_systems``: vLLM NixlConnector P on core 0, D on core 1, pd-router's
vllm-standard flow), sends long prompts of random token ids through the router, unary and streamed, and reads
on D what says the prompt came over NIXL instead of being recomputed: NIXL's bytes transferred and failed
transfers, and vLLM's prompt tokens by source (``external_kv_transfer`` against ``local_compute``). Each
answer's text is compared with P's own greedy answer to the same prompt (P computed the KV D was sent), and
pd-router's count of refused prefill answers must stay 0. Needs nixl in the environment (``pip install
--no-deps nixl==1.5.1 nixl-cu12==1.5.1``, not part of ``make install``); hold the engine lock while it runs
(``flock /tmp/pd-engines.lock python -m benchmarks.goodput_nixl_check``). The last stdout line is one JSON
object whose ``ok`` says whether every request passed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.goodput_systems import SERVED, build
from benchmarks.prompts import model_limits
from integration_tests.pd_checks import metric
from pd_disagg.engines import base_url

LOG_DIR = Path("logs/benchmarks/goodput_nixl_check")
SOURCES = ("external_kv_transfer", "local_compute", "local_cache_hit")


def complete(url: str, prompt: list[int], max_tokens: int, stream: bool) -> tuple[str, str]:
    """A greedy completion's text and the route pd-router took (its ``X-PD-Route`` header; '' from an engine)."""
    body = {
        "model": SERVED,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        route = resp.headers.get("X-PD-Route") or ""
        if not stream:
            return json.loads(resp.read())["choices"][0]["text"], route
        text = ""
        for line in resp:
            if line.startswith(b"data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        return text, route


def d_counters(d: str) -> dict[str, float]:
    """D's NIXL counters and its prompt tokens by source (cumulative)."""
    out = {
        "nixl_bytes": metric(d, "vllm:nixl_bytes_transferred_sum"),
        "nixl_transfers": metric(d, "vllm:nixl_bytes_transferred_count"),
        "nixl_failed": metric(d, "vllm:nixl_num_failed_transfers_total"),
    }
    for source in SOURCES:
        out[source] = metric(d, "vllm:prompt_tokens_by_source_total", {"source": source})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path(".cache/models/tiny-llama"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--requests", type=int, default=4, help="alternately unary and streamed")
    args = parser.parse_args()
    model = args.model.resolve()
    vocab, max_len = model_limits(model)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    system = build("nixl", model, args.dtype, max_len, LOG_DIR)
    results: list[dict[str, Any]] = []
    try:
        system.start()
        p, d = (base_url(s) for s in system.engines)
        for i in range(args.requests):
            prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
            before = d_counters(d)
            text, route = complete(system.url, prompt, args.max_tokens, stream=i % 2 == 1)
            after = d_counters(d)
            reference, _ = complete(p, prompt, args.max_tokens, stream=False)
            delta = {k: after[k] - before[k] for k in after}
            results.append(
                {"streamed": i % 2 == 1, "route": route, "same_text_as_p": text == reference, **delta}
            )
            print(f"[nixl_check] request {i}: {results[-1]}", file=sys.stderr, flush=True)
        refused = metric(system.url, "pd_router_worker_errors_total", {"role": "prefill"})
    finally:
        system.close()
    ok = refused == 0 and all(
        r["route"] == "disagg"
        and r["same_text_as_p"]
        and r["nixl_bytes"] > 0
        and r["nixl_failed"] == 0
        and r["external_kv_transfer"] >= args.prompt_tokens - 1
        and r["local_compute"] <= 1
        for r in results
    )
    print(
        json.dumps(
            {"ok": ok, "prefill_errors": refused, "prompt_tokens": args.prompt_tokens, "requests": results}
        )
    )


if __name__ == "__main__":
    main()
