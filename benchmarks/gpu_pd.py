"""P->D on GPU KV caches: two vLLM GPU servers, greedy equality with a colocated answer, transfer GB/s with and
without staging. NOT run in the session that wrote it (no GPU there): docs/performance.md ``## gpu_pd``.

Run as it is on a machine with a CUDA build of vLLM 0.32 and ``pd-disagg[vllm,ucx]``::

    python -m benchmarks.gpu_pd --model /path/to/hf-model [--gpus 0,1] [--prompt-tokens 4000] [--reps 5]

For each data path, in one run, a fresh P (kv_producer) and D (kv_consumer) pair:
- ``ucx_direct``: UCX registers the CUDA caches themselves (cuda_ipc on one host, GPUDirect RDMA across hosts);
- ``ucx_staged``: UCX moves pinned host staging slots (``kv_staging = always``): the device copies cost what they cost;
- ``tcp_staged``: the TCP fallback, which reaches host memory only, so the caches are staged.
Every request's D answer (greedy, ``max_tokens`` tokens, from P's KV) must equal P's own answer to the same
prompt (colocated), and P's ``vllm:pd_connector_bytes_sent_total`` must grow by the prompt's KV with no failures; a
mismatch exits non-zero. GB/s: bytes P sent over P's seconds spent writing (``write_seconds``), median over
``--reps``. ``--gpus 0,1`` puts P and D on two GPUs (NVLink/PCIe between them); one GPU runs both at a
share of its memory (``--gpu-memory-utilization``). Progress on stderr; the last stdout line is the JSON
summary.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.connector import run_pair
from integration_tests.pd_checks import metric
from pd_disagg import pd_client
from pd_disagg.servers import ManagedServer, free_port

LOG_DIR = Path("logs/benchmarks/gpu_pd")
SERVED = "m"
#: (name, transport, kv_staging): the data paths compared in one run.
PATHS = (("ucx_direct", "ucx", "auto"), ("ucx_staged", "ucx", "always"), ("tcp_staged", "tcp", "auto"))


def log(msg: str) -> None:
    print(f"[gpu_pd] {msg}", file=sys.stderr, flush=True)


def server(args: argparse.Namespace, role: str, gpu: str, kv: dict[str, Any]) -> ManagedServer:
    port = free_port()
    argv = [
        sys.executable, "-m", "pd_disagg.vllm_launcher", "serve", args.model,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED,
        "--max-model-len", str(args.prompt_tokens + args.max_tokens + 16), "--seed", "0",
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    env = {"CUDA_VISIBLE_DEVICES": gpu, "VLLM_NO_USAGE_STATS": "1", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    return ManagedServer(
        name=f"{role}-{port}",
        argv=argv,
        log_path=LOG_DIR / f"{role}-{port}.log",
        health_url=f"http://127.0.0.1:{port}/health",
        env=env,
    )


def run_path(
    args: argparse.Namespace, transport: str, staging: str, prompts: list[list[int]]
) -> dict[str, Any]:
    side = free_port()
    extra = {"transport": transport, "kv_staging": staging}
    gpus = args.gpus.split(",")
    p = server(
        args,
        "prefill",
        gpus[0],
        {"kv_connector": "PDConnector", "kv_role": "kv_producer",
         "kv_connector_extra_config": {**extra, "side_channel_port": side}},
    )  # fmt: skip
    d = server(
        args,
        "decode",
        gpus[-1],
        {"kv_connector": "PDConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "fail",
         "kv_connector_extra_config": extra},
    )  # fmt: skip

    def measure(p_url: str, d_url: str) -> dict[str, Any]:
        gbps, per_request = [], []
        for i, prompt in enumerate(prompts):
            body = {"model": SERVED, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            b0 = metric(p_url, "vllm:pd_connector_bytes_sent_total")
            w0 = metric(p_url, "vllm:pd_connector_write_seconds_total")
            answer, p_answer = pd_client.disaggregated(p_url, d_url, f"127.0.0.1:{side}", body, timeout_s=600)
            if isinstance(p_answer, BaseException):
                raise RuntimeError(f"P leg failed: {p_answer!r}")
            expected = pd_client.post_json(p_url + "/v1/completions", body, 600)["choices"][0]["text"]
            time.sleep(1.5)  # connector stats reach /metrics with the next engine steps
            sent = metric(p_url, "vllm:pd_connector_bytes_sent_total") - b0
            seconds = metric(p_url, "vllm:pd_connector_write_seconds_total") - w0
            text = answer["choices"][0]["text"]
            if text != expected or sent <= 0:
                raise RuntimeError(
                    f"request {i}: D answered {text!r}, P alone {expected!r}; {sent:.0f} bytes sent"
                )
            gbps.append(sent / seconds / 1e9 if seconds > 0 else float("inf"))
            per_request.append(sent)
            log(
                f"{transport}/{staging} request {i}: {sent / 1e6:.1f} MB in {seconds * 1e3:.2f} ms write time"
            )
        failures = metric(d_url, "vllm:pd_connector_failures_total") + metric(
            p_url, "vllm:pd_connector_failures_total"
        )
        if failures:
            raise RuntimeError(f"{failures:.0f} transfer failures")
        return {
            "gb_per_s": round(statistics.median(gbps), 3),
            "bytes_per_request": statistics.median(per_request),
        }

    return run_pair([p, d], measure, start_timeout_s=1800, one_by_one=len(gpus) == 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory vLLM serves")
    parser.add_argument("--gpus", default="0", help="CUDA device of P, or 'P,D' for two GPUs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--paths", default=",".join(name for name, _, _ in PATHS))
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_pd needs a CUDA GPU and a CUDA build of vLLM (this machine has none)")
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(args.prompt_tokens)] for _ in range(args.reps)]
    results = {}
    for name, transport, staging in PATHS:
        if name in args.paths.split(","):
            log(f"{name}: starting P and D")
            results[name] = run_path(args, transport, staging, prompts)
    direct = results.get("ucx_direct", {}).get("gb_per_s")
    summary = {
        "benchmark": "gpu_pd",
        "gpu": torch.cuda.get_device_name(0),
        "gpus": args.gpus,
        "prompt_tokens": args.prompt_tokens,
        "reps": args.reps,
        "paths": results,
        "staged_over_direct": {
            name: round(r["gb_per_s"] / direct, 3)
            for name, r in results.items()
            if direct and name != "ucx_direct"
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
