"""Autoscaling under a traffic shift on a local Ray cluster: static 1P1D vs Serve's own independent autoscaling
vs the planner-driven autoscaler (issue #19; docs/performance.md ``## autoscale``).

Per system (``--systems``; ``benchmarks.autoscale_systems``), one after another: start a local Ray cluster
with ``ray.cluster_utils.Cluster`` (a head with the dashboard and the ``front`` resource, and two nodes with
two and one units of the ``engine`` resource: at most three vLLM engines alive), ``serve deploy`` the
system's config of the application, wait for pd-router and both engines, send one warm-up request per phase
shape, then run the workload (``benchmarks.autoscale_analysis.phases``: long prompts, long outputs, short
only; Poisson arrivals, token-id prompts, streamed, ``ignore_eos``), the same arrivals and prompts for every
system, while sampling the engine replicas from the dashboard every second; then stop the cluster by the
processes it started (every descendant of this process, the engines included, SIGKILLed if still there).
Figures and targets: ``benchmarks.autoscale_analysis``.

The autoscaler's profile is the tiny model's measured one (docs/planner/validation-tiny.json, ``pd-plan
profile`` on this machine kind). ``--short`` runs 60 s phases instead of 120 s (a smoke run: a replica started during a
phase serves little of it). Progress on stderr; the last stdout line is the JSON. Hold the engine lock
(``flock /tmp/pd-engines.lock nice -n 19 python -m benchmarks.autoscale``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.autoscale_analysis import (
    RATES,
    Phase,
    Record,
    Sample,
    Slo,
    arrivals,
    holding,
    phase_figures,
    phases,
    replica_changes,
    report,
    totals,
)
from benchmarks.autoscale_systems import ENGINE_SLOTS, ROOT, SYSTEMS, Knobs, serve_config
from pd_disagg.ray_serve.autoscaler import replicas_from_details
from pd_disagg.servers import descendants, free_port

START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 180.0
PROFILE_SOURCE = ROOT / "docs" / "planner" / "validation-tiny.json"
DEPLOYMENTS = {"prefill": "Prefill", "decode": "Decode"}


def log(msg: str) -> None:
    print(f"[autoscale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_profile(path: Path) -> Path:
    """The tiny model's measured planner profile, as a profile file."""
    measured = json.loads(PROFILE_SOURCE.read_text())["profile"]
    profile = {
        "prefill_max_tokens_per_s": measured["prefill_max_tokens_per_s"],
        "ttft_overhead_s": measured["ttft_overhead_s"],
        "decode": [{"batch": b, "tpot_s": t} for b, t in measured["decode"]],
        "source": str(PROFILE_SOURCE.relative_to(ROOT)),
    }
    path.write_text(json.dumps(profile))
    return path


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json()


async def wait_ready(router: str, dashboard: str, timeout_s: float) -> None:
    """Until pd-router answers /ready with one P and one D registered and Serve lists both RUNNING."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError):
                workers = (await _get_json(session, f"{router}/admin/workers"))["workers"]
                roles = sorted(w["role"] for w in workers)
                details = await _get_json(session, f"{dashboard}/api/serve/applications/")
                counts = replicas_from_details(details, "pd", DEPLOYMENTS)
                if roles == ["decode", "prefill"] and all(c.running == 1 for c in counts.values()):
                    return
            await asyncio.sleep(2)
    raise TimeoutError(f"the application was not ready within {timeout_s:.0f} s")


async def sample_replicas(dashboard: str, t0: float, out: list[Sample], stop: asyncio.Event) -> None:
    """Every second: engine replicas per role in any state but STOPPED."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError):
                details = await _get_json(session, f"{dashboard}/api/serve/applications/")
                deployments = details["applications"]["pd"]["deployments"]
                states = {
                    role: [r["state"] for r in deployments[name]["replicas"]]
                    for role, name in DEPLOYMENTS.items()
                }
                held = holding(states, ENGINE_SLOTS)
                out.append(Sample(time.monotonic() - t0, held["prefill"], held["decode"]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


async def one_request(
    session: aiohttp.ClientSession, router: str, phase: Phase, prompt: list[int], t0: float
) -> Record:
    """Stream one completion; the time of every streamed token from sending."""
    body = {
        "model": "model",
        "prompt": prompt,
        "max_tokens": phase.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    times: list[float] = []
    tokens = 0
    try:
        async with session.post(f"{router}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Record(phase.name, sent - t0, resp.status, error=(await resp.text())[:200])
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return Record(phase.name, sent - t0, 500, tuple(times), str(event["error"])[:200])
                if event.get("choices") and event["choices"][0].get("text"):
                    times.append(time.monotonic() - sent)
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
        return Record(phase.name, sent - t0, 200, tuple(times), tokens=tokens or len(times))
    except (TimeoutError, aiohttp.ClientError) as e:
        return Record(phase.name, sent - t0, 0, tuple(times), repr(e)[:200])


def prompt(tokens: int, rng: random.Random) -> list[int]:
    """Random token ids (fresh each time: no prefix-cache hits); the tiny model's vocabulary is 2048."""
    return [rng.randrange(10, 2048) for _ in range(tokens)]


async def run_workload(
    router: str, dashboard: str, workload: tuple[Phase, ...], seed: int
) -> tuple[list[Record], list[Sample], list[float]]:
    """Warm up, then every phase back to back; returns the records, the samples and each phase's start."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for phase in workload:
            warm = await one_request(
                session, router, phase, prompt(phase.prompt_tokens, rng), time.monotonic()
            )
            log(f"warm-up {phase.name}: status {warm.status}, {len(warm.token_times_s)} tokens {warm.error}")
        samples: list[Sample] = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        sampler = asyncio.create_task(sample_replicas(dashboard, t0, samples, stop))
        tasks, starts, start = [], [], 0.0
        for phase in workload:
            starts.append(start)
            log(f"phase {phase.name}: {phase.rate_rps} req/s for {phase.duration_s:.0f} s")
            for offset in arrivals(phase, seed):
                await asyncio.sleep(max(0.0, t0 + start + offset - time.monotonic()))
                body = prompt(phase.prompt_tokens, rng)
                tasks.append(asyncio.create_task(one_request(session, router, phase, body, t0)))
            start += phase.duration_s
        await asyncio.sleep(max(0.0, t0 + start - time.monotonic()))
        records = list(await asyncio.gather(*tasks))
        stop.set()
        await sampler
    return records, samples, starts


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_cluster(cluster: Any, before: set[int]) -> None:
    """Remove every node, then SIGKILL whatever this run started that is still there (engines included)."""
    started = descendants(os.getpid()) - before
    with contextlib.suppress(Exception):
        cluster.shutdown()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_running(p) for p in started):
        time.sleep(0.5)
    for pid in started:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def run_system(system: str, knobs: Knobs, workload: tuple[Phase, ...], slo: Slo, seed: int) -> dict[str, Any]:
    from ray.cluster_utils import Cluster

    before = descendants(os.getpid())
    config_path = knobs.log_dir / f"serve-{system}.yaml"
    config_path.write_text(yaml.safe_dump(serve_config(system, knobs)))
    dashboard = f"http://127.0.0.1:{knobs.dashboard_port}"
    router = f"http://127.0.0.1:{knobs.router_port}"
    started = time.monotonic()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "resources": {"front": 1},
            "include_dashboard": True,
            "dashboard_port": knobs.dashboard_port,
            "object_store_memory": 100 * 1024 * 1024,
        },
    )
    try:
        for slots in (ENGINE_SLOTS - 1, 1):
            cluster.add_node(num_cpus=0, resources={"engine": slots}, object_store_memory=100 * 1024 * 1024)
        serve_bin = Path(sys.executable).parent / "serve"
        subprocess.run(
            [str(serve_bin), "deploy", str(config_path), "--address", dashboard],
            check=True,
            timeout=120,
            cwd=ROOT,
            stdout=sys.stderr,
        )
        asyncio.run(wait_ready(router, dashboard, START_TIMEOUT_S))
        ready_s = time.monotonic() - started
        log(f"{system}: ready after {ready_s:.0f} s")
        records, samples, starts = asyncio.run(run_workload(router, dashboard, workload, seed))
    finally:
        stop_cluster(cluster, before)
    per_phase = {
        phase.name: phase_figures(records, samples, phase, start, slo)
        for phase, start in zip(workload, starts, strict=True)
    }
    return {
        "ready_s": ready_s,
        "phases": per_phase,
        "total": totals(per_phase),
        "replica_changes": replica_changes(samples),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--short", action="store_true", help="60 s phases (a smoke run)")
    parser.add_argument(
        "--rates",
        default=",".join(map(str, RATES)),
        help="each phase's arrival rate, req/s (default %(default)s)",
    )
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "models" / "tiny-llama")
    parser.add_argument("--ttft-slo-s", type=float, default=2.0)
    parser.add_argument("--tpot-slo-s", type=float, default=0.1)
    parser.add_argument(
        "--hold-s", type=float, default=None, help="scale-down hold (default 30 s short, 60 s)"
    )
    parser.add_argument("--replica-start-s", type=float, default=60.0, help="the autoscaler's first guess")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-autoscale-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        workload = phases(args.short, [float(r) for r in args.rates.split(",")])
    except ValueError as e:
        parser.error(f"--rates: {e}")
    slo = Slo(args.ttft_slo_s, args.tpot_slo_s)
    results: dict[str, Any] = {}
    for system in systems:
        knobs = Knobs(
            model=args.model.resolve(),
            profile=write_profile(log_dir / "profile.json"),
            log_dir=log_dir,
            router_port=free_port(),
            dashboard_port=free_port(),
            ttft_slo_s=slo.ttft_s,
            tpot_slo_s=slo.tpot_s,
            hold_s=args.hold_s if args.hold_s is not None else (30.0 if args.short else 60.0),
            replica_start_s=args.replica_start_s,
        )
        log(f"{system}: starting (logs in {log_dir})")
        results[system] = run_system(system, knobs, workload, slo, args.seed)
        log(f"{system}: {json.dumps(results[system]['total'])}")
    print(json.dumps(report(args.short, slo, workload, results)))


if __name__ == "__main__":
    main()
