"""The live estimate from pd-router's real metrics (``RouterMetrics`` rendered as the router serves them):
histogram arithmetic, the lognormal fit, rates, SLO attainment at ``min_samples``, a router restart, the trend."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pd_disagg.autoscale import prom
from pd_disagg.autoscale.estimate import Window
from planner.trace import Lognormal
from router.metrics import RouterMetrics


def _scrape(metrics: RouterMetrics) -> prom.Scrape:
    return prom.Scrape.parse(metrics.render().decode())


def _traffic(metrics: RouterMetrics, requests: int, route: str = "disagg", ttft_s: float = 0.1) -> None:
    for _ in range(requests):
        metrics.requests_for("/v1/completions", route, "long").inc()
        metrics.lengths(route, 1000, 100)
        metrics.ttft_for(route).observe(ttft_s)
        metrics.itl_for(route).observe(0.02)


def test_fraction_at_most_interpolates_inside_a_bucket_and_counts_a_bound_in_its_bucket() -> None:
    cumulative = {1.0: 2.0, 2.0: 6.0, math.inf: 8.0}
    assert prom.fraction_at_most(cumulative, 1.0) == 2 / 8
    assert prom.fraction_at_most(cumulative, 1.5) == 4 / 8
    assert prom.fraction_at_most(cumulative, 0.5) == 1 / 8
    assert prom.fraction_at_most(cumulative, 2.0) == 6 / 8
    assert prom.fraction_at_most(cumulative, 100.0) == 6 / 8  # beyond the last bound: unknown, not counted
    assert prom.fraction_at_most({math.inf: 0.0}, 1.0) is None


@pytest.mark.parametrize("sigma", [0.0, 0.5, 1.2])
def test_lognormal_fit_from_the_routers_token_buckets(sigma: float) -> None:
    metrics = RouterMetrics()
    truth = Lognormal(median=700.0, sigma=sigma)
    for n in truth.sample(np.random.default_rng(0), 20000):
        metrics.lengths("disagg", int(n), None)
    scrape = _scrape(metrics)
    buckets = scrape.buckets("pd_router_prompt_tokens", route="disagg")
    total = scrape.total("pd_router_prompt_tokens_sum")
    for fitted in (prom.fit_lognormal(buckets), prom.fit_lognormal(buckets, total)):
        assert fitted is not None
        assert fitted.median == pytest.approx(700.0, rel=0.05)
        assert fitted.sigma == pytest.approx(sigma, abs=0.06)
    assert prom.fit_lognormal({math.inf: 0.0}) is None


def test_the_exact_mean_corrects_lengths_at_a_bucket_bound() -> None:
    """Every output limit 32: the bucket (16, 32] alone would say a median of 22.6; the sum says 32."""
    metrics = RouterMetrics()
    for _ in range(10):
        metrics.lengths("local", 5, 32)
    scrape = _scrape(metrics)
    buckets = scrape.buckets("pd_router_max_tokens")
    from_buckets = prom.fit_lognormal(buckets)
    exact = prom.fit_lognormal(buckets, scrape.total("pd_router_max_tokens_sum"))
    assert from_buckets is not None and from_buckets.median == pytest.approx(math.sqrt(16 * 32))
    assert exact == Lognormal(median=32.0, sigma=0.0)


def test_window_rates_lengths_and_attainment() -> None:
    metrics = RouterMetrics()
    window = Window(window_s=60.0, ttft_slo_s=0.5, tpot_slo_s=0.05, min_samples=20)
    assert window.add(0.0, _scrape(metrics)) is None  # one scrape: nothing to subtract yet
    _traffic(metrics, 30, "disagg", ttft_s=0.1)
    _traffic(metrics, 10, "local", ttft_s=5.0)  # a local request's TTFT is D's prefill: not P's SLO
    metrics.requests_for("/v1/completions", "rejected", "overload").inc(20)
    est = window.add(10.0, _scrape(metrics))
    assert est is not None
    assert est.arrival_rate == pytest.approx(6.0) and est.disagg_rate == pytest.approx(3.0)
    assert est.prompt == Lognormal(median=1000.0, sigma=0.0)  # P->D prompts only
    assert est.output == Lognormal(median=100.0, sigma=0.0)
    assert est.ttft_attainment == 1.0 and est.itl_attainment == 1.0 and est.trend == 0.0


def test_attainment_counts_from_min_samples_on() -> None:
    metrics = RouterMetrics()
    window = Window(window_s=60.0, ttft_slo_s=0.5, tpot_slo_s=0.05, min_samples=20)
    window.add(0.0, _scrape(metrics))
    _traffic(metrics, 19, ttft_s=2.0)
    est = window.add(1.0, _scrape(metrics))
    assert est is not None and est.ttft_attainment is None
    _traffic(metrics, 1, ttft_s=2.0)
    est = window.add(2.0, _scrape(metrics))
    assert est is not None and est.ttft_attainment == 0.0


def test_a_router_restart_starts_the_window_again() -> None:
    window = Window(window_s=60.0, ttft_slo_s=0.5, tpot_slo_s=0.05, min_samples=1)
    before = RouterMetrics()
    _traffic(before, 50)
    window.add(0.0, _scrape(before))
    assert window.add(10.0, _scrape(before)) is not None
    restarted = RouterMetrics()
    _traffic(restarted, 5)
    assert window.add(20.0, _scrape(restarted)) is None  # counters went down: no negative rate
    _traffic(restarted, 5)
    est = window.add(30.0, _scrape(restarted))
    assert est is not None and est.arrival_rate == pytest.approx(0.5)


def test_the_window_slides_and_the_trend_compares_a_whole_window_back() -> None:
    metrics = RouterMetrics()
    window = Window(window_s=20.0, ttft_slo_s=0.5, tpot_slo_s=0.05, min_samples=1)
    window.add(0.0, _scrape(metrics))
    rates = []
    for t in range(10, 70, 10):  # 1 req/s for 30 s, then 3 req/s
        _traffic(metrics, 10 if t <= 30 else 30)
        est = window.add(float(t), _scrape(metrics))
        assert est is not None
        rates.append((est.arrival_rate, est.trend))
    assert rates[2] == (pytest.approx(1.0), pytest.approx(0.0))  # t = 30: 20 s of 1 req/s
    assert rates[5][0] == pytest.approx(3.0)  # t = 60: only the last 20 s count
    assert rates[5][1] == pytest.approx((3.0 - 2.0) / 20)  # against t = 40 (the window [20, 40]: 2 req/s)
