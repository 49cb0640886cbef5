"""TTFT of SGLang P->D with the ``pd`` backend pushing KV layer by layer vs per chunk, side by side in one run.

Starts one decode server (D) and two prefill servers on the same core: one pushing each layer as its forward pass
writes it (``PD_SGLANG_LAYERWISE=1``, the default) and one pushing every layer of a chunk after its forward pass
(``PD_SGLANG_LAYERWISE=0``, what SGLang's own backends do). Each repetition sends one new long prompt (a
unique first line, so no prefix cache hit) through both prefill servers, in alternating order, with
``max_new_tokens=1``: D answers once the KV has landed and ``Done`` came, so D's reply time is the
time to first token. Reports medians, the ratio layer-wise / per-chunk, P's exposed transfer time (end of the
last forward until every write landed) and transfer time from each P's ``/metrics``, and the layer-push counts
that show which mode each P ran. Prints one JSON object as its last stdout line.

    flock /tmp/pd-engines.lock python -m benchmarks.sglang_layerwise --reps 7
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from integration_tests.pd_checks import metric
from integration_tests.sglang_client import generate_pd
from pd_disagg.engines import base_url, sglang_server
from pd_disagg.servers import ManagedServer, free_port

MODES = ("layerwise", "per_chunk")
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / ".cache" / "models" / "tiny-llama"


def long_prompt(rep: int, lines: int) -> str:
    """A prompt of ``lines`` code lines (~18 tokens each) whose first line makes it unique to ``rep``."""
    return f"# request {rep}\n" + "".join(f"x_{i} = combine(x_{i - 1}, {i * 7})\n" for i in range(1, lines))


def _p_metric(server: ManagedServer, key: str, labels: dict[str, str] | None = None) -> float:
    return metric(base_url(server), f"sglang:pd_connector_{key}", labels)


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sglang-layerwise-"))
    make = functools.partial(
        sglang_server,
        args.model,
        log_dir=log_dir,
        context_length=2048,
        max_total_tokens=8192,
        extra_args=("--chunked-prefill-size", str(args.chunk), "--enable-metrics"),
    )
    env = {"PD_SGLANG_TRANSPORT": args.transport}
    ports = {mode: free_port() for mode in MODES}
    prefill = {
        mode: make(
            name=f"sglang-prefill-{mode}",
            cpu_core=0,
            disaggregation_mode="prefill",
            bootstrap_port=ports[mode],
            env={**env, "PD_SGLANG_LAYERWISE": "1" if mode == "layerwise" else "0"},
        )
        for mode in MODES
    }
    decode = make(name="sglang-decode", cpu_core=1, disaggregation_mode="decode", env=env)
    servers = [*prefill.values(), decode]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_healthy(600)
        ttft: dict[str, list[float]] = {mode: [] for mode in MODES}
        prompt_tokens = 0

        def send(mode: str, prompt: str) -> float:
            p, d = generate_pd(
                base_url(prefill[mode]),
                base_url(decode),
                ("127.0.0.1", ports[mode]),
                prompt,
                1,
                timeout_s=300,
            )
            if not (p.ok and d.ok):
                raise RuntimeError(f"{mode}: request failed: {p} {d}")
            nonlocal prompt_tokens
            prompt_tokens = int(p.body["meta_info"]["prompt_tokens"])
            return d.seconds

        for mode in MODES:  # warm-up, not counted
            send(mode, long_prompt(-1, args.lines))
        keys = (
            "exposed_seconds_sum",
            "exposed_seconds_count",
            "transfer_seconds_sum",
            "transfer_seconds_count",
        )
        before = {(mode, k): _p_metric(prefill[mode], k) for mode in MODES for k in keys}
        for rep in range(args.reps):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                ttft[mode].append(send(mode, long_prompt(rep, args.lines)))

        def mean_ms(mode: str, series: str) -> float:
            total = _p_metric(prefill[mode], f"{series}_sum") - before[(mode, f"{series}_sum")]
            count = _p_metric(prefill[mode], f"{series}_count") - before[(mode, f"{series}_count")]
            return round(1000 * total / count, 2) if count else float("nan")

        median_ms = {mode: round(1000 * statistics.median(ttft[mode]), 1) for mode in MODES}
        return {
            "benchmark": "sglang_layerwise",
            "conditions": "CPU only, 2 cores (P servers on core 0, D on core 1), tiny model, bf16",
            "model": str(args.model),
            "transport": args.transport,
            "prompt_tokens": prompt_tokens,
            "chunked_prefill_size": args.chunk,
            "reps": args.reps,
            "ttft_ms_median": median_ms,
            "ttft_ms": {mode: [round(1000 * s, 1) for s in ttft[mode]] for mode in MODES},
            "ttft_ratio_layerwise_per_chunk": round(median_ms["layerwise"] / median_ms["per_chunk"], 3),
            "exposed_transfer_ms_mean": {mode: mean_ms(mode, "exposed_seconds") for mode in MODES},
            "transfer_ms_mean": {mode: mean_ms(mode, "transfer_seconds") for mode in MODES},
            "layer_pushes": {
                mode: {
                    when: _p_metric(prefill[mode], "layer_pushes_total", {"when": when})
                    for when in ("forward", "computed", "chunk")
                }
                for mode in MODES
            },
            "log_dir": str(log_dir),
        }
    finally:
        for server in servers:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--lines", type=int, default=80, help="prompt lines (~18 tokens each)")
    parser.add_argument(
        "--chunk", type=int, default=256, help="--chunked-prefill-size of the prefill servers"
    )
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--transport", default="tcp", choices=("tcp", "ucx", "cma"))
    parser.add_argument("--log-dir", default=None)
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
