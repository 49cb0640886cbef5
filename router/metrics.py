"""Prometheus metrics of one router instance, served at ``/metrics``.

Each ``App`` owns its own ``CollectorRegistry`` (no process-global state, so tests can run several routers in
one process). The request path records which route a request took, time to first token, inter-token gaps,
per-worker legs in flight and errors, and failovers.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from router.balancer import Worker
from router.health import CircuitState
from router.prefix_index import PrefixIndex

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)
# Token counts, powers of two: the autoscaler (pd_disagg.autoscale) fits length distributions to them.
_TOKEN_BUCKETS = tuple(float(2**k) for k in range(4, 18))

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pd_router_requests",
            "Requests by endpoint, route taken (local, disagg, rejected) and reason",
            ["endpoint", "route", "reason"],
            registry=r,
        )
        self.responses = Counter(
            "pd_router_responses", "Responses by endpoint and HTTP status", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "pd_router_ttft_seconds",
            "Arrival to first token sent, streamed requests",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = EventHistogram(
            "pd_router_itl_seconds", "Gaps between streamed chunks sent to the client", "route", _ITL_BUCKETS
        )
        r.register(self.itl)
        self.e2e = Histogram(
            "pd_router_request_seconds",
            "Arrival to last byte",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_errors = Counter(
            "pd_router_worker_errors",
            "Failed upstream legs per worker and kind",
            ["role", "url", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "pd_router_retries", "Attempts retried before the first byte", ["role"], registry=r
        )
        self.resumes = Counter(
            "pd_router_decode_resumes",
            "Streams continued on another decode worker after a failure",
            registry=r,
        )
        self.prefill_failures = Counter(
            "pd_router_prefill_failures",
            "Prefill legs that failed; the decode worker recomputed (pd-push) or another P/local prefill took over",
            ["flow"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "pd_router_client_disconnects", "Clients that went away before the response ended", registry=r
        )
        self.transfer_fields_dropped = Counter(
            "pd_router_client_transfer_fields_dropped",
            "Client requests that carried P/D transfer fields (kv_transfer_params, bootstrap_*); the router"
            " dropped them and set its own",
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "pd_router_prompt_tokens",
            "Prompt tokens of routed requests, by route (for a prompt routed on its length bound, the bound)",
            ["route"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_limit = Histogram(
            "pd_router_max_tokens",
            "max_tokens (max_completion_tokens) of routed requests that set one, by route: an upper bound of"
            " their output length",
            ["route"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.queued = Gauge(
            "pd_router_waiting",
            "Requests waiting for a decode slot (sglang-bootstrap: or a prefill slot), or for a worker to"
            " come back when none of a role they need is usable",
            registry=r,
        )
        self.prefix_prompt_tokens = Counter(
            "pd_router_prefix_lookup_tokens",
            "KV-aware routing: prompt tokens of the requests placed by their cached prefix, by route",
            ["route"],
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "pd_router_prefix_hit_tokens",
            "KV-aware routing: of those, the leading tokens the chosen decode worker holds, by route",
            ["route"],
            registry=r,
        )
        self.placements = Counter(
            "pd_router_decode_placements",
            "KV-aware routing: why each decode worker was chosen (prefix, load, balance; lent: a prefill worker)",
            ["reason"],
            registry=r,
        )
        self.kv_events = Counter(
            "pd_router_kv_event_batches",
            "KV event batches from the engines, by worker and result (batch; gap: some were lost, the worker's"
            " view was cleared; undecodable: ignored)",
            ["url", "result"],
            registry=r,
        )
        self.role_switches = Counter(
            "pd_router_role_switches",
            "Role switches asked through the admin API, by target role and result (switched; timeout: its legs"
            " of the old role did not finish within the drain timeout, it kept its role)",
            ["role", "result"],
            registry=r,
        )
        self.role_drain = Histogram(
            "pd_router_role_drain_seconds",
            "Role switches: from the drain's start to the last leg of the old role ending",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # The request path's children, memoized: ``labels()`` costs ~3 us a call (argument checks and a
        # lock), several times per request; these label sets are few (endpoints, routes, reasons, statuses).
        self.requests_for = _memo(self.requests)
        self.responses_for = _memo(self.responses)
        self.ttft_for = _memo(self.ttft)
        self.itl_for = self.itl.series
        self.e2e_for = _memo(self.e2e)
        self._prompt_for = _memo(self.prefix_prompt_tokens)
        self._hit_for = _memo(self.prefix_hit_tokens)
        self._placed_for = _memo(self.placements)
        self._prompt_tokens_for = _memo(self.prompt_tokens)
        self._output_limit_for = _memo(self.output_limit)

    def lengths(self, route: str, prompt_tokens: int, max_tokens: int | None) -> None:
        """One routed request's prompt length and output limit (what the autoscaler plans from)."""
        self._prompt_tokens_for(route).observe(prompt_tokens)
        if max_tokens is not None:
            self._output_limit_for(route).observe(max_tokens)

    def placed(self, route: str, reason: str, prompt_tokens: int, cached_tokens: int) -> None:
        """One request placed by KV-aware routing: its prompt, the chosen D's cached prefix, and why."""
        self._prompt_for(route).inc(prompt_tokens)
        self._hit_for(route).inc(cached_tokens)
        self._placed_for(reason).inc()

    def watch_prefixes(self, index: PrefixIndex) -> None:
        """Export the routing table's size and memory, read at scrape time."""
        self.registry.register(_PrefixCollector(index))

    def watch_workers(self, workers: Callable[[], Iterable[Worker]]) -> None:
        """Export per-worker load and state, read from the balancer at scrape time (no per-request cost)."""
        self.registry.register(_WorkerCollector(workers))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _memo(metric: Counter | Histogram) -> Callable[..., Any]:
    return functools.lru_cache(maxsize=1024)(metric.labels)


class EventSeries:
    """One label value's bucket counts and sum (see ``EventHistogram``)."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # the first bound >= value: Prometheus buckets are "less than or equal"
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.sum += value


class EventHistogram(Collector):
    """A histogram with one label for per-event observations (the relay's inter-token gaps).

    ``prometheus_client.Histogram.observe`` takes a lock and walks the buckets in Python (~2.5 us); the relay
    observes once per event sent, where that was a visible share of its CPU. Here an observation is a bisect
    and two additions. Only the router's event loop thread observes and renders, so no lock is needed. The
    exposition is a standard histogram (``_bucket``, ``_count``, ``_sum``).
    """

    def __init__(self, name: str, documentation: str, label: str, buckets: tuple[float, ...]) -> None:
        self._name, self._doc, self._label = name, documentation, label
        self._bounds = tuple(sorted(buckets))
        self._series: dict[str, EventSeries] = {}

    def series(self, value: str) -> EventSeries:
        found = self._series.get(value)
        if found is None:
            found = self._series[value] = EventSeries(self._bounds)
        return found

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=[self._label])
        for value, s in self._series.items():
            cumulative, total = [], 0
            for bound, count in zip((*map(str, self._bounds), "+Inf"), s.counts, strict=True):
                total += count
                cumulative.append((bound, float(total)))
            family.add_metric([value], cumulative, s.sum)
        yield family


class _WorkerCollector(Collector):
    def __init__(self, workers: Callable[[], Iterable[Worker]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "url"]
        in_flight = GaugeMetricFamily(
            "pd_router_worker_in_flight", "Upstream legs in flight per worker", labels=labels
        )
        tokens = GaugeMetricFamily(
            "pd_router_worker_outstanding_prefill_tokens",
            "Prompt tokens of prefill legs in flight",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "pd_router_worker_healthy", "1 if the worker passes health checks", labels=labels
        )
        circuit = GaugeMetricFamily(
            "pd_router_worker_circuit_open", "1 if the worker's circuit is open", labels=labels
        )
        draining = GaugeMetricFamily(
            "pd_router_worker_draining", "1 if the worker gets no new requests", labels=labels
        )
        for w in self._workers():
            key = [w.role, w.url]
            in_flight.add_metric(key, w.active)
            tokens.add_metric(key, w.outstanding_tokens)
            healthy.add_metric(key, float(w.healthy))
            circuit.add_metric(key, float(w.circuit.state is CircuitState.OPEN))
            draining.add_metric(key, float(w.draining))
        yield from (in_flight, tokens, healthy, circuit, draining)


class _PrefixCollector(Collector):
    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "pd_router_prefix_index_blocks",
            "KV-aware routing: block hashes held, all workers together",
            value=self._index.blocks(),
        )
        yield GaugeMetricFamily(
            "pd_router_prefix_index_bytes",
            "KV-aware routing: memory the block hashes hold",
            value=self._index.memory_bytes(),
        )
