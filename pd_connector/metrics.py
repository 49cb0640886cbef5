"""Transfer metrics, one definition for both engine adapters: what is counted, under which name and meaning.

Who calls what:
- A thread of the adapter that learns of ended transfers calls ``StatsRecorder.record`` with each
  ``TransferResult`` (vLLM: the worker's ``transfer_results``; SGLang: ``PdKVManager``'s result thread), and
  ``write_total`` with the engine's running ``layer_seconds``; refusals and failures the adapter decides itself
  go to ``refused`` / ``failure``. ``take`` drains what was recorded since the last call as a plain dict
  (vLLM ships it from worker to API server inside its ``KVConnectorStats``).
- ``PromMetrics`` turns such dicts into Prometheus counters and histograms named ``<engine>:pd_connector_<key>``
  (``vllm:pd_connector_bytes_sent``, ``sglang:pd_connector_bytes_sent``, ...), built with the metric classes
  the engine exports through (vLLM hands its own to ``build_prom_metrics``; SGLang's scheduler uses
  ``prometheus_client``'s, which write to SGLang's multiprocess directory).

Nothing here imports an engine or ``prometheus_client``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pd_connector.timeline import RECV_STAGES, SEND_STAGES, spans
from pd_connector.transfer.types import TransferResult, TransferState

#: Counters (exported as ``<engine>:pd_connector_<key>_total``) and their meaning.
COUNTERS: dict[str, str] = {
    "bytes_sent": "KV bytes P pushed to decode nodes.",
    "bytes_received": "KV bytes D received from prefill nodes.",
    "transfers_sent": "Transfers P completed (every write landed in D, Done sent).",
    "transfers_received": "Transfers D completed.",
    "failures": "Transfers that failed (peer died, timeout, refused).",
    "expired_leases": "P transfers whose lease expired (D never came or stalled; blocks freed).",
    "integrity_failures": "D: loads failed because the KV that landed did not match P's checksums "
    "(integrity_check on; a torn or misplaced write caught before it could be decoded from).",
    "write_seconds": "P: seconds spent writing layers to decode nodes (summed over writes).",
    "refused_requests": "Requests whose kv_transfer_params were refused and served locally (malformed, a role "
    "this node does not play, a prefill address not allowed, a transfer id in use).",
}
#: Series of seconds (exported as histograms ``<engine>:pd_connector_<key without _s>_seconds``).
HISTOGRAMS: dict[str, str] = {
    "transfer_s": "P: seconds from the first offer (start of the prefill) until every write landed and Done "
    "was sent.",
    "exposed_s": "P: seconds from the end of the last prefill step to Done (not hidden behind compute).",
    "load_s": "D: seconds from the start of a load to the last byte received.",
}
#: ``[stage span, seconds]`` pairs (``pd_connector.timeline.spans``): where a transfer's time went.
STAGES = "stage_s"
STAGE_HELP = (
    "Seconds between consecutive stages of a transfer (label stage, e.g. 'offered->destinations' on P: waiting "
    "for D's block table; 'done->reported' on D: until the engine learnt the load finished); see "
    "docs/architecture.md."
)
BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


def counter_name(engine: str, key: str) -> str:
    """Prometheus name of counter ``key`` for ``engine`` (the client adds ``_total`` when exposing it)."""
    return f"{engine}:pd_connector_{key}"


def histogram_name(engine: str, key: str) -> str:
    """Prometheus name of the histogram of series ``key`` (or ``STAGES``) for ``engine``."""
    return f"{engine}:pd_connector_{key.removesuffix('_s')}_seconds"


def empty() -> dict[str, Any]:
    """A stats payload with nothing recorded."""
    return {**dict.fromkeys(COUNTERS, 0), **{key: [] for key in HISTOGRAMS}, STAGES: []}


def reported_stages(result: TransferResult) -> dict[str, float]:
    """When each stage of ``result`` happened; on D with ``reported`` = now, called when the adapter hands the
    ended load to its engine."""
    if result.role == "recv":
        return {**result.stages, "reported": time.time()}
    return dict(result.stages)


def is_empty(data: Mapping[str, Any]) -> bool:
    return not any(data.get(key) for key in (*COUNTERS, *HISTOGRAMS, STAGES))


class StatsRecorder:
    """Thread-safe accumulator of one process's transfer statistics (the adapters' threads write into it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()
        self._written_s = 0.0

    def record(self, result: TransferResult, stages: dict[str, float]) -> None:
        """Count an ended transfer: bytes and seconds when DONE, a failure when FAILED, an expired lease, and
        where its time went (``stages``: when each stage happened, ``reported_stages``)."""
        durations = spans(stages, SEND_STAGES if result.role == "send" else RECV_STAGES)
        with self._lock:
            if result.state is TransferState.DONE and result.role == "send":
                self._data["bytes_sent"] += result.bytes
                self._data["transfers_sent"] += 1
                self._data["transfer_s"].append(result.duration_s)
                self._data["exposed_s"].append(result.exposed_s)
            elif result.state is TransferState.DONE:
                self._data["bytes_received"] += result.bytes
                self._data["transfers_received"] += 1
                self._data["load_s"].append(result.duration_s)
            elif result.state is TransferState.FAILED:
                self._data["failures"] += 1
            if result.lease_expired:
                self._data["expired_leases"] += 1
            if result.integrity_failed:
                self._data["integrity_failures"] += 1
            self._data[STAGES].extend([name, seconds] for name, seconds in durations.items())

    def failure(self) -> None:
        """A transfer the adapter failed itself before the engine could report it (it never started)."""
        with self._lock:
            self._data["failures"] += 1

    def refused(self) -> None:
        """A request's transfer parameters were refused (bad, wrong role, peer not allowed)."""
        with self._lock:
            self._data["refused_requests"] += 1

    def write_total(self, seconds: float) -> None:
        """P: the engine's running total of seconds spent on layer writes; the growth since the last call is
        recorded (overlapping writes count each)."""
        with self._lock:
            if seconds > self._written_s:
                self._data["write_seconds"] += seconds - self._written_s
                self._written_s = seconds

    def take(self) -> dict[str, Any] | None:
        """What was recorded since the last call (None when nothing was), and start afresh."""
        with self._lock:
            data, self._data = self._data, empty()
        return None if is_empty(data) else data


class PromMetrics:
    """The ``<engine>:pd_connector_*`` counters and histograms, one child per label set.

    ``counter_cls`` / ``histogram_cls`` are called like ``prometheus_client.Counter`` / ``Histogram``
    (name, documentation, labelnames=..., and buckets=... for histograms). ``label_sets`` maps an index (vLLM's
    engine index; 0 on SGLang) to the label values of that source.
    """

    def __init__(
        self,
        engine: str,
        counter_cls: Callable[..., Any],
        histogram_cls: Callable[..., Any],
        labelnames: Sequence[str],
        label_sets: Mapping[int, Sequence[object]],
    ) -> None:
        self._label_sets = {idx: list(values) for idx, values in label_sets.items()}
        self._counters = {
            key: self._children(counter_cls(counter_name(engine, key), text, labelnames=list(labelnames)))
            for key, text in COUNTERS.items()
        }
        self._histograms = {
            key: self._children(
                histogram_cls(histogram_name(engine, key), text, labelnames=list(labelnames), buckets=BUCKETS)
            )
            for key, text in HISTOGRAMS.items()
        }
        self._stages = histogram_cls(
            histogram_name(engine, STAGES), STAGE_HELP, labelnames=[*labelnames, "stage"], buckets=BUCKETS
        )

    def _children(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self._label_sets.items()}

    def observe(self, data: Mapping[str, Any], idx: int = 0) -> None:
        """Add one payload of ``StatsRecorder.take`` from source ``idx``."""
        for key, children in self._counters.items():
            value = data.get(key, 0)
            if value:
                children[idx].inc(value)
        for key, children in self._histograms.items():
            for value in data.get(key, []):
                children[idx].observe(value)
        labels = self._label_sets.get(idx)
        for stage, seconds in data.get(STAGES, []):
            if labels is not None:
                self._stages.labels(*labels, stage).observe(seconds)
