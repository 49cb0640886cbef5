"""Router overhead: pd-router versus sglang-router versus calling the upstream directly, side by side.

    python -m benchmarks.router [--tokenizer DIR] [--reps 3] [--scale 1] [--token-delay-ms 5]

Processes: a fake vLLM upstream (``pd_disagg.fake_vllm``, exact vLLM framing, no model) and this load
generator share core 1; ``pd-router`` and ``sglang-router`` (0.3.2, from PyPI) are pinned to core 0 with
taskset, one core each in turn (both idle while the other is measured). Every request is a streamed 64-token
completion; latency is send-to-last-byte. By default the upstream sends its 64 events as fast as it can, so
a router pays its per-event cost (a receive and a send per event) back to back: the worst case for a relay.
``--token-delay-ms`` paces tokens like an engine instead (on a loaded machine, timer jitter then dominates). Added latency = router percentile - direct percentile, measured in
the same round; rounds rotate direct/ours/sglang and the median over ``--reps`` rounds is reported. Max
requests/s: 64 connections in a closed loop for a few seconds against each router, short non-streamed
completions (the router's per-request cost, not the upstream's streaming cost), with the CPU time each server's
processes used per request meanwhile (from /proc: less sensitive to other load than rates). The load generator speaks
raw HTTP/1.1 on keep-alive sockets so the client adds as little as possible.

Progress goes to stderr; the LAST stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pd_disagg.servers import ManagedServer, free_port, process_group_cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
MODEL = "fake-model"
CONCURRENCY = (1, 16, 64)
TOKENS = 64
# Streamed requests per concurrency level and target, per round.
REQUESTS = {1: 30, 16: 80, 64: 320}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _request(port: int, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def _read_response(reader: asyncio.StreamReader) -> None:
    """Read one HTTP/1.1 response (Content-Length or chunked) and check it is a 200."""
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"bad response: {head[:200]!r}")
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return
    length = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
    await reader.readexactly(length)


async def _conn_loop(
    port: int, payload: bytes, count: int | None, stop_at: float | None, lat: list[float]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        done = 0
        while (count is None or done < count) and (stop_at is None or time.perf_counter() < stop_at):
            t0 = time.perf_counter()
            writer.write(payload)
            await _read_response(reader)
            lat.append(time.perf_counter() - t0)
            done += 1
    finally:
        writer.close()


async def latencies(port: int, concurrency: int, per_conn: int) -> list[float]:
    payload = _request(port, {"model": MODEL, "prompt": "hello world", "max_tokens": TOKENS, "stream": True})
    lat: list[float] = []
    await asyncio.gather(*(_conn_loop(port, payload, per_conn, None, lat) for _ in range(concurrency)))
    return lat


async def max_rps(port: int, seconds: float, pgid: int, concurrency: int = 64) -> tuple[float, float]:
    """Requests/s in a closed loop, and the server's CPU microseconds per request meanwhile."""
    payload = _request(port, {"model": MODEL, "prompt": "hello world", "max_tokens": 1})
    await latencies(port, 8, 5)  # warm connections and code paths
    lat: list[float] = []
    cpu0, start = process_group_cpu_seconds(pgid), time.perf_counter()
    await asyncio.gather(*(_conn_loop(port, payload, None, start + seconds, lat) for _ in range(concurrency)))
    rps = len(lat) / (time.perf_counter() - start)
    return rps, (process_group_cpu_seconds(pgid) - cpu0) / len(lat) * 1e6


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _servers(tokenizer: Path, tmp: Path, delay_ms: float) -> dict[str, ManagedServer]:
    logs = ROOT / "logs" / "bench"
    up, ours, sgl = free_port(), free_port(), free_port()
    upstream = f"http://127.0.0.1:{up}"
    config = tmp / "router.toml"
    config.write_text(
        f'[model]\npath = "{MODEL}"\ntokenizer = {json.dumps(str(tokenizer))}\nmax_model_len = 4096\n'
        f'[server]\nlog_level = "warning"\n[policy]\nthreshold_tokens = 256\n'
        # A saturated upstream answers health checks slowly: do not take the only worker out mid-run.
        f"[health]\ntimeout_s = 10.0\nunhealthy_after = 10\n"
        f'[[decode]]\nurl = "{upstream}"\n'
    )
    py = sys.executable
    return {
        "upstream": ManagedServer(
            "fake-upstream",
            [
                "taskset",
                "-c",
                "1",
                py,
                "-m",
                "pd_disagg.fake_vllm",
                "--port",
                str(up),
                "--model",
                MODEL,
                "--token-delay-ms",
                str(delay_ms),
            ],
            logs / f"fake-upstream-{up}.log",
            f"{upstream}/health",
            cwd=ROOT,
        ),
        "ours": ManagedServer(
            "pd-router",
            ["taskset", "-c", "0", py, "-m", "router.cli", "--config", str(config), "--port", str(ours)],
            logs / f"pd-router-{ours}.log",
            f"http://127.0.0.1:{ours}/ready",
            cwd=ROOT,
        ),
        "sglang_router": ManagedServer(
            "sglang-router",
            [
                "taskset",
                "-c",
                "0",
                py,
                "-m",
                "sglang_router.launch_router",
                "--worker-urls",
                upstream,
                "--port",
                str(sgl),
                "--policy",
                "round_robin",
                "--log-level",
                "warn",
            ],
            logs / f"sglang-router-{sgl}.log",
            f"http://127.0.0.1:{sgl}/health",
            cwd=ROOT,
        ),
    }


def _port(server: ManagedServer) -> int:
    return int(server.health_url.split(":")[2].split("/")[0])


async def measure(
    servers: dict[str, ManagedServer], reps: int, scale: int, rps_seconds: float, delay_ms: float
) -> dict:
    ports = {
        "direct": _port(servers["upstream"]),
        "ours": _port(servers["ours"]),
        "sglang_router": _port(servers["sglang_router"]),
    }
    for port in ports.values():
        await latencies(port, 16, 20)  # warm-up
    rounds: dict[str, dict[int, list[tuple[float, float]]]] = {k: {c: [] for c in CONCURRENCY} for k in ports}
    for rep in range(reps):
        for c in CONCURRENCY:
            order = list(ports)[rep % 3 :] + list(ports)[: rep % 3]
            for name in order:
                lat = await latencies(ports[name], c, max(1, REQUESTS[c] * scale // c))
                rounds[name][c].append((pct(lat, 0.5), pct(lat, 0.99)))
            log(
                f"rep {rep} c{c}: "
                + ", ".join(
                    f"{n} p50 {rounds[n][c][-1][0] * 1e3:.2f} ms p99 {rounds[n][c][-1][1] * 1e3:.2f} ms"
                    for n in ports
                )
            )
    added: dict[str, dict[str, dict[str, float]]] = {}
    absolute: dict[str, dict[str, dict[str, float]]] = {}
    for name in ("ours", "sglang_router"):
        added[name], absolute[name] = {}, {}
        for c in CONCURRENCY:
            d50 = [r[0] - d[0] for r, d in zip(rounds[name][c], rounds["direct"][c], strict=True)]
            d99 = [r[1] - d[1] for r, d in zip(rounds[name][c], rounds["direct"][c], strict=True)]
            added[name][f"c{c}"] = {
                "p50": round(statistics.median(d50) * 1e3, 3),
                "p99": round(statistics.median(d99) * 1e3, 3),
            }
    for name in ports:
        absolute[name] = {
            f"c{c}": {
                "p50": round(statistics.median(r[0] for r in rounds[name][c]) * 1e3, 3),
                "p99": round(statistics.median(r[1] for r in rounds[name][c]) * 1e3, 3),
            }
            for c in CONCURRENCY
        }
    rps: dict[str, list[float]] = {name: [] for name in ports}
    cpu: dict[str, list[float]] = {name: [] for name in ports}
    pgids = {
        "direct": servers["upstream"].pid,
        "ours": servers["ours"].pid,
        "sglang_router": servers["sglang_router"].pid,
    }
    for rep in range(reps):
        for name in ports:
            rate, cpu_us = await max_rps(ports[name], rps_seconds, pgids[name])
            rps[name].append(rate)
            cpu[name].append(cpu_us)
        log(
            f"rep {rep} max rps: "
            + ", ".join(f"{n} {rps[n][-1]:.0f} ({cpu[n][-1]:.0f} us CPU/request)" for n in ports)
        )
    return {
        "added_ms": added,
        "max_rps": {
            "ours": round(statistics.median(rps["ours"])),
            "sglang_router": round(statistics.median(rps["sglang_router"])),
        },
        "direct_max_rps": round(statistics.median(rps["direct"])),
        # CPU time the server spent per request during the max-rps runs (less sensitive to other load).
        "cpu_us_per_request": {name: round(statistics.median(cpu[name])) for name in ports},
        "latency_ms": absolute,
        "conditions": {
            "reps": reps,
            "requests": {f"c{c}": REQUESTS[c] * scale for c in CONCURRENCY},
            "tokens": TOKENS,
            "upstream_token_delay_ms": delay_ms,
            "router_core": 0,
            "client_and_upstream_core": 1,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_tok = os.environ.get("PD_TEST_MODEL", str(ROOT / ".cache" / "models" / "tiny-llama"))
    parser.add_argument("--tokenizer", type=Path, default=Path(default_tok), help="dir with tokenizer.json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1, help="multiply the number of requests per level")
    parser.add_argument(
        "--token-delay-ms",
        type=float,
        default=0.0,
        help="upstream pause between tokens (0: as fast as it can send; 5 = 200 tokens/s per stream)",
    )
    parser.add_argument("--rps-seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    if not (args.tokenizer / "tokenizer.json").exists():
        parser.error(f"no tokenizer.json in {args.tokenizer} (run `make model` or pass --tokenizer)")
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    os.sched_setaffinity(0, {1})
    with tempfile.TemporaryDirectory() as tmp:
        servers = _servers(args.tokenizer, Path(tmp), args.token_delay_ms)
        try:
            # The upstream first: sglang-router gives up on a worker it cannot reach at start-up.
            servers["upstream"].start()
            servers["upstream"].wait_healthy(120)
            for s in servers.values():
                if s is not servers["upstream"]:
                    s.start()
            for s in servers.values():
                s.wait_healthy(120)
            log("upstream, pd-router and sglang-router are up")
            result = asyncio.run(
                measure(servers, args.reps, args.scale, args.rps_seconds, args.token_delay_ms)
            )
        finally:
            for s in servers.values():
                s.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
