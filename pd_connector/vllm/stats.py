"""Transfer statistics on vLLM: collected by the worker (and the scheduler side: refused requests), aggregated by
vLLM, exported on its Prometheus endpoint. What is counted and under which name is ``pd_connector.metrics``'s,
shared with the SGLang backend.

Worker threads record into a ``StatsRecorder`` (thread-safe); each engine step vLLM asks the worker-side
connector for ``get_kv_connector_stats()``, which drains the recorder into a ``PDConnectorStats`` (a plain
dict payload, serializable from worker to the API server). There ``PDPromMetrics.observe`` (built through
``PDConnector.build_prom_metrics``) turns it into ``vllm:pd_connector_*`` counters and histograms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from pd_connector import metrics
from pd_connector.metrics import COUNTERS, HISTOGRAMS, STAGES


@dataclass
class PDConnectorStats(KVConnectorStats):
    """One interval of transfer statistics; ``data`` is a ``metrics.StatsRecorder.take`` payload."""

    def __post_init__(self) -> None:
        if not self.data:
            self.data = metrics.empty()

    def reset(self) -> None:
        self.data = metrics.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in COUNTERS:
            self.data[key] += other.data.get(key, 0)
        for key in (*HISTOGRAMS, STAGES):
            self.data[key].extend(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {key: self.data[key] for key in COUNTERS}
        for key in HISTOGRAMS:
            values = self.data[key]
            summary[f"avg_{key.removesuffix('_s')}_ms"] = 1000 * sum(values) / len(values) if values else 0.0
        return summary

    def is_empty(self) -> bool:
        return metrics.is_empty(self.data)


class StatsRecorder(metrics.StatsRecorder):
    """``metrics.StatsRecorder`` whose drain is vLLM's stats object (worker and scheduler side)."""

    def drain(self) -> PDConnectorStats | None:
        data = self.take()
        return None if data is None else PDConnectorStats(data=data)


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
        self._metrics = metrics.PromMetrics(
            "vllm", self._counter_cls, self._histogram_cls, labelnames, per_engine_labelvalues
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._metrics.observe(transfer_stats_data, engine_idx)
