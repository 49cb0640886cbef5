"""pd_connector.metrics: what an ended transfer counts, and the Prometheus families both engines export from one
definition (real ``prometheus_client`` metrics in a private registry)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Histogram

from pd_connector.metrics import COUNTERS, HISTOGRAMS, PromMetrics, StatsRecorder, reported_stages
from pd_connector.transfer.types import TransferResult, TransferState

SEND_DONE = TransferResult(
    "t1",
    "send",
    TransferState.DONE,
    bytes=4096,
    duration_s=0.5,
    exposed_s=0.1,
    stages={"offered": 1.0, "destinations": 1.5, "prompt_done": 2.0, "done": 2.1},
)
RECV_DONE = TransferResult("t1", "recv", TransferState.DONE, bytes=4096, duration_s=0.3)
SEND_EXPIRED = TransferResult("t2", "send", TransferState.FAILED, lease_expired=True)
RECV_ABORTED = TransferResult("t3", "recv", TransferState.ABORTED)
RECV_TORN = TransferResult("t4", "recv", TransferState.FAILED, integrity_failed=True)


def test_record_counts_by_role_and_state() -> None:
    stats = StatsRecorder()
    for result in (SEND_DONE, RECV_DONE, SEND_EXPIRED, RECV_ABORTED, RECV_TORN):
        stats.record(result, reported_stages(result))
    stats.write_total(2.0)
    stats.write_total(1.0)  # a total never shrinks: nothing recorded
    stats.write_total(2.5)
    data = stats.take()
    assert data is not None
    assert {k: data[k] for k in COUNTERS} == {
        "bytes_sent": 4096,
        "bytes_received": 4096,
        "transfers_sent": 1,
        "transfers_received": 1,
        "failures": 2,  # the expired lease and the torn load; an abort is no failure
        "expired_leases": 1,
        "integrity_failures": 1,
        "write_seconds": 2.5,
        "refused_requests": 0,
    }
    assert data["transfer_s"] == [0.5] and data["exposed_s"] == [0.1] and data["load_s"] == [0.3]
    assert ["offered->destinations", 0.5] in data["stage_s"]
    assert stats.take() is None  # drained


def test_reported_stage_is_added_on_decode_only() -> None:
    assert "reported" in reported_stages(RECV_DONE)
    assert reported_stages(SEND_DONE) == SEND_DONE.stages


def test_both_engines_export_the_same_families_under_their_prefix() -> None:
    stats = StatsRecorder()
    stats.record(SEND_DONE, reported_stages(SEND_DONE))
    stats.record(RECV_TORN, reported_stages(RECV_TORN))
    stats.failure()
    data = stats.take()
    assert data is not None
    for engine in ("vllm", "sglang"):
        registry = CollectorRegistry()
        metrics = PromMetrics(
            engine,
            functools.partial(Counter, registry=registry),
            functools.partial(Histogram, registry=registry),
            ["model_name"],
            {0: ["m"]},
        )
        metrics.observe(data)
        value = functools.partial(registry.get_sample_value, labels={"model_name": "m"})
        assert value(f"{engine}:pd_connector_bytes_sent_total") == 4096
        assert value(f"{engine}:pd_connector_failures_total") == 2
        assert value(f"{engine}:pd_connector_integrity_failures_total") == 1
        assert value(f"{engine}:pd_connector_bytes_received_total") == 0
        assert value(f"{engine}:pd_connector_transfer_seconds_count") == 1
        assert value(f"{engine}:pd_connector_exposed_seconds_sum") == 0.1
        stage = {"model_name": "m", "stage": "offered->destinations"}
        assert registry.get_sample_value(f"{engine}:pd_connector_stage_seconds_sum", stage) == 0.5
        families = {m.name for m in registry.collect()}
        assert families == {
            *(f"{engine}:pd_connector_{key}" for key in COUNTERS),
            *(f"{engine}:pd_connector_{key.removesuffix('_s')}_seconds" for key in HISTOGRAMS),
            f"{engine}:pd_connector_stage_seconds",
        }
