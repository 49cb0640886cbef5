"""TTFT and ITL through pd-router (P->D) against colocated, measured by vLLM's own load generator.

Issue 18's user-side measurement, rerunnable: one P (core 0), one D (core 1) and pd-router (flow pd-push,
every prompt P->D), the same cluster as ``benchmarks.first_token`` (``--confine`` too); ``pd-vllm bench
serve`` (vLLM's ``vllm bench serve`` behind pd-disagg's version shim) sends ``--num-prompts`` random-token prompts of
``--input-len`` tokens, ``--output-len`` tokens each (ignore_eos), Poisson at ``--rate`` requests/s, streamed:
- ``pd``: to pd-router (P->D);
- ``colocated``: straight to D (D prefills and decodes).
Each repetition runs both, in alternating order, with fresh prompts (its own dataset seed, so no prefix-cache
hits). Every ``pd`` run must have moved KV (P's ``bytes_sent`` grows) and every ``colocated`` run none.
Reported: vLLM's median and p99 TTFT and ITL and output tokens/s per system (medians over repetitions), and
pd / colocated. Progress on stderr; the last stdout line is the JSON summary (docs/performance.md
``## bench_serve``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.first_token import SERVED, Cluster
from integration_tests.pd_checks import metric
from pd_connector.vllm.config import PDConnectorConfig
from pd_disagg.engines import base_url

LOG_DIR = Path("logs/benchmarks/bench_serve")
#: vLLM's result keys reported (ms, except output_throughput in tokens/s).
KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")


def log(msg: str) -> None:
    print(f"[bench_serve] {msg}", file=sys.stderr, flush=True)


def dataset_seed(rep: int, name: str) -> int:
    """The random dataset's seed of one run: its own per repetition AND system, so no run's prompts are in a
    server's prefix cache from an earlier run (the same seed for both systems of a repetition made the second
    one's prompts prefix-cache hits on D)."""
    return 1 + 2 * rep + ("pd", "colocated").index(name)


def bench(url: str, model: Path, args: argparse.Namespace, seed: int, name: str) -> dict[str, float]:
    """One ``pd-vllm bench serve`` run against ``url``; vLLM's result (KEYS)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    result = LOG_DIR / f"{name}.json"
    result.unlink(missing_ok=True)
    pd_vllm = Path(sys.executable).with_name("pd-vllm")
    argv = [
        str(pd_vllm), "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", SERVED,
        "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--request-rate", str(args.rate), "--ignore-eos", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
        "--save-result", "--result-dir", str(LOG_DIR), "--result-filename", result.name,
    ]  # fmt: skip
    with open(LOG_DIR / f"{name}.log", "w") as out:
        subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=args.timeout_s, env=os.environ
        )
    data = json.loads(result.read_text())
    if data.get("completed") != args.num_prompts:
        raise RuntimeError(f"{name}: {data.get('completed')} of {args.num_prompts} requests completed")
    return {key: float(data[key]) for key in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path(".cache/models/tiny-llama"))
    parser.add_argument("--input-len", type=int, default=400)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per bench serve run")
    parser.add_argument(
        "--confine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep each server's every process on its core, as on separate hosts (benchmarks.first_token)",
    )
    args = parser.parse_args()
    model = args.model.resolve()
    cluster = Cluster(
        "bench_serve",
        model,
        "tcp",
        PDConnectorConfig.idle_spin_s,
        args.input_len + args.output_len + 16,
        False,
        args.confine,
    )
    runs: dict[str, list[dict[str, float]]] = {"pd": [], "colocated": []}
    try:
        cluster.start()
        p_url, d_url = base_url(cluster.p), base_url(cluster.d)
        targets = {"pd": cluster.router, "colocated": d_url}
        for rep in range(args.reps):
            order = ["pd", "colocated"] if rep % 2 == 0 else ["colocated", "pd"]
            for name in order:
                sent = metric(p_url, "vllm:pd_connector_bytes_sent_total")
                runs[name].append(bench(targets[name], model, args, seed=dataset_seed(rep, name), name=name))
                moved = metric(p_url, "vllm:pd_connector_bytes_sent_total") - sent
                if (name == "pd") != (moved > 0):
                    raise RuntimeError(f"{name} run moved {moved} bytes of KV")
                log(
                    f"rep {rep + 1}/{args.reps} {name}: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in runs[name][-1].items())
                )
    finally:
        cluster.close()
    medians = {
        name: {k: round(statistics.median(r[k] for r in rs), 2) for k in KEYS} for name, rs in runs.items()
    }
    ratios = {
        k: round(medians["pd"][k] / medians["colocated"][k], 3) for k in KEYS if medians["colocated"][k]
    }
    conditions = {k: v for k, v in vars(args).items() if k != "model"} | {"model": str(args.model)}
    print(json.dumps({"medians": medians, "pd_vs_colocated": ratios, "conditions": conditions}))


if __name__ == "__main__":
    main()
