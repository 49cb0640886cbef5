"""PNG figures for a plan: the decode curve with the TPOT SLO, SLO attainment over (P, D) shapes, and a day of
trace-shaped traffic planned by each method (attainment and replicas over the day).

Called by ``pd-plan --plot-dir``, ``pd-plan trace --plot`` and the validation benchmark. Uses matplotlib's Agg backend (files only, no
display), and closes every figure it opens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from planner.fleet import FleetResult
from planner.profile import Profile
from planner.simulator import SimSummary


def plot_decode_curve(profile: Profile, tpot_slo_s: float, decode_tokens_per_s: float, path: Path) -> Path:
    """TPOT and decode throughput vs batch (measured points), with the TPOT SLO and the planned throughput."""
    points = profile.sorted_decode()
    batches = np.array([p.batch for p in points])
    tpots = np.array([p.tpot_s for p in points])
    fig, left = plt.subplots(figsize=(7, 4.8))
    try:
        left.plot(batches, tpots * 1e3, "o-", color="tab:blue", label="TPOT (measured)")
        left.axhline(
            tpot_slo_s * 1e3, color="tab:red", linestyle="--", label=f"TPOT SLO {tpot_slo_s * 1e3:g} ms"
        )
        left.set_xlabel("decode batch (concurrent requests per D instance)")
        left.set_ylabel("TPOT (ms)", color="tab:blue")
        left.set_xscale("log", base=2)
        right = left.twinx()
        right.plot(batches, batches / tpots, "s-", color="tab:green", label="throughput (measured)")
        right.axhline(
            decode_tokens_per_s,
            color="tab:green",
            linestyle=":",
            label=f"at SLO: {decode_tokens_per_s:.4g} tok/s",
        )
        right.set_ylabel("decode throughput (tokens/s)", color="tab:green")
        handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8)
        left.set_title("Decode: TPOT and throughput vs batch")
        fig.tight_layout(rect=(0, 0.12, 1, 1))
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def plot_attainment(results: Sequence[SimSummary], planned: tuple[int, int], path: Path) -> Path:
    """Heat map of simulated SLO attainment (both SLOs) over numbers of P and D; the plan is outlined."""
    p_values = sorted({r.prefill_instances for r in results})
    d_values = sorted({r.decode_instances for r in results})
    grid = np.full((len(p_values), len(d_values)), np.nan)
    for r in results:
        grid[p_values.index(r.prefill_instances), d_values.index(r.decode_instances)] = r.slo_attainment * 100
    fig, ax = plt.subplots(figsize=(1.2 * len(d_values) + 2.5, 0.9 * len(p_values) + 1.8))
    try:
        image = ax.imshow(grid, origin="lower", cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for i in range(len(p_values)):
            for j in range(len(d_values)):
                ax.text(j, i, f"{grid[i, j]:.0f}%", ha="center", va="center", fontsize=9)
        if planned[0] in p_values and planned[1] in d_values:
            i, j = p_values.index(planned[0]), d_values.index(planned[1])
            ax.add_patch(
                plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2.5)
            )
        ax.set_xticks(range(len(d_values)), [str(d) for d in d_values])
        ax.set_yticks(range(len(p_values)), [str(p) for p in p_values])
        ax.set_xlabel("D instances")
        ax.set_ylabel("P instances")
        ax.set_title("Simulated SLO attainment (TTFT and TPOT)")
        fig.colorbar(image, ax=ax, label="% of requests within both SLOs")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def plot_trace(result: FleetResult, gpus_per_instance: int, path: Path) -> Path:
    """Top: per window, the lower of the shares of requests within the TTFT and the TPOT SLO, each method. Bottom: GPUs ready (P + D), each
    method, with the mean request rate on a second axis."""
    hours = np.array(result.window_start_s) / 3600
    styles = {
        "mean-only": ("tab:red", "-"),
        "mean-only-same-gpus": ("tab:purple", "--"),
        "ours-no-lead": ("tab:orange", ":"),
        "ours": ("tab:green", "-"),
    }
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    try:
        for m in result.methods:
            color, line = styles.get(m.method, ("tab:gray", "-"))
            top.step(hours, np.array(m.slo_attainment) * 100, where="post", color=color, linestyle=line,
                     label=f"{m.method} ({m.gpu_hours:.0f} GPU-h)")  # fmt: skip
            gpus = (np.array(m.prefill_ready) + np.array(m.decode_ready)) * gpus_per_instance
            bottom.step(hours, gpus, where="post", color=color, linestyle=line, label=m.method)
        top.axhline(result.percentile, color="black", linestyle="--", linewidth=1,
                    label=f"target p{result.percentile:g}")  # fmt: skip
        top.set_ylabel("% requests within SLO (lower of TTFT, TPOT)")
        top.set_ylim(0, 101)
        top.legend(fontsize=8, loc="lower right")
        top.set_title(
            f"SLO attainment per window (TTFT {result.ttft_slo_s:g} s, TPOT {result.tpot_slo_s * 1e3:g} ms "
            f"at p{result.percentile:g})"
        )
        bottom.set_ylabel("GPUs ready (P + D)")
        bottom.set_xlabel("hour of the day")
        rate = bottom.twinx()
        rate.step(hours, result.rate_mean, where="post", color="tab:blue", alpha=0.4, label="request rate")
        rate.set_ylabel("requests/s (window mean)", color="tab:blue")
        bottom.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
