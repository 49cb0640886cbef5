"""Distribution-aware capacity against the simulator: M/G/1 (Pollaczek-Khinchine) for P, batch tails for D."""

from __future__ import annotations

import numpy as np
import pytest

from planner import simulator, tails
from planner.model import InfeasibleError
from planner.trace import Lognormal
from tests.planner.conftest import PROFILE

ISL = Lognormal(2048, 0.8)
OSL = Lognormal(256, 1.0)


def _simulated_ttft(rate: float, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, count))
    service = ISL.sample(rng, count) / PROFILE.prefill_max_tokens_per_s
    return simulator.single_queue_prefill(arrival, service) + PROFILE.ttft_overhead_s - arrival


@pytest.mark.parametrize("rho", [0.5, 0.85])
def test_pollaczek_khinchine_mean_matches_the_simulator(rho: float) -> None:
    mean_s = ISL.mean / PROFILE.prefill_max_tokens_per_s
    second_s = ISL.moment(2) / PROFILE.prefill_max_tokens_per_s**2
    rate = rho / mean_s
    ttft = _simulated_ttft(rate, 1_000_000, seed=4)
    wait = rate * second_s / (2 * (1 - rho))
    assert ttft.mean() == pytest.approx(PROFILE.ttft_overhead_s + mean_s + wait, rel=0.05)


@pytest.mark.parametrize(("rho", "q"), [(0.5, 0.9), (0.85, 0.9), (0.7, 0.99)])
def test_ttft_quantile_matches_the_simulator(rho: float, q: float) -> None:
    rate = rho * PROFILE.prefill_max_tokens_per_s / ISL.mean
    predicted = tails.ttft_quantile_s(PROFILE, ISL, rate, q)
    assert predicted == pytest.approx(np.quantile(_simulated_ttft(rate, 1_000_000, seed=5), q), rel=0.06)


def test_prefill_rate_holds_the_percentile_slo_and_mean_only_does_not() -> None:
    rate = tails.prefill_rate(PROFILE, ISL, ttft_slo_s=1.0, q=0.9)
    attained = (_simulated_ttft(rate, 1_000_000, seed=6) <= 1.0).mean()
    assert attained == pytest.approx(0.9, abs=0.015)
    # More load than that (what a mean-TTFT plan at the same SLO allows) misses the percentile.
    assert (_simulated_ttft(rate * 1.1, 1_000_000, seed=6) <= 1.0).mean() < 0.87


def test_prefill_infeasible_below_the_idle_percentile() -> None:
    floor = PROFILE.ttft_overhead_s + float(ISL.quantile(0.99)) / PROFILE.prefill_max_tokens_per_s
    with pytest.raises(InfeasibleError, match="p99 TTFT of an idle P instance"):
        tails.prefill_rate(PROFILE, ISL, ttft_slo_s=floor * 0.99, q=0.99)
    assert tails.prefill_rate(PROFILE, ISL, ttft_slo_s=floor * 1.05, q=0.99) > 0


@pytest.mark.parametrize(
    ("mean", "q", "expected"), [(10, 0.9, 14), (10, 0.5, 10), (0.5, 0.9, 1), (0, 0.9, 0)]
)
def test_poisson_quantile(mean: float, q: float, expected: int) -> None:
    assert tails.poisson_quantile(mean, q) == expected


@pytest.mark.parametrize(
    ("osl", "slo", "q"), [(OSL, 0.020, 0.9), (OSL, 0.020, 0.99), (Lognormal(64, 0.5), 0.018, 0.9)]
)
def test_decode_rate_holds_the_tpot_percentile_in_simulation(osl: Lognormal, slo: float, q: float) -> None:
    rate = tails.decode_rate(PROFILE, osl, slo, q)
    rng = np.random.default_rng(7)
    count = 100_000
    arrival = np.cumsum(rng.exponential(1 / rate, count))
    steps = np.maximum(osl.sample(rng, count), 2) - 1
    tpot = (simulator.fluid_decode(arrival, steps, PROFILE, dt_s=0.25) - arrival) / steps
    attained = (tpot <= slo).mean()
    # Sized on the per-step batch tail, so on the safe side, and not by much.
    assert q <= attained <= q + 0.07


def test_decode_infeasible_below_batch_one() -> None:
    with pytest.raises(InfeasibleError, match="batch-1 TPOT"):
        tails.decode_rate(PROFILE, OSL, 0.009, 0.9)


def test_percentile_out_of_range() -> None:
    with pytest.raises(ValueError, match="percentile"):
        tails.prefill_rate(PROFILE, ISL, 1.0, 1.0)
