"""``pd-plan``: size P and D pools under TTFT/TPOT SLOs, size KV transfers, and profile live servers.

    pd-plan --isl 6144 --osl 512 --ttft 2 --tpot 0.02 --tpm 5e6 --profile profile.json [--json] [--verify]
    pd-plan kv --model PATH_OR_CONFIG --tokens N [--link 400Gbps]
    pd-plan profile --endpoint URL --isl N --out profile.json
    pd-plan trace --profile profile.json --ttft 1 --tpot 0.02 --percentile 90 --peak-rate 5000 [--plot day.png]

Exit codes: 0 success, 2 bad input or an infeasible target (the reason is printed; with ``--json`` the last
stdout line is ``{"error": ...}``), 1 a failure talking to a server.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import aiohttp
import msgspec
from rich.console import Console
from rich.table import Table

from planner import fleet, kv, model, trace
from planner.profile import Profile, ProfileError, load_profile, save_profile
from planner.profiler import ProfilerConfig, ProfilerError, measure_profile
from planner.simulator import SimSummary, Statistic, load_lengths, poisson_requests, simulate_grid

SUBCOMMANDS = ("kv", "profile", "trace")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(part) for part in text.split(",") if part.strip())


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-plan",
        description="SLO-aware P/D capacity planner (subcommands: `pd-plan kv ...`, `pd-plan profile ...`, "
        "`pd-plan trace ...`).",
    )
    p.add_argument("--profile", required=True, help="profile JSON (from `pd-plan profile` or by hand)")
    p.add_argument("--isl", type=_positive_float, required=True, help="mean input length (tokens)")
    p.add_argument("--osl", type=_positive_float, required=True, help="mean output length (tokens)")
    p.add_argument("--ttft", type=_positive_float, required=True, help="TTFT SLO on the mean (seconds)")
    p.add_argument("--tpot", type=_positive_float, required=True, help="TPOT SLO on the mean (seconds)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--throughput", type=_positive_float, help="target input+output tokens/s")
    target.add_argument("--tpm", type=_positive_float, help="target input+output tokens per minute")
    p.add_argument("--method", choices=[m.value for m in model.Method], default="mm1", help="prefill model")
    p.add_argument(
        "--prefill-efficiency",
        type=_positive_float,
        default=model.DEFAULT_PREFILL_EFFICIENCY,
        help="rate-match: fraction of the profiled prefill maximum to plan with",
    )
    p.add_argument(
        "--decode-efficiency",
        type=_positive_float,
        default=model.DEFAULT_DECODE_EFFICIENCY,
        help="rate-match: fraction of the decode throughput at the TPOT SLO to plan with",
    )
    p.add_argument("--json", action="store_true", help="end with one JSON line of the headline figures")
    p.add_argument("--verify", action="store_true", help="simulate the plan and the plans one node smaller")
    p.add_argument(
        "--verify-stat", choices=["mean", "p50", "p90", "p99"], default="mean", help="compared with the SLOs"
    )
    p.add_argument("--requests", type=_positive_int, default=20000, help="simulated requests")
    p.add_argument("--seed", type=int, default=0, help="seed of simulated arrivals and service times")
    p.add_argument(
        "--prefill-service", choices=["det", "exp"], default="det", help="simulated prefill time distribution"
    )
    p.add_argument("--max-batch", type=_positive_int, default=None, help="decode batch cap per D instance")
    p.add_argument("--lengths", help='JSON Lines of {"input": N, "output": M} to replay in the simulator')
    p.add_argument("--plot-dir", type=Path, help="write decode-curve.png and attainment.png here")
    return p


def _kv_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-plan kv", description="KV-cache bytes per token/request and transfer time"
    )
    p.add_argument("--model", required=True, help="model folder or its config.json")
    p.add_argument("--tokens", type=_positive_int, required=True, help="tokens per request (prompt length)")
    p.add_argument("--link", help="link speed, e.g. 400Gbps or 50GB/s")
    p.add_argument("--dtype", help="KV-cache dtype if not the model's (e.g. fp8)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the sizes")
    return p


def _profile_parser() -> argparse.ArgumentParser:
    defaults = ProfilerConfig(endpoint="", isl=1)
    p = argparse.ArgumentParser(prog="pd-plan profile", description="measure a profile on a live server")
    p.add_argument("--endpoint", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--isl", type=_positive_int, required=True, help="input length to measure prefill at")
    p.add_argument("--out", type=Path, default=Path("profile.json"))
    p.add_argument("--decode-endpoint", help="measure decode on this server instead (a separate D pool)")
    p.add_argument("--model", help="model name to request (default: the first at /v1/models)")
    p.add_argument(
        "--ttft-samples", type=_positive_int, default=defaults.ttft_samples, help="one-at-a-time requests"
    )
    p.add_argument(
        "--prefill-requests", type=_positive_int, default=defaults.prefill_requests, help="saturated phase"
    )
    p.add_argument(
        "--prefill-concurrency", type=_positive_int, default=defaults.prefill_concurrency, help="in flight"
    )
    p.add_argument("--batches", type=_int_list, default=defaults.decode_batches, help="comma-separated")
    p.add_argument("--decode-tokens", type=_positive_int, default=defaults.decode_tokens, help="per request")
    p.add_argument("--decode-prompt-tokens", type=_positive_int, default=defaults.decode_prompt_tokens)
    p.add_argument("--token-id-low", type=int, default=defaults.token_id_low, help="random prompt ids from")
    p.add_argument("--token-id-high", type=_positive_int, default=defaults.token_id_high, help="... up to")
    p.add_argument("--timeout", type=_positive_float, default=defaults.timeout_s, help="per request (s)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of the random prompts")
    return p


def _trace_parser() -> argparse.ArgumentParser:
    defaults = {f.name: f.default for f in msgspec.structs.fields(fleet.FleetConfig)}
    p = argparse.ArgumentParser(
        prog="pd-plan trace",
        description="plan a day of trace-shaped traffic per window and simulate it: mean-only sizing vs ours",
    )
    p.add_argument("--profile", required=True, help="profile JSON (from `pd-plan profile` or by hand)")
    p.add_argument("--ttft", type=_positive_float, required=True, help="TTFT SLO at --percentile (s)")
    p.add_argument("--tpot", type=_positive_float, required=True, help="TPOT SLO at --percentile (s)")
    p.add_argument("--percentile", type=_positive_float, default=defaults["percentile"], help="of requests")
    p.add_argument("--lengths", help='JSON Lines of {"input": N, "output": M}: fit both lognormals to it')
    p.add_argument("--isl-median", type=_positive_float, default=2048.0, help="input length median (tokens)")
    p.add_argument("--isl-sigma", type=float, default=0.8, help="input length log-space sigma")
    p.add_argument("--osl-median", type=_positive_float, default=256.0, help="output length median (tokens)")
    p.add_argument("--osl-sigma", type=float, default=1.0, help="output length log-space sigma")
    rate = p.add_mutually_exclusive_group(required=True)
    rate.add_argument("--peak-rate", type=_positive_float, help="diurnal sinusoid: requests/s at the peak")
    rate.add_argument("--hourly-rates", help="JSON list of per-hour rates (requests/s) instead")
    p.add_argument("--peak-to-trough", type=_positive_float, default=3.0, help="diurnal peak/trough ratio")
    p.add_argument("--peak-hour", type=float, default=14.0, help="diurnal hour of the peak (0-24)")
    p.add_argument("--hours", type=_positive_float, default=24.0, help="diurnal horizon (hours)")
    p.add_argument(
        "--window-s", type=_positive_float, default=defaults["window_s"], help="planning window (s)"
    )
    p.add_argument("--tick-s", type=_positive_float, default=defaults["tick_s"], help="controller period (s)")
    p.add_argument(
        "--replica-start-s", type=float, default=defaults["replica_start_s"], help="order to ready (s)"
    )
    p.add_argument(
        "--scale-down-hold-s",
        type=float,
        default=defaults["scale_down_hold_s"],
        help="want fewer this long (s)",
    )
    p.add_argument("--gpus-per-instance", type=_positive_int, default=defaults["gpus_per_instance"])
    p.add_argument("--prefill-samples", type=_positive_int, default=defaults["prefill_samples"])
    p.add_argument("--decode-samples", type=_positive_int, default=defaults["decode_samples"])
    p.add_argument("--seed", type=int, default=defaults["seed"], help="seed of the simulated traffic")
    p.add_argument("--plot", type=Path, help="write the attainment/replicas-over-the-day PNG here")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the comparison")
    return p


def _print_plan(console: Console, plan: model.Plan, workload: model.Workload) -> None:
    table = Table(title=f"P/D plan ({plan.method.value})", show_header=False)
    rows = [
        ("request rate", f"{plan.request_rate:.4g} req/s"),
        ("minimum achievable TTFT", f"{plan.min_ttft_s:.4g} s"),
        ("prefill tokens/s per P under TTFT SLO", f"{plan.prefill_tokens_per_s:.4g}"),
        ("decode tokens/s per D at TPOT SLO", f"{plan.decode_tokens_per_s:.4g}"),
        ("P/D ratio", f"{plan.pd_ratio:.4g}"),
        ("P instances (exact -> whole)", f"{plan.prefill_instances_exact:.3f} -> {plan.prefill_instances}"),
        ("D instances (exact -> whole)", f"{plan.decode_instances_exact:.3f} -> {plan.decode_instances}"),
        ("load per P", f"{plan.prefill_load_tokens_per_s:.4g} tok/s ({plan.prefill_utilization:.0%} busy)"),
        (
            "predicted mean TTFT (M/M/1, whole P)",
            f"{plan.predicted_ttft_s:.4g} s (SLO {workload.ttft_s:g} s)",
        ),
        ("load per D", f"{plan.decode_load_tokens_per_s:.4g} tok/s"),
        ("concurrent streams per D", f"{plan.decode_streams_per_instance:.3g}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for note in plan.notes:
        console.print(f"note: {note}")


def _verify_shapes(plan: model.Plan) -> list[tuple[int, int]]:
    n_p, n_d = plan.prefill_instances, plan.decode_instances
    shapes = [(n_p, n_d)]
    if n_p > 1:
        shapes.append((n_p - 1, n_d))
    if n_d > 1:
        shapes.append((n_p, n_d - 1))
    return shapes


def _grid_shapes(plan: model.Plan) -> list[tuple[int, int]]:
    def around(n: int) -> range:
        return range(max(1, n - 3), n + 2)

    return [(p, d) for p in around(plan.prefill_instances) for d in around(plan.decode_instances)]


def _print_verify(console: Console, results: Sequence[SimSummary], stat: Statistic) -> None:
    table = Table(title=f"simulation ({results[0].requests} Poisson requests); SLO check on the {stat}")
    for column in ("xPyD", "TTFT mean/p90/p99 s", "TPOT mean/p90/p99 ms", "attainment", "meets"):
        table.add_column(column)
    for r in results:
        ttft_ok, tpot_ok = r.meets(stat)
        table.add_row(
            f"{r.prefill_instances}P{r.decode_instances}D",
            f"{r.ttft_mean_s:.3g} / {r.ttft_p90_s:.3g} / {r.ttft_p99_s:.3g}",
            f"{r.tpot_mean_s * 1e3:.3g} / {r.tpot_p90_s * 1e3:.3g} / {r.tpot_p99_s * 1e3:.3g}",
            f"{r.slo_attainment:.1%}",
            "yes" if ttft_ok and tpot_ok else ("no (TTFT)" if not ttft_ok else "no (TPOT)"),
        )
    console.print(table)
    planned_ok = all(results[0].meets(stat))
    smaller_ok = [r for r in results[1:] if all(r.meets(stat))]
    if not planned_ok:
        console.print("verdict: the plan MISSES the SLOs in simulation; add instances or relax the SLOs")
    elif smaller_ok:
        names = ", ".join(f"{r.prefill_instances}P{r.decode_instances}D" for r in smaller_ok)
        console.print(
            f"verdict: the plan meets the SLOs, but so does {names} (the analytic model is conservative)"
        )
    else:
        console.print("verdict: the plan meets the SLOs and every plan one node smaller misses them")


def run_plan(args: argparse.Namespace, console: Console) -> int:
    profile = load_profile(args.profile)
    throughput = args.throughput if args.throughput is not None else args.tpm / 60.0
    workload = model.Workload(
        throughput_tokens_per_s=throughput, isl=args.isl, osl=args.osl, ttft_s=args.ttft, tpot_s=args.tpot
    )
    plan = model.plan(
        profile, workload, model.Method(args.method), args.prefill_efficiency, args.decode_efficiency
    )
    _print_plan(console, plan, workload)
    if args.verify or args.plot_dir:
        _simulate(args, console, profile, plan, workload)
    if args.json:
        sys.stdout.write(msgspec.json.encode(plan.summary()).decode() + "\n")
    return 0


def _simulate(
    args: argparse.Namespace, console: Console, profile: Profile, plan: model.Plan, workload: model.Workload
) -> None:
    lengths = load_lengths(args.lengths) if args.lengths else None
    requests = poisson_requests(
        plan.request_rate, args.requests, workload.isl, workload.osl, args.seed, lengths
    )
    common = {"prefill_service": args.prefill_service, "max_batch": args.max_batch, "seed": args.seed}
    if args.verify:
        results = simulate_grid(
            profile, requests, _verify_shapes(plan), workload.ttft_s, workload.tpot_s, **common
        )
        _print_verify(console, results, cast(Statistic, args.verify_stat))
    if args.plot_dir:
        from planner import plots  # matplotlib is only imported when plots are asked for

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        curve = plots.plot_decode_curve(
            profile, workload.tpot_s, plan.decode_tokens_per_s, args.plot_dir / "decode-curve.png"
        )
        grid = simulate_grid(
            profile, requests, _grid_shapes(plan), workload.ttft_s, workload.tpot_s, **common
        )
        shape = (plan.prefill_instances, plan.decode_instances)
        attainment = plots.plot_attainment(grid, shape, args.plot_dir / "attainment.png")
        console.print(f"plots: {curve} {attainment}")


def _trace_config(args: argparse.Namespace) -> fleet.FleetConfig:
    if args.lengths:
        inputs, outputs = load_lengths(args.lengths)
        isl, osl = trace.Lognormal.fit(inputs), trace.Lognormal.fit(outputs)
    else:
        isl = trace.Lognormal(args.isl_median, args.isl_sigma)
        osl = trace.Lognormal(args.osl_median, args.osl_sigma)
    if args.hourly_rates:
        rate = trace.load_hourly(args.hourly_rates)
    else:
        rate = trace.diurnal(args.peak_rate, args.peak_to_trough, args.peak_hour, args.hours)
    return fleet.FleetConfig(
        profile=load_profile(args.profile),
        isl=isl,
        osl=osl,
        rate=rate,
        ttft_slo_s=args.ttft,
        tpot_slo_s=args.tpot,
        percentile=args.percentile,
        window_s=args.window_s,
        tick_s=args.tick_s,
        replica_start_s=args.replica_start_s,
        scale_down_hold_s=args.scale_down_hold_s,
        gpus_per_instance=args.gpus_per_instance,
        prefill_samples=args.prefill_samples,
        decode_samples=args.decode_samples,
        seed=args.seed,
    )


def run_trace(args: argparse.Namespace, console: Console) -> int:
    config = _trace_config(args)
    result = fleet.plan_and_simulate(config)
    console.print(
        f"lengths: ISL lognormal median {config.isl.median:.4g} sigma {config.isl.sigma:.3g} (mean "
        f"{config.isl.mean:.4g}), OSL median {config.osl.median:.4g} sigma {config.osl.sigma:.3g} (mean "
        f"{config.osl.mean:.4g}); per instance at p{config.percentile:g}: P {result.prefill_rate_per_instance:.4g} "
        f"req/s, D {result.decode_rate_per_instance:.4g} req/s"
    )
    table = Table(
        title=f"{len(result.window_start_s)} windows of {config.window_s:g} s, SLOs at p{config.percentile:g}"
    )
    for column in ("method", "GPU-hours", "peak GPUs", "windows meeting SLOs", "worst window", "overall"):
        table.add_column(column)
    for m in result.methods:
        table.add_row(
            m.method,
            f"{m.gpu_hours:.0f}",
            str(m.peak_gpus),
            f"{m.windows_meeting_slo:.0%}",
            f"{m.worst_window_attainment:.1%}",
            f"{m.overall_attainment:.1%}",
        )
    console.print(table)
    console.print(
        f"planned in {result.plan_s:.2f} s, simulated in {result.simulate_s:.2f} s "
        f"({sum(m.simulated_requests for m in result.methods)} sampled requests)"
    )
    if args.plot:
        from planner import plots  # matplotlib is only imported when plots are asked for

        args.plot.parent.mkdir(parents=True, exist_ok=True)
        console.print(f"plot: {plots.plot_trace(result, config.gpus_per_instance, args.plot)}")
    if args.json:
        sys.stdout.write(msgspec.json.encode(result.summary()).decode() + "\n")
    return 0


def run_kv(args: argparse.Namespace, console: Console) -> int:
    link = kv.parse_link(args.link) if args.link else None
    size = kv.kv_size(kv.load_config(args.model), args.tokens, args.dtype, link)
    console.print(
        f"{size.attention}: {size.layers} layers x {size.kv_heads} KV heads x {size.head_dim} dims, {size.dtype}"
    )
    console.print(f"KV per token: {size.bytes_per_token:,.0f} B ({size.bytes_per_token / 1024:.4g} KiB)")
    console.print(f"KV per request ({size.tokens} tokens): {size.bytes_per_request / 2**20:,.4g} MiB")
    if size.transfer_s is not None:
        console.print(f"transfer over {args.link}: {size.transfer_s * 1e3:.4g} ms")
    if args.json:
        sys.stdout.write(msgspec.json.encode(size).decode() + "\n")
    return 0


def run_profile(args: argparse.Namespace, console: Console) -> int:
    config = ProfilerConfig(
        endpoint=args.endpoint,
        isl=args.isl,
        model=args.model,
        decode_endpoint=args.decode_endpoint,
        ttft_samples=args.ttft_samples,
        prefill_requests=args.prefill_requests,
        prefill_concurrency=args.prefill_concurrency,
        decode_batches=args.batches,
        decode_tokens=args.decode_tokens,
        decode_prompt_tokens=args.decode_prompt_tokens,
        token_id_low=args.token_id_low,
        token_id_high=args.token_id_high,
        timeout_s=args.timeout,
        seed=args.seed,
    )
    profile = asyncio.run(measure_profile(config, Console(file=sys.stderr)))
    save_profile(profile, args.out)
    console.print(
        f"wrote {args.out}: prefill {profile.prefill_max_tokens_per_s:.4g} tok/s, "
        f"overhead {profile.ttft_overhead_s:.4g} s, {len(profile.decode)} decode points"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else "plan"
    parser = {"kv": _kv_parser, "profile": _profile_parser, "trace": _trace_parser}.get(
        command, _plan_parser
    )()
    args = parser.parse_args(argv[1:] if command != "plan" else argv)
    console = Console(file=sys.stderr if getattr(args, "json", False) else sys.stdout, soft_wrap=True)
    runner = {"kv": run_kv, "profile": run_profile, "trace": run_trace}.get(command, run_plan)
    try:
        return runner(args, console)
    except model.InfeasibleError as exc:
        console.print(f"infeasible: {exc}", markup=False)
        if getattr(args, "json", False):
            sys.stdout.write(msgspec.json.encode({"error": str(exc)}).decode() + "\n")
        return 2
    except (ProfileError, kv.KVConfigError, ValueError) as exc:
        parser.error(str(exc))
    except (ProfilerError, aiohttp.ClientError, TimeoutError, OSError) as exc:
        print(f"pd-plan {command}: cannot talk to the server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
