"""What ``benchmarks.scheduler`` records besides the token timings (which process had the cores) and the
gap plot it draws; both run in the benchmark's harness process."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from scheduler_plugins.step_clock import RunQueueWait


def process_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's own process (``api_server``: vLLM's front end)
    and of its descendants, summed by process name (vLLM names them: ``VLLM::EngineCor``, ``VLLM::Worker``,
    ...), from ``/proc``: which process had the cores; and, as ``<name> wait``, the seconds their main
    threads spent runnable but waiting for a CPU (``schedstat``): how much other processes kept them off."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu, name = {}, {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # the process ended while we listed them
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; fields[0] is the state
        pid = int(stat.parent.name)
        parent[pid], cpu[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
        name[pid] = text[text.index("(") + 1 : text.rindex(")")]

    def under(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == root:
                return True
        return False

    out = {"api_server": cpu.get(root, 0.0), "api_server wait": RunQueueWait([root]).seconds()}
    for pid in filter(under, cpu):
        out[name[pid]] = out.get(name[pid], 0.0) + cpu[pid]
        out[f"{name[pid]} wait"] = out.get(f"{name[pid]} wait", 0.0) + RunQueueWait([pid]).seconds()
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
