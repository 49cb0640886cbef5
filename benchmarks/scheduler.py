"""Head-of-line blocking benchmark: the engine's default vs the best static chunk budget vs our SLO scheduler.

``--engine vllm`` (default): vLLM's scheduler, static ``--max-num-batched-tokens``, ``SLOScheduler``.
``--engine sglang``: SGLang as shipped (its default ``--chunked-prefill-size``, prefill and decode steps
alternating), static ``--chunked-prefill-size`` with ``--enable-mixed-chunk`` (decodes ride along with each
chunk; the size counts them, like vLLM's budget), and ``PD_SGLANG_SCHEDULER=slo`` with
``--enable-mixed-chunk``.

One colocated CPU server at a time (bench model; tiny model for SGLang), the same seeded workload for every
configuration: ``--decodes`` streaming requests kept running all the time (a finished one is replaced at
once), plus long prompts (``--long-tokens`` random token ids each, distinct so the prefix cache never helps)
arriving as a Poisson process. The client records the arrival time of every streamed token.

Reported per configuration (all from the measurement window, after a warm-up long prompt):
- ``itl_max``: the worst gap between consecutive tokens of a stream (what a user sees as a freeze);
- ``itl_window_p99``: p99 of the gaps that overlap an interference window (a long prompt's arrival to its
  first token), where head-of-line blocking happens;
- ``itl_p99``: p99 of all gaps; ``ttft_long_p50``: median TTFT of the long prompts;
- ``ttft_stream_max``: the longest wait of a decode stream (started in the window) for its first token: a
  scheduler that kept new streams out during a long prefill would show it here, not in the gaps;
  ``ttft_stream_p90``: the 90th percentile of those waits (a maximum over one run hangs on one coincidence);
- ``throughput``: generated tokens per second (decode streams and long prompts);
- ``cpu_share``: CPU seconds per second of the server's processes over the window (``api_server``: vLLM's
  front end; the others by process name, e.g. ``VLLM::EngineCor`` (the scheduler's process) and
  ``VLLM::Worker`` (the model's)): which process had the cores.

Defaults (the configuration docs/performance.md ``## scheduler`` quotes): the model's OpenMP threads on
core 1 (``--cores 1``: like vLLM's automatic CPU binding, it leaves a core to the server's other processes),
a 75 s window (the seeded schedule sends 4 long prompts in it; a 45 s window had 2, too few for a TTFT
median), and 2 static runs, so the 4 servers of a default run fit one 15-minute slot of the shared engine
lock. ``--ours-variant`` adds runs of ours with settings changed (the behaviour before issue 20:
``step_time=forward,admit_during_prefill=false``), ``--ours-args-variant`` runs of ours with server
arguments added (SGLang's ``--schedule-policy shortest-prefill-first``, which leaves room in a chunked
prefill's step for shorter waiting prompts).

``static_best``: the largest static per-step budget that holds the target (window p99 and p99 <=
the target), searched in steps of 16 tokens from an estimate derived from the default run (decode step time
and per-token prefill cost); among the budgets run, the holding one with the lowest long-prompt TTFT is
reported (the smallest one run if none holds it).

Progress goes to stderr; the last stdout line is the JSON summary. Runs in the harness process; servers are
started and always stopped through ``pd_disagg.servers``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks.scheduler_report import plot, process_cpu_s
from integration_tests.pd_checks import token_stream_body
from pd_disagg.engines import base_url, sglang_server, vllm_server
from pd_disagg.servers import running
from pd_disagg.tiny_model import PRESETS, bench_model, build

ROOT = Path(__file__).resolve().parent.parent
HTTP_TIMEOUT_S = 300.0
STATIC_STEP = 16  # granularity of the static --max-num-batched-tokens search (tokens)


@dataclass
class Stream:
    """One streamed completion: when it was sent and when each token arrived (perf_counter seconds)."""

    sent: float
    long: bool
    token_times: list[float] = field(default_factory=list)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def stream_completion(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int, long: bool
) -> Stream:
    """POST a streaming completion; timestamp every event that carries tokens."""
    record = Stream(sent=time.perf_counter(), long=long)
    body = token_stream_body(model, prompt, max_tokens)
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"server error event: {event['error']}")
            for choice in event.get("choices", []):
                record.token_times.extend([now] * max(1, len(choice.get("token_ids") or [])))
    return record


@dataclass(frozen=True)
class Workload:
    model: str
    decodes: int
    decode_prompt_tokens: int
    decode_max_tokens: int
    long_tokens: int
    long_rate_per_s: float
    duration_s: float
    seed: int
    max_token_id: int  # prompts are random ids in [100, max_token_id): inside the model's vocabulary

    def long_schedule(self) -> list[tuple[float, list[int]]]:
        """Seeded Poisson arrival offsets (s) and distinct random prompts; identical for every config."""
        rng = np.random.default_rng(self.seed)
        t, out = 0.0, list[tuple[float, list[int]]]()
        while True:
            t += float(rng.exponential(1.0 / self.long_rate_per_s))
            if t > self.duration_s:
                return out
            out.append((t, rng.integers(100, self.max_token_id, self.long_tokens).tolist()))


async def run_workload(
    url: str, work: Workload, cpu: Callable[[], dict[str, float]] = dict
) -> tuple[list[Stream], float, float, dict[str, float]]:
    """Warm up, then run decodes + Poisson long prompts; returns streams, the window (start, end) and the
    CPU share of each of ``cpu()``'s processes over the window (CPU seconds per second: 1.0 = one core)."""
    rng = np.random.default_rng(work.seed + 1)
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        def prompt(n: int) -> list[int]:
            return rng.integers(100, work.max_token_id, n).tolist()

        # Warm-up: one long prompt with decodes running (first-use costs, and the cost model's first fit).
        warm = [
            stream_completion(session, url, work.model, prompt(work.decode_prompt_tokens), 32, False)
            for _ in range(work.decodes)
        ]
        await asyncio.gather(
            *warm, stream_completion(session, url, work.model, prompt(work.long_tokens), 1, True)
        )

        streams: list[Stream] = []
        stop = asyncio.Event()

        async def decode_loop() -> None:
            while not stop.is_set():
                streams.append(
                    await stream_completion(
                        session,
                        url,
                        work.model,
                        prompt(work.decode_prompt_tokens),
                        work.decode_max_tokens,
                        False,
                    )
                )

        async def long_request(delay: float, ids: list[int]) -> None:
            await asyncio.sleep(delay)
            streams.append(await stream_completion(session, url, work.model, ids, 1, True))

        loops = [asyncio.create_task(decode_loop()) for _ in range(work.decodes)]
        await asyncio.sleep(0.5)  # let the decode streams get going
        cpu_start, start = cpu(), time.perf_counter()
        await asyncio.gather(*(long_request(d, ids) for d, ids in work.long_schedule()))
        await asyncio.sleep(max(0.0, start + work.duration_s - time.perf_counter()))
        cpu_end, end = cpu(), time.perf_counter()
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), timeout=HTTP_TIMEOUT_S)
        share = {name: (cpu_end[name] - cpu_start.get(name, 0.0)) / (end - start) for name in cpu_end}
        return streams, start, end, share


def summarize(streams: list[Stream], start: float, end: float) -> dict[str, Any]:
    """Gap statistics inside [start, end]; see the module docstring for the definitions."""
    windows = [(s.sent, s.token_times[0]) for s in streams if s.long and s.token_times and s.sent >= start]
    gaps: list[tuple[float, float, float]] = []  # (gap start, gap end, seconds)
    for s in streams:
        if s.long:
            continue
        for a, b in zip(s.token_times, s.token_times[1:], strict=False):
            if start <= b <= end:
                gaps.append((a, b, b - a))
    values = np.array([g for _, _, g in gaps])
    in_window = np.array([g for a, b, g in gaps if any(a < w1 and b > w0 for w0, w1 in windows)])
    tokens = sum(1 for s in streams for t in s.token_times if start <= t <= end)
    # A decode stream's wait for its first token is a freeze too, though no gap between tokens shows it.
    short_ttfts = [
        s.token_times[0] - s.sent for s in streams if not s.long and s.token_times and s.sent >= start
    ]
    return {
        "itl_max_ms": float(values.max() * 1e3),
        "itl_window_p99_ms": float(np.percentile(in_window, 99) * 1e3) if in_window.size else float("nan"),
        "itl_p99_ms": float(np.percentile(values, 99) * 1e3),
        "itl_p50_ms": float(np.percentile(values, 50) * 1e3),
        "ttft_long_p50_ms": statistics.median(w1 - w0 for w0, w1 in windows) * 1e3,
        "ttft_stream_max_ms": max(short_ttfts, default=float("nan")) * 1e3,
        "ttft_stream_p90_ms": float(np.percentile(short_ttfts, 90) * 1e3) if short_ttfts else float("nan"),
        "long_prompts": len(windows),
        "throughput_tok_s": tokens / (end - start),
        "gaps": [[b - start, g * 1e3] for _, b, g in gaps],
        "windows": [[w0 - start, w1 - start] for w0, w1 in windows],
    }


@dataclass(frozen=True)
class Engine:
    """How one engine is run for each configuration: server flags and environment, default model and
    prompt."""

    static_args: Callable[[int], list[str]]  # a static per-step token budget
    ours_args: list[str]
    ours_env: dict[str, str]
    model: Callable[[], Path]
    long_tokens: int


ENGINES = {
    "vllm": Engine(
        static_args=lambda budget: ["--max-num-batched-tokens", str(budget)],
        ours_args=["--scheduler-cls", "scheduler_plugins.vllm.SLOScheduler"],
        ours_env={},
        model=bench_model,
        long_tokens=2000,
    ),
    # The tiny model: SGLang's CPU path (torch_native attention) prefills the bench model at ~46 tokens/s on
    # one core (a 2000-token prompt: 43 s; vLLM: 2.2 s), too slow for a 100 ms ITL target to mean anything.
    "sglang": Engine(
        static_args=lambda budget: ["--chunked-prefill-size", str(budget), "--enable-mixed-chunk"],
        ours_args=["--enable-mixed-chunk"],
        ours_env={"PD_SGLANG_SCHEDULER": "slo"},
        model=lambda: build(ROOT / ".cache" / "models" / "tiny-llama", PRESETS["tiny"]),
        long_tokens=1500,
    ),
}


def run_config(
    name: str, args: argparse.Namespace, work: Workload, extra: list[str], env: dict[str, str]
) -> dict:
    common: dict[str, Any] = {
        "log_dir": ROOT / "logs" / "bench",
        "name": re.sub(r"[^\w.=-]+", "_", f"sched-{args.engine}-{name}"),  # a file name: no spaces
        "cpu_core": args.cores,
        "extra_args": extra,
        "env": env,
    }
    if args.engine == "sglang":
        tokens = args.long_tokens + 256
        # KV room for the decode streams and a few long prompts at once
        server = sglang_server(args.model, context_length=tokens, max_total_tokens=4 * tokens, **common)
    else:
        server = vllm_server(args.model, max_model_len=args.long_tokens + 256, **common)
    log(f"{name}: starting server {' '.join(extra)}")
    with running(server, timeout_s=600):
        streams, start, end, share = asyncio.run(
            run_workload(base_url(server), work, lambda: process_cpu_s(server.pid))
        )
    result = summarize(streams, start, end)
    result["cpu_share"] = share
    log(
        f"{name}: itl_max={result['itl_max_ms']:.0f}ms window_p99={result['itl_window_p99_ms']:.0f}ms "
        f"p99={result['itl_p99_ms']:.0f}ms p50={result['itl_p50_ms']:.0f}ms "
        f"ttft_long_p50={result['ttft_long_p50_ms']:.0f}ms ({result['long_prompts']} long) "
        f"ttft_stream_max={result['ttft_stream_max_ms']:.0f}ms p90={result['ttft_stream_p90_ms']:.0f}ms "
        f"throughput={result['throughput_tok_s']:.1f} tok/s cpu_share="
        + " ".join(f"{k}={v:.2f}" for k, v in share.items())
    )
    return result


def static_estimate(default: dict, work: Workload, target_ms: float) -> int:
    """The budget whose step is predicted to hit the target, from the default run's figures:
    step(B) ~ decode step + (B - decodes) * per-token prefill cost, rounded down to ``STATIC_STEP``."""
    step_ms = float(default["itl_p50_ms"])
    per_token_ms = float(default["ttft_long_p50_ms"]) / work.long_tokens
    return max(
        STATIC_STEP, int(work.decodes + (target_ms - step_ms) / per_token_ms) // STATIC_STEP * STATIC_STEP
    )


def search_static(run: Callable[[int], dict], start: int, target_ms: float, tries: int) -> dict[int, dict]:
    """Find the largest static budget (a multiple of ``STATIC_STEP``) that holds the target, by runs.

    Starts at ``start``; steps down while it misses the target, up while it holds it, and stops at the
    boundary or after ``tries`` runs. The estimate ignores attention's growth with depth, so the boundary
    is usually one or two steps below it. The largest holding budget has the best long-prompt TTFT: that
    is ``static_best``.
    """
    results: dict[int, dict] = {}
    budget = start
    while len(results) < tries and budget >= STATIC_STEP and budget not in results:
        results[budget] = run(budget)
        held = holds_target(results[budget], target_ms)
        if (budget + STATIC_STEP if held else budget - STATIC_STEP) in results:
            break  # both sides of the boundary were run
        budget += STATIC_STEP if held else -STATIC_STEP
    return results


def holds_target(result: dict, target_ms: float) -> bool:
    return bool(result["itl_window_p99_ms"] <= target_ms and result["itl_p99_ms"] <= target_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        help="model directory (default: vLLM PD_BENCH_MODEL or the bench preset, SGLang the tiny preset)",
    )
    parser.add_argument("--engine", choices=sorted(ENGINES), default="vllm")
    parser.add_argument("--target-ms", type=float, default=100.0)
    parser.add_argument("--decodes", type=int, default=4)
    parser.add_argument(
        "--long-tokens", type=int, help="long prompt length (default: vLLM 2000, SGLang 1500)"
    )
    parser.add_argument("--long-rate", type=float, default=1 / 8, help="long prompts per second (Poisson)")
    parser.add_argument(
        "--duration",
        type=float,
        default=75.0,
        help="measurement window per config (s); 75 s: 4 long prompts with the default rate and seed",
    )
    parser.add_argument("--cores", default="1", help="CPU cores of the server's OpenMP threads (0-1, 1, ...)")
    parser.add_argument(
        "--static", type=int, nargs="*", help="static budgets to try (default: searched, see --static-tries)"
    )
    parser.add_argument(
        "--static-tries",
        type=int,
        default=2,
        help="at most this many static runs when searching for the largest budget that holds the target "
        "(2: the estimate and its neighbour, so a default run of 4 servers fits a 15-minute engine slot)",
    )
    parser.add_argument(
        "--ours-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra scheduler_plugins setting for ours, e.g. chunk_align_tokens=16 (repeatable)",
    )
    parser.add_argument(
        "--ours-variant",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also run ours with these settings changed (NAME=VALUE[,NAME=VALUE...]), reported as "
        "ours[NAME=VALUE...] (repeatable)",
    )
    parser.add_argument(
        "--ours-args-variant",
        action="append",
        default=[],
        metavar="ARGS",
        help="also run ours with these server arguments added (one string, split on spaces), reported as "
        "ours[ARGS], e.g. '--schedule-policy shortest-prefill-first' for SGLang (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plot", type=Path, help="gap plot (default: docs/scheduler_gaps.png, _sglang.png for SGLang)"
    )
    args = parser.parse_args(argv)
    engine = ENGINES[args.engine]
    args.model = args.model or str(engine.model())
    args.long_tokens = args.long_tokens or engine.long_tokens
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    suffix = "" if args.engine == "vllm" else f"_{args.engine}"
    args.plot = args.plot or ROOT / "docs" / f"scheduler_gaps{suffix}.png"
    # SIGTERM (e.g. `timeout`) must unwind through `running()` so the server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Workload(
        model=args.model,
        decodes=args.decodes,
        decode_prompt_tokens=32,
        decode_max_tokens=256,
        long_tokens=args.long_tokens,
        long_rate_per_s=args.long_rate,
        duration_s=args.duration,
        seed=args.seed,
        max_token_id=min(4000, vocab),
    )
    results = {"default": run_config("default", args, work, [], {})}

    def run_static(budget: int) -> dict:
        return run_config(f"static-{budget}", args, work, engine.static_args(budget), {})

    if args.static:
        statics = {b: run_static(b) for b in args.static}
    else:
        start = static_estimate(results["default"], work, args.target_ms)
        statics = search_static(run_static, start, args.target_ms, args.static_tries)
    candidates = sorted(statics)
    holding = [b for b in candidates if holds_target(statics[b], args.target_ms)]
    best = min(holding, key=lambda b: statics[b]["ttft_long_p50_ms"]) if holding else min(candidates)
    results["static_best"] = statics[best]

    def ours_env(settings: list[str]) -> dict[str, str]:
        pairs = (kv.split("=", 1) for kv in settings)
        return {
            **engine.ours_env,
            "PD_SCHED_ITL_TARGET_MS": f"{args.target_ms:g}",
            **{f"PD_SCHED_{name.upper()}": value for name, value in pairs},
        }

    for variant in args.ours_variant:
        name = f"ours[{variant}]"
        changed = [*args.ours_setting, *variant.split(",")]
        results[name] = run_config(name, args, work, engine.ours_args, ours_env(changed))
    for extra in args.ours_args_variant:
        name = f"ours[{extra}]"
        results[name] = run_config(
            name, args, work, [*engine.ours_args, *extra.split()], ours_env(args.ours_setting)
        )
    results["ours"] = run_config("ours", args, work, engine.ours_args, ours_env(args.ours_setting))
    plot(
        {
            "default": results["default"],
            f"static_best ({best} tokens)": results["static_best"],
            **{name: res for name, res in results.items() if name.startswith("ours")},
        },
        args.target_ms,
        args.plot,
    )
    keys = (
        "itl_max_ms",
        "itl_window_p99_ms",
        "itl_p99_ms",
        "ttft_long_p50_ms",
        "ttft_stream_max_ms",
        "ttft_stream_p90_ms",
        "throughput_tok_s",
    )
    summary: dict[str, object] = {"engine": args.engine, "itl_target_ms": args.target_ms}
    for key in keys:
        summary[key] = {name: round(float(res[key]), 1) for name, res in results.items()}
    summary["static_best_tokens"] = best
    summary["static_tried"] = {str(b): {k: round(float(statics[b][k]), 1) for k in keys} for b in candidates}
    summary["long_prompts"] = {name: res["long_prompts"] for name, res in results.items()}
    summary["cpu_share"] = {
        name: {k: round(v, 2) for k, v in res["cpu_share"].items()} for name, res in results.items()
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
