"""Router overhead: pd-router versus sglang-router versus calling the upstream directly, side by side.

    python -m benchmarks.router [--tokenizer DIR] [--reps 3] [--scale 1] [--token-delay-ms 5]

Processes: a fake vLLM upstream (``test_support.fake_vllm``, exact vLLM framing, no model) and this load
generator share core 1; ``pd-router``, ``sglang-router`` (0.3.2, from PyPI) and the byte relay are pinned to
core 0 with taskset, one measured at a time (the others idle meanwhile). Every request is a streamed 64-token
completion. The upstream paces its tokens (``--token-delay-ms``, default 5 ms: 200 tokens/s per stream, faster
than an engine serving 64 streams decodes each of them); ``--token-delay-ms 0`` sends the 64 events as fast
as it can, the relay's stress case (at c64 that measures saturation, like the max-rps runs).

Added latency, per request: the upstream stamps when a request arrived and when it handed its first and its
``[DONE]`` event to the socket; this load generator stamps when it sent the request and when the first and
last body bytes came back, all on CLOCK_MONOTONIC (one clock for every process on the host). A request's
*transit* = (arrived - sent) + (last byte back - [DONE] sent): the time spent outside the upstream, which
excludes the upstream's own pacing and scheduling jitter. Added = transit percentile through a router minus
transit percentile on the direct path, over all requests of all rounds (``added_ms``); the same for the
first event (``added_ttft_ms``). The older end-to-end figures stay alongside: send-to-last-byte percentiles
per round, router minus direct of the same round, median over rounds (``added_e2e_ms``: noisy, since the
upstream's own spread between runs enters it). Rounds rotate the order of the targets.

The floor: ``benchmarks.byte_relay`` (bytes in, the same bytes out on uvloop, no HTTP) runs as a fourth target
on the routers' core. Its added latency is what the extra process hop itself costs on this host;
``added_over_byte_relay_ms`` is each router's transit percentile minus the relay's, i.e. what its HTTP
handling, routing and relaying add on top of the hop.

Max requests/s: 64 connections in a closed loop for a few seconds against each router, short non-streamed
completions (the router's per-request cost, not the upstream's streaming cost), driven from a child process
(also on core 1: the upstream keeps this process's loop), with the CPU time each router's processes used per
request meanwhile (from /proc: less sensitive to other load than rates). The load
generator speaks raw HTTP/1.1 on keep-alive sockets (llhttp parses the answers) so it adds as little as
possible.

Progress goes to stderr; the LAST stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple, cast

import httptools
from aiohttp import web

from pd_disagg.servers import ManagedServer, free_port, process_group_cpu_seconds
from test_support.fake_vllm import FakeEngine

ROOT = Path(__file__).resolve().parent.parent
MODEL = "fake-model"
CONCURRENCY = (1, 16, 64)
TOKENS = 64
DEFAULT_TOKEN_DELAY_MS = 5.0
# Streamed requests per concurrency level and target, per round.
REQUESTS = {1: 30, 16: 160, 64: 640}
ROUTERS = ("ours", "sglang_router")  # what the targets are about
FLOOR = "byte_relay"  # a zero-work relay in the routers' place: what the extra hop alone adds
RELAYS = (*ROUTERS, FLOOR)  # everything measured against the direct path
TARGETS = ("direct", *RELAYS)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class ClientStamps(NamedTuple):
    """One request as the load generator saw it (monotonic ns); ``key`` is the prompt's last word."""

    key: str
    sent: int
    first: int  # first body bytes arrived
    last: int  # last body bytes arrived


class Transit(NamedTuple):
    """Nanoseconds a request spent outside the upstream, from both sides' stamps of it."""

    forward: int  # sent -> the upstream's handler started
    first_back: int  # the upstream wrote its first event -> the client got the first body bytes
    last_back: int  # the upstream wrote [DONE] -> the client got the last body bytes

    @property
    def total(self) -> int:
        return self.forward + self.last_back

    @property
    def ttft(self) -> int:
        return self.forward + self.first_back


def transits(client: Sequence[ClientStamps], upstream: Mapping[str, Sequence[int]]) -> list[Transit]:
    """Join the load generator's stamps with the upstream's (``key -> [arrived, first, done]``)."""
    out = []
    for c in client:
        if c.key not in upstream:
            raise ValueError(f"the upstream recorded no stamps for request {c.key!r}")
        arrived, first, done = upstream[c.key]
        if not c.sent <= arrived <= first <= done <= c.last or c.first < first:
            raise ValueError(f"stamps of {c.key!r} are out of order: {c} vs {upstream[c.key]}")
        out.append(Transit(arrived - c.sent, c.first - first, c.last - done))
    return out


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def added_ms(through: Sequence[float], direct: Sequence[float]) -> dict[str, float]:
    """Percentiles (ns samples) through a router minus the same percentiles on the direct path, in ms."""
    return {f"p{round(q * 100)}": round((pct(through, q) - pct(direct, q)) / 1e6, 3) for q in (0.5, 0.99)}


class _Exchange(asyncio.Protocol):
    """One keep-alive client connection: send a request, stamp when its body starts and ends arriving."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._done: asyncio.Future[None] | None = None
        self._status = 0
        self.first = self.last = 0
        self.body = bytearray()
        self.keep_body = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._finish(RuntimeError(f"malformed response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(ConnectionError("the server closed the connection"))

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.last = time.monotonic_ns()
        self.first = self.first or self.last
        if self.keep_body:
            self.body += body

    def on_message_complete(self) -> None:
        self._finish(None if self._status == 200 else RuntimeError(f"status {self._status}"))

    def _finish(self, error: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            if error is None:
                self._done.set_result(None)
            else:
                self._done.set_exception(error)

    async def exchange(self, payload: bytes) -> int:
        """Send one request and wait for its whole response; returns the monotonic ns it was sent at."""
        assert self.transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self.first = self.last = 0
        self.body.clear()
        sent = time.monotonic_ns()
        self.transport.write(payload)
        async with asyncio.timeout(60):
            await self._done
        return sent


async def _connect(port: int) -> _Exchange:
    _, conn = await asyncio.get_running_loop().create_connection(_Exchange, "127.0.0.1", port)
    return conn


def _request(port: int, body: dict, method: str = "POST", path: str = "/v1/completions") -> bytes:
    data = json.dumps(body).encode() if body else b""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


_keys = itertools.count()


def _streamed(port: int) -> tuple[str, bytes]:
    """A streamed completion whose prompt ends in a fresh key word (the upstream stamps it under that key)."""
    key = f"k{next(_keys)}"
    body = {"model": MODEL, "prompt": f"hello world {key}", "max_tokens": TOKENS, "stream": True}
    return key, _request(port, body)


async def _conn_loop(
    port: int,
    make: Callable[[], tuple[str, bytes]],
    count: int | None,
    stop_at: float | None,
    out: list[ClientStamps],
    delay_s: float = 0.0,
) -> None:
    conn = await _connect(port)
    await asyncio.sleep(delay_s)
    try:
        done = 0
        while (count is None or done < count) and (stop_at is None or time.perf_counter() < stop_at):
            key, payload = make()
            sent = await conn.exchange(payload)
            out.append(ClientStamps(key, sent, conn.first, conn.last))
            done += 1
    finally:
        assert conn.transport is not None
        conn.transport.close()


async def latencies(port: int, concurrency: int, per_conn: int, spread_s: float = 0.0) -> list[ClientStamps]:
    """``concurrency`` closed loops of ``per_conn`` streamed requests each; loop i starts ``i / concurrency``
    of ``spread_s`` late. With ``spread_s`` = one request's duration the loops stay out of phase, as
    independent clients are: started together they would stay in lockstep (equal durations), and every
    request would arrive together with all the others, a burst no steady load makes."""
    out: list[ClientStamps] = []
    await asyncio.gather(
        *(
            _conn_loop(port, lambda: _streamed(port), per_conn, None, out, spread_s * i / concurrency)
            for i in range(concurrency)
        )
    )
    return out


def _closed_loops(port: int, seconds: float, concurrency: int) -> tuple[int, float]:
    """``concurrency`` closed loops of short non-streamed completions for ``seconds``: (answers, elapsed s).

    Runs in a child process (``max_rps``): the upstream lives in the benchmark's process and event loop, so a
    load generator there would share that loop with it and saturate before the routers do.
    """

    async def run() -> tuple[int, float]:
        payload = _request(port, {"model": MODEL, "prompt": "hello world", "max_tokens": 1})
        done: list[ClientStamps] = []
        start = time.perf_counter()
        stop = start + seconds
        await asyncio.gather(
            *(_conn_loop(port, lambda: ("", payload), None, stop, done) for _ in range(concurrency))
        )
        return len(done), time.perf_counter() - start

    _use_uvloop()
    return asyncio.run(run())


async def max_rps(
    port: int, seconds: float, pgid: int | None, pool: ProcessPoolExecutor, concurrency: int = 64
) -> tuple[float, float]:
    """Requests/s in closed loops driven from ``pool``'s process, and the CPU microseconds per request
    meanwhile of process group ``pgid`` (nan without one)."""
    await latencies(port, 8, 5)  # warm connections and code paths
    cpu0 = process_group_cpu_seconds(pgid) if pgid else 0.0
    loop = asyncio.get_running_loop()
    count, elapsed = await loop.run_in_executor(pool, _closed_loops, port, seconds, concurrency)
    if pgid is None:
        return count / elapsed, math.nan
    return count / elapsed, (process_group_cpu_seconds(pgid) - cpu0) / count * 1e6


def _use_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


def _routers(tokenizer: Path, tmp: Path, upstream: str) -> dict[str, ManagedServer]:
    logs = ROOT / "logs" / "bench"
    ours, sgl, relay = free_port(), free_port(), free_port()
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
        FLOOR: ManagedServer(
            "byte-relay",
            ["taskset", "-c", "0", py, "-m", "benchmarks.byte_relay", str(relay), upstream.rsplit(":", 1)[1]],
            logs / f"byte-relay-{relay}.log",
            f"http://127.0.0.1:{relay}/health",  # the upstream's, through the relay
            cwd=ROOT,
        ),
    }


def _port(server: ManagedServer) -> int:
    return int(server.health_url.split(":")[2].split("/")[0])


def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


async def measure(
    engine: FakeEngine,
    up: int,
    routers: dict[str, ManagedServer],
    reps: int,
    scale: int,
    rps_seconds: float,
    delay_ms: float,
) -> dict:
    ports = {"direct": up, **{name: _port(server) for name, server in routers.items()}}
    spread_s = TOKENS * delay_ms / 1e3  # about one paced request's duration
    for port in ports.values():
        await latencies(port, 16, 20)  # warm-up
    # Per target and level: every request's transit (pooled over rounds), and per round the end-to-end p50/p99.
    moved: dict[str, dict[int, list[Transit]]] = {k: {c: [] for c in CONCURRENCY} for k in TARGETS}
    e2e: dict[str, dict[int, list[tuple[float, float]]]] = {k: {c: [] for c in CONCURRENCY} for k in TARGETS}
    for rep in range(reps):
        for c in CONCURRENCY:
            order = TARGETS[rep % len(TARGETS) :] + TARGETS[: rep % len(TARGETS)]
            for name in order:
                engine.take_stamps()  # forget anything earlier (warm-up, max-rps probes)
                seen = await latencies(ports[name], c, max(1, REQUESTS[c] * scale // c), spread_s)
                moved[name][c] += transits(seen, engine.take_stamps())
                ends = [s.last - s.sent for s in seen]
                e2e[name][c].append((pct(ends, 0.5), pct(ends, 0.99)))
            log(
                f"rep {rep} c{c} transit p50/p99 (ms): "
                + ", ".join(
                    f"{n} {_ms(pct([t.total for t in moved[n][c]], 0.5))}"
                    f"/{_ms(pct([t.total for t in moved[n][c]], 0.99))}"
                    for n in TARGETS
                )
                + "; end-to-end p99: "
                + ", ".join(f"{n} {_ms(e2e[n][c][-1][1])}" for n in TARGETS)
            )
    added: dict[str, dict[str, dict[str, float]]] = {}
    added_ttft: dict[str, dict[str, dict[str, float]]] = {}
    added_e2e: dict[str, dict[str, dict[str, float]]] = {}
    for name in RELAYS:
        added[name], added_ttft[name], added_e2e[name] = {}, {}, {}
        for c in CONCURRENCY:
            mine, direct = moved[name][c], moved["direct"][c]
            added[name][f"c{c}"] = added_ms([t.total for t in mine], [t.total for t in direct])
            added_ttft[name][f"c{c}"] = added_ms([t.ttft for t in mine], [t.ttft for t in direct])
            added_e2e[name][f"c{c}"] = {
                f"p{q}": _ms(
                    statistics.median(
                        r[i] - d[i] for r, d in zip(e2e[name][c], e2e["direct"][c], strict=True)
                    )
                )
                for i, q in ((0, 50), (1, 99))
            }
    transit_ms = {
        name: {
            f"c{c}": {
                "p50": _ms(pct([t.total for t in moved[name][c]], 0.5)),
                "p99": _ms(pct([t.total for t in moved[name][c]], 0.99)),
                "forward_p50": _ms(pct([t.forward for t in moved[name][c]], 0.5)),
                "back_p50": _ms(pct([t.last_back for t in moved[name][c]], 0.5)),
            }
            for c in CONCURRENCY
        }
        for name in TARGETS
    }
    absolute = {
        name: {
            f"c{c}": {
                "p50": _ms(statistics.median(r[0] for r in e2e[name][c])),
                "p99": _ms(statistics.median(r[1] for r in e2e[name][c])),
            }
            for c in CONCURRENCY
        }
        for name in TARGETS
    }
    rps: dict[str, list[float]] = {name: [] for name in TARGETS}
    cpu: dict[str, list[float]] = {name: [] for name in TARGETS}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        await asyncio.get_running_loop().run_in_executor(pool, _use_uvloop)  # start it before measuring
        for rep in range(reps):
            for name in TARGETS:
                # The direct upstream is this process, which also serves the routers' legs: no CPU figure.
                pgid = routers[name].pid if name in routers else None
                rate, cpu_us = await max_rps(ports[name], rps_seconds, pgid, pool)
                rps[name].append(rate)
                cpu[name].append(cpu_us)
            log(
                f"rep {rep} max rps: "
                + ", ".join(f"{n} {rps[n][-1]:.0f} ({cpu[n][-1]:.0f} us CPU/request)" for n in TARGETS)
            )
    # Above the floor: what a router adds beyond what a zero-work byte relay in its place adds.
    over_floor = {
        name: {
            f"c{c}": added_ms([t.total for t in moved[name][c]], [t.total for t in moved[FLOOR][c]])
            for c in CONCURRENCY
        }
        for name in ROUTERS
    }
    return {
        "added_ms": added,
        "max_rps": {name: round(statistics.median(rps[name])) for name in RELAYS},
        "added_over_byte_relay_ms": over_floor,
        "added_ttft_ms": added_ttft,
        "added_e2e_ms": added_e2e,
        "transit_ms": transit_ms,
        "latency_ms": absolute,
        "direct_max_rps": round(statistics.median(rps["direct"])),
        # CPU time the server spent per request during the max-rps runs (less sensitive to other load).
        "cpu_us_per_request": {name: round(statistics.median(cpu[name])) for name in routers},
        "conditions": {
            "reps": reps,
            "requests": {f"c{c}": REQUESTS[c] * scale for c in CONCURRENCY},
            "tokens": TOKENS,
            "upstream_token_delay_ms": delay_ms,
            "client_start_spread_s": TOKENS * delay_ms / 1e3,
            "added_method": "transit = (upstream arrival - sent) + (last byte back - upstream [DONE]); "
            "router percentile - direct percentile, all rounds pooled",
            "router_core": 0,
            "client_and_upstream": "one process (one event loop) on core 1",
        },
    }


async def _run(args: argparse.Namespace, tmp: Path) -> dict:
    """Start the upstream in this process, then the routers in front of it; measure; stop everything."""
    engine = FakeEngine(model=MODEL, token_delay_s=args.token_delay_ms / 1e3, stamps={})
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    up = free_port()
    # The upstream first: sglang-router gives up on a worker it cannot reach at start-up.
    await web.TCPSite(runner, "127.0.0.1", up).start()
    routers = _routers(args.tokenizer, tmp, f"http://127.0.0.1:{up}")
    try:
        for server in routers.values():
            server.start()
        for server in routers.values():
            await asyncio.to_thread(server.wait_healthy, 120)  # this loop serves their health checks
        log("upstream, pd-router and sglang-router are up")
        return await measure(
            engine, up, routers, args.reps, args.scale, args.rps_seconds, args.token_delay_ms
        )
    finally:
        for server in routers.values():
            server.stop()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_tok = os.environ.get("PD_TEST_MODEL", str(ROOT / ".cache" / "models" / "tiny-llama"))
    parser.add_argument("--tokenizer", type=Path, default=Path(default_tok), help="dir with tokenizer.json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1, help="multiply the number of requests per level")
    parser.add_argument(
        "--token-delay-ms",
        type=float,
        default=DEFAULT_TOKEN_DELAY_MS,
        help="upstream pause between tokens (5 = 200 tokens/s per stream; 0: as fast as it can send)",
    )
    parser.add_argument("--rps-seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    if not (args.tokenizer / "tokenizer.json").exists():
        parser.error(f"no tokenizer.json in {args.tokenizer} (run `make model` or pass --tokenizer)")
    _use_uvloop()
    # sglang-router opens connections with an HTTP/2 preface, which the in-process upstream's aiohttp server
    # logs as a bad request with a traceback; a real failure of the upstream fails a request here instead.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    os.sched_setaffinity(0, {1})
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(_run(args, Path(tmp)))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
