"""A trace-shaped workload: lognormal input/output lengths and a request rate that varies over the day.

Read by ``pd-plan trace`` (``planner.cli``) and the fleet simulation (``planner.fleet``); the sizing in
``planner.tails`` uses the lengths' moments and quantiles in closed form. Everything is seeded by the caller.

- ``Lognormal``: lengths as a median and a log-space sigma (the parameters people quote for request traces),
  or fitted from a lengths file (``fit``: median = exp(mean(log x)), sigma = std(log x)).
- ``RateCurve``: requests/s as a piecewise-linear curve over time, built from a documented shape (``diurnal``:
  a sinusoid with a peak rate, a peak/trough ratio and the hour of the peak) or from a list of per-hour rates
  (``hourly``: one rate per hour, at the middle of that hour, interpolated in between and wrapping around the
  day). Its exact integral gives window means and the arrival process (``arrivals``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from statistics import NormalDist

import msgspec
import numpy as np

DAY_S = 86400.0
HOUR_S = 3600.0
# The diurnal sinusoid is sampled this often; its piecewise-linear curve is within 0.01% of the sinusoid.
_DIURNAL_STEP_S = 60.0


class Lognormal(msgspec.Struct, frozen=True):
    """A length distribution: log(X) is normal with mean log(median) and standard deviation ``sigma``."""

    median: float
    sigma: float

    def __post_init__(self) -> None:
        if not (self.median > 0 and math.isfinite(self.median)):
            raise ValueError(f"lognormal median must be > 0, got {self.median!r}")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"lognormal sigma must be >= 0, got {self.sigma!r}")

    def moment(self, k: int) -> float:
        """E[X^k] = median^k exp(k^2 sigma^2 / 2)."""
        return float(self.median**k * math.exp(k * k * self.sigma**2 / 2))

    @property
    def mean(self) -> float:
        return self.moment(1)

    def quantile(self, q: float | np.ndarray) -> np.ndarray:
        """The ``q`` quantile(s), 0 < q < 1."""
        z = np.vectorize(NormalDist().inv_cdf)(np.asarray(q, dtype=float))
        return np.asarray(self.median * np.exp(self.sigma * z))

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` whole lengths (rounded, at least 1)."""
        values = rng.lognormal(math.log(self.median), self.sigma, count)
        return np.maximum(1, np.rint(values)).astype(np.int64)

    @classmethod
    def fit(cls, values: np.ndarray) -> Lognormal:
        """Maximum-likelihood fit to observed lengths (all must be >= 1)."""
        logs = np.log(np.asarray(values, dtype=float))
        return cls(median=float(math.exp(logs.mean())), sigma=float(logs.std()))


class RateCurve(msgspec.Struct, frozen=True):
    """Requests/s at ``times_s`` (increasing, from 0 to the curve's duration), linear in between."""

    times_s: tuple[float, ...]
    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.times_s) != len(self.rates) or len(self.times_s) < 2:
            raise ValueError("a rate curve needs at least two (time, rate) points")
        if any(b <= a for a, b in zip(self.times_s, self.times_s[1:], strict=False)) or self.times_s[0] != 0:
            raise ValueError("rate curve times must start at 0 and increase")
        if any(not (r >= 0 and math.isfinite(r)) for r in self.rates) or max(self.rates) <= 0:
            raise ValueError("rates must be >= 0 and not all 0")

    @property
    def duration_s(self) -> float:
        return self.times_s[-1]

    def rate(self, t: np.ndarray | float) -> np.ndarray:
        """Requests/s at time(s) ``t``."""
        return np.asarray(np.interp(t, self.times_s, self.rates))

    def cumulative(self, t: np.ndarray | float) -> np.ndarray:
        """Expected arrivals in [0, t] (the exact integral of the piecewise-linear rate)."""
        times, rates = np.array(self.times_s), np.array(self.rates)
        at_points = np.concatenate([[0.0], np.cumsum(np.diff(times) * (rates[1:] + rates[:-1]) / 2)])
        t = np.clip(np.asarray(t, dtype=float), 0.0, times[-1])
        index = np.clip(np.searchsorted(times, t, side="right") - 1, 0, len(times) - 2)
        dt = t - times[index]
        slope = (rates[index + 1] - rates[index]) / (times[index + 1] - times[index])
        return np.asarray(at_points[index] + rates[index] * dt + slope * dt * dt / 2)

    def window_mean(self, start_s: float, end_s: float) -> float:
        """Mean rate over [start, end): what a planner that predicts each window's load sees."""
        return float((self.cumulative(end_s) - self.cumulative(start_s)) / (end_s - start_s))

    def window_peak(self, start_s: float, end_s: float) -> float:
        """Highest rate in [start, end] (the curve's points inside and both ends)."""
        inside = [r for t, r in zip(self.times_s, self.rates, strict=True) if start_s <= t <= end_s]
        return float(max([*inside, float(self.rate(start_s)), float(self.rate(min(end_s, self.duration_s)))]))


def diurnal(
    peak_rate: float, peak_to_trough: float, peak_hour: float = 14.0, hours: float = 24.0
) -> RateCurve:
    """rate(t) = m + a cos(2 pi (t_h - peak_hour) / 24): the peak ``peak_rate`` at ``peak_hour``, the trough
    ``peak_rate / peak_to_trough`` twelve hours away (m and a follow from the two)."""
    if not (peak_rate > 0 and peak_to_trough >= 1):
        raise ValueError("diurnal: peak rate must be > 0 and peak/trough ratio >= 1")
    trough = peak_rate / peak_to_trough
    middle, amplitude = (peak_rate + trough) / 2, (peak_rate - trough) / 2
    times = np.arange(0.0, hours * HOUR_S + _DIURNAL_STEP_S / 2, _DIURNAL_STEP_S)
    rates = middle + amplitude * np.cos(2 * math.pi * (times / HOUR_S - peak_hour) / 24.0)
    return RateCurve(tuple(times.tolist()), tuple(rates.tolist()))


def hourly(rates: Sequence[float]) -> RateCurve:
    """Per-hour rates (req/s), each at the middle of its hour, linear in between, wrapping around the day."""
    if not rates:
        raise ValueError("hourly rates: the list is empty")
    values = [float(r) for r in rates]
    middles = [(h + 0.5) * HOUR_S for h in range(len(values))]
    edge = (values[0] + values[-1]) / 2  # the rate at midnight, between the last hour and the first
    return RateCurve((0.0, *middles, len(values) * HOUR_S), (edge, *values, edge))


def load_hourly(path: str | Path) -> RateCurve:
    """A JSON list of per-hour rates (req/s), e.g. ``[120, 90, ..., 300]``."""
    try:
        values = msgspec.json.decode(Path(path).read_bytes(), type=list[float])
    except OSError as exc:
        raise ValueError(f"{path}: cannot read rates file: {exc.strerror or exc}") from exc
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: expected a JSON list of per-hour rates: {exc}") from exc
    return hourly(values)


def arrivals(times_s: np.ndarray, intensity: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrival times of a Poisson process whose rate is ``intensity[i]`` on [times_s[i], times_s[i+1]).

    Exact for the piecewise-constant rate: a unit-rate Poisson process (cumulative exponential gaps) mapped
    through the inverse of the cumulative rate. Vectorised: a day at thousands of requests/s takes well under
    a second.
    """
    cumulative = np.concatenate([[0.0], np.cumsum(intensity * np.diff(times_s))])
    total = float(cumulative[-1])
    marks = np.cumsum(rng.exponential(1.0, int(total + 10 * math.sqrt(total) + 20)))
    while marks[-1] < total:  # rare: more arrivals than ten standard deviations above the mean
        marks = np.concatenate([marks, marks[-1] + np.cumsum(rng.exponential(1.0, len(marks)))])
    return np.asarray(np.interp(marks[marks < total], cumulative, times_s))
