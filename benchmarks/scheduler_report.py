"""What ``benchmarks.scheduler`` records besides the token timings (which process had the cores) and the
gap plot it draws; both run in the benchmark's harness process."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pd_disagg.servers import descendants, process_cpu_seconds
from scheduler_plugins.step_clock import RunQueueWait


def process_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's own process (``api_server``: vLLM's front end)
    and of its live descendants, summed by process name (vLLM names them: ``VLLM::EngineCor``,
    ``VLLM::Worker``, ...), from ``/proc``: which process had the cores; and, as ``<name> wait``, the seconds
    their main threads spent runnable but waiting for a CPU (``schedstat``): how much other processes kept
    them off."""
    own = process_cpu_seconds(root)
    out = {"api_server": own[1] if own else 0.0, "api_server wait": RunQueueWait([root]).seconds()}
    for pid in descendants(root):
        got = process_cpu_seconds(pid)
        if got is None:
            continue  # the process ended while we listed them
        name, cpu = got
        out[name] = out.get(name, 0.0) + cpu
        out[f"{name} wait"] = out.get(f"{name} wait", 0.0) + RunQueueWait([pid]).seconds()
    return out


def plot(results: dict[str, dict], target_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.6 * len(results)), sharex=True, sharey=True)
    for ax, (name, res) in zip(axes, results.items(), strict=True):
        gaps = np.array(res["gaps"])
        for w0, w1 in res["windows"]:
            ax.axvspan(w0, w1, color="orange", alpha=0.15, lw=0)
        ax.scatter(gaps[:, 0], gaps[:, 1], s=3)
        ax.axhline(target_ms, color="red", ls="--", lw=1, label=f"ITL target {target_ms:g} ms")
        ax.set_yscale("log")
        ax.set_ylabel("gap (ms)")
        ax.set_title(
            f"{name}: max {res['itl_max_ms']:.0f} ms, window p99 {res['itl_window_p99_ms']:.0f} ms, "
            f"TTFT(long) p50 {res['ttft_long_p50_ms']:.0f} ms",
            fontsize=9,
        )
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("time (s); shaded: long prompt waiting for its first token")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
