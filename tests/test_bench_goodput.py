"""The pure parts of benchmarks.goodput: goodput interpolation at its boundaries, SLO derivation, attainment
per request class, SLOs from figures fixed on the command line, and the JSON's shape
(benchmarks/goodput_analysis.py, goodput.py); that ``--confine`` puts every process of an engine on its core and
what ``pd_lend`` changes (benchmarks/goodput_systems.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.goodput import class_ms, slo_basis
from benchmarks.goodput_analysis import (
    WORKLOADS,
    goodput_rps,
    ratios,
    score,
    slos,
    stage_means,
    summarize,
    target_met,
)
from benchmarks.goodput_systems import LEND_MAX_ACTIVE, build

MIXED = WORKLOADS["mixed"]


def test_goodput_interpolates_between_the_last_holding_and_first_missing_rate() -> None:
    # 0.95 at 0.2, 0.85 at 0.4: 90% is crossed half-way.
    assert goodput_rps([(0.1, 1.0), (0.2, 0.95), (0.4, 0.85)]) == (pytest.approx(0.3), False)


def test_goodput_at_the_boundaries() -> None:
    assert goodput_rps([(0.1, 0.5), (0.2, 0.4)]) == (0.0, False)  # the lowest rate already misses
    assert goodput_rps([(0.1, 1.0), (0.2, 0.9)]) == (0.2, True)  # exactly 90% holds; capped by the sweep
    assert goodput_rps([(0.3, 0.9), (0.1, 1.0), (0.5, 0.0)]) == (pytest.approx(0.3), False)  # any order
    # The first crossing counts: a noisy recovery at a higher rate does not raise goodput.
    assert goodput_rps([(0.1, 1.0), (0.2, 0.8), (0.3, 0.95)])[0] == pytest.approx(0.15)
    with pytest.raises(ValueError):
        goodput_rps([])


def test_slos_scale_the_idle_figures_and_refuse_nonsense() -> None:
    slo = slos({"short": 300.0, "long": 4000.0}, 30.0, 2.0)
    assert slo.ttft_ms == {"short": 600.0, "long": 8000.0}
    assert slo.tpot_ms == 60.0
    for bad in ((0.0, 30.0, 2.0), (300.0, 0.0, 2.0), (300.0, 30.0, 0.0)):
        with pytest.raises(ValueError):
            slos({"short": bad[0]}, bad[1], bad[2])


def test_workload_counts_and_classes() -> None:
    assert MIXED.counts(10) == {"short": 6, "long": 4}
    assert sum(MIXED.counts(7).values()) == 7
    assert MIXED.class_of(2003).name == "long"
    assert MIXED.class_of(129).name == "short"


def result(*reqs: tuple[int, int, float, float, str]) -> dict[str, object]:
    """A vLLM detailed result from (prompt_len, output_len, ttft_s, latency_s, error) per request."""
    return {
        "input_lens": [r[0] for r in reqs],
        "output_lens": [r[1] for r in reqs],
        "ttfts": [r[2] for r in reqs],
        "latencies": [r[3] for r in reqs],
        "errors": [r[4] for r in reqs],
        "itls": [[0.05] * (r[1] - 1) if not r[4] else [] for r in reqs],
        "completed": sum(1 for r in reqs if not r[4]),
        "failed": sum(1 for r in reqs if r[4]),
        "duration": 10.0,
    }


def test_attainment_per_class_ttft_and_tpot_and_failures() -> None:
    slo = slos({"short": 300.0, "long": 4000.0}, 30.0, 2.0)  # TTFT 600 / 8000 ms, TPOT 60 ms
    res = result(
        (128, 128, 0.5, 0.5 + 127 * 0.05, ""),  # short, both within
        (128, 128, 0.7, 0.7 + 127 * 0.05, ""),  # short, TTFT over its class's 600 ms
        (2000, 200, 7.0, 7.0 + 199 * 0.05, ""),  # long: 7 s is within the long class's 8 s
        (2000, 200, 1.0, 1.0 + 199 * 0.07, ""),  # long, TPOT 70 ms over 60
        (2000, 0, 0.0, 0.0, "HTTP 500"),  # failed: never attains
    )
    s = score(res, MIXED, {2.0: slo}, sent=5)
    assert s["attainment"] == {"2.0": 0.4}
    assert s["failed"] == 1
    assert s["worst_gap_ms"] == pytest.approx(50.0)


def test_targets_and_ratios_with_a_zero_denominator() -> None:
    goodput = {"aggregated": 0.2, "aggregated_slo": 0.25, "pd": 0.1, "nixl": 0.0}
    assert ratios(goodput) == {
        "pd_over_aggregated": 0.5,
        "pd_over_nixl": None,
        "best_ours_over_aggregated": 1.25,
    }
    assert target_met(goodput, "pd_over_nixl", 1.2) is True  # positive goodput over none
    assert target_met(goodput, "pd_over_aggregated", 2.0) is False
    assert target_met({"aggregated": 0.2}, "pd_over_aggregated", 2.0) is None  # pd not run


def test_summary_has_the_issue_shape() -> None:
    scales = [1.5, 2.0, 3.0]
    slo_by_scale = {k: slos({"short": 300.0, "long": 4000.0}, 30.0, k) for k in scales}
    ok = score(result((128, 128, 0.2, 0.2 + 127 * 0.03, "")), MIXED, slo_by_scale, sent=1)
    bad = score(result((128, 128, 9.0, 9.0 + 127 * 0.03, "")), MIXED, slo_by_scale, sent=1)
    runs = {
        "mixed": {
            "aggregated": [(0.1, ok), (0.2, bad)],
            "aggregated_slo": [(0.1, ok), (0.2, ok), (0.4, bad)],
            "pd": [(0.1, bad)],
            "nixl": [(0.1, bad)],
        }
    }
    out = summarize(runs, {"mixed": slo_by_scale}, scales, 2.0)
    json.dumps(out)  # serialisable as the last stdout line
    w = out["workloads"]["mixed"]
    assert set(w) >= {"slo", "goodput_rps", "itl_p99_ms", "worst_gap_ms", "ttft_p99_ms"}
    assert w["slo"] == {"ttft_ms": {"short": 600.0, "long": 8000.0}, "tpot_ms": 60.0}
    # 100% then 0%: 90% is crossed a tenth of the way to the next rate.
    assert w["goodput_rps"] == {"aggregated": 0.11, "aggregated_slo": 0.22, "pd": 0.0, "nixl": 0.0}
    assert w["at_rate_rps"] == 0.1  # the highest rate every system ran
    assert set(w["itl_p99_ms"]) == set(runs["mixed"])
    assert out["ratios"]["mixed"] == {
        "pd_over_aggregated": 0.0,
        "pd_over_nixl": None,
        "best_ours_over_aggregated": 2.0,
    }
    assert set(out["by_slo_scale"]) == {"1.5", "2.0", "3.0"}
    assert out["by_slo_scale"]["3.0"]["workloads"]["mixed"]["slo"]["tpot_ms"] == 90.0
    assert out["targets"] == {"mixed.best_ours_over_aggregated>=1.5": True, "zero_failed_requests": True}


def test_stage_means_are_per_engine_deltas() -> None:
    before = {"prefill": {"requests": 2.0, "queue_s": 1.0, "prefill_s": 8.0, "decode_s": 0.0}}
    after = {"prefill": {"requests": 6.0, "queue_s": 3.0, "prefill_s": 24.0, "decode_s": 0.0}}
    assert stage_means(before, after) == {
        "prefill": {"requests": 4, "queue_ms_mean": 500.0, "prefill_ms_mean": 4000.0, "decode_ms_mean": 0.0}
    }
    assert stage_means(before, before)["prefill"]["queue_ms_mean"] is None  # nothing finished


@pytest.mark.parametrize("confine", [False, True])
def test_confine_puts_each_engine_on_its_core(tmp_path: Path, confine: bool) -> None:
    system = build("pd", tmp_path / "model", "float32", 2048, tmp_path, confine=confine)
    firsts = [list(engine.argv[:3]) for engine in system.engines]
    if confine:
        assert firsts == [["taskset", "-c", "0"], ["taskset", "-c", "1"]]
    else:
        assert all(first[0] != "taskset" for first in firsts)


def test_pd_lend_systems_are_pd_with_lending_and_count_as_ours(tmp_path: Path) -> None:
    pd, lend = (build(name, tmp_path / "model", "float32", 2048, tmp_path) for name in ("pd", "pd_lend"))
    assert "policy" not in pd.router_config["sections"]
    assert lend.router_config["sections"]["policy"] == {"lend_max_active": LEND_MAX_ACTIVE}
    assert lend.router_config["flow"] == pd.router_config["flow"] == "pd-push"
    assert ratios({"aggregated": 4.0, "pd": 1.0, "pd_lend": 5.0})["best_ours_over_aggregated"] == 1.25
    with pytest.raises(ValueError, match="SLOs"):
        build("pd_lend_slo", tmp_path / "model", "float32", 2048, tmp_path)
    slo = build("pd_lend_slo", tmp_path / "model", "float32", 2048, tmp_path, slo_ms=(500.0, 11.0))
    p, d = ([*e.argv] for e in slo.engines)
    assert "--scheduler-cls" in p and "--scheduler-cls" not in d  # P's lent chats get bounded steps
    # The TPOT SLO is the scheduler's TPOT target (a mean), not its ITL target (each gap).
    targets = {k: v for k, v in slo.engines[0].env.items() if k.endswith("_TARGET_MS")}
    assert targets == {
        "PD_SCHED_TTFT_TARGET_MS": "500",
        "PD_SCHED_TPOT_TARGET_MS": "11.0",
        "PD_SCHED_ITL_TARGET_MS": "500",
    }
    assert slo.router_config["sections"]["policy"] == {"lend_max_active": LEND_MAX_ACTIVE}
    assert ratios({"aggregated": 4.0, "pd_lend_slo": 6.0})["best_ours_over_aggregated"] == 1.5


def test_slo_basis_takes_the_figures_fixed_on_the_command_line() -> None:
    idle = {"ttft_ms": {"short": 20.0, "long": 250.0}, "step_ms": 7.5}
    given = argparse.Namespace(idle_ttft_ms=[("long", 300.0)], idle_step_ms=6.0)
    assert slo_basis(idle, given) == {"ttft_ms": {"short": 20.0, "long": 300.0}, "step_ms": 6.0}
    none = argparse.Namespace(idle_ttft_ms=[], idle_step_ms=None)
    assert slo_basis(idle, none) == {"ttft_ms": idle["ttft_ms"], "step_ms": 7.5}
    assert class_ms("short=44") == ("short", 44.0)
    for bad in ("short", "=4", "short=0", "short=x"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            class_ms(bad)
