"""What ``SLOScheduler`` itself costs each decode step, against vLLM's default scheduler.

On a CPU engine the scheduler's process (vLLM's EngineCore) shares its core with the model's worker, so
every millisecond the scheduler spends per step (planning, refitting its cost model, its step clock) can
lengthen the step. This benchmark runs one vLLM server at a time on ``--core``, every process of it there
(``taskset``, as ``benchmarks.goodput --confine``), in turn with vLLM's default scheduler, with vLLM's
scheduler without async scheduling (``--no-async-scheduling``: how vLLM runs any ``--scheduler-cls`` that
subclasses its ``Scheduler``) and with ``--scheduler-cls scheduler_plugins.vllm.SLOScheduler``
(``--servers`` of each), and on each sends ``--requests`` streamed requests one after another (a
``--prompt-tokens`` prompt, ``--decode-tokens`` tokens, nothing else pending: every step is a decode step
with no prefill to plan). Per request: the median gap between streamed tokens; per server: the median over
its requests; reported: the median over the servers of each kind, ``slo_over_default`` and
``slo_over_default_sync``. Progress on stderr; the last stdout line is the JSON summary (docs/performance.md
``## scheduler``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

from benchmarks.idle_spin import post
from pd_disagg.engines import base_url, vllm_server

LOG_DIR = Path("logs/benchmarks/scheduler_overhead")
# vLLM runs a ``--scheduler-cls`` that subclasses its ``Scheduler`` without async scheduling (vLLM's config
# warns so): ``default_sync`` is vLLM's own scheduler that way, so the two causes of a difference separate.
SCHEDULERS = {
    "default": [],
    "default_sync": ["--no-async-scheduling"],
    "slo": ["--scheduler-cls", "scheduler_plugins.vllm.SLOScheduler"],
}
SERVED = "m"


def log(msg: str) -> None:
    print(f"[scheduler_overhead] {msg}", file=sys.stderr, flush=True)


def gaps_ms(url: str, prompt: list[int], tokens: int) -> float:
    """The median gap (ms) between the streamed tokens of one greedy request of ``tokens`` tokens."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    stamps = post(url, body, stream=True)
    return statistics.median(b - a for a, b in itertools.pairwise(stamps)) * 1000


def one_server(kind: str, index: int, args: argparse.Namespace) -> float:
    """Start a server with scheduler ``kind``, warm it up, and return its median decode gap (ms)."""
    server = vllm_server(
        args.model,
        log_dir=LOG_DIR,
        name=f"{kind}-{index}",
        dtype="float32",
        cpu_core=args.core,
        confine=True,
        max_model_len=args.prompt_tokens + args.decode_tokens + 16,
        extra_args=["--served-model-name", SERVED, *SCHEDULERS[kind]],
    )
    server.start()
    try:
        server.wait_healthy(900)
        url = base_url(server)
        for i in range(3):  # warm-up: the first requests compile and allocate
            gaps_ms(url, [11 + i] * 16, 16)
        per_request = [
            gaps_ms(
                url,
                [100 + (index * 31 + r * 7 + t) % 1900 for t in range(args.prompt_tokens)],
                args.decode_tokens,
            )
            for r in range(args.requests)
        ]
    finally:
        server.stop()
    median = statistics.median(per_request)
    log(f"{kind} server {index + 1}: median gaps {[round(g, 2) for g in per_request]} ms -> {median:.2f}")
    return median


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path(".cache/models/tiny-llama"))
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--servers", type=int, default=3, help="servers of each kind, alternating")
    parser.add_argument("--requests", type=int, default=5, help="requests per server, one at a time")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=200)
    args = parser.parse_args()
    servers: dict[str, list[float]] = {kind: [] for kind in SCHEDULERS}
    kinds = list(SCHEDULERS)
    for index in range(args.servers):
        for kind in kinds[index % len(kinds) :] + kinds[: index % len(kinds)]:  # each kind leads once
            servers[kind].append(one_server(kind, index, args))
    medians = {kind: round(statistics.median(values), 3) for kind, values in servers.items()}
    print(
        json.dumps(
            {
                "decode_gap_ms": medians,
                "per_server_ms": {kind: [round(v, 3) for v in values] for kind, values in servers.items()},
                "slo_over_default": round(medians["slo"] / medians["default"], 3),
                "slo_over_default_sync": round(medians["slo"] / medians["default_sync"], 3),
                "conditions": {
                    "model": str(args.model),
                    "dtype": "float32",
                    "core": args.core,
                    "confined": True,
                    "servers": args.servers,
                    "requests": args.requests,
                    "prompt_tokens": args.prompt_tokens,
                    "decode_tokens": args.decode_tokens,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
