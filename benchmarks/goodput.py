"""Goodput under TTFT/TPOT SLOs, end to end: aggregated vLLM vs aggregated + SLO scheduler vs our P/D (with and
without lending P's idle capacity) vs vLLM's NixlConnector P/D, on the same two cores (issue 17;
docs/performance.md ``## goodput``).

Per workload (``--workloads``; ``benchmarks.goodput_analysis.WORKLOADS``: ``long`` 1800 -> 180 tokens,
``mixed`` 60% 128 -> 128 chats and 40% 1800 -> 180 documents, ``short`` 128 -> 128) and per system
(``--systems``; ``benchmarks.goodput_systems``), one after another: start the system (two engines, one per
core, behind pd-router), warm it up, and run vLLM's own load generator (``pd-vllm bench serve``, random
dataset of the workload's lengths, ``--ignore-eos``; see ``bench``) at each rate of the sweep (``--rates``,
Poisson), ascending, ``max(--min-prompts, rate x --duration)`` requests per rate, the same prompts and
arrival seed for every system; stop the system (every server by its process group, also on
failure). A sweep stops after the first rate where even the loosest SLO scale misses 90% attainment.

SLOs come from idle figures measured on the first system run (``aggregated`` by default): per request
class, the median TTFT of a lone request of the class's prompt length, and the median gap between streamed
tokens of a lone request (an idle decode step); at each ``--slo-scales`` k, TTFT SLO = k x the class's idle
TTFT, TPOT SLO = k x the idle step. ``--idle-ttft-ms`` / ``--idle-step-ms`` fix those figures instead (still
measured and reported): one measurement moves with the machine's state, and fixed ones let separate
invocations share their SLOs. ``aggregated_slo``'s scheduler gets the k = 2 SLOs as its targets.
Goodput and the rest: ``benchmarks.goodput_analysis``. Checked per run: ``vllm bench serve``'s failed count
(reported; the target is zero), KV bytes moved by ``pd`` and ``nixl`` whenever long prompts ran, and no
failed KV load.

Progress on stderr (rich); the last stdout line is the JSON; plots go to ``--plot-dir``. Hold the shared
engine lock while it runs (``flock /tmp/pd-engines.lock python -m benchmarks.goodput ...``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import MofNCompleteColumn, Progress, TimeElapsedColumn

from benchmarks import goodput_plots
from benchmarks.first_token import body, stream
from benchmarks.goodput_analysis import (
    WORKLOADS,
    Slo,
    Workload,
    failed_run,
    score,
    slos,
    stage_means,
    summarize,
)
from benchmarks.goodput_systems import SERVED, SYSTEMS, System, build
from benchmarks.prompts import model_limits
from pd_disagg.engines import base_url

LOG_DIR = Path("logs/benchmarks/goodput")
HEADLINE_SCALE = 2.0
#: Per-request lists of vLLM's detailed result that a run keeps (merged over its request classes).
DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors")
IDLE_REPS = 3
IDLE_TOKENS = 16  # streamed tokens of an idle request: its gaps are idle decode steps
console = Console(stderr=True)


def log(msg: str) -> None:
    """A progress line on stderr (shown above the progress bar on a terminal, plain lines in a log file)."""
    print(f"[goodput {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench(
    url: str,
    model: Path,
    workload: Workload,
    n: int,
    rate: float,
    slo: Slo,
    seed: int,
    name: str,
    timeout_s: float,
    class_ttft_targets: bool = False,
) -> dict[str, Any]:
    """One run of ``n`` requests at ``rate``: one ``pd-vllm bench serve`` per request class, all at once,
    each Poisson at the class's share of ``rate`` (independent Poisson streams add up to one at ``rate``)
    over vLLM's random dataset (random token ids of exactly the class's lengths, fresh per seed); their
    detailed results merged (per-request TTFT, ITLs, latency, errors; vLLM's counts summed)."""
    procs = []
    for i, cls in enumerate(workload.classes):
        count = workload.counts(n)[cls.name]
        if not count:
            continue
        result = LOG_DIR / f"{name}-{cls.name}.json"
        result.unlink(missing_ok=True)
        argv = [
            str(Path(sys.executable).with_name("pd-vllm")), "bench", "serve", "--backend", "vllm",
            "--base-url", url, "--model", SERVED, "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(cls.prompt_tokens), "--random-output-len", str(cls.output_tokens),
            "--num-prompts", str(count), "--request-rate", f"{rate * cls.share:.6g}", "--ignore-eos",
            "--seed", str(seed * len(workload.classes) + i),
            "--goodput", f"ttft:{slo.ttft_ms[cls.name]:.0f}", f"tpot:{slo.tpot_ms:.1f}",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(LOG_DIR), "--result-filename", result.name,
        ]  # fmt: skip
        if class_ttft_targets:  # each request carries its class's TTFT SLO as its scheduler deadline
            xargs = {"vllm_xargs": {"ttft_target_ms": round(slo.ttft_ms[cls.name], 1)}}
            argv += ["--extra-body", json.dumps(xargs)]
        with open(LOG_DIR / f"{name}-{cls.name}.log", "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
        procs.append((proc, argv, result))
    deadline = time.monotonic() + timeout_s
    try:
        for proc, argv, _ in procs:
            if proc.wait(max(1.0, deadline - time.monotonic())):
                raise subprocess.CalledProcessError(proc.returncode, argv[:3])
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    parts = [json.loads(result.read_text()) for _, _, result in procs]
    merged: dict[str, Any] = {key: [v for p in parts for v in p[key]] for key in DETAIL_KEYS}
    merged["completed"] = sum(p["completed"] for p in parts)
    merged["failed"] = sum(p["failed"] for p in parts)
    merged["duration"] = max(p["duration"] for p in parts)
    merged["request_goodput"] = sum(p["request_goodput"] * p["duration"] for p in parts) / merged["duration"]
    return merged


def prompt(tokens: int, rng: random.Random, vocab: int) -> list[int]:
    """Random token ids of the model's vocabulary, fresh each time (no prefix-cache hits)."""
    return [rng.randrange(10, vocab) for _ in range(tokens)]


def idle_figures(url: str, workload: Workload, rng: random.Random, vocab: int) -> dict[str, Any]:
    """Median TTFT per request class and median inter-token gap of lone requests (nothing else running)."""
    ttft: dict[str, float] = {}
    gaps: list[float] = []
    for cls in workload.classes:
        stream(url, body(prompt(cls.prompt_tokens, rng, vocab), 2))  # warm-up
        firsts = []
        for _ in range(IDLE_REPS):
            arrivals, _ = stream(url, body(prompt(cls.prompt_tokens, rng, vocab), IDLE_TOKENS))
            firsts.append(1000 * arrivals[0])
            gaps += [1000 * (b - a) for a, b in itertools.pairwise(arrivals)]
        ttft[cls.name] = sorted(firsts)[len(firsts) // 2]
    return {"ttft_ms": ttft, "step_ms": sorted(gaps)[len(gaps) // 2]}


def slo_basis(idle: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The figures the SLOs scale: the measured idle ones, each replaced by its value fixed on the command line
    if any (``--idle-ttft-ms``, ``--idle-step-ms``), so that runs of different invocations share their SLOs."""
    return {
        "ttft_ms": {**idle["ttft_ms"], **{c: ms for c, ms in args.idle_ttft_ms if c in idle["ttft_ms"]}},
        "step_ms": args.idle_step_ms or idle["step_ms"],
    }


def class_ms(text: str) -> tuple[str, float]:
    """``CLASS=MS`` of ``--idle-ttft-ms``."""
    name, sep, ms = text.partition("=")
    if not sep or not name or float(ms) <= 0:
        raise argparse.ArgumentTypeError(f"expected CLASS=MS with MS > 0, got {text!r}")
    return name, float(ms)


def warm_up(system: System, workload: Workload, rng: random.Random, vocab: int) -> None:
    """One short request straight to every engine, then as many requests of each class through the router as
    the idle measurement sends (the first requests of a vLLM server compile and allocate; the first P->D one
    connects P and D): every system starts its sweep as warm as the one the idle figures were measured on."""
    for engine in system.engines:
        stream(base_url(engine), body(prompt(64, rng, vocab), 2))
    for cls in workload.classes:
        for _ in range(IDLE_REPS + 1):
            stream(system.url, body(prompt(cls.prompt_tokens, rng, vocab), IDLE_TOKENS))


def kv_check(system: System, workload: Workload, before: dict[str, float], after: dict[str, float]) -> str:
    """'' when the run moved KV as the system must (P/D systems: bytes whenever long prompts ran, no failed
    load), else what went wrong."""
    if not before:
        return ""
    moved, failures = after["kv_bytes"] - before["kv_bytes"], after["kv_failures"] - before["kv_failures"]
    if failures:
        return f"{failures:g} failed KV loads"
    if any(c.name == "long" for c in workload.classes) and moved <= 0:
        return "no KV moved although long prompts ran"
    return ""


def run_system(
    name: str,
    workload: Workload,
    args: argparse.Namespace,
    slo_by_scale: dict[float, Slo] | None,
    sizes: dict[float, int],
    progress: Progress,
    task: Any,
) -> tuple[
    dict[str, Any] | None, dict[float, Slo], list[tuple[float, dict[str, Any]]], dict[float, dict[str, Any]]
]:
    """Start ``name``, measure idle figures if ``slo_by_scale`` is still unknown, sweep the rates, stop it.
    Returns (idle figures or None, SLOs per scale, [(rate, score)], {rate: raw vLLM result})."""
    rng = random.Random(f"{args.seed}-{workload.name}-{name}")
    slo2 = slo_by_scale[HEADLINE_SCALE] if slo_by_scale else None
    slo_ms = (max(slo2.ttft_ms.values()), slo2.tpot_ms) if slo2 else None
    system = build(name, args.model, args.dtype, args.max_len, LOG_DIR, slo_ms, args.confine)
    idle: dict[str, Any] | None = None
    points: list[tuple[float, dict[str, Any]]] = []
    raw: dict[float, dict[str, Any]] = {}
    try:
        progress.update(task, description=f"{workload.name}: starting {name}")
        system.start()
        warm_up(system, workload, rng, args.vocab)
        if slo_by_scale is None:
            progress.update(task, description=f"{workload.name}: idle figures on {name}")
            idle = idle_figures(system.url, workload, rng, args.vocab)
            log(f"{workload.name} idle on {name}: {idle}")
            basis = slo_basis(idle, args)
            if basis != {k: idle[k] for k in basis}:
                idle["slo_basis"] = basis
                log(f"{workload.name} SLOs scale the figures given instead: {basis}")
            slo_by_scale = {k: slos(basis["ttft_ms"], basis["step_ms"], k) for k in args.slo_scales}
        for i, rate in enumerate(sorted(sizes)):
            n = sizes[rate]
            progress.update(task, description=f"{workload.name}: {name} at {rate:g} req/s ({n} requests)")
            before, stages = system.kv_counters(), system.stage_seconds()
            tag = f"{workload.name}-{name}-{rate:g}"
            try:
                res = bench(
                    system.url, args.model, workload, n, rate, slo_by_scale[HEADLINE_SCALE],
                    1000 * args.seed + i, tag, args.run_timeout_s, system.slo_scheduler,
                )  # fmt: skip
                point = score(res, workload, slo_by_scale, n)
                raw[rate] = res
            except (subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
                point = failed_run(n, f"{type(exc).__name__}: {exc}"[:300], args.slo_scales)
            point["kv_check"] = kv_check(system, workload, before, system.kv_counters())
            point["engines"] = stage_means(stages, system.stage_seconds())
            points.append((rate, point))
            progress.advance(task)
            log(
                f"{tag}: attainment {point['attainment']}, failed {point['failed']}, "
                f"ttft p99 {point.get('ttft_p99_ms')} ms, itl p99 {point.get('itl_p99_ms')} ms "
                f"{point['kv_check'] or ''}"
            )
            if point["attainment"][str(max(args.slo_scales))] < 0.9 and not args.full_sweep:
                progress.advance(task, len(sizes) - i - 1)
                break
    finally:
        system.close()
    return idle, slo_by_scale, points, raw


def run_workload(
    workload: Workload, args: argparse.Namespace, progress: Progress
) -> tuple[dict[float, Slo], dict[str, Any], dict[str, list[tuple[float, dict[str, Any]]]]]:
    """Every system on one workload; its SLOs per scale, idle figures and sweep points per system."""
    rates = tuple(sorted(args.rates)) if args.rates else workload.rates
    sizes = {rate: max(args.min_prompts, round(rate * args.duration)) for rate in rates}
    task = progress.add_task(workload.name, total=len(args.systems) * len(rates))
    slo_by_scale: dict[float, Slo] | None = None
    idle: dict[str, Any] = {}
    sweeps: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    raws: dict[str, dict[float, dict[str, Any]]] = {}
    for name in args.systems:
        measured, slo_by_scale, sweeps[name], raws[name] = run_system(
            name, workload, args, slo_by_scale, sizes, progress, task
        )
        if measured is not None:
            idle = measured | {"measured_on": name}
    assert slo_by_scale is not None
    if args.plot_dir:
        goodput_plots.attainment(
            workload.name, sweeps, args.slo_scales, args.plot_dir / f"goodput_{workload.name}_attainment.png"
        )
        common = min(max(raw, default=0.0) for raw in raws.values())
        at = {name: raw[common] for name, raw in raws.items() if common in raw}
        if at:
            goodput_plots.itl_around_long(
                workload, common, at, args.plot_dir / f"goodput_{workload.name}_itl.png"
            )
    return slo_by_scale, idle, sweeps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path(".cache/models/tiny-llama"))
    parser.add_argument(
        "--dtype", default="float32", help="the engines' (bfloat16 is slow without AVX512-BF16)"
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument(
        "--rates", nargs="+", type=float, help="req/s for every workload (default: per workload)"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="s of Poisson arrivals per rate")
    parser.add_argument("--min-prompts", type=int, default=5, help="requests per rate at least")
    parser.add_argument("--slo-scales", nargs="+", type=float, default=[1.5, HEADLINE_SCALE, 3.0])
    parser.add_argument(
        "--idle-ttft-ms",
        nargs="+",
        type=class_ms,
        default=[],
        metavar="CLASS=MS",
        help="idle TTFT per request class (short, long) the SLOs scale, instead of the measured one",
    )
    parser.add_argument(
        "--idle-step-ms", type=float, help="idle decode step the TPOT SLO scales, instead of the measured one"
    )
    parser.add_argument("--full-sweep", action="store_true", help="run every rate even after attainment fell")
    parser.add_argument("--run-timeout-s", type=float, default=600.0, help="per vllm bench serve run")
    parser.add_argument("--plot-dir", type=Path, default=Path("docs"), help="'' for no plots")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--confine",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="every process of an engine on its core (API server, EngineCore too), not only vLLM's OpenMP "
        "threads; the runs in docs/performance.md are without it",
    )
    args = parser.parse_args()
    if HEADLINE_SCALE not in args.slo_scales:
        args.slo_scales.append(HEADLINE_SCALE)
    args.slo_scales.sort()
    classes = {c.name for w in WORKLOADS.values() for c in w.classes}
    if unknown := {c for c, _ in args.idle_ttft_ms} - classes:
        parser.error(f"--idle-ttft-ms: unknown request classes {sorted(unknown)}; known: {sorted(classes)}")
    if args.idle_step_ms is not None and args.idle_step_ms <= 0:
        parser.error("--idle-step-ms: must be > 0")
    args.model = args.model.resolve()
    args.vocab, args.max_len = model_limits(args.model)
    if str(args.plot_dir) in ("", "."):
        args.plot_dir = None
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    slo_by_workload: dict[str, dict[float, Slo]] = {}
    idle: dict[str, Any] = {}
    runs: dict[str, dict[str, list[tuple[float, dict[str, Any]]]]] = {}
    columns = (*Progress.get_default_columns(), MofNCompleteColumn(), TimeElapsedColumn())
    # A progress bar on a terminal only: rich holds a live display's output back when stderr is a file.
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        for name in args.workloads:
            slo_by_workload[name], idle[name], runs[name] = run_workload(WORKLOADS[name], args, progress)
    out = summarize(runs, slo_by_workload, args.slo_scales, HEADLINE_SCALE)
    out["conditions"] = {
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": args.model.name,
        "dtype": args.dtype,
        "systems": args.systems,
        "duration_s": args.duration,
        "min_prompts": args.min_prompts,
        "rates": {w: sorted(args.rates) if args.rates else list(WORKLOADS[w].rates) for w in args.workloads},
        "workloads": {w: [vars(c) for c in WORKLOADS[w].classes] for w in args.workloads},
        "idle": idle,
        "cores": "one engine per core (0, 1)"
        + (", every process of it there" if args.confine else ", its OpenMP threads pinned")
        + "; router and load generator unpinned",
        "load_average": os.getloadavg(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
