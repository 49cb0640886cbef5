"""The first-token benchmark's breakdown joins the three records of a P/D request (router, P, D) on the
transfer id, measures each span between anchor stamps, and leaves out what it cannot join."""

from __future__ import annotations

from benchmarks.first_token import SPANS, stage_breakdown
from pd_connector.trace import TraceRecord


def _request(tid: str, shift: float, state: str = "done") -> list[TraceRecord]:
    router = {"received": 0.0, "prefill_sent": 0.001, "decode_first_event": 0.2, "client_first_byte": 0.201}
    prefill = {"offered": 0.01, "prompt_done": 0.15, "done": 0.152}
    decode = {"done": 0.153, "reported": 0.16}
    return [
        TraceRecord("router", tid, {k: v + shift for k, v in router.items()}, "ok"),
        TraceRecord("prefill", tid, {k: v + shift for k, v in prefill.items()}, state),
        TraceRecord("decode", tid, {k: v + shift for k, v in decode.items()}, state),
    ]


def test_spans_of_joined_requests_add_up_to_the_routers_ttft() -> None:
    records = (
        _request("a", 100.0) + _request("b", 200.0) + [TraceRecord("router", "lonely", {"received": 1.0})]
    )
    stages = stage_breakdown(records)
    assert list(stages) == [name for name, _, _ in SPANS]
    assert stages["p_prefill"] == 140.0 and stages["d_first_token"] == 40.0
    assert round(sum(stages.values()), 6) == 201.0  # received -> client_first_byte


def test_failed_transfers_are_left_out() -> None:
    stages = stage_breakdown(_request("a", 0.0, state="failed"))
    assert "p_prefill" not in stages and stages["router_in"] == 1.0
