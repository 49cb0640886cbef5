"""Trace-shaped workload: lognormal moments and fit, the diurnal and hourly rate curves, arrivals."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from planner import trace


def test_lognormal_moments_match_samples() -> None:
    lengths = trace.Lognormal(median=2048, sigma=0.8)
    values = np.random.default_rng(0).lognormal(math.log(2048), 0.8, 2_000_000)
    assert lengths.mean == pytest.approx(2048 * math.exp(0.32))
    assert lengths.mean == pytest.approx(values.mean(), rel=0.01)
    assert lengths.moment(2) == pytest.approx((values**2).mean(), rel=0.03)
    assert float(lengths.quantile(0.5)) == pytest.approx(2048)
    assert float(lengths.quantile(0.9)) == pytest.approx(np.quantile(values, 0.9), rel=0.01)


def test_lognormal_fit_recovers_parameters_and_samples_are_whole() -> None:
    sample = trace.Lognormal(300, 1.1).sample(np.random.default_rng(1), 200_000)
    assert sample.dtype == np.int64 and sample.min() >= 1
    fitted = trace.Lognormal.fit(sample)
    assert fitted.median == pytest.approx(300, rel=0.01)
    assert fitted.sigma == pytest.approx(1.1, rel=0.01)


@pytest.mark.parametrize(("median", "sigma"), [(0, 1), (10, -0.1), (math.inf, 1)])
def test_lognormal_rejects_bad_parameters(median: float, sigma: float) -> None:
    with pytest.raises(ValueError, match="lognormal"):
        trace.Lognormal(median, sigma)


def test_diurnal_peak_trough_and_integral() -> None:
    curve = trace.diurnal(peak_rate=600, peak_to_trough=3, peak_hour=14)
    assert curve.duration_s == trace.DAY_S
    assert float(curve.rate(14 * 3600)) == pytest.approx(600)
    assert float(curve.rate(2 * 3600)) == pytest.approx(200)
    assert float(curve.cumulative(trace.DAY_S)) == pytest.approx(400 * trace.DAY_S, rel=1e-6)  # mean (m)
    # The window mean is the integral over the window: here a numeric one on a fine grid.
    grid = np.linspace(3600, 5400, 20001)
    assert curve.window_mean(3600, 5400) == pytest.approx(
        np.trapezoid(curve.rate(grid), grid) / 1800, rel=1e-6
    )
    assert curve.window_peak(13 * 3600, 15 * 3600) == pytest.approx(600)


def test_hourly_rates_sit_at_hour_middles_and_wrap(tmp_path: Path) -> None:
    path = tmp_path / "rates.json"
    path.write_text("[100, 300, 200]")
    curve = trace.load_hourly(path)
    assert curve.duration_s == 3 * 3600
    assert curve.rate(np.array([1800, 5400, 9000])).tolist() == pytest.approx([100, 300, 200])
    assert float(curve.rate(0)) == pytest.approx(150) and float(curve.rate(3 * 3600)) == pytest.approx(150)


@pytest.mark.parametrize(("text", "message"), [("{}", "JSON list"), ("[]", "empty"), ("[-1, 2]", ">= 0")])
def test_hourly_rates_file_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rates.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        trace.load_hourly(path)


def test_arrivals_follow_the_piecewise_rate() -> None:
    times = np.array([0.0, 100.0, 200.0])
    got = trace.arrivals(times, np.array([50.0, 150.0]), np.random.default_rng(2))
    assert np.all(np.diff(got) >= 0) and got.min() >= 0 and got.max() <= 200
    first, second = int((got < 100).sum()), int((got >= 100).sum())
    # Poisson counts with means 5000 and 15000: within 4 standard deviations.
    assert abs(first - 5000) < 4 * math.sqrt(5000)
    assert abs(second - 15000) < 4 * math.sqrt(15000)
