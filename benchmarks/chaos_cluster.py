"""The chaos benchmark's cluster: one phase's engines (vLLM or SGLang P/D servers), fault proxies and
pd-router, how each is started and stopped, and what is read off them after the load (KV usage, open requests,
connector counters, RSS). Used by ``benchmarks.chaos`` in the benchmark's process; every server here is
started and stopped by it, on loopback.

vLLM phase: P and D with PDConnector (tcp data plane, ``integrity_check`` on, the short ``TIMERS``), each P's
side channel (control: D dials it) and each D's tcp data listener (data: P dials it to push) reached through a
``FaultProxy`` (the router hands D the control proxy's address; D listens on a fixed ``data_port`` and
advertises the data proxy's as ``data_advertise_port``); new connections through either get seeded delays,
stalls and resets, and ``benchmarks.chaos`` strikes the connections open at a moment of its timeline.
pd-router with flow ``pd-push``. Settled: the engine's ``vllm:kv_cache_usage_perc`` back to baseline,
nothing running or waiting.

SGLang phase: one P and one D SGLang server with our ``pd`` transfer backend (same timers and integrity
check through ``PD_SGLANG_*``, SGLang's strict idle memory check on, so a leaked page or request slot kills
the scheduler), pd-router with flow ``sglang-bootstrap``. No proxy: D learns P's side-channel address from
P's bootstrap server, which the router does not relay. Settled: ``/v1/loads``' used KV tokens back to
baseline and every request count (running, queued, bootstrapping, transferring) zero.
"""

from __future__ import annotations

import json
import math
import random
import signal
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from benchmarks.chaos_load import SERVED
from integration_tests.pd_checks import metric
from pd_disagg.engines import base_url, router_server, sglang_server, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port, process_group_members
from test_support.fault_proxy import Fault, FaultProxy, Schedule

Engine = Literal["vllm", "sglang"]
#: The connector's timers, short so that every fault resolves within the run (seconds).
TIMERS = {
    "heartbeat_interval_s": 0.5,
    "heartbeat_timeout_s": 3.0,
    "lease_s": 8.0,
    "load_timeout_s": 8.0,
    "abort_grace_s": 1.0,
}
#: pd-router's timeouts in the run (seconds).
ROUTER_TIMEOUTS = {"first_byte_s": 60.0, "idle_s": 60.0, "request_s": 150.0}
#: SGLang's own disaggregation timeouts in the run (seconds): P waiting for its D, D waiting for KV.
SGLANG_TIMEOUTS = {"bootstrap_timeout_s": 20.0, "waiting_timeout_s": 30.0}
MAX_MODEL_LEN = 1024
#: Every engine process prints its threads' Python stacks if it dies of a fatal signal (SIGSEGV, SIGABRT, ...):
#: a P's model worker once died in a run with no trace in its log (docs/performance.md ``## chaos``).
CRASH_TRACES = {"PYTHONFAULTHANDLER": "1"}


@dataclass
class Cluster:
    """One phase's servers; ``url`` is the router's once started."""

    engine: Engine
    prefills: list[ManagedServer]
    decodes: list[ManagedServer]
    router: ManagedServer
    #: vLLM: each P's side-channel port. SGLang: each P's bootstrap port (its side channel is asked of it).
    ports: list[int]
    #: vLLM: the proxy in front of each P's side channel (control connections, D -> P).
    proxies: list[FaultProxy] = field(default_factory=list)
    #: vLLM: the proxy in front of each D's tcp data listener (data connections, P -> D).
    data_proxies: list[FaultProxy] = field(default_factory=list)
    url: str = ""

    def all_proxies(self) -> dict[str, FaultProxy]:
        """Every proxy by what it carries: ``control-pI``, ``data-dI``."""
        return {
            **{f"control-p{i}": proxy for i, proxy in enumerate(self.proxies)},
            **{f"data-d{i}": proxy for i, proxy in enumerate(self.data_proxies)},
        }

    @property
    def engines(self) -> list[ManagedServer]:
        return [*self.prefills, *self.decodes]

    def servers(self) -> list[ManagedServer]:
        return [*self.engines, self.router]

    def transfer_port(self, i: int) -> int:
        """P ``i``'s side-channel (transfer engine) port, where a garbage peer dials."""
        if self.engine == "vllm":
            return self.ports[i]
        query = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
        url = f"http://127.0.0.1:{self.ports[i]}/route?{query}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(json.load(resp)["rank_port"])


def build(
    engine: Engine,
    model: Path,
    prefills: int,
    decodes: int,
    dtype: str,
    seed: int,
    log_dir: Path,
    proxy_data: bool = True,
) -> Cluster:
    """The servers and proxies of a phase (nothing started); ``proxy_data``: vLLM's data connections go
    through fault proxies too."""
    router = router_server(
        log_dir / f"chaos-{engine}-router.toml",
        log_dir=log_dir,
        port=free_port(),
        name=f"chaos-{engine}-router",
    )
    if engine == "sglang":
        return _build_sglang(model, prefills, decodes, dtype, router, log_dir)
    rng = random.Random(f"{seed}:proxy")
    short, long = TIMERS["heartbeat_timeout_s"] / 3, TIMERS["heartbeat_timeout_s"] * 2
    control_menu = [
        Fault("delay", after_bytes=4096, seconds=0.05),
        Fault("stall", after_bytes=4096, seconds=short),
        Fault("stall", after_bytes=4096, seconds=long),
    ]
    # A data connection lives as long as its P/D pair and carries MBs: a delay on every later chunk would
    # slow the whole run, so its faults are stalls and a reset, somewhere in its first 8 MiB.
    data_menu = [
        Fault("stall", after_bytes=8 << 20, seconds=short),
        Fault("stall", after_bytes=8 << 20, seconds=long),
        Fault("reset", after_bytes=8 << 20),
    ]
    connector = {"integrity_check": True, **TIMERS}

    def server(name: str, core: int, kv: dict[str, Any]) -> ManagedServer:
        return vllm_server(
            model,
            log_dir=log_dir,
            name=name,
            cpu_core=core,
            dtype=dtype,
            max_model_len=MAX_MODEL_LEN,
            kv_transfer_config={"kv_connector": "PDConnector", **kv},
            extra_args=["--served-model-name", SERVED],
            env=CRASH_TRACES,
        )

    side_ports = [free_port() for _ in range(prefills)]
    p = [
        server(
            f"chaos-p{i}",
            i % 2,
            {"kv_role": "kv_producer", "kv_connector_extra_config": {**connector, "side_channel_port": port}},
        )
        for i, port in enumerate(side_ports)
    ]
    # (D's listener, its proxy); 0, 0: D's own free port, dialled directly
    data_ports = [(free_port(), free_port()) if proxy_data else (0, 0) for _ in range(decodes)]
    d = [
        server(
            f"chaos-d{i}",
            (i + 1) % 2,
            {
                "kv_role": "kv_consumer",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {**connector, "data_port": port, "data_advertise_port": via},
            },
        )
        for i, (port, via) in enumerate(data_ports)
    ]
    proxies = [
        FaultProxy(("127.0.0.1", port), Schedule.seeded(rng.randrange(1 << 30), control_menu, 0.5), seed=seed)
        for port in side_ports
    ]
    data_proxies = [
        FaultProxy(
            ("127.0.0.1", port),
            Schedule.seeded(rng.randrange(1 << 30), data_menu, 0.5),
            seed=seed,
            listen_port=via,
        )
        for port, via in data_ports
        if proxy_data
    ]
    return Cluster("vllm", p, d, router, side_ports, proxies, data_proxies)


def _sglang_env() -> dict[str, str]:
    """The pd backend's settings (``PD_SGLANG_*``) and SGLang's own timeouts and leak check, for P and D."""
    return {
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
        "PD_SGLANG_TRANSPORT": "tcp",
        "PD_SGLANG_INTEGRITY_CHECK": "1",
        **{f"PD_SGLANG_{k.upper()}": str(v) for k, v in TIMERS.items() if k != "load_timeout_s"},
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(int(SGLANG_TIMEOUTS["bootstrap_timeout_s"])),
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(int(SGLANG_TIMEOUTS["waiting_timeout_s"])),
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    }


def sglang(model: Path, dtype: str, log_dir: Path, name: str, core: int, **kw: Any) -> ManagedServer:
    """An SGLang server of the phase (``kw``: its disaggregation mode and bootstrap port; none: colocated,
    the known answers' server), all with the same model settings, so their greedy answers agree."""
    return sglang_server(
        model,
        log_dir=log_dir,
        name=name,
        cpu_core=core,
        dtype=dtype,
        context_length=MAX_MODEL_LEN,
        max_total_tokens=8192,
        extra_args=("--served-model-name", SERVED, "--enable-metrics"),
        env={**_sglang_env(), **CRASH_TRACES},
        **kw,
    )


def _build_sglang(
    model: Path, prefills: int, decodes: int, dtype: str, router: ManagedServer, log_dir: Path
) -> Cluster:
    if prefills != 1 or decodes != 1:
        raise ValueError(
            "the SGLang phase runs one P/D pair (memory: six engines do not fit beside the load)"
        )
    port = free_port()
    p = sglang(
        model, dtype, log_dir, "chaos-sglang-p0", 0, disaggregation_mode="prefill", bootstrap_port=port
    )
    d = sglang(model, dtype, log_dir, "chaos-sglang-d0", 1, disaggregation_mode="decode")
    return Cluster("sglang", [p], [d], router, [port])


def start(cluster: Cluster, model: Path, log_dir: Path) -> None:
    for server in cluster.engines:
        server.start()
    for server in cluster.engines:
        server.wait_healthy(900)
    for proxy in cluster.all_proxies().values():
        proxy.start()
    sections: dict[str, dict[str, Any]] = {
        "model": {"path": str(model), "served_names": [SERVED], "max_model_len": MAX_MODEL_LEN},
        "timeouts": ROUTER_TIMEOUTS,
    }
    prefill: list[dict[str, Any]]
    if cluster.engine == "vllm":
        prefill = [
            {"url": base_url(p), "bootstrap": proxy.address}
            for p, proxy in zip(cluster.prefills, cluster.proxies, strict=True)
        ]
        decode = [{"url": base_url(d)} for d in cluster.decodes]
    else:
        # SGLang's D cannot prefill alone: every prompt goes P->D; its /health generates a token (>= 1 s).
        sections |= {"policy": {"threshold_tokens": 0}, "health": {"interval_s": 0.5, "timeout_s": 5}}
        prefill = [
            {"url": base_url(p), "engine": "sglang", "bootstrap_port": port}
            for p, port in zip(cluster.prefills, cluster.ports, strict=True)
        ]
        decode = [{"url": base_url(d), "engine": "sglang"} for d in cluster.decodes]
    flow = "pd-push" if cluster.engine == "vllm" else "sglang-bootstrap"
    write_router_config(
        log_dir / f"chaos-{cluster.engine}-router.toml",
        flow=flow,
        sections=sections,
        prefill=prefill,
        decode=decode,
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
    for proxy in cluster.all_proxies().values():
        proxy.stop()


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


def engine_state(server: ManagedServer, engine: Engine) -> tuple[float, float]:
    """(KV in use, requests open) of an engine; (inf, inf) while it does not answer (restarting, stopped, or
    an SGLang scheduler killed by its leak check), which never counts as settled.

    vLLM: ``vllm:kv_cache_usage_perc`` (%) and requests running or waiting (a load stuck waiting for KV is
    waiting). SGLang: ``/v1/loads``' used KV tokens and its requests running, waiting in any queue or in
    flight (``_loads``)."""
    url = base_url(server)
    try:
        if engine == "vllm":
            usage = metric(url, "vllm:kv_cache_usage_perc")
            open_requests = metric(url, "vllm:num_requests_running") + metric(
                url, "vllm:num_requests_waiting"
            )
            return usage, open_requests
        with urllib.request.urlopen(f"{url}/v1/loads", timeout=10) as resp:
            return _loads(json.load(resp))
    except OSError as e:
        print(f"chaos: {server.name} ({url}) does not answer: {e!r}", file=sys.stderr)
        return math.inf, math.inf


def _loads(answer: dict[str, Any]) -> tuple[float, float]:
    """(used KV tokens, open requests) summed over the DP ranks of SGLang's /v1/loads answer. Waiting counts
    every queue before the forward pass (P: bootstrapping; D: preallocating, transferring, retracted); P's
    in-flight queue (KV being sent after the forward pass) is counted beside it."""
    used, open_requests = 0.0, 0.0
    for rank in answer["loads"]:
        used += rank.get("num_used_tokens", 0)
        inflight = (rank.get("disaggregation") or {}).get("prefill_inflight_queue_reqs", 0)
        open_requests += rank.get("num_running_reqs", 0) + rank.get("num_waiting_reqs", 0) + inflight
    return used, open_requests


def connector_counters(cluster: Cluster, engines: list[ManagedServer] | None = None) -> dict[str, float]:
    """What proves KV moved and was checked, summed over ``engines`` (default: all; since each one's
    start)."""
    names = ("bytes_sent", "transfers_received", "failures", "integrity_failures")
    totals = dict.fromkeys(names, 0.0)
    for server in cluster.engines if engines is None else engines:
        try:
            for n in names:
                totals[n] += metric(base_url(server), f"{cluster.engine}:pd_connector_{n}_total")
        except OSError:
            continue  # reported by settle already
    return totals


def router_state(server: ManagedServer) -> dict[str, float]:
    """What pd-router still holds: requests waiting for a slot, upstream legs in flight and prefill tokens
    leased, each summed over its workers (inf while it does not answer)."""
    names = ("waiting", "worker_in_flight", "worker_outstanding_prefill_tokens")
    try:
        return {n: metric(base_url(server), f"pd_router_{n}") for n in names}
    except OSError as e:
        print(f"chaos: {server.name} does not answer: {e!r}", file=sys.stderr)
        return dict.fromkeys(names, math.inf)


def settle(
    cluster: Cluster, baseline: dict[str, float], quiet_s: float
) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """After the load: poll every engine and the router until each engine is back to its baseline with
    nothing open and the router holds nothing, at most ``quiet_s``; the last reading of each engine, and the
    router's."""
    deadline = time.monotonic() + quiet_s
    while True:
        state = {s.name: engine_state(s, cluster.engine) for s in cluster.engines}
        router = router_state(cluster.router)
        settled = all(u <= baseline[n] + 1e-9 and o == 0 for n, (u, o) in state.items())
        if (settled and not any(router.values())) or time.monotonic() > deadline:
            return state, router
        time.sleep(0.5)  # polling a remote server's /metrics, not a synchronisation


def send(port: int, data: bytes) -> None:
    """A peer that dials a loopback port, sends ``data`` and leaves."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
