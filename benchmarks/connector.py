"""TTFT of a ~2k-token prompt: colocated vs PDConnector (layer-wise push) vs vLLM's NixlConnector (pull).

1P1D on vLLM CPU with the bench model (12 layers, hidden 1024, 24 KiB of KV per token: one layer's prefill
takes longer than sending that layer). P is pinned to core 0 and D to core 1; every request uses a fresh
random prompt (no prefix-cache hits), after one warm-up request per configuration. In the same run:
- colocated: the prompt streamed from one server (D of the PD pair, no transfer parameters);
- pd: our push flow (P and D legs sent concurrently, docs/wire-contract.md); TTFT = first token on D's stream;
- nixl: vLLM's standard flow (P with max_tokens=1, then D with the kv_transfer_params P returned).
Transfer time: PD = P's summed layer-write seconds (``vllm:pd_connector_write_seconds_total``), exposed =
P's ``vllm:pd_connector_exposed_seconds`` (end of the last layer until every write landed); NIXL pulls after
P finished, so its whole transfer (``vllm:nixl_xfer_time_seconds`` on D) is exposed by construction.
Idle CPU: CPU time of every process of the P and D servers over ``--idle-s`` seconds with no requests,
in percent of one core (both servers together; includes vLLM's own idle loops).

Medians over ``--reps``; progress on stderr; the last stdout line is the JSON summary
(docs/performance.md ``## connector``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from integration_tests.pd_checks import metric
from pd_connector import wire
from pd_disagg import pd_client
from pd_disagg.engines import base_url, vllm_server
from pd_disagg.servers import ManagedServer, free_port, process_group_cpu_seconds
from pd_disagg.tiny_model import bench_model

LOG_DIR = Path("logs/benchmarks/connector")
SERVED = "bench"


def log(msg: str) -> None:
    print(f"[connector] {msg}", file=sys.stderr, flush=True)


def stream_first_token(url: str, body: dict[str, Any], t0: float) -> float:
    """POST a streamed completion; seconds from ``t0`` until the first token arrives, then drain."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request(
        "POST", "/v1/completions", json.dumps({**body, "stream": True}), {"content-type": "application/json"}
    )
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
    first: float | None = None
    for raw in resp:
        line = raw.decode().strip()
        if first is None and line.startswith("data: {"):
            first = time.perf_counter() - t0
    conn.close()
    if first is None:
        raise RuntimeError(f"{url}: no token streamed")
    return first


def prompt_body(n_tokens: int, rng: random.Random, max_tokens: int) -> dict[str, Any]:
    prompt = [rng.randrange(10, 4000) for _ in range(n_tokens)]
    return {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def ttft_colocated(d_url: str, body: dict[str, Any]) -> float:
    return stream_first_token(d_url, body, time.perf_counter())


def ttft_pd(p_url: str, d_url: str, bootstrap: str, body: dict[str, Any]) -> float:
    tid = uuid.uuid4().hex
    t0 = time.perf_counter()
    p_errors: list[BaseException] = []

    def prefill() -> None:
        try:
            pd_client.post_json(
                p_url + "/v1/completions",
                pd_client.prefill_body(body, wire.PushPrefill(tid)),
                600,
            )
        except BaseException as exc:
            p_errors.append(exc)

    thread = threading.Thread(target=prefill)
    thread.start()
    ttft = stream_first_token(d_url, pd_client.decode_body(body, tid, bootstrap), t0)
    thread.join()
    if p_errors:
        raise RuntimeError(f"P leg failed: {p_errors[0]!r}")
    return ttft


def ttft_standard(p_url: str, d_url: str, body: dict[str, Any], timeout_s: float = 600.0) -> float:
    t0 = time.perf_counter()
    params = pd_client.standard_prefill(p_url, body, timeout_s=timeout_s)
    return stream_first_token(d_url, {**body, "kv_transfer_params": params}, t0)


def idle_cpu_percent(servers: list[ManagedServer], seconds: float) -> float:
    def cpu_s() -> float:
        return sum(process_group_cpu_seconds(server.pid) for server in servers)

    time.sleep(2.0)
    before, t0 = cpu_s(), time.monotonic()
    time.sleep(seconds)
    after, t1 = cpu_s(), time.monotonic()
    return 100.0 * (after - before) / (t1 - t0)


def pair(
    name: str,
    kv_p: dict[str, Any],
    kv_d: dict[str, Any],
    env_p: dict[str, str],
    env_d: dict[str, str],
    max_len: int,
) -> list[ManagedServer]:
    model = bench_model()
    return [
        vllm_server(
            model,
            name=f"{name}-{role}",
            cpu_core=core,
            kv_transfer_config=kv,
            env=env,
            log_dir=LOG_DIR,
            max_model_len=max_len,
            extra_args=["--served-model-name", SERVED],
        )
        for role, core, kv, env in (("prefill", 0, kv_p, env_p), ("decode", 1, kv_d, env_d))
    ]


def run_pair(
    servers: list[ManagedServer],
    measure: Callable[[str, str], dict[str, Any]],
    start_timeout_s: float = 900,
    one_by_one: bool = False,
) -> dict[str, Any]:
    """Start P and D (``servers``), ``measure(p_url, d_url)``, stop both, also on failure. ``one_by_one``: each
    server is healthy before the next starts (two servers on one GPU: the second sizes its cache after the
    first took its share). Also used by ``benchmarks.gpu_pd``."""
    try:
        for s in servers:
            s.start()
            if one_by_one:
                s.wait_healthy(start_timeout_s)
        for s in servers:
            s.wait_healthy(start_timeout_s)
        return measure(base_url(servers[0]), base_url(servers[1]))
    finally:
        for s in servers:
            s.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
    parser.add_argument("--nixl-timeout-s", type=float, default=180.0, help="per NIXL request (it can hang)")
    args = parser.parse_args()
    rng = random.Random(0)
    max_len = args.prompt_tokens + 64
    bodies = [prompt_body(args.prompt_tokens, rng, 4) for _ in range(3 * args.reps + 3)]
    results: dict[str, Any] = {
        "ttft_ms": {},
        "transfer_ms": {},
        "exposed_transfer_ms": {},
        "idle_cpu_percent": {},
    }

    side = free_port()
    bootstrap = f"127.0.0.1:{side}"
    pd_p = {
        "kv_connector": "PDConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"side_channel_port": side, "transport": args.transport},
    }
    pd_d = {
        "kv_connector": "PDConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"transport": args.transport},
    }

    def measure_pd(p_url: str, d_url: str) -> dict[str, Any]:
        log("PD pair up; warm-up")
        ttft_pd(p_url, d_url, bootstrap, bodies.pop())
        ttft_colocated(d_url, bodies.pop())
        colo, pd, write, exposed = [], [], [], []
        for rep in range(args.reps):
            colo.append(ttft_colocated(d_url, bodies.pop()))
            w0 = metric(p_url, "vllm:pd_connector_write_seconds_total")
            e0 = metric(p_url, "vllm:pd_connector_exposed_seconds_sum")
            pd.append(ttft_pd(p_url, d_url, bootstrap, bodies.pop()))
            time.sleep(1.5)  # connector stats reach /metrics with the next engine steps
            write.append(metric(p_url, "vllm:pd_connector_write_seconds_total") - w0)
            exposed.append(metric(p_url, "vllm:pd_connector_exposed_seconds_sum") - e0)
            log(
                f"rep {rep}: colocated {colo[-1]:.3f}s pd {pd[-1]:.3f}s write {write[-1]:.3f}s exposed {exposed[-1]:.4f}s"
            )
        failures = metric(d_url, "vllm:pd_connector_failures_total")
        return {"colo": colo, "pd": pd, "write": write, "exposed": exposed, "failures": failures}

    pd_servers = pair("pd", pd_p, pd_d, {}, {}, max_len)
    pd_res = run_pair(
        pd_servers, lambda p, d: {**measure_pd(p, d), "idle": idle_cpu_percent(pd_servers, args.idle_s)}
    )

    nixl_p = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    nixl_d = {**nixl_p, "kv_role": "kv_consumer"}
    nixl_servers = pair(
        "nixl",
        nixl_p,
        nixl_d,
        {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        max_len,
    )

    def measure_nixl(p_url: str, d_url: str) -> dict[str, Any]:
        log("NIXL pair up; warm-up")
        ttfts: list[float] = []
        xfer: list[float] = []
        error = ""
        try:
            ttft_standard(p_url, d_url, bodies.pop(), args.nixl_timeout_s)
            for rep in range(args.reps):
                x0 = metric(d_url, "vllm:nixl_xfer_time_seconds_sum")
                ttfts.append(ttft_standard(p_url, d_url, bodies.pop(), args.nixl_timeout_s))
                time.sleep(1.5)
                xfer.append(metric(d_url, "vllm:nixl_xfer_time_seconds_sum") - x0)
                log(f"rep {rep}: nixl {ttfts[-1]:.3f}s transfer {xfer[-1]:.4f}s")
        except (OSError, RuntimeError) as exc:  # a hung or failing NIXL pair is a result, not a crash
            error = f"{type(exc).__name__}: {exc}"
            log(f"NIXL failed: {error}")
        return {
            "nixl": ttfts,
            "xfer": xfer,
            "error": error,
            "idle": idle_cpu_percent(nixl_servers, args.idle_s),
        }

    nixl_res = run_pair(nixl_servers, measure_nixl)

    def ms(values: list[float], digits: int) -> float | None:
        return round(1000 * statistics.median(values), digits) if values else None

    results["ttft_ms"] = {
        "colocated": ms(pd_res["colo"], 1),
        "pd": ms(pd_res["pd"], 1),
        "nixl": ms(nixl_res["nixl"], 1),
    }
    results["transfer_ms"] = {"pd": ms(pd_res["write"], 2), "nixl": ms(nixl_res["xfer"], 2)}
    results["exposed_transfer_ms"] = {"pd": ms(pd_res["exposed"], 2), "nixl": ms(nixl_res["xfer"], 2)}
    results["idle_cpu_percent"] = {"pd": round(pd_res["idle"], 2), "nixl": round(nixl_res["idle"], 2)}
    ttft = results["ttft_ms"]
    write_s = statistics.median(pd_res["write"])
    results["ratios"] = {
        "pd_over_nixl": round(ttft["pd"] / ttft["nixl"], 3) if ttft["nixl"] else None,
        "pd_over_colocated": round(ttft["pd"] / ttft["colocated"], 3),
        "pd_exposed_fraction": round(statistics.median(pd_res["exposed"]) / write_s, 3) if write_s else None,
    }
    results["conditions"] = {
        "prompt_tokens": args.prompt_tokens,
        "reps": args.reps,
        "transport": args.transport,
        "pd_failures": pd_res["failures"],
        "nixl_error": nixl_res["error"],
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
