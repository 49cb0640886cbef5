"""The live workload, estimated from pd-router's metrics over a sliding window.

The controller feeds every scrape of pd-router's ``/metrics`` to a ``Window`` (its own; no shared state); the
window subtracts the oldest scrape it keeps (about ``window_s`` old) from the newest and turns the difference
into an ``Estimate``:

- arrival rates: every request the router counted (``pd_router_requests_total``, rejected ones included: they
  are demand the cluster did not meet), and the share of it routed P->D (route ``disagg``), which is what the
  P pool serves; the D pool serves them all;
- the prompt lengths of P->D requests (``pd_router_prompt_tokens{route="disagg"}``) and the output limits of
  all requests (``pd_router_max_tokens``) as lognormals (``prom.fit_lognormal``: the spread from the buckets,
  the exact mean from the sums): the planner sizes from the
  distributions, not their means. The output limit is an upper bound of the output length, so D is sized on the
  safe side; requests without ``max_tokens`` are not in it;
- SLO attainment: the share of P->D first tokens within the TTFT SLO (``pd_router_ttft_seconds{route="disagg"}``,
  streamed requests: P's side of the SLO; a local request's first token is D's prefill) and of token gaps within the TPOT SLO (``pd_router_itl_seconds``: per gap, stricter than per request), each
  None below ``min_samples`` observations;
- decode queueing: requests waiting for a decode slot (``pd_router_waiting``, at the newest scrape).

The rate trend (``trend``: the newest window's rate against the one before) lets the plan look a replica
start time ahead.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

from pd_disagg.autoscale import prom
from planner.trace import Lognormal


@dataclass(frozen=True)
class Estimate:
    """What the router saw over ``duration_s`` seconds; rates in requests/s."""

    duration_s: float
    arrival_rate: float
    disagg_rate: float
    prompt: Lognormal | None
    output: Lognormal | None
    ttft_attainment: float | None
    itl_attainment: float | None
    waiting: float
    #: Requests/s per second: how fast ``arrival_rate`` grew against the window before (0 when unknown).
    trend: float = 0.0


class Window:
    """Scrapes of the last ``window_s`` seconds (and the one just older), turned into an ``Estimate``."""

    def __init__(self, window_s: float, ttft_slo_s: float, tpot_slo_s: float, min_samples: int) -> None:
        self._window_s = window_s
        self._ttft_slo_s, self._tpot_slo_s = ttft_slo_s, tpot_slo_s
        self._min_samples = min_samples
        self._scrapes: collections.deque[tuple[float, prom.Scrape]] = collections.deque()
        self._rates: collections.deque[tuple[float, float]] = collections.deque()  # (time, arrival rate)

    def add(self, now: float, scrape: prom.Scrape) -> Estimate | None:
        """Record a scrape taken at ``now``; the estimate since the oldest kept one (None until two scrapes,
        and after a router restart until the next one)."""
        if self._scrapes and scrape.minus(self._scrapes[-1][1]) is None:
            self._scrapes.clear()  # the counters started again: nothing older compares
            self._rates.clear()
        self._scrapes.append((now, scrape))
        while len(self._scrapes) > 2 and now - self._scrapes[1][0] >= self._window_s:
            self._scrapes.popleft()
        if len(self._scrapes) < 2:
            return None
        began, oldest = self._scrapes[0]
        diff = scrape.minus(oldest)
        if diff is None or now <= began:
            return None
        estimate = self._estimate(now - began, diff)
        self._rates.append((now, estimate.arrival_rate))
        while len(self._rates) > 1 and now - self._rates[1][0] >= self._window_s:
            self._rates.popleft()
        then, rate_then = self._rates[0]
        if now - then < self._window_s:
            return estimate  # no estimate a whole window old yet: no trend
        return dataclasses.replace(estimate, trend=(estimate.arrival_rate - rate_then) / (now - then))

    def _attainment(self, cumulative: dict[float, float], slo_s: float) -> float | None:
        if prom.count(cumulative) < self._min_samples:
            return None
        return prom.fraction_at_most(cumulative, slo_s)

    def _estimate(self, duration_s: float, diff: prom.Scrape) -> Estimate:
        return Estimate(
            duration_s=duration_s,
            arrival_rate=diff.total("pd_router_requests_total") / duration_s,
            disagg_rate=diff.total("pd_router_requests_total", route="disagg") / duration_s,
            prompt=prom.fit_lognormal(
                diff.buckets("pd_router_prompt_tokens", route="disagg"),
                diff.total("pd_router_prompt_tokens_sum", route="disagg"),
            ),
            output=prom.fit_lognormal(
                diff.buckets("pd_router_max_tokens"), diff.total("pd_router_max_tokens_sum")
            ),
            ttft_attainment=self._attainment(
                diff.buckets("pd_router_ttft_seconds", route="disagg"), self._ttft_slo_s
            ),
            itl_attainment=self._attainment(diff.buckets("pd_router_itl_seconds"), self._tpot_slo_s),
            waiting=diff.total("pd_router_waiting"),
        )
