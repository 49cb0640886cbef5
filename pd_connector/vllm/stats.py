"""Transfer statistics: collected by the worker (and the scheduler side: refused requests), aggregated by
vLLM, exported on its Prometheus endpoint.

Worker threads record into a ``StatsRecorder`` (thread-safe); each engine step vLLM asks the worker-side
connector for ``get_kv_connector_stats()``, which drains the recorder into a ``PDConnectorStats`` (a plain
dict payload, serializable from worker to the API server). There ``PDPromMetrics.observe`` (built through
``PDConnector.build_prom_metrics``) turns it into ``vllm:pd_connector_*`` counters and histograms.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, cast

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

COUNTERS = (
    "bytes_sent",
    "bytes_received",
    "transfers_sent",
    "transfers_received",
    "failures",
    "expired_leases",
    "write_seconds",
    "refused_requests",
)
SERIES = ("transfer_s", "exposed_s", "load_s")
#: ``[stage span, seconds]`` pairs (``pd_connector.timeline.spans``): where a transfer's time went.
STAGES = "stage_s"


def _empty() -> dict[str, Any]:
    return {**dict.fromkeys(COUNTERS, 0), **{key: [] for key in SERIES}, STAGES: []}


@dataclass
class PDConnectorStats(KVConnectorStats):
    """One interval of transfer statistics; ``data`` holds the COUNTERS and SERIES keys."""

    def __post_init__(self) -> None:
        if not self.data:
            self.data = _empty()

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in COUNTERS:
            self.data[key] += other.data.get(key, 0)
        for key in (*SERIES, STAGES):
            self.data[key].extend(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {key: self.data[key] for key in COUNTERS}
        for key in SERIES:
            values = self.data[key]
            summary[f"avg_{key.removesuffix('_s')}_ms"] = 1000 * sum(values) / len(values) if values else 0.0
        return summary

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in (*COUNTERS, *SERIES, STAGES))


class StatsRecorder:
    """Thread-safe accumulator the sender/loader threads write into (worker process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()

    def sent(self, nbytes: int, transfer_s: float, exposed_s: float) -> None:
        with self._lock:
            self._data["bytes_sent"] += nbytes
            self._data["transfers_sent"] += 1
            self._data["transfer_s"].append(transfer_s)
            self._data["exposed_s"].append(exposed_s)

    def received(self, nbytes: int, transfer_s: float) -> None:
        with self._lock:
            self._data["bytes_received"] += nbytes
            self._data["transfers_received"] += 1
            self._data["load_s"].append(transfer_s)

    def stages(self, spans: dict[str, float]) -> None:
        """Seconds between consecutive stages of one ended transfer (P's or D's side)."""
        with self._lock:
            self._data[STAGES].extend([name, seconds] for name, seconds in spans.items())

    def failure(self) -> None:
        with self._lock:
            self._data["failures"] += 1

    def write_time(self, seconds: float) -> None:
        """P: time the data plane spent on layer writes (overlapping writes count each)."""
        with self._lock:
            self._data["write_seconds"] += seconds

    def refused(self) -> None:
        """Scheduler: a request's transfer parameters were refused (bad, wrong role, peer not allowed)."""
        with self._lock:
            self._data["refused_requests"] += 1

    def expired_lease(self) -> None:
        with self._lock:
            self._data["expired_leases"] += 1

    def drain(self) -> PDConnectorStats | None:
        with self._lock:
            data, self._data = self._data, _empty()
        stats = PDConnectorStats(data=data)
        return None if stats.is_empty() else stats


_COUNTER_HELP = {
    "bytes_sent": "KV bytes P pushed to decode nodes.",
    "bytes_received": "KV bytes D received from prefill nodes.",
    "transfers_sent": "Transfers P completed (every write landed in D, Done sent).",
    "transfers_received": "Transfers D completed.",
    "failures": "Transfers that failed (peer died, timeout, refused).",
    "expired_leases": "P transfers whose lease expired (D never came or stalled; blocks freed).",
    "write_seconds": "P: seconds spent writing layers to decode nodes (summed over writes).",
    "refused_requests": "Requests whose kv_transfer_params were refused and served locally (malformed, a role "
    "this node does not play, a prefill address not allowed, a transfer id in use).",
}
_HISTOGRAM_HELP = {
    "transfer_s": "P: seconds from the first offer (start of the prefill) until every write landed and Done was sent.",
    "exposed_s": "P: seconds from the end of the last prefill step to Done (not hidden behind compute).",
    "load_s": "D: seconds from the start of a load to the last byte received.",
}
_STAGE_HELP = (
    "Seconds between consecutive stages of a transfer (label stage, e.g. 'offered->destinations' on P: waiting "
    "for D's block table; 'done->reported' on D: until vLLM learnt the load finished); see docs/architecture.md."
)
_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class PDPromMetrics(KVConnectorPromMetrics):
    """``vllm:pd_connector_*`` metrics, one child per engine label set (API server process)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        self._histograms: dict[str, dict[int, Any]] = {}
        for key, help_text in _COUNTER_HELP.items():
            metric = self._counter_cls(f"vllm:pd_connector_{key}", help_text, labelnames=labelnames)
            self._counters[key] = self._per_engine(metric)
        for key, help_text in _HISTOGRAM_HELP.items():
            metric = cast(Any, self._histogram_cls)(
                f"vllm:pd_connector_{key.removesuffix('_s')}_seconds",
                help_text,
                labelnames=labelnames,
                buckets=_BUCKETS,
            )
            self._histograms[key] = self._per_engine(metric)
        self._stages = cast(Any, self._histogram_cls)(
            "vllm:pd_connector_stage_seconds",
            _STAGE_HELP,
            labelnames=[*labelnames, "stage"],
            buckets=_BUCKETS,
        )

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, children in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                children[engine_idx].inc(value)
        for key, children in self._histograms.items():
            for value in transfer_stats_data.get(key, []):
                children[engine_idx].observe(value)
        labels = self.per_engine_labelvalues.get(engine_idx)
        for stage, seconds in transfer_stats_data.get(STAGES, []):
            if labels is not None:
                self._stages.labels(*labels, stage).observe(seconds)
