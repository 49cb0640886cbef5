"""The first-token benchmark's breakdown joins the three records of a P/D request (router, P, D) on the
transfer id, measures each span between anchor stamps, and leaves out what it cannot join; its servers can be
confined to their cores."""

from __future__ import annotations

from pathlib import Path

from benchmarks.first_token import PATHS, gap_stats, paired_overhead, stage_breakdown
from pd_connector.trace import TraceRecord
from pd_disagg.engines import vllm_server


def _request(tid: str, shift: float, state: str = "done", via: str = "decode") -> list[TraceRecord]:
    """A P/D request's three records; ``via``: which way its first token came (P's answer: the router stamps
    D's stream joining after it)."""
    router = {"received": 0.0, "prefill_sent": 0.001, "prefill_returned": 0.17, "client_first_byte": 0.171}
    if via == "decode":
        router["decode_first_event"] = 0.168
        router["client_first_byte"] = 0.169
    else:
        router["decode_first_event"] = 0.1705
        router["decode_continued"] = 0.175
    prefill = {"offered": 0.01, "prompt_done": 0.15, "done": 0.152}
    decode = {"done": 0.153, "reported": 0.16}
    return [
        TraceRecord("router", tid, {k: v + shift for k, v in router.items()}, "ok"),
        TraceRecord("prefill", tid, {k: v + shift for k, v in prefill.items()}, state),
        TraceRecord("decode", tid, {k: v + shift for k, v in decode.items()}, state),
    ]


def test_spans_along_the_way_each_first_token_came_add_up_to_the_routers_ttft() -> None:
    records = (
        _request("a", 100.0)
        + _request("b", 200.0)
        + _request("c", 300.0, via="prefill")
        + [TraceRecord("router", "lonely", {"received": 1.0})]
    )
    stages = stage_breakdown(records)
    assert list(stages) == list(PATHS)
    via_d, via_p = stages["via_decode"], stages["via_prefill"]
    assert (via_d.pop("requests"), via_p.pop("requests")) == (2, 1)
    assert list(via_d) == [name for name, _, _ in PATHS["via_decode"]]
    assert via_d["p_prefill"] == 140.0 and via_d["d_report"] == 7.0 and via_d["d_first_token"] == 8.0
    assert round(sum(via_d.values()), 6) == 169.0  # received -> client_first_byte, through D's stream
    assert via_p["p_answer"] == 20.0 and round(sum(via_p.values()), 6) == 171.0  # through P's answer


def test_failed_transfers_are_left_out() -> None:
    stages = stage_breakdown(_request("a", 0.0, state="failed"))["via_decode"]
    assert "p_prefill" not in stages and stages["router_in"] == 1.0 and stages["requests"] == 0


def test_fixed_overhead_is_the_ttft_less_ps_own_time_on_the_same_request() -> None:
    # P's own time (router sent P's leg -> P's prefill ended) is 149 ms in both; the client saw 175 and 160 ms.
    records = _request("a", 100.0) + _request("b", 200.0) + _request("c", 300.0, state="failed")
    overheads = paired_overhead(records, {"a": 0.175, "b": 0.160, "c": 0.5})
    assert [round(ms, 6) for ms in overheads] == [26.0, 11.0]


def test_first_gap_is_split_from_the_later_ones() -> None:
    stats = gap_stats([[0.0, 0.050, 0.060, 0.070], [0.0, 0.030, 0.040]])
    assert stats["first_gap_ms"]["p99"] == 50.0 and stats["first_gap_ms"]["p50"] in (30.0, 50.0)
    assert stats["later_itl_ms"] == {"p50": 10.0, "p99": 10.0}
    assert stats["itl_ms"]["p99"] == 50.0


def test_confine_runs_every_process_of_a_server_on_its_cores(tmp_path: Path) -> None:
    confined = vllm_server("m", log_dir=tmp_path, cpu_core="0|1", confine=True)
    assert list(confined.argv[:3]) == ["taskset", "-c", "0,1"]
    assert confined.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert vllm_server("m", log_dir=tmp_path, cpu_core=1).argv[0] != "taskset"
