"""The PNG plots of ``benchmarks.goodput``, written by the benchmark process after its runs (matplotlib, Agg).

- ``attainment``: SLO attainment vs Poisson request rate for every system of one workload, at each SLO
  scale (one panel per scale), with the 90% line goodput is read at;
- ``itl_around_long``: every inter-token gap of every request, in a window around one long prompt's
  arrival (the middle long prompt of the run), one panel per system, all at the same request rate: what a
  user streaming an answer sees while a long prompt is prefilled (on the same engine, or on P).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.goodput_analysis import ATTAINMENT, Workload

WINDOW_S = (-5.0, 25.0)  # seconds around the long prompt's arrival


def attainment(
    workload: str, runs: dict[str, list[tuple[float, dict[str, Any]]]], scales: list[float], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scales), figsize=(4.2 * len(scales), 3.6), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], scales, strict=True):
        for system, points in runs.items():
            rates = [r for r, _ in points]
            ax.plot(rates, [100 * p["attainment"][str(k)] for _, p in points], marker="o", label=system)
        ax.axhline(100 * ATTAINMENT, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"{workload}: SLO scale k = {k:g}")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylim(-3, 103)
    axes[0][0].set_ylabel("requests within both SLOs (%)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def itl_around_long(workload: Workload, rate: float, results: dict[str, dict[str, Any]], path: Path) -> bool:
    """Plot the gaps around the middle long prompt of each system's run at ``rate``; False (nothing
    written) when the workload has no long prompts."""
    long_lens = [c.prompt_tokens for c in workload.classes if c.name == "long"]
    if not long_lens:
        return False
    long_len = long_lens[0]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.9 * len(results)), sharex=True, squeeze=False)
    for ax, (system, res) in zip(axes[:, 0], results.items(), strict=True):
        starts = res["start_times"]
        longs = [i for i, n in enumerate(res["input_lens"]) if workload.class_of(n).prompt_tokens == long_len]
        if not longs:
            continue
        longs.sort(key=lambda i: starts[i])
        focus = longs[len(longs) // 2]
        t_arrival = starts[focus]
        for i, (start, ttft, itl) in enumerate(zip(starts, res["ttfts"], res["itls"], strict=True)):
            t, xs, ys = start + ttft, [], []
            for gap in itl:
                t += gap
                xs.append(t - t_arrival)
                ys.append(1000 * gap)
            ax.scatter(xs, ys, s=3, color="tab:red" if i == focus else "tab:blue")
        ax.axvline(0, color="black", linewidth=0.8)
        ax.axvline(res["ttfts"][focus], color="tab:red", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.set_ylabel("gap (ms)")
        ax.set_title(f"{system}", fontsize=9, loc="left")
    axes[-1][0].set_xlim(*WINDOW_S)
    axes[-1][0].set_xlabel(
        f"s from a long prompt's arrival (solid; dashed: its first token), {workload.name} at {rate:g} req/s"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
