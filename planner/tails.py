"""Distribution-aware capacity of one P and one D instance against PERCENTILE SLOs.

``model.plan`` sizes from mean lengths against SLOs on the mean. Here the lengths are lognormal
(``planner.trace.Lognormal``) and the SLOs hold for a fraction ``q`` of requests (p90: q = 0.9). Called by
``planner.fleet`` (the window plan) and tested against the simulator in ``tests/planner/test_tails.py``.

Prefill, M/G/1 per P instance (requests dispatched at random to P instances, each a FCFS queue):
service S = ISL / TP_max with ISL lognormal, so E[S^k] = E[ISL^k] / TP_max^k. Pollaczek-Khinchine gives the
mean wait E[W] = lambda E[S^2] / (2 (1 - rho)) and Takacs the second moment E[W^2] = 2 E[W]^2 +
lambda E[S^3] / (3 (1 - rho)). The wait is 0 with probability 1 - rho and otherwise modelled by a two-phase
hyperexponential matching E[W | W > 0] and E[W^2 | W > 0] (one exponential when that is less variable): the
lognormal's long prompts make waits more variable than an exponential, and an exponential alone read the p99
7% short. TTFT = T_ovh + W + S with the request's own S independent of W, so
P(TTFT <= t) = E_S[1{S <= t'} (1 - rho P(W > t' - S | W > 0))], t' = t - T_ovh, averaged over quantile points
of S. Against the simulator (tests/planner/test_tails.py) the p50/p90/p99 are within ~2% up to rho 0.85 and
on the safe side above. The largest rate whose q-quantile TTFT is at the SLO is found by bisection on rho. A
long prompt's own prefill counts: the SLO must exceed T_ovh + S_q.

Decode, per D instance: by Little's law the mean number of concurrent streams is B = lambda_D E[steps] TPOT;
with Poisson arrivals and a fixed TPOT the count would be Poisson(B) whatever the output-length distribution
(M/G/inf insensitivity), so the OSL distribution enters through its mean. But TPOT grows with the batch, and a
larger batch makes every stream last longer, which grows the batch: to first order a deviation of the Poisson
count is amplified by 1 / (1 - e), e = d ln TPOT / d ln B (``batch_quantile``). B is the largest mean whose
amplified q-quantile batch still decodes within the SLO on the profile's TPOT curve. That bounds each step,
so it errs on the safe side (a request's TPOT averages the steps of its life): in the fluid simulation the
share of requests within the TPOT SLO comes out 2-5 points above q (tests/planner/test_tails.py).
"""

from __future__ import annotations

import math

import numpy as np

from planner.model import InfeasibleError
from planner.profile import Profile
from planner.simulator import tpot_curve_array
from planner.trace import Lognormal

# Quantile points of the service time the TTFT distribution is averaged over, and bisection steps.
_SERVICE_POINTS = 2000
_BISECT_STEPS = 40


def _check_fraction(q: float) -> None:
    if not 0 < q < 1:
        raise ValueError(f"percentile must be between 0 and 100 (exclusive), got {q * 100:g}")


def _service_points(profile: Profile, isl: Lognormal) -> np.ndarray:
    quantiles = (np.arange(_SERVICE_POINTS) + 0.5) / _SERVICE_POINTS
    return isl.quantile(quantiles) / profile.prefill_max_tokens_per_s


def _waiting_mixture(mean: float, second: float) -> tuple[np.ndarray, np.ndarray]:
    """Weights and means of the exponentials that model a positive wait with these first two moments: a
    two-phase hyperexponential with balanced means when the wait is more variable than an exponential, else one
    exponential."""
    cv2 = second / mean**2 - 1
    if cv2 <= 1:
        return np.array([1.0]), np.array([mean])
    p = (1 + math.sqrt((cv2 - 1) / (cv2 + 1))) / 2
    return np.array([p, 1 - p]), np.array([mean / (2 * p), mean / (2 * (1 - p))])


def ttft_quantile_s(profile: Profile, isl: Lognormal, rate: float, q: float) -> float:
    """The q-quantile of TTFT on one M/G/1 P instance at ``rate`` req/s (infinite once rho >= 1)."""
    _check_fraction(q)
    return _ttft_quantile(profile, isl, _service_points(profile, isl), rate, q)


def _ttft_quantile(profile: Profile, isl: Lognormal, services: np.ndarray, rate: float, q: float) -> float:
    tp_max = profile.prefill_max_tokens_per_s
    mean_s, second_s = isl.mean / tp_max, isl.moment(2) / tp_max**2
    rho = rate * mean_s
    if rho >= 1:
        return math.inf
    if rho <= 0:
        return profile.ttft_overhead_s + float(np.quantile(services, q))
    third_s = isl.moment(3) / tp_max**3
    mean_wait = rate * second_s / (2 * (1 - rho))
    second_wait = 2 * mean_wait**2 + rate * third_s / (3 * (1 - rho))
    weights, scales = _waiting_mixture(mean_wait / rho, second_wait / rho)

    def cdf(t: float) -> float:
        slack = np.maximum(t - services, 0.0)[:, None]
        tail = (weights * np.exp(-slack / scales)).sum(axis=1)
        return float(np.where(t >= services, 1 - rho * tail, 0.0).mean())

    low, high = 0.0, float(services[-1]) + float(scales.max()) * (math.log(rho / (1 - q)) + 5) + 1.0
    for _ in range(_BISECT_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < q else (low, middle)
    return profile.ttft_overhead_s + high


def prefill_rate(profile: Profile, isl: Lognormal, ttft_slo_s: float, q: float) -> float:
    """Requests/s one P instance takes with its q-quantile TTFT at ``ttft_slo_s`` (M/G/1, see the module)."""
    _check_fraction(q)
    services = _service_points(profile, isl)
    floor = _ttft_quantile(profile, isl, services, 0.0, q)
    if ttft_slo_s <= floor:
        raise InfeasibleError(
            f"TTFT SLO {ttft_slo_s:g} s at p{q * 100:g} is not above {floor:.4g} s, the p{q * 100:g} TTFT of an "
            f"idle P instance (overhead {profile.ttft_overhead_s:.4g} s + the prefill of a p{q * 100:g} prompt, "
            f"{float(isl.quantile(q)):.0f} tokens): relax the SLO, shorten prompts, or use faster P instances"
        )
    mu = profile.prefill_max_tokens_per_s / isl.mean
    low, high = 0.0, 1.0
    for _ in range(_BISECT_STEPS):
        rho = (low + high) / 2
        ok = _ttft_quantile(profile, isl, services, rho * mu, q) <= ttft_slo_s
        low, high = (rho, high) if ok else (low, rho)
    return low * mu


def poisson_quantile(mean: float, q: float) -> int:
    """Smallest k with P(N <= k) >= q for N ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    k = np.arange(0, int(mean + 12 * math.sqrt(mean) + 20))
    log_pmf = k * math.log(mean) - mean - np.array([math.lgamma(i + 1) for i in k])
    return int(np.searchsorted(np.cumsum(np.exp(log_pmf)), q))


def batch_quantile(profile: Profile, mean: float, q: float) -> float:
    """The q-quantile of the decode batch around a mean of ``mean`` streams: Poisson, its excess over the mean
    amplified by 1 / (1 - e), e = d ln TPOT / d ln batch (see the module); infinite when e >= 1."""
    base = max(1, poisson_quantile(mean, q))
    around = np.array([max(mean, 1.0), max(mean, 1.0) + 1])
    tpot_here, tpot_next = tpot_curve_array(profile, around)
    elasticity = (tpot_next - tpot_here) / tpot_here * around[0]
    if elasticity >= 1:
        return math.inf
    return float(mean + max(base - mean, 0.0) / (1 - elasticity))


def decode_streams(profile: Profile, tpot_slo_s: float, q: float) -> float:
    """Largest mean number of concurrent streams per D whose q-quantile batch decodes within the TPOT SLO."""
    _check_fraction(q)

    def step_at_quantile(mean: float) -> float:
        return float(tpot_curve_array(profile, np.array([batch_quantile(profile, mean, q)]))[0])

    if step_at_quantile(1e-9) > tpot_slo_s:
        raise InfeasibleError(
            f"TPOT SLO {tpot_slo_s * 1e3:g} ms is below the batch-1 TPOT "
            f"{step_at_quantile(1e-9) * 1e3:.4g} ms: no batch decodes that fast; relax the SLO or use faster D"
        )
    low, high = 0.0, 1.0
    while step_at_quantile(high) <= tpot_slo_s:  # the extrapolated curve grows, so this ends
        low, high = high, high * 2
    for _ in range(_BISECT_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if step_at_quantile(middle) <= tpot_slo_s else (low, middle)
    return low


def decode_rate(profile: Profile, osl: Lognormal, tpot_slo_s: float, q: float) -> float:
    """Requests/s one D instance takes: Little's law, streams / (mean decode steps x TPOT at that batch)."""
    streams = decode_streams(profile, tpot_slo_s, q)
    steps = max(osl.mean - 1, 1e-9)
    tpot = float(tpot_curve_array(profile, np.array([max(streams, 1.0)]))[0])
    return streams / (steps * tpot)
