"""Plan a cluster over a day of trace-shaped traffic and simulate the plan: mean-only sizing against ours.

Called by ``pd-plan trace`` (``planner.cli``) and ``benchmarks.planner_trace``. Steps:

1. Needs per window (``window_s``): for each method, the P and D instances each window needs.
   - ``mean-only`` (Dynamo's way: counts from mean ISL/OSL): ``model.plan`` on the window's mean rate with the
     mean lengths, the percentile SLOs read as SLOs on the mean; it orders at the window's start (lead 0).
     ``mean-only-same-gpus`` scales its counts by one factor so that they add up to ours over the day: the same
     GPUs spent the mean-only way, to tell distribution-aware sizing from simply buying more.
   - ``ours``: ``planner.tails`` per-instance capacity against the percentile SLOs with the lognormal lengths
     (M/G/1 for P, the Poisson batch quantile for D), on the window's PEAK rate, ordered ``replica_start_s``
     ahead; ``ours-no-lead`` is the same sizing ordered at the window's start, to show what the lead buys.
2. ``planner.schedule`` turns needs into ordered and ready replicas (start time, hysteresis on the way down).
3. Simulation by a statistically representative sample of instances: the router is modelled as dispatching
   each request at random among the ready instances of a pool, so one instance sees a Poisson stream of rate
   lambda(t) / ready(t), independent of the others (Poisson splitting): simulating ``prefill_samples`` P and
   ``decode_samples`` D instances over the whole day gives the distribution of TTFT and TPOT for any cluster size, exactly for random
   dispatch (join-the-shortest-queue would do better). P: FCFS queue with service ISL / TP_max
   (``simulator.single_queue_prefill``). D: continuous batching (``simulator.fluid_decode``). TTFT and TPOT
   come from separate samples (P and D queues are independent under random dispatch). A sample instance lives
   the whole day: replicas that start empty after a scale-up are not modelled.
4. Per window: the share of requests within the TTFT SLO and within the TPOT SLO, and the lower of the two
   (``slo_attainment``: the SLOs are met in a window when both shares reach the percentile); per method:
   GPU-hours (ordered replicas, starting ones included, times GPUs per instance), the peak, the share of
   windows meeting the SLOs, the worst window and the rate-weighted mean of ``slo_attainment``.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

from planner import model, schedule, tails
from planner.profile import Profile
from planner.simulator import fluid_decode, single_queue_prefill
from planner.trace import Lognormal, RateCurve, arrivals

METHODS = ("mean-only", "mean-only-same-gpus", "ours-no-lead", "ours")
# Arrival intensity per sampled instance is piecewise constant on this grid (s).
_GRID_S = 10.0
# Fluid decode's time step on a day-long run (s): TPOT percentiles within 0.5% of a 0.1 s step.
_DECODE_DT_S = 1.0


class FleetConfig(msgspec.Struct, frozen=True):
    """Everything ``plan_and_simulate`` needs; times in seconds, ``percentile`` in (0, 100)."""

    profile: Profile
    isl: Lognormal
    osl: Lognormal
    rate: RateCurve
    ttft_slo_s: float
    tpot_slo_s: float
    percentile: float = 90.0
    window_s: float = 900.0
    tick_s: float = 60.0
    replica_start_s: float = 600.0
    scale_down_hold_s: float = 1800.0
    gpus_per_instance: int = 1
    prefill_samples: int = 8
    decode_samples: int = 2
    seed: int = 0


class MethodResult(msgspec.Struct, frozen=True):
    """One method's plan and its simulated outcome; per-window lists are in window order."""

    method: str
    prefill_needed: list[int]
    decode_needed: list[int]
    prefill_ready: list[float]
    decode_ready: list[float]
    ttft_attainment: list[float]
    tpot_attainment: list[float]
    slo_attainment: list[float]
    gpu_hours: float
    peak_gpus: int
    windows_meeting_slo: float
    worst_window_attainment: float
    overall_attainment: float
    simulated_requests: int


class FleetResult(msgspec.Struct, frozen=True):
    """The comparison: window start times, the rate per window, each method's result and the timings."""

    window_start_s: list[float]
    rate_mean: list[float]
    percentile: float
    ttft_slo_s: float
    tpot_slo_s: float
    prefill_rate_per_instance: float
    decode_rate_per_instance: float
    methods: list[MethodResult]
    plan_s: float
    simulate_s: float

    def summary(self) -> dict[str, object]:
        """The headline figures per method (the ``--json`` line adds nothing else but the timings)."""
        return {
            "percentile": self.percentile,
            "plan_s": self.plan_s,
            "simulate_s": self.simulate_s,
            "methods": {
                m.method: {
                    "gpu_hours": m.gpu_hours,
                    "peak_gpus": m.peak_gpus,
                    "windows_meeting_slo": m.windows_meeting_slo,
                    "worst_window_attainment": m.worst_window_attainment,
                    "overall_attainment": m.overall_attainment,
                    "simulated_requests": m.simulated_requests,
                }
                for m in self.methods
            },
        }


def _windows(config: FleetConfig) -> np.ndarray:
    count = int(np.ceil(config.rate.duration_s / config.window_s - 1e-9))
    return np.arange(count) * config.window_s


def mean_only_needs(config: FleetConfig, starts: np.ndarray) -> tuple[list[int], list[int]]:
    """P and D per window from ``model.plan`` on the window's mean rate and the mean lengths."""
    prefill, decode = [], []
    for start in starts.tolist():
        rate = config.rate.window_mean(start, min(start + config.window_s, config.rate.duration_s))
        workload = model.Workload(
            throughput_tokens_per_s=max(rate, 1e-9) * (config.isl.mean + config.osl.mean),
            isl=config.isl.mean,
            osl=config.osl.mean,
            ttft_s=config.ttft_slo_s,
            tpot_s=config.tpot_slo_s,
        )
        plan = model.plan(config.profile, workload)
        prefill.append(plan.prefill_instances)
        decode.append(plan.decode_instances)
    return prefill, decode


def ours_needs(
    config: FleetConfig, starts: np.ndarray, prefill_rate: float, decode_rate: float
) -> tuple[list[int], list[int]]:
    """P and D per window: the window's peak rate over the per-instance rates of ``planner.tails``."""
    peaks = [config.rate.window_peak(s, min(s + config.window_s, config.rate.duration_s)) for s in starts]
    return [model.whole(p / prefill_rate) for p in peaks], [model.whole(p / decode_rate) for p in peaks]


def _per_window(values: np.ndarray, arrival_s: np.ndarray, window_s: float, windows: int) -> np.ndarray:
    index = np.minimum((arrival_s // window_s).astype(np.int64), windows - 1)
    counts = np.bincount(index, minlength=windows)
    hits = np.bincount(index, weights=values.astype(float), minlength=windows)
    return np.divide(hits, counts, out=np.ones(windows), where=counts > 0)


def _simulate_method(
    config: FleetConfig, name: str, needs: tuple[list[int], list[int]], lead_s: float
) -> MethodResult:
    """Schedule both pools for one method and simulate the sampled instances over the horizon."""
    horizon = config.rate.duration_s
    starts = _windows(config)
    grid = np.arange(0.0, horizon + _GRID_S / 2, _GRID_S)
    middles = grid[:-1] + _GRID_S / 2
    q = config.percentile / 100
    # Each method draws its own seeded traffic from the same rate curve and length distributions.
    rng = np.random.default_rng((config.seed, METHODS.index(name)))
    per_window = len(starts)
    pools: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for pool, need in zip(("prefill", "decode"), needs, strict=True):
        counts = schedule.ordered(need, config.window_s, config.tick_s, lead_s, config.scale_down_hold_s)
        pools[pool] = (counts, schedule.ready(counts, config.tick_s, config.replica_start_s, middles))
    ttft_hits, tpot_hits = np.zeros(per_window), np.zeros(per_window)
    total = 0
    for _ in range(config.prefill_samples):
        share = config.rate.rate(middles) / pools["prefill"][1]
        arrival = arrivals(grid, share, rng)
        isl = config.isl.sample(rng, len(arrival))
        first_token = single_queue_prefill(arrival, isl / config.profile.prefill_max_tokens_per_s)
        ttft = first_token + config.profile.ttft_overhead_s - arrival
        ttft_hits += _per_window(ttft <= config.ttft_slo_s, arrival, config.window_s, per_window)
        total += len(arrival)
    for _ in range(config.decode_samples):
        share = config.rate.rate(middles) / pools["decode"][1]
        arrival = arrivals(grid, share, rng)
        osl = np.maximum(config.osl.sample(rng, len(arrival)), 2)
        finish = fluid_decode(arrival, osl - 1, config.profile, dt_s=_DECODE_DT_S)
        tpot = (finish - arrival) / (osl - 1)
        tpot_hits += _per_window(tpot <= config.tpot_slo_s, arrival, config.window_s, per_window)
        total += len(arrival)
    ttft_att = ttft_hits / config.prefill_samples
    tpot_att = tpot_hits / config.decode_samples
    binding = np.minimum(ttft_att, tpot_att)
    ordered_gpus = (pools["prefill"][0] + pools["decode"][0]) * config.gpus_per_instance
    window_rates = np.array([config.rate.window_mean(s, min(s + config.window_s, horizon)) for s in starts])
    meeting = binding >= q

    def ready_per_window(ready: np.ndarray) -> list[float]:
        index = np.minimum((middles // config.window_s).astype(np.int64), per_window - 1)
        return (np.bincount(index, weights=ready) / np.bincount(index)).tolist()

    return MethodResult(
        method=name,
        prefill_needed=list(needs[0]),
        decode_needed=list(needs[1]),
        prefill_ready=ready_per_window(pools["prefill"][1]),
        decode_ready=ready_per_window(pools["decode"][1]),
        ttft_attainment=ttft_att.tolist(),
        tpot_attainment=tpot_att.tolist(),
        slo_attainment=binding.tolist(),
        gpu_hours=float(ordered_gpus.sum() * config.tick_s / 3600),
        peak_gpus=int(ordered_gpus.max()),
        windows_meeting_slo=float(meeting.mean()),
        worst_window_attainment=float(binding.min()),
        overall_attainment=float((binding * window_rates).sum() / window_rates.sum()),
        simulated_requests=total,
    )


def plan_and_simulate(config: FleetConfig) -> FleetResult:
    """Needs per window for each method, their schedules, and the sampled simulation of each."""
    if config.prefill_samples < 1 or config.decode_samples < 1:
        raise ValueError("at least one sampled P and one sampled D instance")
    began = time.perf_counter()
    q = config.percentile / 100
    starts = _windows(config)
    prefill_rate = tails.prefill_rate(config.profile, config.isl, config.ttft_slo_s, q)
    decode_rate = tails.decode_rate(config.profile, config.osl, config.tpot_slo_s, q)
    ours = ours_needs(config, starts, prefill_rate, decode_rate)
    mean_only = mean_only_needs(config, starts)
    factor = (sum(ours[0]) + sum(ours[1])) / (sum(mean_only[0]) + sum(mean_only[1]))
    same_gpus = (
        [model.whole(n * factor) for n in mean_only[0]],
        [model.whole(n * factor) for n in mean_only[1]],
    )
    plans = {
        "mean-only": (mean_only, 0.0),
        "mean-only-same-gpus": (same_gpus, 0.0),
        "ours-no-lead": (ours, 0.0),
        "ours": (ours, config.replica_start_s),
    }
    planned = time.perf_counter()
    results = [_simulate_method(config, name, *plans[name]) for name in METHODS]
    return FleetResult(
        window_start_s=starts.tolist(),
        rate_mean=[
            config.rate.window_mean(s, min(s + config.window_s, config.rate.duration_s)) for s in starts
        ],
        percentile=config.percentile,
        ttft_slo_s=config.ttft_slo_s,
        tpot_slo_s=config.tpot_slo_s,
        prefill_rate_per_instance=prefill_rate,
        decode_rate_per_instance=decode_rate,
        methods=results,
        plan_s=planned - began,
        simulate_s=time.perf_counter() - planned,
    )
