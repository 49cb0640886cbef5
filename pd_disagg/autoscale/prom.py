"""Prometheus text exposition as numbers the estimate can subtract: one scrape is a ``Scrape``.

The controller (``pd_disagg.autoscale.controller``) scrapes pd-router's ``/metrics`` every interval; the estimate
(``pd_disagg.autoscale.estimate``) subtracts an older scrape from a newer one to get what happened in between
(counters and histograms only grow while the router lives). Parsing is prometheus_client's own parser.

Histogram helpers, on a histogram's cumulative bucket counts ``{upper bound: count}`` (+Inf included):
- ``fraction_at_most``: the share of observations <= x, linear inside the bucket holding x (the assumption of
  PromQL's ``histogram_quantile``);
- ``fit_lognormal``: log-space sigma from the buckets, each bucket's observations at the geometric middle of
  its bounds, with Sheppard's correction removing the variance the bucketing adds; the median from the exact
  mean (the histogram's sum over its count) when given, else from the buckets too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from planner.trace import Lognormal

Labels = frozenset[tuple[str, str]]


class Scrape:
    """One scrape's samples, by sample name and label set (``pd_router_requests_total``, ``..._bucket``)."""

    def __init__(self, samples: dict[tuple[str, Labels], float]) -> None:
        self.samples = samples

    @classmethod
    def parse(cls, text: str) -> Scrape:
        """Parse exposition text; raises ``ValueError`` on text that is not Prometheus' format."""
        samples: dict[tuple[str, Labels], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, frozenset(s.labels.items()))] = float(s.value)
        return cls(samples)

    def total(self, name: str, **match: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``match``."""
        wanted = set(match.items())
        return sum(v for (n, labels), v in self.samples.items() if n == name and wanted <= labels)

    def buckets(self, name: str, **match: str) -> dict[float, float]:
        """Cumulative counts of histogram ``name`` (without ``_bucket``) by upper bound, summed over the label
        sets that include ``match``."""
        wanted = set(match.items())
        out: dict[float, float] = {}
        for (n, labels), v in self.samples.items():
            if n != f"{name}_bucket":
                continue
            others = dict(labels)
            bound = float(others.pop("le"))
            if wanted <= others.items():
                out[bound] = out.get(bound, 0.0) + v
        return out

    def minus(self, older: Scrape) -> Scrape | None:
        """What was added since ``older``; None when any counter went down (the router restarted)."""
        diff: dict[tuple[str, Labels], float] = {}
        for key, value in self.samples.items():
            before = older.samples.get(key, 0.0)
            if value < before and not _is_gauge(key[0]):
                return None
            diff[key] = value - before if not _is_gauge(key[0]) else value
        return Scrape(diff)


def _is_gauge(name: str) -> bool:
    return not name.endswith(("_total", "_bucket", "_count", "_sum", "_created"))


def count(cumulative: dict[float, float]) -> float:
    """Observations in the histogram (its +Inf bucket)."""
    return cumulative.get(math.inf, 0.0)


def fraction_at_most(cumulative: dict[float, float], x: float) -> float | None:
    """Share of observations <= ``x`` (None without observations)."""
    total = count(cumulative)
    if total <= 0:
        return None
    lower, below = 0.0, 0.0
    for bound, seen in sorted(cumulative.items()):
        if x < bound:
            if math.isinf(bound):
                return below / total  # beyond the last finite bound nothing is known: count none of it
            return (below + (seen - below) * (x - lower) / (bound - lower)) / total
        lower, below = bound, seen
    return below / total


def _middles(bounds: Iterable[float]) -> list[tuple[float, float]]:
    """(log of the bucket's geometric middle, log-width of the bucket) for each bucket above 0."""
    out, lower = [], None
    for bound in bounds:
        if math.isinf(bound):
            assert lower is not None
            out.append((math.log(lower * math.sqrt(2)), math.log(2)))  # past the last bound: one more step
        elif lower is None or lower <= 0:
            out.append((math.log(bound / math.sqrt(2)), math.log(2)))  # the first bucket: the step below
        else:
            out.append((math.log(math.sqrt(lower * bound)), math.log(bound / lower)))
        lower = bound
    return out


def fit_lognormal(cumulative: dict[float, float], observed_sum: float | None = None) -> Lognormal | None:
    """The lognormal of the observations (None without observations). With ``observed_sum`` (the histogram's
    ``_sum``) the median is set so that the lognormal's mean is the exact mean, the buckets giving the spread
    only: a bucket's middle can be ~40% off its observations (all at 32 in the bucket (16, 32])."""
    ordered = sorted(cumulative.items())
    if count(cumulative) <= 0 or any(bound <= 0 for bound, _ in ordered):
        return None
    counts, before = [], 0.0
    for _, seen in ordered:
        counts.append(seen - before)
        before = seen
    places = _middles(bound for bound, _ in ordered)
    total = sum(counts)
    mean = sum(c * m for c, (m, _) in zip(counts, places, strict=True)) / total
    variance = sum(c * (m - mean) ** 2 for c, (m, _) in zip(counts, places, strict=True)) / total
    bucketing = sum(c * w * w / 12 for c, (_, w) in zip(counts, places, strict=True)) / total
    sigma = math.sqrt(max(variance - bucketing, 0.0))
    if observed_sum is not None and observed_sum > 0:
        return Lognormal(median=observed_sum / total / math.exp(sigma**2 / 2), sigma=sigma)
    return Lognormal(median=math.exp(mean), sigma=sigma)
