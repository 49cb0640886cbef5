"""KV-aware routing on real vLLM CPU servers, and what a routing decision costs the router.

    python -m benchmarks.kv_routing [--model DIR] [--prefills 1] [--conversations 6] [--turns 4] [--agents 4]
                                    [--steps 4] [--repeat 1]
    python -m benchmarks.kv_routing --decision-only [--conversations 10000] [--decisions 5000]

End to end (default): ``--prefills`` prefill (one by default) and two decode vLLM servers (PDConnector, tiny
model unless ``--model``, block size 32, prefix caching on; the prefills alternate between the cores, D0 on
core 0, D1 on core 1) behind three routers, measured one after the other on the same servers: ``ours`` (pd-router, KV-aware), ``ours_off`` (pd-router with
``kv_routing.enabled = false``: power of two choices, disaggregation on whole prompts) and ``sglang`` (sglang-router
0.3.2's ``cache_aware`` policy over the two decode servers in local mode, i.e. each prefills its requests
itself). Two workloads per router, streamed chat requests, greedy, 16 tokens:

- ``multi_turn``: ``--conversations`` conversations at once, each ``--turns`` turns in sequence; a shared system
  prompt (~150 words), each turn a ~30-word user message, the answers appended to the history;
- ``agent``: ``--agents`` agents at once sharing a long tool prompt (~200 words), each ``--steps`` steps whose
  history grows by a ~25-word tool result.

Every (router, workload) run has text of its own (seeded per run), so no run finds another's blocks cached.
``--repeat N`` measures every router N times, each repetition starting with the next router (the first runs
meet servers that have served nothing yet), and reports the median of each figure with every run's.
Per run: ``ttft_ms`` p50/p99 (client side, to the first content event), ``goodput_rps`` (requests per second
of the run's wall time, all requests succeeded), and from the engines' own counters over the run:
``prefill_tokens_computed`` (``vllm:prompt_tokens_by_source_total{source="local_compute"}`` summed over the
servers: P's and D's) and ``prefix_hit_rate`` (their ``local_cache_hit`` tokens over all their prompt
tokens), and ``slowest``: the three slowest requests (their turn, 0 being a conversation's first; when they
were sent from the run's start; TTFT; pd-router's route), to see where the tail comes from. Only two cores
serve three or more engines, a router and this client: TTFT here is dominated by CPU contention; the token
counts are the robust figures. With one P, a router that ignores prefixes loses
little: that P's own prefix cache holds every conversation, so it computes only each turn's new tokens.
With two, a turn sent to the P that did not see the conversation's last turn computes the whole history
again: ``--prefills 2`` is the topology where knowing the prefixes should halve the tokens computed.

Decision only (``--decision-only``): in one process, no servers: a ``Balancer`` with two decode and one prefill
worker and KV-aware routing on (block size 16) is filled with ``--conversations`` chat histories (a 256-token
shared system prompt and 512 tokens of their own, each recorded on the D it was placed on and on P), then
routes ``--decisions`` new turns of random conversations (the history plus 64 new tokens). Per turn it times,
in wall time (``perf_counter_ns``) and in this thread's CPU time (``thread_time_ns``: the same minus the time
the process was preempted, which on a shared host is most of the wall-time tail): hashing the prompt's ids
(``Balancer.hashes``, done once per request after tokenizing) and the decision itself: placing D
(``place_decode``), the policy on the uncached tokens, choosing P and recording the prompt on the chosen
workers, which is what the router does per request between tokenizing and sending (``Proxy._decide`` and
``_attempts``). Target (issue 21): decision p99 <= 200 us at 10k conversations.

Progress goes to stderr; the LAST stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from integration_tests.pd_checks import metric
from pd_disagg.engines import base_url, router_server, sglang_python, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port
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


ROUTERS = ("ours", "ours_off", "sglang")
WORKLOADS = ("multi_turn", "agent")
ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 16
ENGINE_BLOCK = 32  # VLLM_CPU_ARGS' --block-size


def _log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
        for _ in range(words)
    )


async def _turn(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]
) -> tuple[float, str, str]:
    """One streamed greedy chat request; (seconds to the first content event, the answer, pd-router's route:
    ``X-PD-Route``, "" from sglang-router)."""
    body = {"model": "m", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    start = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
        route = resp.headers.get("X-PD-Route", "")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            content = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
            if content:
                first = first if first is not None else time.monotonic() - start
                parts.append(content)
    return (first if first is not None else time.monotonic() - start), "".join(parts), route


async def _workload(
    url: str, kind: str, args: argparse.Namespace, seed: int
) -> tuple[list[dict[str, Any]], float]:
    """Run one workload through ``url``; (one record per request: its turn, when it was sent and its TTFT in
    ms from the run's start, its route; the wall seconds)."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    if kind == "multi_turn":
        shared = _text(rng, 150)
        streams = [
            [f"Conversation {i}. " + _text(rng, 30) for _ in range(args.turns)]
            for i in range(args.conversations)
        ]
        system = [{"role": "system", "content": shared}]
    else:
        shared = _text(rng, 200)
        streams = [
            [f"Task {i}: " + _text(rng, 20)]
            + [f"Tool result: {_text(rng, 25)}" for _ in range(args.steps - 1)]
            for i in range(args.agents)
        ]
        system = [{"role": "system", "content": "Tools: " + shared}]

    async def one(session: aiohttp.ClientSession, turns: list[str]) -> None:
        history = list(system)
        for k, user in enumerate(turns):
            history.append({"role": "user", "content": user})
            sent = time.monotonic() - start
            ttft, answer, route = await _turn(session, url, history)
            records.append(
                {"turn": k, "sent_ms": round(1000 * sent), "ttft_ms": round(1000 * ttft), "route": route}
            )
            history.append({"role": "assistant", "content": answer})

    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, turns) for turns in streams))
    return records, time.monotonic() - start


def _sources(urls: list[str]) -> dict[str, float]:
    name = "vllm:prompt_tokens_by_source_total"
    return {
        src: sum(metric(u, name, {"source": src}) for u in urls)
        for src in ("local_compute", "local_cache_hit")
    }


def _engines(model: Path, logs: Path, prefills: int) -> tuple[list[ManagedServer], list[str]]:
    """``prefills`` P (alternating between the cores) then two D; and each P's side-channel address."""
    common = {"kv_load_failure_policy": "recompute"}

    def engine(role: str, name: str, core: int, extra: dict[str, Any]) -> ManagedServer:
        return vllm_server(
            model,
            log_dir=logs,
            name=name,
            cpu_core=core,
            dtype="float32",
            max_model_len=2048,
            extra_args=["--served-model-name", "m"],
            kv_transfer_config={
                "kv_connector": "PDConnector",
                "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                **common,
                "kv_connector_extra_config": extra,
            },
        )

    sides = [free_port() for _ in range(prefills)]
    p_addrs = [f"127.0.0.1:{side}" for side in sides]
    servers = [
        engine("prefill", f"kv-p{i}", i % 2, {"side_channel_port": side}) for i, side in enumerate(sides)
    ]
    servers += [engine("decode", f"kv-d{i}", i, {"allowed_prefill_addrs": p_addrs}) for i in range(2)]
    return servers, p_addrs


def _routers(
    model: Path, logs: Path, tmp: Path, ps: list[str], p_addrs: list[str], ds: list[str]
) -> dict[str, ManagedServer]:
    routers = {}
    for name, kv in (("ours", {"block_size": ENGINE_BLOCK}), ("ours_off", {"enabled": False})):
        config = write_router_config(
            tmp / f"{name}.toml",
            flow="pd-push",
            sections={
                "model": {"path": str(model), "served_names": ["m"], "max_model_len": 2048},
                "policy": {"threshold_tokens": 256},
                "kv_routing": kv,
            },
            prefill=[{"url": p, "bootstrap": a} for p, a in zip(ps, p_addrs, strict=True)],
            decode=[{"url": d} for d in ds],
        )
        routers[name] = router_server(config, log_dir=logs, port=free_port(), name=f"kv-{name}", cwd=ROOT)
    port = free_port()
    routers["sglang"] = ManagedServer(
        "sglang-router",
        [
            sglang_python(),  # the SGLang environment has sglang-router (pd_disagg.engines.sglang_router)
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            *ds,
            "--port",
            str(port),
            # its metrics listener defaults to a fixed port: a free one, beside other engineers' routers
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--policy",
            "cache_aware",
            "--log-level",
            "warn",
        ],
        logs / f"sglang-router-{port}.log",
        f"http://127.0.0.1:{port}/health",
        cwd=ROOT,
    )
    return routers


def _measured(url: str, engines: list[str], kind: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One workload through the router at ``url``: its figures, and the engines' token counts over it."""
    before = _sources(engines)
    records, wall = asyncio.run(_workload(url, kind, args, seed))
    ttfts = [r["ttft_ms"] for r in records]
    after = _sources(engines)
    computed = after["local_compute"] - before["local_compute"]
    hit = after["local_cache_hit"] - before["local_cache_hit"]
    return {
        "requests": len(records),
        "ttft_ms": {"p50": _percentile(ttfts, 0.5), "p99": _percentile(ttfts, 0.99)},
        "prefill_tokens_computed": computed,
        "prefix_hit_rate": hit / (hit + computed) if hit + computed else 0.0,
        "goodput_rps": len(records) / wall,
        # where the tail comes from: the slowest requests (turn 0: a conversation's first)
        "slowest": sorted(records, key=lambda r: -r["ttft_ms"])[:3],
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over a (router, workload)'s repetitions, and every repetition's figures."""

    def med(get: Any) -> float:
        return statistics.median(get(r) for r in runs)

    return {
        "requests": runs[0]["requests"],
        "ttft_ms": {q: med(lambda r, q=q: r["ttft_ms"][q]) for q in ("p50", "p99")},
        "prefill_tokens_computed": med(lambda r: r["prefill_tokens_computed"]),
        "prefix_hit_rate": med(lambda r: r["prefix_hit_rate"]),
        "goodput_rps": med(lambda r: r["goodput_rps"]),
        "runs": runs,
    }


def end_to_end(args: argparse.Namespace) -> dict:
    logs = ROOT / "logs" / "benchmarks"
    engines, p_addrs = _engines(args.model, logs, args.prefills)
    started: list[ManagedServer] = []
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        for s in engines:
            started.append(s.start())
        for s in engines:
            s.wait_healthy(600)
        urls = [base_url(s) for s in engines]
        with tempfile.TemporaryDirectory() as tmp:
            ps, ds = urls[: args.prefills], urls[args.prefills :]
            routers = _routers(args.model, logs, Path(tmp), ps, p_addrs, ds)
            for r in routers.values():
                started.append(r.start())
            for r in routers.values():
                r.wait_healthy(120)
            _log("servers up")
            for rep in range(args.repeat):
                # each repetition starts with another router: none always meets the servers' first requests
                for i, name in enumerate(ROUTERS[rep % 3 :] + ROUTERS[: rep % 3]):
                    url = base_url(routers[name])
                    for j, kind in enumerate(WORKLOADS):
                        run = _measured(url, urls, kind, args, 100 * rep + 10 * i + j)
                        runs.setdefault(name, {}).setdefault(kind, []).append(run)
                        _log(rep, name, kind, json.dumps(run))
    finally:
        for s in reversed(started):
            s.stop()
    results = {name: {kind: _median(r) for kind, r in kinds.items()} for name, kinds in runs.items()}
    ratios = {
        kind: {
            "computed_ours_over_off": results["ours"][kind]["prefill_tokens_computed"]
            / max(1.0, results["ours_off"][kind]["prefill_tokens_computed"]),
            "ttft_p50_ours_over_sglang": results["ours"][kind]["ttft_ms"]["p50"]
            / results["sglang"][kind]["ttft_ms"]["p50"],
        }
        for kind in WORKLOADS
    }
    conditions = {"prefills": args.prefills, "decodes": 2, "repetitions": args.repeat}
    return {"routers": results, "ratios": ratios, "conditions": conditions}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decision-only", action="store_true", help="the in-process decision cost only")
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "models" / "tiny-llama")
    parser.add_argument("--prefills", type=int, default=1, help="prefill servers (two decode servers)")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--decisions", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=1, help="repetitions (end to end; medians reported)")
    args = parser.parse_args(argv)
    if args.decision_only:
        result = {"decision": decision_cost(args.conversations or 10_000, args.decisions)}
    else:
        args.conversations = args.conversations or 6
        result = end_to_end(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
