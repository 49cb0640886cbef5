"""What a vLLM engine waiting for KV costs the cores it shares: vLLM's own spin against ``idle_spin_s``.

A D engine whose request waits for its KV steps every few milliseconds with nothing to compute, and vLLM's
EngineCore and workers spin on the shared-memory queues between them for 1 s after each message. The
connector's ``idle_spin_s`` (docs/configuration.md) caps that spin on idle steps only. This benchmark runs
two D servers side by side (core 1), one with ``idle_spin_s`` 1 (vLLM's behaviour) and one with the
setting under test, plus a plain server X (core 0) that stands for P, and measures, alternating between
the two D servers each repetition:
- ``waiting_cpu_cores``: CPU time of the whole D server (every process) per second of wall time while one
  request waits for KV from a prefill peer that accepted the connection and never answers (the wait ends
  at ``connect_timeout_s`` and D prefills locally: ``kv_load_failure_policy`` recompute);
- ``x_prefill_ms``: X's prefill of a fresh ``--prompt-tokens`` prompt (max_tokens 1) while that D waits,
  against ``x_prefill_alone_ms`` with no D waiting: what the waiting D takes from a P on the same host;
- ``itl_ms``: the median gap between streamed tokens of a ``--decode-tokens`` request straight to that D
  (nothing pending, so vLLM's spin is kept on these steps: the setting must not slow decoding).
Medians over ``--reps``; ratios ours / vLLM's. Progress on stderr; the last stdout line is the JSON summary
(docs/performance.md ``## idle_spin``).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import random
import socket
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from integration_tests.pd_checks import metric
from pd_connector import wire
from pd_connector.vllm.config import PDConnectorConfig
from pd_disagg.engines import base_url, vllm_server
from pd_disagg.servers import ManagedServer, process_group_cpu_seconds

LOG_DIR = Path("logs/benchmarks/idle_spin")
VLLM_SPIN_S = 1.0  # vLLM's own SpinCondition.busy_loop_s


def log(msg: str) -> None:
    print(f"[idle_spin] {msg}", file=sys.stderr, flush=True)


class SilentPeer:
    """A TCP listener that accepts connections and never answers: a prefill side channel that hangs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def post(url: str, body: dict[str, Any], stream: bool = False) -> list[float]:
    """POST a completion; the arrival time of each streamed event (one entry when not streamed)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({**body, "stream": stream}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
        if not stream:
            resp.read()
            return [time.monotonic()]
        stamps = []
        for line in resp:
            if line.startswith(b"data: {"):
                stamps.append(time.monotonic())
        return stamps
    finally:
        conn.close()


def pending(url: str) -> float:
    """Requests D's engine holds (running or waiting, including those waiting for KV), from its metrics."""
    return metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting")


def d_config(idle_spin_s: float, wait_s: float) -> dict[str, Any]:
    return {
        "kv_connector": "PDConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "idle_spin_s": idle_spin_s,
            "connect_timeout_s": wait_s,
            "load_timeout_s": wait_s + 5,
        },
    }


def measure(
    d: ManagedServer, x: ManagedServer, peer: SilentPeer, args: argparse.Namespace, rng: random.Random
) -> dict[str, float]:
    """One repetition on one D: its CPU while a request waits, X's prefill meanwhile, then its decode ITL."""
    d_url, x_url = base_url(d), base_url(x)
    waiting = {
        "model": args.served,
        "prompt": [rng.randrange(10, 1000) for _ in range(64)],
        "max_tokens": 1,
        wire.KV_TRANSFER_PARAMS: {
            "pd_transfer_id": uuid.uuid4().hex,
            "pd_role": "decode",
            "pd_prefill_addr": peer.addr,
        },
    }
    done = threading.Event()

    def wait_for_kv() -> None:
        post(d_url, waiting)
        done.set()

    waiter = threading.Thread(target=wait_for_kv, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while pending(d_url) < 1:  # the window opens once D's engine holds the request
        if time.monotonic() > deadline:
            raise RuntimeError("D never took the waiting request")
        time.sleep(0.01)
    cpu0, t0 = process_group_cpu_seconds(d.pid), time.monotonic()
    prefill = {
        "model": args.served,
        "prompt": [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)],
        "max_tokens": 1,
    }
    start = time.monotonic()
    post(x_url, prefill)
    x_ms = (time.monotonic() - start) * 1000
    remaining = args.wait_s / 2 - (time.monotonic() - t0)
    if remaining > 0:
        time.sleep(remaining)  # the CPU window: the first half of the wait (and at least X's prefill)
    cpu = (process_group_cpu_seconds(d.pid) - cpu0) / (time.monotonic() - t0)
    waiter.join(args.wait_s + 30)
    if not done.is_set():
        raise RuntimeError("D's waiting request did not end after its connect timeout")
    alone_body = {**prefill, "prompt": [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)]}
    start = time.monotonic()
    post(x_url, alone_body)
    alone_ms = (time.monotonic() - start) * 1000
    decode = {
        "model": args.served,
        "prompt": [rng.randrange(10, 1000) for _ in range(32)],
        "max_tokens": args.decode_tokens,
        "ignore_eos": True,
    }
    stamps = post(d_url, decode, stream=True)
    itl = statistics.median(b - a for a, b in itertools.pairwise(stamps)) * 1000
    return {"waiting_cpu_cores": cpu, "x_prefill_ms": x_ms, "x_prefill_alone_ms": alone_ms, "itl_ms": itl}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path(".cache/models/tiny-llama"))
    parser.add_argument(
        "--idle-spin-s", type=float, default=PDConnectorConfig.idle_spin_s, help="the setting under test"
    )
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="X's prefill while D waits")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--wait-s", type=float, default=6.0, help="how long each waiting request waits for KV"
    )
    args = parser.parse_args()
    args.served = "m"
    rng = random.Random(0)
    settings = {"vllm": VLLM_SPIN_S, "ours": args.idle_spin_s}
    common = {
        "log_dir": LOG_DIR,
        "dtype": "float32",
        "max_model_len": args.prompt_tokens + 128,
        "extra_args": ["--served-model-name", args.served],
    }
    servers = {
        name: vllm_server(
            args.model,
            name=f"d-{name}",
            cpu_core=1,
            kv_transfer_config=d_config(value, args.wait_s),
            **common,
        )
        for name, value in settings.items()
    }
    x = vllm_server(args.model, name="x", cpu_core=0, **common)
    peer = SilentPeer()
    every = [*servers.values(), x]
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    try:
        for server in every:
            server.start()
        for server in every:
            server.wait_healthy(900)
        for d in servers.values():  # warm-up: first requests compile and allocate
            post(base_url(d), {"model": args.served, "prompt": [11, 12, 13], "max_tokens": 4})
        post(base_url(x), {"model": args.served, "prompt": [11] * args.prompt_tokens, "max_tokens": 1})
        for rep in range(args.reps):
            for name in settings if rep % 2 == 0 else reversed(list(settings)):
                sample = measure(servers[name], x, peer, args, rng)
                samples[name].append(sample)
                log(
                    f"rep {rep + 1}/{args.reps} {name}: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in sample.items())
                )
    finally:
        peer.close()
        for server in every:
            server.stop()
    medians = {
        name: {k: round(statistics.median(s[k] for s in runs), 3) for k in runs[0]}
        for name, runs in samples.items()
    }
    ratios = {k: round(medians["ours"][k] / medians["vllm"][k], 3) for k in medians["ours"]}
    print(
        json.dumps(
            {
                "medians": medians,
                "ours_vs_vllm": ratios,
                "conditions": {
                    "model": str(args.model),
                    "idle_spin_s": settings,
                    "prompt_tokens": args.prompt_tokens,
                    "decode_tokens": args.decode_tokens,
                    "reps": args.reps,
                    "wait_s": args.wait_s,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
