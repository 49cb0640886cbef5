"""The P/D path's fixed cost: TTFT and ITL through pd-router (P->D) against colocated, per prompt length, with
where the first token's time went.

Per model (``--models``: the real SmolLM2-135M-Instruct, on prompts of real text from ``benchmarks.prompts``;
the tiny test model and the bench model, on random token ids), one P (core 0), one D (core 1; with
``--confine``, the default, each server's every process stays on its core, standing in for separate hosts:
otherwise a waiting D's front end and idle steps run on P's core and slow its prefill) and pd-router
(flow pd-push, every prompt P->D) run with the first-token trace on (P, D and the router append to one trace
file, docs/architecture.md ``## First-token trace``). For each prompt length (``--lengths``) and repetition,
in shuffled order and each with a fresh random token-id prompt (no prefix-cache hits), three streamed
requests are timed on the client side (greedy, ``--max-tokens`` each, float32 so P's and D's tokens agree):
- ``pd``: through pd-router (P->D);
- ``colocated``: straight to D, no transfer (D prefills and decodes);
- ``prefill``: straight to P with ``max_tokens`` 1: P's prefill alone.
``fixed_overhead_ms`` is, per P/D request, its client-side TTFT minus P's own time on that same request
(``P_SPAN``: the router sent P's leg -> P's prefill ended, which holds vLLM's front end on P and the prefill,
both paid by a request sent straight to P too), then the median: what the P/D path adds around P's work,
an upper bound (P's output path is counted in it, though a request straight to P pays that too). Pairing
within one request keeps it measurable where P's prefill varies between requests by more than the overhead
(the bench model here). ``fixed_overhead_unpaired_ms`` is the older estimate, per repetition TTFT pd minus
the prefill request's TTFT, then the median. ITL is the gaps between the events the client got (one per
token unless an engine merged them), pd vs colocated; ``first_gap_ms`` is the first of them (with
first-token seeding, P's token to the first token D sampled), the rest are ``later_itl_ms``. ``stages_ms``
gives, per way the first token came (``PATHS``: P's answer or D's stream, whichever reached the router
first), how many P/D requests took it and the median of each span between anchor stamps of their trace
records along it.

Progress on stderr; the last stdout line is the JSON summary; ``--plot`` writes a PNG of the stages
(docs/performance.md ``## first_token``).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.prompts import RealPrompts
from pd_connector.trace import TraceRecord, read_trace
from pd_connector.vllm.config import PDConnectorConfig
from pd_disagg.engines import base_url, router_server, vllm_server, write_router_config
from pd_disagg.servers import ManagedServer, free_port
from pd_disagg.smollm2 import chat_model
from pd_disagg.tiny_model import bench_model

LOG_DIR = Path("logs/benchmarks/first_token")
SERVED = "model"
#: The first token's path as spans between anchor stamps, in order: (name, (component, stage) from, to), by
#: the path it took. With first-token seeding in pd-push (no logprobs asked) the client's first token is P's,
#: and it comes by whichever reaches the router first: P's answer (``via_prefill``) or D's stream, which
#: carries it too (``via_decode``: through the hand-off to D). Each path's spans add up to the router's TTFT;
#: components are the trace records' (prefill, decode, router).
Spans = tuple[tuple[str, tuple[str, str], tuple[str, str]], ...]
_TO_PROMPT_DONE: Spans = (
    ("router_in", ("router", "received"), ("router", "prefill_sent")),
    ("to_p_engine", ("router", "prefill_sent"), ("prefill", "offered")),
    ("p_prefill", ("prefill", "offered"), ("prefill", "prompt_done")),
)
PATHS: dict[str, Spans] = {
    "via_prefill": (
        *_TO_PROMPT_DONE,
        ("p_answer", ("prefill", "prompt_done"), ("router", "prefill_returned")),
        ("router_out", ("router", "prefill_returned"), ("router", "client_first_byte")),
    ),
    "via_decode": (
        *_TO_PROMPT_DONE,
        ("p_exposed_transfer", ("prefill", "prompt_done"), ("prefill", "done")),
        ("done_to_d", ("prefill", "done"), ("decode", "done")),
        ("d_report", ("decode", "done"), ("decode", "reported")),
        ("d_first_token", ("decode", "reported"), ("router", "decode_first_event")),
        ("router_out", ("router", "decode_first_event"), ("router", "client_first_byte")),
    ),
}
#: P's own time on a P/D request, what a request sent straight to P pays too: vLLM's front end and the
#: prefill.
P_SPAN: tuple[tuple[str, str], tuple[str, str]] = (("router", "prefill_sent"), ("prefill", "prompt_done"))


def log(msg: str) -> None:
    print(f"[first_token] {msg}", file=sys.stderr, flush=True)


def stream(url: str, body: dict[str, Any]) -> tuple[list[float], str]:
    """POST a streamed completion; seconds from sending until each event, and the route pd-router took."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
    arrivals: list[float] = []
    while line := resp.readline():
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            arrivals.append(time.perf_counter() - t0)
    conn.close()
    return arrivals, resp.getheader("X-PD-Route") or ""


def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed greedy completion of exactly ``max_tokens`` tokens."""
    return {
        "model": SERVED,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


class Cluster:
    """P, D and pd-router for one model, with the trace on; stopped by ``close`` (also on failure)."""

    def __init__(
        self,
        name: str,
        model: Path,
        transport: str,
        idle_spin_s: float,
        max_len: int,
        real_text: bool,
        confine: bool,
    ) -> None:
        self.trace = (LOG_DIR / f"{name}-trace.jsonl").resolve()
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        self.trace.unlink(missing_ok=True)
        side = free_port()
        extra = {"transport": transport, "trace_path": str(self.trace), "idle_spin_s": idle_spin_s}
        kv = {
            "prefill": {
                "kv_connector": "PDConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {**extra, "side_channel_port": side},
            },
            "decode": {
                "kv_connector": "PDConnector",
                "kv_role": "kv_consumer",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            },
        }
        self.p, self.d = (
            vllm_server(
                model,
                log_dir=LOG_DIR,
                name=f"{name}-{role}",
                cpu_core=core,
                confine=confine,
                dtype="float32",
                max_model_len=max_len,
                kv_transfer_config=kv[role],
                extra_args=["--served-model-name", SERVED],
            )
            for role, core in (("prefill", 0), ("decode", 1))
        )
        self.servers: list[ManagedServer] = [self.p, self.d]
        self.name, self.model, self.side, self.max_len = name, model, side, max_len
        self.vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        self.real = RealPrompts(model) if real_text else None

    def prompt(self, tokens: int, rng: random.Random) -> list[int]:
        """A fresh prompt of ``tokens`` token ids (no prefix-cache hit): real text, or random ids."""
        if self.real is not None:
            return self.real.document(tokens, rng)
        return [rng.randrange(10, self.vocab) for _ in range(tokens)]

    def start(self) -> None:
        for server in self.servers:
            server.start()
        for server in self.servers:
            server.wait_healthy(900)
        config = write_router_config(
            LOG_DIR / f"{self.name}-router.toml",
            flow="pd-push",
            sections={
                "server": {"trace_path": str(self.trace)},
                "model": {"path": str(self.model), "served_names": [SERVED], "max_model_len": self.max_len},
                "policy": {"threshold_tokens": 1},
            },
            prefill=[{"url": base_url(self.p), "bootstrap": f"127.0.0.1:{self.side}"}],
            decode=[{"url": base_url(self.d)}],
        )
        router = router_server(config, log_dir=LOG_DIR, port=free_port(), name=f"{self.name}-router")
        self.servers.append(router)
        router.start()
        router.wait_healthy(120)
        self.router = base_url(router)

    def close(self) -> None:
        for server in reversed(self.servers):
            server.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def joined(records: list[TraceRecord]) -> dict[str, dict[str, dict[str, float]]]:
    """Transfer id -> component -> stages, of the router's records and the engines' completed transfers."""
    by_id: dict[str, dict[str, dict[str, float]]] = {}
    for record in records:
        if record.transfer_id and (record.component == "router" or record.state == "done"):
            by_id.setdefault(record.transfer_id, {})[record.component] = record.stages
    return by_id


def span_ms(parts: dict[str, dict[str, float]], start: tuple[str, str], end: tuple[str, str]) -> float | None:
    """Milliseconds from ``start`` to ``end`` (component, stage) of one joined request, None if one is
    missing."""
    (ca, sa), (cb, sb) = start, end
    if sa in parts.get(ca, {}) and sb in parts.get(cb, {}):
        return 1000 * (parts[cb][sb] - parts[ca][sa])
    return None


def path_of(parts: dict[str, dict[str, float]]) -> str:
    """Which way a joined request's first token came: the router stamps ``decode_continued`` (D's own stream
    joining after the first token) only where P's answer was the first token."""
    return "via_prefill" if "decode_continued" in parts.get("router", {}) else "via_decode"


def stage_breakdown(records: list[TraceRecord]) -> dict[str, dict[str, Any]]:
    """Per path (``PATHS``) the requests whose three records are complete and whose first token came that way:
    how many, and the median milliseconds of each span along it."""
    values: dict[str, dict[str, list[float]]] = {
        path: {n: [] for n, _, _ in spans} for path, spans in PATHS.items()
    }
    counts = dict.fromkeys(PATHS, 0)
    for parts in joined(records).values():
        path = path_of(parts)
        if "prefill" in parts and "decode" in parts:
            counts[path] += 1
        for name, start, end in PATHS[path]:
            if (ms := span_ms(parts, start, end)) is not None:
                values[path][name].append(ms)
    return {
        path: {
            "requests": counts[path],
            **{name: round(statistics.median(v), 2) for name, v in values[path].items() if v},
        }
        for path in PATHS
    }


def paired_overhead(records: list[TraceRecord], ttft_s: dict[str, float]) -> list[float]:
    """Per P/D request (transfer id -> client TTFT in s): TTFT minus P's own time on it (``P_SPAN``), in
    ms."""
    by_id = joined(records)
    out = []
    for tid, ttft in ttft_s.items():
        if (p_ms := span_ms(by_id.get(tid, {}), *P_SPAN)) is not None:
            out.append(1000 * ttft - p_ms)
    return out


def gap_stats(arrivals: list[list[float]]) -> dict[str, dict[str, float]]:
    """p50/p99 ms of all gaps between events, of the first gap of each request, and of the later ones."""
    every = [b - a for events in arrivals for a, b in itertools.pairwise(events)]
    first = [events[1] - events[0] for events in arrivals if len(events) > 1]
    later = [b - a for events in arrivals for a, b in itertools.pairwise(events[1:])]
    return {
        key: {"p50": round(1000 * percentile(v, 0.5), 2), "p99": round(1000 * percentile(v, 0.99), 2)}
        for key, v in (("itl_ms", every), ("first_gap_ms", first), ("later_itl_ms", later))
        if v
    }


def measure(
    cluster: Cluster, lengths: list[int], reps: int, max_tokens: int, rng: random.Random
) -> dict[str, Any]:
    """Every length ``reps`` times (shuffled), pd / colocated / prefill each with a fresh prompt."""
    order = [(length, rep) for length in lengths for rep in range(reps)]
    rng.shuffle(order)
    for length in lengths:  # warm-up: first requests compile and allocate
        stream(cluster.router, body(cluster.prompt(length, rng), 2))
        stream(base_url(cluster.d), body(cluster.prompt(length, rng), 2))
    cluster.trace.write_bytes(b"")  # only measured requests from here on
    ttft: dict[tuple[int, str], list[float]] = {}
    events: dict[tuple[int, str], list[list[float]]] = {}
    unpaired: dict[int, list[float]] = {}
    pd_ttft: dict[int, dict[str, float]] = {length: {} for length in lengths}
    for i, (length, _) in enumerate(order):
        seen = {r.transfer_id for r in read_trace(str(cluster.trace)) if r.component == "router"}
        pd, route = stream(cluster.router, body(cluster.prompt(length, rng), max_tokens))
        if route != "disagg":
            raise RuntimeError(f"pd-router sent a {length}-token prompt {route!r}, not P->D")
        new = {r.transfer_id for r in read_trace(str(cluster.trace)) if r.component == "router"} - seen
        if len(new) != 1:
            raise RuntimeError(f"expected one new router trace record for a P/D request, found {len(new)}")
        pd_ttft[length][new.pop()] = pd[0]
        colocated, _ = stream(base_url(cluster.d), body(cluster.prompt(length, rng), max_tokens))
        prefill, _ = stream(base_url(cluster.p), body(cluster.prompt(length, rng), 1))
        for kind, arrivals in (("pd", pd), ("colocated", colocated), ("prefill", prefill)):
            ttft.setdefault((length, kind), []).append(arrivals[0])
            events.setdefault((length, kind), []).append(arrivals)
        unpaired.setdefault(length, []).append(pd[0] - prefill[0])
        log(f"{cluster.name}: {i + 1}/{len(order)} ({length} tokens) ttft pd {pd[0] * 1000:.1f} ms")
    records = read_trace(str(cluster.trace))
    out: dict[str, Any] = {}
    for length in lengths:
        ms = {kind: 1000 * statistics.median(ttft[length, kind]) for kind in ("pd", "colocated", "prefill")}
        mine = [r for r in records if r.transfer_id in pd_ttft[length]]
        paired = paired_overhead(mine, pd_ttft[length])
        if len(paired) != len(pd_ttft[length]):
            raise RuntimeError(f"{len(pd_ttft[length]) - len(paired)} P/D requests lack P's trace stamps")
        gaps = {kind: gap_stats(events[length, kind]) for kind in ("pd", "colocated")}
        out[str(length)] = {
            "ttft_ms": {k: round(v, 2) for k, v in ms.items()},
            "ttft_pd_vs_colocated": round(ms["pd"] / ms["colocated"], 3),
            "fixed_overhead_ms": round(statistics.median(paired), 2),
            "fixed_overhead_p99_ms": round(percentile(paired, 0.99), 2),
            "fixed_overhead_unpaired_ms": round(1000 * statistics.median(unpaired[length]), 2),
            **{key: {kind: gaps[kind][key] for kind in gaps} for key in gaps["pd"]},
            "stages_ms": stage_breakdown(mine),
        }
    return out


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Two panels per model and length: TTFT of pd and of P's prefill alone against colocated, and the first
    token's stages other than P's prefill (what the P/D path adds around it), stacked, in ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(model, length) for model, per in results.items() for length in per]
    labels = [f"{model}\n{length} tok" for model, length in cases]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7, 1.3 * len(labels)), 7.5), sharex=True)
    x = range(len(cases))
    for offset, kind in ((-0.2, "pd"), (0.2, "prefill")):
        ratios = [results[m][n]["ttft_ms"][kind] / results[m][n]["ttft_ms"]["colocated"] for m, n in cases]
        top.bar([i + offset for i in x], ratios, width=0.4, label=f"TTFT {kind} / colocated")
    top.axhline(1.0, color="black", linewidth=0.8)
    top.set_ylabel("x colocated TTFT (median)")
    top.legend(fontsize=8)
    top.set_title("First token through pd-router (P->D)")
    for offset, (way, spans) in zip((-0.2, 0.2), PATHS.items(), strict=True):
        bottoms = [0.0] * len(cases)
        for name, _, _ in spans:
            if name == "p_prefill":
                continue
            values = [results[m][n]["stages_ms"][way].get(name, 0.0) for m, n in cases]
            label = f"{name} ({way})" if name not in ("router_in", "to_p_engine") or offset < 0 else None
            bottom.bar([i + offset for i in x], values, width=0.4, bottom=bottoms, label=label)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    bottom.set_ylabel("ms (median per stage)")
    bottom.set_title(
        "Stages besides P's prefill, by the way the first token came (left: P's answer, right: D's stream)",
        fontsize=9,
    )
    bottom.set_xticks(list(x), labels)
    bottom.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="smollm2,tiny,bench", help="comma-separated: smollm2, tiny, bench"
    )
    parser.add_argument("--tiny-model", type=Path, default=Path(".cache/models/tiny-llama"))
    parser.add_argument("--lengths", default="64,400,2000", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "ucx", "cma"])
    parser.add_argument(
        "--idle-spin-s",
        type=float,
        default=PDConnectorConfig.idle_spin_s,
        help="the connector's idle_spin_s on P and D (1: vLLM's own spin)",
    )
    parser.add_argument(
        "--confine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep each server's every process on its core, as on separate hosts "
        "(else only vLLM's OpenMP threads)",
    )
    parser.add_argument("--plot", type=Path, help="write the stage breakdown as a PNG here")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(0)
    results: dict[str, dict[str, Any]] = {}
    for name in args.models.split(","):
        model = {"smollm2": chat_model, "tiny": lambda: args.tiny_model, "bench": bench_model}[name]()
        max_len = max(lengths) + args.max_tokens + 8
        cluster = Cluster(
            name,
            model.resolve(),
            args.transport,
            args.idle_spin_s,
            max_len,
            real_text=name == "smollm2",
            confine=args.confine,
        )
        try:
            log(f"{name}: starting P, D and pd-router")
            cluster.start()
            results[name] = measure(cluster, lengths, args.reps, args.max_tokens, rng)
        finally:
            cluster.close()
    if args.plot:
        plot(results, args.plot)
    summary = {
        "results": results,
        "conditions": {
            "reps": args.reps,
            "max_tokens": args.max_tokens,
            "transport": args.transport,
            "idle_spin_s": args.idle_spin_s,
            "confine": args.confine,
            "flow": "pd-push",
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
