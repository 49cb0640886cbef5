"""KV-aware routing: what a routing decision costs the router with many conversations cached.

    python -m benchmarks.kv_routing --decision-only [--conversations 10000] [--decisions 5000]

In one process, no servers: a ``Balancer`` with two decode and one prefill worker and KV-aware routing on
(block size 16) is filled with ``--conversations`` chat histories (a 256-token shared system prompt and
512 tokens of their own, each recorded on the D it was placed on and on P), then routes ``--decisions`` new
turns of random conversations (the history plus 64 new tokens). Per turn it times, in wall time
(``perf_counter_ns``) and in this thread's CPU time (``thread_time_ns``: the same minus the time the process
was preempted, which on a shared host is most of the wall-time tail): hashing the prompt's ids (``Balancer.hashes``, done once per request after tokenizing)
and the decision itself: placing D (``place_decode``: a lookup per D until the first miss, the cost), the
policy on the uncached tokens, choosing P and recording the prompt on the chosen workers, which is what
the router does per request between tokenizing and sending (``Proxy._decide`` and ``_attempts``). Reported:
p50/p99 of each in microseconds, the table's size and memory, and the share of turns placed on the D that
held their history. Target (issue 21): decision p99 <= 200 us at 10k conversations.

Progress goes to stderr; the LAST stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from router.balancer import Balancer
from router.config import CircuitConfig, KvRoutingConfig, PolicyConfig, WorkerConfig
from router.policy import PolicyInput, Route, ThresholdPolicy

BLOCK = 16
SYSTEM_TOKENS = 256
OWN_TOKENS = 512
NEW_TOKENS = 64
VOCAB = 49_152  # SmolLM2's


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def decision_cost(conversations: int, decisions: int, seed: int = 0) -> dict:
    """Fill a balancer with ``conversations`` histories, then time ``decisions`` routed turns (see module doc)."""
    rng = random.Random(seed)
    per_worker = 2 * conversations * (SYSTEM_TOKENS + OWN_TOKENS + NEW_TOKENS) // BLOCK  # nothing evicted
    kv = KvRoutingConfig(block_size=BLOCK, max_blocks_per_worker=per_worker)
    b = Balancer(CircuitConfig(), random.Random(seed), kv=kv)
    b.add(WorkerConfig("http://p0:1", bootstrap="h:1"), "prefill")
    for i in range(2):
        b.add(WorkerConfig(f"http://d{i}:1"), "decode")
    pcfg = PolicyConfig()
    policy = ThresholdPolicy(pcfg)
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)]
    histories = [system + [rng.randrange(VOCAB) for _ in range(OWN_TOKENS)] for _ in range(conversations)]
    home = []
    for ids in histories:
        hashes = b.hashes(ids)
        placed = b.place_decode(pcfg.decode_max_active, frozenset(), hashes, len(ids))
        b.record(hashes, placed.worker, b.prefill.workers[0])
        home.append(placed.worker)
    print(
        f"filled: {conversations} conversations, {b.prefixes.blocks() if b.prefixes else 0} blocks",
        file=sys.stderr,
    )
    hash_us: list[float] = []
    decide_us: list[float] = []
    decide_cpu_us: list[float] = []
    at_home = 0
    for _ in range(decisions):
        c = rng.randrange(conversations)
        ids = histories[c] + [rng.randrange(VOCAB) for _ in range(NEW_TOKENS)]
        t0 = time.perf_counter_ns()
        hashes = b.hashes(ids)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        placed = b.place_decode(pcfg.decode_max_active, frozenset(), hashes, len(ids))
        decision = policy.decide(
            PolicyInput(len(ids), b.prefill.load(), b.decode.load(), True, placed.cached_tokens)
        )
        prefill = b.pick_prefill(frozenset(), hashes, len(ids)) if decision.route is Route.DISAGG else None
        b.record(hashes, placed.worker, prefill)
        c2 = time.thread_time_ns()
        t2 = time.perf_counter_ns()
        decide_cpu_us.append((c2 - c1) / 1000)
        hash_us.append((t1 - t0) / 1000)
        decide_us.append((t2 - t1) / 1000)
        at_home += placed.worker is home[c]
    index = b.prefixes
    assert index is not None
    return {
        "conversations": conversations,
        "decisions": decisions,
        "prompt_tokens": SYSTEM_TOKENS + OWN_TOKENS + NEW_TOKENS,
        "block_size": BLOCK,
        "decision_us": {"p50": _percentile(decide_us, 0.5), "p99": _percentile(decide_us, 0.99)},
        "decision_cpu_us": {"p50": _percentile(decide_cpu_us, 0.5), "p99": _percentile(decide_cpu_us, 0.99)},
        "hash_us": {"p50": _percentile(hash_us, 0.5), "p99": _percentile(hash_us, 0.99)},
        "decision_mean_us": statistics.fmean(decide_us),
        "index_blocks": index.blocks(),
        "index_mib": index.memory_bytes() / 2**20,
        "placed_on_history_share": at_home / decisions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--decision-only", action="store_true", required=True, help="the in-process cost only"
    )
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--decisions", type=int, default=5_000)
    args = parser.parse_args(argv)
    result = {"decision": decision_cost(args.conversations, args.decisions)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
