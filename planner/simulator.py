"""Discrete-event simulation of an xPyD cluster, to check a plan before buying hardware.

Called by ``pd-plan --verify`` / ``--plot-dir`` (``planner.cli``) and the validation benchmark. Model:

- arrivals: Poisson at a request rate, with fixed mean lengths or lengths replayed from a file;
- prefill: ``x`` FCFS P instances; a request goes to the instance that frees up first; its service time is
  ``isl / prefill_max_tokens_per_s`` (``det``) or exponential with that mean (``exp``, the M/M/1 assumption);
- the first token reaches the user ``ttft_overhead_s`` after prefill ends (KV transfer and the rest of the
  overhead); the request then joins the D instance with the fewest requests;
- decode: ``y`` D instances with continuous batching; new requests join at the next step boundary, every step
  takes ``TPOT(batch)`` interpolated from the profile (linearly extrapolated above the largest measured
  batch) and gives every running request one token. Steps in which the batch cannot change are fast-forwarded
  together, so simulating 1e5 requests takes seconds.

TPOT of a request is (last token time - first token time) / (output tokens - 1), so it includes any wait for a
decode slot, as a user would see it.

``single_queue_prefill`` (closed-form FCFS queue) and ``fluid_decode`` (continuous batching as a fluid) are
vectorised one-instance versions for ``planner.fleet``'s day-long runs, tested against ``_prefill`` and
``_decode``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from planner.profile import Profile

ServiceKind = Literal["det", "exp"]
Statistic = Literal["mean", "p50", "p90", "p99"]


class Requests(msgspec.Struct, frozen=True):
    """Arrival times (s, sorted) and input/output lengths (tokens) of the simulated requests."""

    arrival_s: np.ndarray
    isl: np.ndarray
    osl: np.ndarray


class LengthSample(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One line of a replayed lengths file."""

    input: int
    output: int


class SimSummary(msgspec.Struct, frozen=True):
    """Latency percentiles (seconds) and SLO attainment (fractions) of one simulated run."""

    prefill_instances: int
    decode_instances: int
    requests: int
    ttft_slo_s: float
    tpot_slo_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    tpot_p99_s: float
    ttft_attainment: float
    tpot_attainment: float
    slo_attainment: float

    def meets(self, stat: Statistic) -> tuple[bool, bool]:
        """Whether the TTFT and the TPOT statistic ``stat`` are within the SLOs they were summarised with."""
        ttft: float = getattr(self, f"ttft_{stat}_s")
        tpot: float = getattr(self, f"tpot_{stat}_s")
        return ttft <= self.ttft_slo_s, tpot <= self.tpot_slo_s


def load_lengths(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Input and output lengths from a JSON Lines file of ``{"input": N, "output": M}`` objects."""
    decoder = msgspec.json.Decoder(LengthSample)
    inputs, outputs = [], []
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read lengths file: {exc.strerror or exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            sample = decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise ValueError(f'{path}:{number}: expected {{"input": N, "output": M}}: {exc}') from exc
        if sample.input < 1 or sample.output < 1:
            raise ValueError(f"{path}:{number}: lengths must be >= 1")
        inputs.append(sample.input)
        outputs.append(sample.output)
    if not inputs:
        raise ValueError(f"{path}: no length samples")
    return np.array(inputs), np.array(outputs)


def poisson_requests(
    rate: float,
    count: int,
    isl: float,
    osl: float,
    seed: int = 0,
    lengths: tuple[np.ndarray, np.ndarray] | None = None,
) -> Requests:
    """``count`` Poisson arrivals at ``rate`` req/s; lengths fixed, or drawn with replacement from ``lengths``."""
    if rate <= 0 or count < 1:
        raise ValueError("rate must be > 0 and count >= 1")
    rng = np.random.default_rng((seed, 0))  # distinct stream from the service times' (seed, 1)
    arrivals = np.cumsum(rng.exponential(1 / rate, count))
    if lengths is None:
        inputs = np.full(count, max(1, round(isl)))
        outputs = np.full(count, max(1, round(osl)))
    else:
        picks = rng.integers(0, len(lengths[0]), count)
        inputs, outputs = lengths[0][picks], lengths[1][picks]
    return Requests(arrival_s=arrivals, isl=inputs, osl=outputs)


def tpot_curve(profile: Profile, batch: int) -> float:
    """Decode step time at ``batch``: interpolated, and linearly extrapolated above the largest measured batch."""
    return float(tpot_curve_array(profile, np.array([batch]))[0])


def tpot_curve_array(profile: Profile, batches: np.ndarray) -> np.ndarray:
    """``tpot_curve`` for many batch sizes at once (the fleet simulation reads it on every time step)."""
    points = profile.sorted_decode()
    measured = np.array([p.batch for p in points], dtype=float)
    tpots = np.array([p.tpot_s for p in points])
    values = np.interp(batches, measured, tpots)
    if len(points) > 1:
        slope = (tpots[-1] - tpots[-2]) / (measured[-1] - measured[-2])
        values = np.where(batches > measured[-1], tpots[-1] + slope * (batches - measured[-1]), values)
    return values


def _prefill(
    requests: Requests, profile: Profile, instances: int, service: ServiceKind, rng: np.random.Generator
) -> np.ndarray:
    """Time each request's prefill ends, FCFS on the instance that frees up first."""
    means = requests.isl / profile.prefill_max_tokens_per_s
    services = rng.exponential(means) if service == "exp" else means
    free = [0.0] * instances
    done = np.empty(len(means))
    for i, (arrival, duration) in enumerate(zip(requests.arrival_s.tolist(), services.tolist(), strict=True)):
        k = min(range(instances), key=free.__getitem__)
        free[k] = max(arrival, free[k]) + duration
        done[i] = free[k]
    return done


class _DecodeInstance:
    """One D instance's running batch and queue, advanced by ``_decode``."""

    def __init__(self) -> None:
        self.active = np.empty(0, dtype=np.int64)
        self.pending: deque[int] = deque()
        self.scheduled = False

    @property
    def load(self) -> int:
        return len(self.active) + len(self.pending)


def _decode(
    ready: np.ndarray, steps: np.ndarray, profile: Profile, instances: int, max_batch: int | None
) -> np.ndarray:
    """Time each request's last token leaves its D instance; requests join at step boundaries."""
    remaining = steps.astype(np.int64).copy()
    finish = ready.astype(float).copy()
    order = np.argsort(ready, kind="stable").tolist()
    nodes = [_DecodeInstance() for _ in range(instances)]
    tpot_cache: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    cap = max_batch or math.inf
    position = 0
    while position < len(order) or heap:
        next_ready = ready[order[position]] if position < len(order) else math.inf
        if not heap or next_ready <= heap[0][0]:  # arrivals first: a tie joins this step
            request = order[position]
            position += 1
            if remaining[request] == 0:
                continue
            node_index = min(range(instances), key=lambda k: nodes[k].load)
            node = nodes[node_index]
            node.pending.append(request)
            if not node.scheduled:
                node.scheduled = True
                heapq.heappush(heap, (next_ready, node_index))
            continue
        now, node_index = heapq.heappop(heap)
        node = nodes[node_index]
        done = node.active[remaining[node.active] == 0]
        finish[done] = now
        node.active = node.active[remaining[node.active] > 0]
        free_slots = cap - len(node.active)
        admitted = []
        while node.pending and free_slots > 0:
            admitted.append(node.pending.popleft())
            free_slots -= 1
        if admitted:
            node.active = np.concatenate([node.active, np.array(admitted, dtype=np.int64)])
        if len(node.active) == 0:
            node.scheduled = False
            continue
        batch = len(node.active)
        if batch not in tpot_cache:
            tpot_cache[batch] = tpot_curve(profile, batch)
        step = tpot_cache[batch]
        count = int(remaining[node.active].min())
        if not node.pending and next_ready < math.inf:
            # A request arriving before then may join this batch: stop at the first boundary after it.
            count = min(count, max(1, math.ceil((next_ready - now) / step)))
        remaining[node.active] -= count
        heapq.heappush(heap, (now + count * step, node_index))
    return finish


def simulate(
    profile: Profile,
    requests: Requests,
    prefill_instances: int,
    decode_instances: int,
    prefill_service: ServiceKind = "det",
    max_batch: int | None = None,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-request TTFT and TPOT (seconds; TPOT is NaN for one-token outputs) for an xPyD cluster."""
    if prefill_instances < 1 or decode_instances < 1:
        raise ValueError("a cluster needs at least one P and one D instance")
    rng = np.random.default_rng((seed, 1))
    first_token = (
        _prefill(requests, profile, prefill_instances, prefill_service, rng) + profile.ttft_overhead_s
    )
    finish = _decode(first_token, requests.osl - 1, profile, decode_instances, max_batch)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(requests.osl > 1, (finish - first_token) / (requests.osl - 1), np.nan)
    return first_token - requests.arrival_s, tpot


def summarise(
    ttft: np.ndarray,
    tpot: np.ndarray,
    ttft_slo_s: float,
    tpot_slo_s: float,
    prefill_instances: int,
    decode_instances: int,
) -> SimSummary:
    """Means, percentiles and the fraction of requests within each SLO and within both."""
    decoded = tpot[~np.isnan(tpot)]
    tpot_stats = decoded if len(decoded) else np.zeros(1)
    ttft_ok = ttft <= ttft_slo_s
    tpot_ok = np.isnan(tpot) | (tpot <= tpot_slo_s)
    p_ttft = np.percentile(ttft, [50, 90, 99])
    p_tpot = np.percentile(tpot_stats, [50, 90, 99])
    return SimSummary(
        prefill_instances=prefill_instances,
        decode_instances=decode_instances,
        requests=len(ttft),
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        ttft_mean_s=float(ttft.mean()),
        ttft_p50_s=float(p_ttft[0]),
        ttft_p90_s=float(p_ttft[1]),
        ttft_p99_s=float(p_ttft[2]),
        tpot_mean_s=float(tpot_stats.mean()),
        tpot_p50_s=float(p_tpot[0]),
        tpot_p90_s=float(p_tpot[1]),
        tpot_p99_s=float(p_tpot[2]),
        ttft_attainment=float(ttft_ok.mean()),
        tpot_attainment=float(tpot_ok.mean()),
        slo_attainment=float((ttft_ok & tpot_ok).mean()),
    )


def simulate_grid(
    profile: Profile,
    requests: Requests,
    shapes: Sequence[tuple[int, int]],
    ttft_slo_s: float,
    tpot_slo_s: float,
    prefill_service: ServiceKind = "det",
    max_batch: int | None = None,
    seed: int = 0,
) -> list[SimSummary]:
    """Simulate the same requests on each (P, D) shape: the comparison ``--verify`` and the plots need."""
    results = []
    for n_p, n_d in shapes:
        ttft, tpot = simulate(profile, requests, n_p, n_d, prefill_service, max_batch, seed)
        results.append(summarise(ttft, tpot, ttft_slo_s, tpot_slo_s, n_p, n_d))
    return results


def single_queue_prefill(arrival_s: np.ndarray, service_s: np.ndarray) -> np.ndarray:
    """Time each request's prefill ends on ONE FCFS instance that starts empty (arrivals sorted).

    Lindley's recursion W_n = max(0, W_{n-1} + S_{n-1} - (a_n - a_{n-1})) in closed form: with the random walk
    Y_n = sum_{k<n} S_k - (a_n - a_0), the wait is W_n = Y_n - min_{k<=n} Y_k (Y_0 = 0). Vectorised, so a
    sampled instance's day of requests takes milliseconds; equal to ``_prefill`` with one instance.
    """
    if len(arrival_s) == 0:
        return np.empty(0)
    walk = np.concatenate([[0.0], np.cumsum(service_s[:-1])]) - (arrival_s - arrival_s[0])
    waits = walk - np.minimum.accumulate(np.minimum(walk, 0.0))
    return np.asarray(arrival_s + waits + service_s)


def fluid_decode(
    ready: np.ndarray,
    steps: np.ndarray,
    profile: Profile,
    dt_s: float = 0.1,
    tpot_tolerance_s: float = 1e-6,
    max_rounds: int = 40,
) -> np.ndarray:
    """Time each request's last token leaves ONE D instance with unbounded continuous batching (fluid model).

    The batch B(t) is the number of requests between their first and last token; every running request gains
    1 / TPOT(B(t)) tokens per second, so a request ends when the integral of that rate from its first token
    reaches its decode steps. Both depend on the end times, which are found by fixed-point iteration starting
    from the batch-1 speed (ends only grow, towards the least fixed point) on a time grid of ``dt_s``, until the
    requests' TPOTs move by less than ``tpot_tolerance_s`` on average (about 10-20 rounds); joining at step
    boundaries is ignored (at most one step per request). ``_decode`` is the exact event simulation it
    is tested against; this one is vectorised for the fleet simulation's long runs.
    """
    if len(ready) == 0:
        return np.empty(0)
    steps = steps.astype(float)
    start = float(np.floor(ready.min()))
    finish = ready + steps * float(tpot_curve_array(profile, np.array([1]))[0])
    for _ in range(max_rounds):
        cells = int(np.ceil((finish.max() - start) / dt_s)) + 2
        grid = start + np.arange(cells + 1) * dt_s
        # Requests running at each cell's middle: started at or before it, not yet finished (bincounts, no sort).
        joined = np.bincount(np.ceil((ready - start) / dt_s - 0.5).astype(np.int64), minlength=cells + 1)
        left = np.bincount(np.ceil((finish - start) / dt_s - 0.5).astype(np.int64), minlength=cells + 1)
        batch = np.cumsum(joined[:cells] - left[:cells])
        step_time = tpot_curve_array(profile, np.maximum(batch, 1))
        done = np.concatenate([[0.0], np.cumsum(dt_s / step_time)])  # steps completed since ``start``
        position = (ready - start) / dt_s  # the grid is uniform: interpolate by index
        cell = np.minimum(position.astype(np.int64), cells - 1)
        target = done[cell] + (position - cell) * (done[cell + 1] - done[cell]) + steps
        updated = np.interp(target, done, grid)
        beyond = target > done[-1]
        updated[beyond] = grid[-1] + (target[beyond] - done[-1]) * step_time[-1]
        change = float((np.abs(updated - finish) / np.maximum(steps, 1)).mean())
        finish = np.maximum(updated, finish)
        if change < tpot_tolerance_s:
            break
    return np.asarray(finish)
