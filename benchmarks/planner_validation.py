"""Planner validation: predicted vs measured TTFT/TPOT on real vLLM CPU servers (a few minutes; not in CI).

    python -m benchmarks.planner_validation [--model PATH] [--isl 512] [--osl 64] [--requests 120]

1. Starts two vLLM CPU servers, each pinned to its own core: P (``--max-num-batched-tokens`` = isl, so it
   prefills one prompt per step, the single-server queue the model assumes) and D.
2. Profiles them with ``planner.profiler`` (prefill on P, the decode curve on D).
3. Chooses a target: Poisson arrivals at ``--utilization`` of one P's maximum prefill rate, TTFT SLO = the
   M/M/1 TTFT at ``--utilization + 0.1`` and TPOT SLO = the TPOT at the largest profiled batch, so the plan is
   1P1D, and predicts TTFT/TPOT with the M/M/1 closed form and the simulator (deterministic and exponential
   prefill service).
4. Runs the same load for real as an emulated 1P1D pair: each request is prefilled on P (``max_tokens=1``;
   TTFT = arrival to P's first token), then decoded on D (short prompt, ``--osl`` tokens; TPOT from D's
   stream). There is no KV transfer between the two servers (that is the connector's job, not on this branch):
   its cost would be part of the profile's TTFT overhead.
5. Prints a table (stderr) and, as its last stdout line, one JSON object with the predictions and measurements.
   With ``--plot-dir`` it also writes the decode-curve and attainment PNGs from the measured profile.

Timings on a shared 2-core machine are noisy; the report says so and gives the exact conditions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
from rich.console import Console
from rich.progress import MofNCompleteColumn, Progress

from pd_disagg.engines import base_url, vllm_server
from pd_disagg.servers import ManagedServer
from pd_disagg.tiny_model import bench_model
from planner import model, plots
from planner.profile import Profile, save_profile
from planner.profiler import ProfilerConfig, RandomPrompts, RequestTiming, measure_profile, stream_completion
from planner.simulator import poisson_requests, simulate, simulate_grid, summarise

ROOT = Path(__file__).resolve().parent.parent
DECODE_PROMPT_TOKENS = 16


def _stats(values: np.ndarray) -> dict[str, float]:
    values = values[~np.isnan(values)]
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


async def _real_run(
    p_url: str,
    d_url: str,
    model_name: str,
    arrivals: np.ndarray,
    isl: int,
    osl: int,
    seed: int,
    console: Console,
) -> tuple[np.ndarray, np.ndarray]:
    """Replay ``arrivals`` (s): prefill on P, then decode on D; returns per-request TTFT and TPOT."""
    prompts = RandomPrompts(seed + 100, 10, 1000)
    timeout = aiohttp.ClientTimeout(total=600)
    progress = Progress(*Progress.get_default_columns(), MofNCompleteColumn(), console=console)
    task = progress.add_task("real run", total=len(arrivals))
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()

        async def one(arrival: float) -> tuple[float, float]:
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            late = time.perf_counter() - (start + arrival)  # client lag counts against TTFT, as for a user
            prefill = await stream_completion(session, p_url, model_name, prompts(isl), 1)
            decode: RequestTiming = await stream_completion(
                session, d_url, model_name, prompts(DECODE_PROMPT_TOKENS), osl
            )
            progress.advance(task)
            return late + prefill.ttft_s, decode.tpot_s

        with progress:
            results = await asyncio.gather(*(one(float(a)) for a in arrivals))
    return np.array([r[0] for r in results]), np.array([r[1] for r in results])


def _servers(args: argparse.Namespace, log_dir: Path) -> tuple[ManagedServer, ManagedServer]:
    max_len = args.isl + args.osl + DECODE_PROMPT_TOKENS + 64
    prefill = vllm_server(
        args.model,
        log_dir=log_dir,
        name="planner-p",
        cpu_core=0,
        max_model_len=max_len,
        extra_args=("--max-num-batched-tokens", str(args.isl)),
    )
    decode = vllm_server(args.model, log_dir=log_dir, name="planner-d", cpu_core=1, max_model_len=max_len)
    return prefill, decode


def _targets(profile: Profile, args: argparse.Namespace) -> model.Workload:
    """A workload whose plan is 1P1D: P at ``utilization``; SLOs with some headroom."""
    mu = profile.prefill_max_tokens_per_s / args.isl
    rate = args.utilization * mu
    slo_load = min(args.utilization + 0.1, 0.95) * profile.prefill_max_tokens_per_s
    ttft = model.mm1_ttft_s(profile, args.isl, slo_load)
    tpot = profile.sorted_decode()[-1].tpot_s
    return model.Workload(rate * (args.isl + args.osl), isl=args.isl, osl=args.osl, ttft_s=ttft, tpot_s=tpot)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, help="model folder (default: $PD_BENCH_MODEL or the bench preset)"
    )
    parser.add_argument("--isl", type=int, default=512)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--requests", type=int, default=120, help="requests in the real run")
    parser.add_argument("--utilization", type=float, default=0.6, help="P load as a fraction of its maximum")
    parser.add_argument("--batches", default="1,2,4,8,16", help="decode batches to profile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=ROOT / "logs" / "benchmarks")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "logs" / "benchmarks" / "planner")
    parser.add_argument("--plot-dir", type=Path, help="write decode-curve.png and attainment.png here")
    args = parser.parse_args(argv)
    args.model = args.model or bench_model()
    console = Console(file=sys.stderr)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    servers = _servers(args, args.log_dir)
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_healthy(600)
        p_url, d_url = (base_url(s) for s in servers)
        config = ProfilerConfig(
            endpoint=p_url,
            decode_endpoint=d_url,
            isl=args.isl,
            prefill_requests=8,
            prefill_concurrency=2,
            decode_batches=tuple(int(b) for b in args.batches.split(",")),
            decode_tokens=args.osl,
            decode_prompt_tokens=DECODE_PROMPT_TOKENS,
            seed=args.seed,
        )
        profile = asyncio.run(measure_profile(config, console))
        save_profile(profile, args.out_dir / "profile.json")
        workload = _targets(profile, args)
        plan = model.plan(profile, workload)
        console.print(f"workload {workload}\nplan {plan.summary()}")
        predicted = {}
        sim_requests = poisson_requests(workload.request_rate, 20000, args.isl, args.osl, args.seed)
        for service in ("det", "exp"):
            ttft, tpot = simulate(profile, sim_requests, 1, 1, prefill_service=service, seed=args.seed)
            attained = summarise(ttft, tpot, workload.ttft_s, workload.tpot_s, 1, 1).slo_attainment
            predicted[f"sim_{service}"] = {
                "ttft_s": _stats(ttft),
                "tpot_s": _stats(tpot),
                "slo_attainment": attained,
            }
        predicted["mm1"] = {"ttft_s": {"mean": plan.predicted_ttft_s}}
        arrivals = poisson_requests(workload.request_rate, args.requests, args.isl, args.osl, args.seed + 7)
        name = profile.source.rsplit("model=", 1)[1] if profile.source else str(args.model)
        started = time.perf_counter()
        ttft, tpot = asyncio.run(
            _real_run(p_url, d_url, name, arrivals.arrival_s, args.isl, args.osl, args.seed, console)
        )
        wall = time.perf_counter() - started
        measured = {"ttft_s": _stats(ttft), "tpot_s": _stats(tpot)}
        measured_attainment = summarise(ttft, tpot, workload.ttft_s, workload.tpot_s, 1, 1).slo_attainment
        if args.plot_dir:
            args.plot_dir.mkdir(parents=True, exist_ok=True)
            plots.plot_decode_curve(
                profile, workload.tpot_s, plan.decode_tokens_per_s, args.plot_dir / "decode-curve.png"
            )
            shapes = [(p, d) for p in (1, 2, 3) for d in (1, 2, 3)]
            grid = simulate_grid(profile, sim_requests, shapes, workload.ttft_s, workload.tpot_s)
            plots.plot_attainment(
                grid, (plan.prefill_instances, plan.decode_instances), args.plot_dir / "attainment.png"
            )
    finally:
        for server in servers:
            server.stop()
    result = {
        "model": str(args.model),
        "isl": args.isl,
        "osl": args.osl,
        "requests": args.requests,
        "request_rate": workload.request_rate,
        "wall_s": wall,
        "profile": {
            "prefill_max_tokens_per_s": profile.prefill_max_tokens_per_s,
            "ttft_overhead_s": profile.ttft_overhead_s,
            "decode": [[p.batch, p.tpot_s] for p in profile.decode],
        },
        "slo": {"ttft_s": workload.ttft_s, "tpot_s": workload.tpot_s},
        "plan": plan.summary(),
        "predicted": predicted,
        "measured": measured,
        "measured_slo_attainment": measured_attainment,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
