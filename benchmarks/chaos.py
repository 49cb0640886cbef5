"""Chaos under load: ``python -m benchmarks.chaos`` runs a real P/D cluster behind pd-router, injects faults on
a seeded timeline while a bounded load runs, and accounts for every request, every block and every process.

What runs (all on this machine, loopback only, every process started and stopped here):
- ``--prefills`` P and ``--decodes`` D vLLM servers with PDConnector (tcp data plane, ``integrity_check`` on,
  short heartbeats, leases and load timeouts so faults resolve within the run), prefix caching on (vLLM's
  default), and pd-router in front (``pd-push``). Each P's side channel is reached through a
  ``test_support.fault_proxy.FaultProxy`` (the router hands D the proxy's address), whose new connections get
  a seeded delay or stall. (P's tcp data port is not proxied here: no setting moves a vLLM engine's data
  port; the data-plane faults and the fence are covered by tests/pd_connector/test_fence.py and
  test_side_channel_faults.py.)
- Known answers first: every distinct prompt's greedy answer is recorded on the first P alone (colocated, no
  transfer) before any fault, so each answer of the run is checked text for text.
- Load: ``--requests`` completions at up to ``--concurrency`` at once, prompts of mixed lengths (short ones
  stay on D, long ones go P->D), streamed and not; a seeded share of streams is dropped by the client after
  its first chunk (``client_disconnect``).
- Faults, each at a seeded point of the load's progress: ``kill_prefill``/``kill_decode`` (SIGKILL of the
  process group, restart on the same ports), ``stop_short``/``stop_long`` (SIGSTOP of an engine for less than
  its heartbeat timeout / more than its lease, then SIGCONT), ``garbage`` (random bytes into a P's side
  channel), ``proxy_reset`` (every connection through a P's proxy reset: D redials), ``router_restart``.
- Per request: ``ok`` (the known answer), ``failed_clean`` (an HTTP error, a dropped connection or a stream
  that ended with an error, its text so far a prefix of the known answer; a refused connection, while the
  router restarts, is retried as a client would, within the deadline), ``wrong_tokens`` (a 200, or text
  so far, that differs), ``hung`` (no end within ``--deadline-s``), ``disconnected`` (dropped on purpose).
- After a quiet period: on every engine, ``vllm:kv_cache_usage_perc`` back to its idle baseline and no
  request running or waiting (a load stuck waiting for KV would show there), the router's waiting gauge at 0,
  and RSS of every process group (growth since the first sample, per server).

Last stdout line, one JSON object: ``{"requests", "ok", "failed_clean", "wrong_tokens", "hung",
"disconnected", "faults": {kind: n}, "blocks_leaked": {server: usage % above baseline},
"open_requests": {server: n}, "rss_growth_mb": {server: MB}, "recovery_s": {kind: [p50, p99]}}``, where a
kind's recovery is the time from the fault until the next request that started after it was answered right.
A PNG of request outcomes over time, with the faults marked, goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from integration_tests.pd_checks import metric
from pd_disagg.engines import base_url, router_server, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port, process_group_members
from test_support.fault_proxy import Fault, FaultProxy, Schedule

SERVED = "model"
FAULT_KINDS = (
    "kill_prefill",
    "kill_decode",
    "stop_short",
    "stop_long",
    "client_disconnect",
    "garbage",
    "proxy_reset",
    "router_restart",
)
OUTCOMES = ("ok", "failed_clean", "wrong_tokens", "hung", "disconnected")
#: The connector's timers, short so that every fault resolves within the run (seconds).
TIMERS = {
    "heartbeat_interval_s": 0.5,
    "heartbeat_timeout_s": 3.0,
    "lease_s": 8.0,
    "load_timeout_s": 8.0,
    "abort_grace_s": 1.0,
}


@dataclass
class Plan:
    """What one run does (``python -m benchmarks.chaos --help`` for the long-run defaults)."""

    model: Path
    prefills: int = 2
    decodes: int = 2
    requests: int = 10_000
    concurrency: int = 256
    prompts: int = 64
    max_tokens: int = 12
    seed: int = 0
    #: Faults of each kind, spread over the load's progress (client_disconnect: streams dropped).
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 5))
    deadline_s: float = 180.0
    quiet_s: float = 60.0
    dtype: str = "float32"
    out: Path = Path("chaos.png")


@dataclass
class Record:
    """One request: when it started and ended (seconds into the load) and how it ended."""

    start: float
    end: float
    outcome: str
    detail: str = ""


@dataclass
class Cluster:
    prefills: list[ManagedServer]
    decodes: list[ManagedServer]
    proxies: list[FaultProxy]
    side_ports: list[int]
    router: ManagedServer
    url: str = ""

    @property
    def engines(self) -> list[ManagedServer]:
        return [*self.prefills, *self.decodes]

    def servers(self) -> list[ManagedServer]:
        return [*self.engines, self.router]


def build(plan: Plan, log_dir: Path) -> Cluster:
    """The servers and proxies of the run (nothing started)."""
    rng = random.Random(f"{plan.seed}:proxy")
    menu = [
        Fault("delay", after_bytes=4096, seconds=0.05),
        Fault("stall", after_bytes=4096, seconds=TIMERS["heartbeat_timeout_s"] / 3),
        Fault("stall", after_bytes=4096, seconds=TIMERS["heartbeat_timeout_s"] * 2),
    ]
    connector = {"integrity_check": True, **TIMERS}

    def engine(name: str, core: int, kv: dict[str, Any]) -> ManagedServer:
        return vllm_server(
            plan.model,
            log_dir=log_dir,
            name=name,
            cpu_core=core,
            dtype=plan.dtype,
            max_model_len=1024,
            kv_transfer_config={"kv_connector": "PDConnector", **kv},
            extra_args=["--served-model-name", SERVED],
        )

    side_ports = [free_port() for _ in range(plan.prefills)]
    prefills = [
        engine(
            f"chaos-p{i}",
            i % 2,
            {"kv_role": "kv_producer", "kv_connector_extra_config": {**connector, "side_channel_port": port}},
        )
        for i, port in enumerate(side_ports)
    ]
    decodes = [
        engine(
            f"chaos-d{i}",
            (i + 1) % 2,
            {
                "kv_role": "kv_consumer",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": connector,
            },
        )
        for i in range(plan.decodes)
    ]
    proxies = [
        FaultProxy(("127.0.0.1", port), Schedule.seeded(rng.randrange(1 << 30), menu, 0.5), seed=plan.seed)
        for port in side_ports
    ]
    router = router_server(
        log_dir / "chaos-router.toml", log_dir=log_dir, port=free_port(), name="chaos-router"
    )
    return Cluster(prefills, decodes, proxies, side_ports, router)


def start(cluster: Cluster, plan: Plan, log_dir: Path) -> None:
    for server in cluster.engines:
        server.start()
    for server in cluster.engines:
        server.wait_healthy(900)
    for proxy in cluster.proxies:
        proxy.start()
    write_router_config(
        log_dir / "chaos-router.toml",
        flow="pd-push",
        sections={
            "model": {"path": str(plan.model), "served_names": [SERVED], "max_model_len": 1024},
            "timeouts": {"first_byte_s": 60.0, "idle_s": 60.0, "request_s": 150.0},
        },
        prefill=[
            {"url": base_url(p), "bootstrap": proxy.address}
            for p, proxy in zip(cluster.prefills, cluster.proxies, strict=True)
        ],
        decode=[{"url": base_url(d)} for d in cluster.decodes],
    )
    cluster.router.start()
    cluster.router.wait_healthy(120)
    cluster.url = base_url(cluster.router)


def stop(cluster: Cluster) -> None:
    """Stop everything that was started (router first), also after a failure; SIGCONT first: a stopped group
    would not die of SIGTERM."""
    for server in reversed(cluster.servers()):
        server.kill(signal.SIGCONT)
        server.stop()
    for proxy in cluster.proxies:
        proxy.stop()


def prompts(plan: Plan) -> list[list[int]]:
    """Distinct token-id prompts of mixed lengths: a third short (D alone), the rest long enough for P->D."""
    rng = random.Random(f"{plan.seed}:prompts")
    vocab = json.loads((plan.model / "config.json").read_text())["vocab_size"]
    out = []
    for i in range(plan.prompts):
        length = rng.randint(16, 120) if i % 3 == 0 else rng.randint(300, 800)
        out.append([rng.randrange(10, vocab - 10) for _ in range(length)])  # ids of the model's vocabulary
    return out


def body(prompt: list[int], plan: Plan, stream: bool) -> dict[str, Any]:
    return {
        "model": SERVED,
        "prompt": prompt,
        "max_tokens": plan.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,  # compared as token ids: text splits multi-byte characters differently
    }


async def known_answers(url: str, items: list[list[int]], plan: Plan) -> list[list[int]]:
    """Each prompt's greedy answer from one engine alone (colocated: no transfer), before any fault.

    Asked of a P, not a D: a D that computed a prompt holds it in its prefix cache and would load nothing for
    it later, while a P's cached prompt is still pushed whole (P pushes from token 0)."""
    limit = asyncio.Semaphore(8)
    async with aiohttp.ClientSession() as session:

        async def answer(prompt: list[int]) -> list[int]:
            async with limit, session.post(f"{url}/v1/completions", json=body(prompt, plan, False)) as resp:
                resp.raise_for_status()
                return [int(t) for t in (await resp.json())["choices"][0]["token_ids"]]

        return list(await asyncio.gather(*(answer(p) for p in items)))


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    want: list[int],
    plan: Plan,
    mode: str,
    t0: float,
) -> Record:
    """Send one completion and classify how it ended (``mode``: plain, stream or drop)."""
    start = time.monotonic() - t0
    text: list[int] = []  # the answer's token ids so far
    detail = ""

    def done(outcome: str) -> Record:
        why = f"{mode}: got {text!r}, want {want!r}; {detail}" if outcome == "wrong_tokens" else detail
        return Record(start, time.monotonic() - t0, outcome, why)

    try:
        async with asyncio.timeout(plan.deadline_s):
            resp = await _post(session, f"{url}/v1/completions", body(prompt, plan, mode != "plain"))
            async with resp:
                if resp.status != 200:
                    detail = f"HTTP {resp.status}"
                    return done("failed_clean")
                if mode == "plain":
                    text = list((await resp.json())["choices"][0]["token_ids"])
                    return done("ok" if text == want else "wrong_tokens")
                ended = False
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        ended = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        detail = str(event["error"])[:200]
                        break
                    text += event["choices"][0].get("token_ids") or []
                    if mode == "drop":
                        return done("disconnected")  # leaving the block drops the connection mid-stream
                if want[: len(text)] != text:
                    return done("wrong_tokens")
                return done("ok" if ended and text == want else "failed_clean")
    except TimeoutError:
        detail = f"no end within {plan.deadline_s} s"
        return done("hung")
    except (aiohttp.ClientError, ConnectionError, json.JSONDecodeError, KeyError) as e:
        detail = repr(e)[:200]
        return done("wrong_tokens" if text and want[: len(text)] != text else "failed_clean")


async def _post(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> aiohttp.ClientResponse:
    """POST, retrying while nothing listens (the router restarting), as a client with a retry policy does;
    the caller's deadline bounds it."""
    while True:
        try:
            return await session.post(url, json=payload)
        except aiohttp.ClientConnectorError:
            await asyncio.sleep(0.2)  # back-off before the next connection attempt


def timeline(plan: Plan) -> list[tuple[int, str]]:
    """(requests started before it, kind) for every fault but client disconnects, seeded and in order."""
    rng = random.Random(f"{plan.seed}:timeline")
    events = [
        (rng.randint(plan.requests // 20, plan.requests * 17 // 20), kind)
        for kind, n in plan.faults.items()
        if kind != "client_disconnect"
        for _ in range(n)
    ]
    return sorted(events)


class Injector:
    """Carries out the faults (on worker threads: kills and restarts block) and remembers when each struck."""

    def __init__(self, cluster: Cluster, plan: Plan, t0: float) -> None:
        self.cluster, self.plan, self.t0 = cluster, plan, t0
        self.rng = random.Random(f"{plan.seed}:targets")
        self.struck: list[tuple[float, str]] = []
        self.errors: list[str] = []
        #: Connector counters of the servers killed, read just before (a restart starts them from zero).
        self.killed_counters: Counter[str] = Counter()
        self._lock = (
            asyncio.Lock()
        )  # one fault at a time: a restart must not overlap a stop of the same group

    async def strike(self, kind: str) -> None:
        async with self._lock:
            self.struck.append((time.monotonic() - self.t0, kind))
            try:
                restart = await asyncio.to_thread(self._do, kind)
                if restart is not None:
                    # Started from this (the main) thread: a server started from a worker thread gets its
                    # parent-death signal when that thread exits (PR_SET_PDEATHSIG follows the thread).
                    restart.start()
                    await asyncio.to_thread(restart.wait_healthy, 600)
            except Exception as e:  # a fault that could not be carried out is reported, not hidden
                self.errors.append(f"{kind}: {e!r}")

    def _do(self, kind: str) -> ManagedServer | None:
        """Carry out ``kind``; the server to start again, if it stopped one."""
        c = self.cluster
        if kind in ("kill_prefill", "kill_decode"):
            server = self.rng.choice(c.prefills if kind == "kill_prefill" else c.decodes)
            self.killed_counters.update(connector_counters([server]))
            server.kill(signal.SIGKILL)
            server.stop(grace_s=0.1)
            return server
        if kind in ("stop_short", "stop_long"):
            server = self.rng.choice(c.engines)
            pause = TIMERS["heartbeat_timeout_s"] / 2 if kind == "stop_short" else TIMERS["lease_s"] + 2
            server.kill(signal.SIGSTOP)
            time.sleep(pause)  # the fault itself: how long the engine stays stopped
            server.kill(signal.SIGCONT)
        elif kind == "garbage":
            port = self.rng.choice(c.side_ports)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(self.rng.randbytes(4096))
        elif kind == "proxy_reset":
            self.rng.choice(c.proxies).reset_connections()
        elif kind == "router_restart":
            c.router.stop(grace_s=1)
            return c.router
        else:
            raise ValueError(f"unknown fault {kind!r}")
        return None


async def load(
    cluster: Cluster, plan: Plan, items: list[list[int]], answers: list[list[int]]
) -> tuple[list[Record], Injector]:
    rng = random.Random(f"{plan.seed}:load")
    drops = set(rng.sample(range(plan.requests), min(plan.faults.get("client_disconnect", 0), plan.requests)))
    pending_faults = timeline(plan)
    t0 = time.monotonic()
    injector = Injector(cluster, plan, t0)
    records: list[Record] = []
    limit = asyncio.Semaphore(plan.concurrency)
    fault_tasks: list[asyncio.Task[None]] = []
    progress = _progress(plan.requests)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def run(i: int) -> None:
            k = rng.randrange(len(items))
            mode = "drop" if i in drops else rng.choice(("plain", "stream"))
            try:
                records.append(await one_request(session, cluster.url, items[k], answers[k], plan, mode, t0))
            finally:
                limit.release()
                progress(records)

        tasks = []
        for i in range(plan.requests):
            while pending_faults and pending_faults[0][0] <= i:
                fault_tasks.append(asyncio.create_task(injector.strike(pending_faults.pop(0)[1])))
            await limit.acquire()
            tasks.append(asyncio.create_task(run(i)))
        await asyncio.gather(*tasks)
        await asyncio.gather(*fault_tasks)
    return records, injector


def _progress(total: int) -> Any:
    """A rich progress line on stderr (stdout's last line is the JSON result)."""
    from rich.console import Console
    from rich.progress import Progress

    bar = Progress(console=Console(stderr=True), transient=True)
    task = bar.add_task("chaos", total=total)
    bar.start()

    def update(records: list[Record]) -> None:
        counts = Counter(r.outcome for r in records)
        bar.update(task, completed=len(records), description=" ".join(f"{k}={counts[k]}" for k in OUTCOMES))
        if len(records) >= total:
            bar.stop()

    return update


def rss_mb(server: ManagedServer) -> float:
    """Resident memory of the server's whole process group, in MB."""
    total = 0
    for pid in process_group_members(server.pid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def engine_state(server: ManagedServer) -> tuple[float, float]:
    """(KV cache usage %, requests running or waiting) of a vLLM engine; (inf, inf) while it does not answer
    (restarting, stopped), which never counts as settled."""
    url = base_url(server)
    try:
        usage = metric(url, "vllm:kv_cache_usage_perc")
        open_requests = metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting")
    except OSError as e:
        print(f"chaos: {server.name} ({url}) does not answer /metrics: {e!r}", file=sys.stderr)
        return math.inf, math.inf
    return usage, open_requests


def connector_counters(engines: list[ManagedServer]) -> dict[str, float]:
    """What proves KV moved and was checked, summed over ``engines`` (since each one's last start)."""
    names = ("bytes_sent", "transfers_received", "failures", "integrity_failures")
    totals = dict.fromkeys(names, 0.0)
    for server in engines:
        try:
            for n in names:
                totals[n] += metric(base_url(server), f"vllm:pd_connector_{n}_total")
        except OSError:
            continue  # reported by settle already
    return totals


def settle(cluster: Cluster, baseline: dict[str, float], quiet_s: float) -> dict[str, tuple[float, float]]:
    """After the load: poll every engine until it is back to its baseline with nothing open, at most
    ``quiet_s``; the last reading of each."""
    deadline = time.monotonic() + quiet_s
    while True:
        state = {s.name: engine_state(s) for s in cluster.engines}
        settled = all(u <= baseline[n] + 1e-9 and o == 0 for n, (u, o) in state.items())
        if settled or time.monotonic() > deadline:
            return state
        time.sleep(0.5)  # polling a remote server's /metrics, not a synchronisation


def recovery(records: list[Record], struck: list[tuple[float, str]]) -> dict[str, list[float] | None]:
    """Per fault kind: seconds from each fault to the end of the first request started after it and answered
    right, as [p50, p99]; None for a kind whose faults all struck after the last request started (faults
    wait for each other, so a late one can miss the load)."""
    ok = sorted((r.start, r.end) for r in records if r.outcome == "ok")
    per: dict[str, list[float]] = {}
    for at, kind in struck:
        after = [end for start, end in ok if start >= at]
        per.setdefault(kind, [])
        if after:
            per[kind].append(min(after) - at)
    return {k: [_pct(v, 50), _pct(v, 99)] if v else None for k, v in per.items()}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 3)


def plot(records: list[Record], struck: list[tuple[float, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for i, outcome in enumerate(OUTCOMES):
        ends = [r.end for r in records if r.outcome == outcome]
        ax.scatter(ends, [i] * len(ends), s=4, label=f"{outcome} ({len(ends)})")
    for at, kind in struck:
        ax.axvline(at, color="grey", lw=0.6)
        ax.text(at, len(OUTCOMES) - 0.5, kind, rotation=90, fontsize=6, va="top")
    ax.set_yticks(range(len(OUTCOMES)), OUTCOMES)
    ax.set_xlabel("seconds into the load (request end); grey lines: faults")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(plan: Plan, log_dir: Path) -> dict[str, Any]:
    """The whole run; every server and proxy is stopped before it returns, also on failure."""
    cluster = build(plan, log_dir)
    try:
        start(cluster, plan, log_dir)
        items = prompts(plan)
        answers = asyncio.run(known_answers(base_url(cluster.prefills[0]), items, plan))
        baseline = {s.name: engine_state(s)[0] for s in cluster.engines}
        rss_before = {s.name: rss_mb(s) for s in cluster.servers()}
        records, injector = asyncio.run(load(cluster, plan, items, answers))
        state = settle(cluster, baseline, plan.quiet_s)
        rss_after = {s.name: rss_mb(s) for s in cluster.servers()}
        moved = {k: v + injector.killed_counters[k] for k, v in connector_counters(cluster.engines).items()}
        plot(records, injector.struck, plan.out)
    finally:
        stop(cluster)
    counts = Counter(r.outcome for r in records)
    faults = Counter(kind for _, kind in injector.struck)
    faults["client_disconnect"] = counts["disconnected"]
    return {
        "requests": len(records),
        **{k: counts[k] for k in OUTCOMES},
        "faults": dict(faults),
        "fault_errors": injector.errors,
        "proxy_faults": {f"p{i}": dict(p.injected) for i, p in enumerate(cluster.proxies)},
        # None: the engine did not answer after the quiet period.
        "blocks_leaked": {
            n: round(u - baseline[n], 4) if math.isfinite(u) else None for n, (u, _) in state.items()
        },
        "open_requests": {n: o if math.isfinite(o) else None for n, (_, o) in state.items()},
        "rss_growth_mb": {n: round(rss_after[n] - rss_before[n], 1) for n in rss_before},
        "recovery_s": recovery(records, injector.struck),
        "connector": moved,
        "timers_s": TIMERS,
        "wrong_examples": [r.detail for r in records if r.outcome == "wrong_tokens"][:5],
    }


def main() -> None:
    default = Plan(model=Path())
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=Path(os.environ.get("PD_TEST_MODEL", ".cache/models/tiny-llama"))
    )
    parser.add_argument("--prefills", type=int, default=default.prefills)
    parser.add_argument("--decodes", type=int, default=default.decodes)
    parser.add_argument("--requests", type=int, default=default.requests)
    parser.add_argument("--concurrency", type=int, default=default.concurrency)
    parser.add_argument("--faults-per-kind", type=int, default=5)
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--quiet-s", type=float, default=default.quiet_s)
    parser.add_argument("--out", type=Path, default=default.out)
    args = parser.parse_args()
    plan = Plan(
        model=args.model,
        prefills=args.prefills,
        decodes=args.decodes,
        requests=args.requests,
        concurrency=args.concurrency,
        faults=dict.fromkeys(FAULT_KINDS, args.faults_per_kind),
        seed=args.seed,
        quiet_s=args.quiet_s,
        out=args.out,
    )
    with tempfile.TemporaryDirectory(prefix="pd-chaos-") as tmp:
        result = run(plan, Path(tmp))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
