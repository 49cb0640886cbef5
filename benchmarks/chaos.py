"""Chaos under load: ``python -m benchmarks.chaos`` runs a real P/D cluster behind pd-router, injects faults
on a seeded timeline while a bounded load runs, and accounts for every request, every block and every process.

Phases (``--phases``, default ``vllm``; ``vllm,sglang`` runs both, one after the other, never both clusters at
once: six engines do not fit in 24 GiB beside the load), all on this machine, loopback only, every process
started and stopped here (``benchmarks.chaos_cluster`` says how each is configured):
- ``vllm``: ``--prefills`` P and ``--decodes`` D vLLM servers with PDConnector, each P's side channel (control
  connections) and each D's tcp data listener (data connections) behind a seeded
  ``test_support.fault_proxy.FaultProxy`` (new connections get delays, stalls and resets), pd-router
  (``pd-push``). Known answers from the first P alone (colocated, no transfer: a D that computed a prompt
  holds it in its prefix cache and would load nothing for it later, while P pushes a cached prompt whole).
- ``sglang``: one SGLang P/D pair with our ``pd`` transfer backend behind pd-router (``sglang-bootstrap``).
  Known answers from a colocated SGLang server with the same settings, stopped before the pair starts.
- Load (``benchmarks.chaos_load``): ``--requests`` requests at up to ``--concurrency`` at once, completions
  (token ids) and chats (user messages) of mixed lengths, streamed and not, each checked against its known
  greedy answer, token id for token id (text for text where the engine returns no ids: SGLang's chat); a
  seeded share of streams is dropped by the client after its first chunk (``client_disconnect``).
- Faults, each at a seeded point of the load's progress: ``kill_prefill``/``kill_decode`` (SIGKILL of the
  process group, restart on the same ports), ``stop_short``/``stop_long`` (SIGSTOP of an engine for less than
  its heartbeat timeout / more than its lease, then SIGCONT), ``garbage`` (random bytes into a P's side
  channel), ``proxy_delay``/``proxy_stall``/``proxy_reset`` (vLLM only: every control and data connection
  open at that moment, through every proxy, slowed by ``PROXY_DELAY`` per chunk for a while / held for
  ``PROXY_STALL_S``, longer than the heartbeat timeout / reset, and the peers redial), ``router_restart``.
- Per request: ``ok`` (the known answer), ``failed_clean`` (an HTTP error, a dropped connection or a stream
  that ended with an error, its answer so far a prefix of the known one; a refused connection, while the
  router restarts, is retried as a client would, within the deadline), ``wrong_tokens`` (a 200, or an answer
  so far, that differs), ``hung`` (no end within ``deadline_s``), ``disconnected`` (dropped on purpose).
- After a quiet period: every engine's KV usage back to its idle baseline with no request open (a load stuck
  waiting for KV would show there), pd-router holding nothing (no request waiting, no leg in flight, no
  prefill tokens leased), and RSS of every process group (growth since the first sample).

Last stdout line, one JSON object: with one phase, ``{"engine", "requests", "ok", "failed_clean",
"wrong_tokens", "hung", "disconnected", "failed_by_cause": {cause: {n, survivor_up, faults, examples}},
"resumes": {what pd-router's log counts}, "faults": {kind: n}, "blocks_leaked": {server: KV above baseline
(vLLM: usage %, SGLang: tokens)}, "open_requests": {server: n}, "router_open": {gauge: n},
"rss_growth_mb": {server: MB}, "recovery_s": {kind: [p50, p99]}, "recovery_bounds": {kind: what to
compare it with}, "timeouts_s": {...}}``,
where a kind's recovery is the time from the fault until the next request that started after it was answered
right; with several, ``{"phases": {engine: that object}}`` plus the outcome counts summed. A PNG of request
outcomes over time, with the faults marked, goes to ``--out`` (one per phase).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import chaos_cluster
from benchmarks.chaos_causes import Window, attribute, router_resumes
from benchmarks.chaos_cluster import (
    ROUTER_TIMEOUTS,
    SGLANG_TIMEOUTS,
    TIMERS,
    Cluster,
    Engine,
    connector_counters,
    engine_state,
    rss_mb,
    settle,
)
from benchmarks.chaos_load import (
    OUTCOMES,
    Answer,
    Prompt,
    known_answers,
    load,
    pct,
    plot,
    prompts,
    recovery,
)
from pd_disagg.engines import base_url
from pd_disagg.servers import ManagedServer, running

FAULT_KINDS = (
    "kill_prefill",
    "kill_decode",
    "stop_short",
    "stop_long",
    "client_disconnect",
    "garbage",
    "proxy_delay",
    "proxy_stall",
    "proxy_reset",
    "router_restart",
)
#: The kinds each phase injects: SGLang's D dials P's side channel at the address P's bootstrap server gives,
#: and P its data port at the address D gives, which no proxy can stand in for.
PHASE_FAULTS: dict[str, tuple[str, ...]] = {
    "vllm": FAULT_KINDS,
    "sglang": tuple(k for k in FAULT_KINDS if not k.startswith("proxy_")),
}
#: The kinds that take an engine down (while it is killed and restarting, or stopped).
DOWN = ("kill_prefill", "kill_decode", "stop_short", "stop_long")
#: How long an engine stays stopped (seconds): shorter than the heartbeat timeout, and longer than the lease.
STOPS = {"stop_short": TIMERS["heartbeat_timeout_s"] / 2, "stop_long": TIMERS["lease_s"] + 2}
#: proxy_delay: for this long (seconds), every chunk relayed waits this long first.
PROXY_DELAY = {"seconds": 10.0, "per_chunk_s": 0.05}
#: proxy_stall: how long nothing is relayed (seconds): past the heartbeat timeout, so the links are lost.
PROXY_STALL_S = TIMERS["heartbeat_timeout_s"] * 2
#: The configured timeouts that bound each kind's recovery (the names of ``timeouts(engine)``' entries).
BOUNDS = {
    "kill_prefill": ("heartbeat_timeout_s", "waiting_timeout_s"),
    "kill_decode": ("heartbeat_timeout_s", "lease_s", "first_byte_s"),
    "stop_short": ("heartbeat_timeout_s",),
    "stop_long": ("heartbeat_timeout_s", "lease_s", "load_timeout_s", "waiting_timeout_s"),
    "garbage": ("connect_timeout_s",),
    "proxy_delay": ("heartbeat_timeout_s", "load_timeout_s"),
    "proxy_stall": ("heartbeat_timeout_s", "connect_timeout_s", "load_timeout_s"),
    "proxy_reset": ("heartbeat_timeout_s", "connect_timeout_s"),
    "router_restart": ("first_byte_s",),
    "client_disconnect": ("abort_grace_s",),
}


@dataclass
class Plan:
    """What one phase does (``python -m benchmarks.chaos --help`` for the long-run defaults)."""

    model: Path
    engine: Engine = "vllm"
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
    #: How long a client waits after a failed request before its next one (seconds).
    backoff_s: float = 2.0
    quiet_s: float = 60.0
    dtype: str = "float32"
    out: Path = Path("chaos.png")
    #: vLLM: put each D's tcp data listener behind a fault proxy too (else P pushes to D directly).
    proxy_data: bool = True


def timeouts(engine: Engine) -> dict[str, float]:
    """Every timeout configured in a phase, by name (seconds): the connector's, pd-router's and SGLang's
    own."""
    out = {
        "connect_timeout_s": 5.0,
        **TIMERS,
        **ROUTER_TIMEOUTS,
    }  # connect_timeout_s: the connector's default
    if engine == "sglang":
        out.pop("load_timeout_s")  # vLLM's D only
        out |= SGLANG_TIMEOUTS
    return out


class Injector:
    """Carries out the faults and remembers when each struck.

    Faults overlap: each picks its target among the servers that are up (waiting, if none is, until one is
    back) and holds it only while it is stopped or restarting, so a P's restart does not hold back a stop
    of D or a router restart queued after it. A kill or a stop never takes down the last server of its role
    that is up when the role has several (it waits for another to be back): the issue allows failures only
    where no survivor could continue, and with every P or every D down at once each request fails at once,
    the load runs through its requests in seconds and the rest of the timeline strikes after it (a
    1000-request run did so: 847 failed within 33 s). Called on the load's event loop; what blocks (kills,
    restarts, sockets) runs on worker threads."""

    def __init__(self, cluster: Cluster, seed: int, t0: float) -> None:
        self.cluster, self.t0 = cluster, t0
        self.rng = random.Random(f"{seed}:targets")
        self.struck: list[tuple[float, str]] = []
        #: Each fault from when it struck until its target was back (``chaos_causes`` attributes failures).
        self.windows: list[Window] = []
        self.errors: list[str] = []
        #: Seconds each restarted server took to be healthy again, by the fault's kind.
        self.restarts: dict[str, list[float]] = {}
        #: Connector counters of the servers killed, read just before (a restart starts them from zero).
        self.killed_counters: Counter[str] = Counter()
        #: Connections open through the proxies when each proxy fault struck, summed by kind.
        self.proxy_hits: Counter[str] = Counter()
        self.busy: set[str] = set()  # servers a fault holds now (stopped, restarting)
        self._turn = asyncio.Condition()

    def _targets(self, kind: str) -> list[ManagedServer]:
        c = self.cluster
        pool = {
            "kill_prefill": c.prefills,
            "kill_decode": c.decodes,
            "garbage": c.prefills,  # into its side channel
            "router_restart": [c.router],
        }.get(kind, c.engines)
        return [s for s in pool if s.name not in self.busy and (kind not in DOWN or self._spared(s))]

    def _role(self, server: ManagedServer) -> str:
        c = self.cluster
        return "prefill" if server in c.prefills else "decode" if server in c.decodes else "router"

    def _spared(self, server: ManagedServer) -> bool:
        """Whether taking ``server`` down leaves its role a server that is up (a role of one: always)."""
        role = next(r for r in (self.cluster.prefills, self.cluster.decodes) if server in r)
        return len(role) == 1 or any(s.name not in self.busy for s in role if s is not server)

    async def strike(self, kind: str) -> None:
        if kind.startswith("proxy_"):  # the links, not a server: nothing to wait for or hold
            at = time.monotonic() - self.t0
            self.struck.append((at, kind))
            lasts = {"proxy_delay": PROXY_DELAY["seconds"], "proxy_stall": PROXY_STALL_S}.get(kind, 0.0)
            self.windows.append(Window(at, at + lasts, kind, "", "links"))
            try:
                self.proxy_hits[kind] += await asyncio.to_thread(self._proxies, kind)
            except Exception as e:  # a fault that could not be carried out is reported, not hidden
                self.errors.append(f"{kind}: {e!r}")
            return
        async with self._turn:
            await self._turn.wait_for(lambda: bool(self._targets(kind)))
            target = self.rng.choice(self._targets(kind))
            garbage = self.rng.randbytes(4096)
            self.busy.add(target.name)
        at = time.monotonic() - self.t0
        self.struck.append((at, kind))
        try:
            await self._hit(kind, target, garbage)
        except Exception as e:  # a fault that could not be carried out is reported, not hidden
            self.errors.append(f"{kind}: {e!r}")
        finally:
            self.windows.append(Window(at, time.monotonic() - self.t0, kind, target.name, self._role(target)))
            async with self._turn:
                self.busy.discard(target.name)
                self._turn.notify_all()

    async def _hit(self, kind: str, target: ManagedServer, garbage: bytes) -> None:
        c = self.cluster
        if kind in STOPS:
            target.kill(signal.SIGSTOP)
            try:
                await asyncio.sleep(STOPS[kind])  # the fault itself: how long the engine stays stopped
            finally:
                target.kill(signal.SIGCONT)
        elif kind == "garbage":
            port = await asyncio.to_thread(c.transfer_port, c.prefills.index(target))
            await asyncio.to_thread(chaos_cluster.send, port, garbage)
        elif kind in ("kill_prefill", "kill_decode", "router_restart"):
            if kind != "router_restart":
                self.killed_counters.update(await asyncio.to_thread(connector_counters, c, [target]))
                target.kill(signal.SIGKILL)
            await asyncio.to_thread(target.stop, 1.0 if kind == "router_restart" else 0.1)
            began = time.monotonic()
            # Started from this (the main) thread: a server started from a worker thread gets its
            # parent-death signal when that thread exits (PR_SET_PDEATHSIG follows the thread).
            target.start()
            await asyncio.to_thread(target.wait_healthy, 600)
            self.restarts.setdefault(kind, []).append(time.monotonic() - began)
        else:
            raise ValueError(f"fault {kind!r} does not apply to the {c.engine} phase")

    def _proxies(self, kind: str) -> int:
        """A proxy fault on every control and data connection open now; how many it struck."""
        proxies = list(self.cluster.all_proxies().values())
        if not proxies:
            raise ValueError(f"fault {kind!r} does not apply to the {self.cluster.engine} phase")
        if kind == "proxy_delay":
            return sum(
                p.delay_connections(PROXY_DELAY["seconds"], PROXY_DELAY["per_chunk_s"]) for p in proxies
            )
        if kind == "proxy_stall":
            return sum(p.stall_connections(PROXY_STALL_S) for p in proxies)
        return sum(p.reset_connections() for p in proxies)


def _colocated_sglang_answers(plan: Plan, items: list[Prompt], log_dir: Path) -> list[Answer]:
    """The SGLang phase's known answers: from an SGLang server with the phase's settings, colocated, started
    and stopped here before the pair starts. SGLang streams a chat's text only (no token ids): chats are
    compared text for text."""
    server = chaos_cluster.sglang(plan.model, plan.dtype, log_dir, "chaos-sglang-colocated", 0)
    with running(server, timeout_s=900):
        return asyncio.run(known_answers(base_url(server), items, plan.max_tokens, lambda p: not p.chat))


def run(plan: Plan, log_dir: Path) -> dict[str, Any]:
    """One phase; every server and proxy is stopped before it returns, also on failure."""
    if unknown := {k for k, n in plan.faults.items() if n} - set(PHASE_FAULTS[plan.engine]):
        raise ValueError(f"faults {sorted(unknown)} do not apply to the {plan.engine} phase")
    items = prompts(plan.model, plan.prompts, plan.seed)
    answers = _colocated_sglang_answers(plan, items, log_dir) if plan.engine == "sglang" else None
    cluster = chaos_cluster.build(
        plan.engine, plan.model, plan.prefills, plan.decodes, plan.dtype, plan.seed, log_dir, plan.proxy_data
    )
    try:
        chaos_cluster.start(cluster, plan.model, log_dir)
        if answers is None:  # vLLM: from the first P alone
            url = base_url(cluster.prefills[0])
            answers = asyncio.run(known_answers(url, items, plan.max_tokens, lambda p: True))
        baseline = {s.name: engine_state(s, plan.engine)[0] for s in cluster.engines}
        rss_before = {s.name: rss_mb(s) for s in cluster.servers()}
        t0 = time.monotonic()
        injector = Injector(cluster, plan.seed, t0)
        records = asyncio.run(
            load(
                cluster.url,
                items,
                answers,
                requests=plan.requests,
                concurrency=plan.concurrency,
                faults=plan.faults,
                max_tokens=plan.max_tokens,
                deadline_s=plan.deadline_s,
                backoff_s=plan.backoff_s,
                seed=plan.seed,
                strike=injector.strike,
                t0=t0,
            )
        )
        state, router_open = settle(cluster, baseline, plan.quiet_s)
        rss_after = {s.name: rss_mb(s) for s in cluster.servers()}
        moved = {k: v + injector.killed_counters[k] for k, v in connector_counters(cluster).items()}
        plot(records, injector.struck, plan.out)
    finally:
        chaos_cluster.stop(cluster)
    counts = Counter(r.outcome for r in records)
    faults = Counter(kind for _, kind in injector.struck)
    faults["client_disconnect"] = counts["disconnected"]
    limits = timeouts(plan.engine)
    return {
        "engine": plan.engine,
        "requests": len(records),
        **{k: counts[k] for k in OUTCOMES},
        "outcomes_by_kind": {
            kind: dict(Counter(r.outcome for r in records if r.kind == kind))
            for kind in sorted({r.kind for r in records})
        },
        # Every failed_clean request by cause, and the streams pd-router resumed (``chaos_causes``).
        "failed_by_cause": attribute(
            records,
            injector.windows,
            {"prefill": len(cluster.prefills), "decode": len(cluster.decodes), "router": 1},
        ),
        "resumes": router_resumes(cluster.router.log_path),
        "faults": dict(faults),
        # Each fault: seconds into the load when it struck and when its target was back, kind, target.
        "fault_timeline": [
            [round(w.start, 2), round(w.end, 2), w.kind, w.target or w.role]
            for w in sorted(injector.windows, key=lambda w: w.start)
        ],
        "fault_errors": injector.errors,
        # What struck through each proxy (the seeded per-connection faults and the timeline's), and how many
        # open connections the timeline's proxy faults found, by kind.
        "proxy_faults": {name: dict(p.injected) for name, p in cluster.all_proxies().items()},
        "proxy_connections_hit": dict(injector.proxy_hits),
        "proxy_relayed_mb": {n: round(p.relayed.total() / 1e6, 1) for n, p in cluster.all_proxies().items()},
        # None: the engine did not answer after the quiet period.
        "blocks_leaked": {
            n: round(u - baseline[n], 4) if math.isfinite(u) else None for n, (u, _) in state.items()
        },
        "open_requests": {n: o if math.isfinite(o) else None for n, (_, o) in state.items()},
        # Engines that did not answer after the quiet period: every server a fault kills is restarted and
        # waited for, so each one here died of something else (its log says what, see CRASH_TRACES).
        "engines_down": sorted(n for n, (u, _) in state.items() if not math.isfinite(u)),
        "router_open": {k: v if math.isfinite(v) else None for k, v in router_open.items()},
        "rss_growth_mb": {n: round(rss_after[n] - rss_before[n], 1) for n in rss_before},
        "recovery_s": recovery(records, injector.struck),
        "recovery_bounds": {
            kind: {
                "timeouts_s": {name: limits[name] for name in BOUNDS[kind] if name in limits},
                **({"stopped_s": STOPS[kind]} if kind in STOPS else {}),
                **({"stalled_s": PROXY_STALL_S} if kind == "proxy_stall" else {}),
                **({"delayed": PROXY_DELAY} if kind == "proxy_delay" else {}),
                **(
                    {"restart_s": [pct(injector.restarts[kind], 50), pct(injector.restarts[kind], 99)]}
                    if kind in injector.restarts
                    else {}
                ),
            }
            for kind in faults
        },
        "connector": moved,
        "timeouts_s": limits,
        "wrong_examples": [r.detail for r in records if r.outcome == "wrong_tokens"][:5],
    }


def main() -> None:
    default = Plan(model=Path())
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=Path(os.environ.get("PD_TEST_MODEL", ".cache/models/tiny-llama"))
    )
    parser.add_argument("--phases", default="vllm", help="comma-separated: vllm, sglang (run in this order)")
    parser.add_argument("--prefills", type=int, default=default.prefills, help="vLLM phase (SGLang: 1)")
    parser.add_argument("--decodes", type=int, default=default.decodes, help="vLLM phase (SGLang: 1)")
    parser.add_argument("--requests", type=int, default=default.requests)
    parser.add_argument(
        "--sglang-requests", type=int, help="the SGLang phase's requests (default: --requests)"
    )
    parser.add_argument("--concurrency", type=int, default=default.concurrency)
    parser.add_argument("--faults-per-kind", type=int, default=5)
    parser.add_argument("--sglang-faults-per-kind", type=int, help="default: --faults-per-kind")
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument(
        "--backoff-s", type=float, default=default.backoff_s, help="a client's wait after a failure"
    )
    parser.add_argument("--quiet-s", type=float, default=default.quiet_s)
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs here (default: removed)")
    parser.add_argument(
        "--out", type=Path, default=default.out, help="the vLLM phase's plot (SGLang: NAME-sglang)"
    )
    args = parser.parse_args()
    phases: list[Engine] = []
    for name in args.phases.split(","):
        if name not in PHASE_FAULTS:
            parser.error(f"--phases: unknown phase {name!r} (vllm, sglang)")
        phases.append(name)
    results = {}
    for engine in phases:
        sglang = engine == "sglang"
        per_kind = args.sglang_faults_per_kind if sglang and args.sglang_faults_per_kind is not None else None
        plan = Plan(
            model=args.model,
            engine=engine,
            prefills=1 if sglang else args.prefills,
            decodes=1 if sglang else args.decodes,
            requests=(args.sglang_requests if sglang else None) or args.requests,
            concurrency=args.concurrency,
            faults=dict.fromkeys(
                PHASE_FAULTS[engine], args.faults_per_kind if per_kind is None else per_kind
            ),
            seed=args.seed,
            backoff_s=args.backoff_s,
            quiet_s=args.quiet_s,
            out=args.out.with_stem(f"{args.out.stem}-sglang") if sglang else args.out,
        )
        if args.log_dir is not None:
            (args.log_dir / engine).mkdir(parents=True, exist_ok=True)
            results[engine] = run(plan, args.log_dir / engine)
        else:
            with tempfile.TemporaryDirectory(prefix=f"pd-chaos-{engine}-") as tmp:
                results[engine] = run(plan, Path(tmp))
        print(json.dumps(results[engine]), flush=True)  # each phase's figures as soon as it ends
    if len(results) > 1:
        totals = {k: sum(r[k] for r in results.values()) for k in ("requests", *OUTCOMES)}
        print(json.dumps({"phases": results, **totals}))


if __name__ == "__main__":
    main()
