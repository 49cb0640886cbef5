"""Does a P/D pair's memory grow with the requests it serves more than stock vLLM's under the same load?

The chaos run (docs/performance.md ``## chaos``) saw D's resident memory grow by ~150 MB over 300 requests;
one run cannot tell a leak in the connector from vLLM's own growth. This benchmark runs the same seeded load,
in rounds, against two systems of ``benchmarks.goodput_systems`` one after the other (same model, same two
cores): ``pd`` (P and D with PDConnector behind pd-router) and ``aggregated`` (two stock vLLM servers behind
pd-router, no connector), and reads the resident memory (VmRSS, summed over each engine's process group)
of every engine after each round. Requests: token-id prompts of 16-800 tokens (pd-router sends the longer
ones P->D, the shorter ones to D alone), 16 output tokens, half of them streamed, ``--concurrency`` at once.

``growth_mb`` is an engine's memory after the last round minus after the first (the first round's own
growth counts as warm-up); ``per_1k_requests_mb`` scales the system's total by the requests served after the
first round. Progress on stderr; the last stdout line is the JSON summary (docs/performance.md
``## rss_soak``); ``--plot`` draws every engine's memory by round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.chaos_cluster import rss_mb
from benchmarks.first_token import SERVED
from benchmarks.goodput_systems import build
from benchmarks.prompts import model_limits

SYSTEMS = ("pd", "aggregated")
PROMPT_TOKENS = (16, 800)
OUTPUT_TOKENS = 16
LOG_DIR = Path("logs/benchmarks/rss_soak")


def request_bodies(n: int, vocab: int, rng: random.Random) -> list[dict[str, Any]]:
    """``n`` completions with random token-id prompts (ids 100 up, below ``vocab``), half streamed."""
    return [
        {
            "model": SERVED,
            "prompt": [rng.randrange(100, vocab) for _ in range(rng.randint(*PROMPT_TOKENS))],
            "max_tokens": OUTPUT_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": rng.random() < 0.5,
        }
        for _ in range(n)
    ]


async def _send(url: str, bodies: list[dict[str, Any]], concurrency: int) -> None:
    """Every body, ``concurrency`` at once; an answer other than 200 fails the run (a soak must not hide
    errors as less work)."""
    slots = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def one(body: dict[str, Any]) -> None:
            async with slots, session.post(f"{url}/v1/completions", json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {text[:200]}")

        await asyncio.gather(*(one(b) for b in bodies))


def summarize(rss: dict[str, list[float]], per_round: int) -> dict[str, Any]:
    """Growth per engine from its reading after the first round to its last, and the system's total per
    thousand requests served in between."""
    growth = {name: round(series[-1] - series[0], 1) for name, series in rss.items()}
    served = per_round * (len(next(iter(rss.values()))) - 1)
    total = sum(growth.values())
    return {
        "rss_mb": {name: [round(v, 1) for v in series] for name, series in rss.items()},
        "growth_mb": growth,
        "per_1k_requests_mb": round(1000 * total / served, 1) if served else None,
    }


def plot(systems: dict[str, dict[str, Any]], per_round: int, path: Path) -> None:
    """Every engine's resident memory after each round, against the requests served so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for system in systems.values():
        for engine, series in system["rss_mb"].items():
            ax.plot([per_round * (k + 1) for k in range(len(series))], series, marker="o", label=engine)
    ax.set_xlabel("requests served")
    ax.set_ylabel("resident memory of the engine (MB)")
    ax.set_title("engine memory under the same load: P/D vs stock vLLM")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_system(name: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Start ``name``, serve ``args.rounds`` rounds of the seeded load, read every engine after each."""
    system = build(name, args.model, args.dtype, args.max_len, log_dir)
    rng = random.Random(args.seed)  # the same requests for every system
    try:
        system.start()
        rss: dict[str, list[float]] = {e.name: [] for e in system.engines}
        for k in range(args.rounds):
            started = time.monotonic()
            asyncio.run(_send(system.url, request_bodies(args.per_round, args.vocab, rng), args.concurrency))
            for engine in system.engines:
                rss[engine.name].append(rss_mb(engine))
            readings = ", ".join(f"{n} {s[-1]:.0f} MB" for n, s in rss.items())
            took = time.monotonic() - started
            print(
                f"{name}: round {k + 1}/{args.rounds} in {took:.1f}s: {readings}", file=sys.stderr, flush=True
            )
    finally:
        system.close()
    return summarize(rss, args.per_round)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path(".cache/models/tiny-llama"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per-round", type=int, default=150, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--plot", type=Path, default=Path("docs/rss_soak.png"), help="'' for no plot")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (growth is measured from the first round's end)")
    args.model = args.model.resolve()
    args.vocab, args.max_len = model_limits(args.model)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    systems = {name: run_system(name, args, LOG_DIR) for name in SYSTEMS}
    if str(args.plot) not in ("", "."):
        plot(systems, args.per_round, args.plot)
    per_1k = {name: s["per_1k_requests_mb"] for name, s in systems.items()}
    result = {
        "systems": systems,
        "ratios": {
            "pd_over_aggregated_per_1k_requests": round(per_1k["pd"] / per_1k["aggregated"], 2)
            if per_1k["aggregated"]
            else None
        },
        "conditions": {
            "model": str(args.model),
            "rounds": args.rounds,
            "per_round": args.per_round,
            "concurrency": args.concurrency,
            "prompt_tokens": list(PROMPT_TOKENS),
            "output_tokens": OUTPUT_TOKENS,
            "started": started,
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
