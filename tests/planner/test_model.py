"""Planning formulas against hand-computed cases."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from planner import model
from planner.model import InfeasibleError, Method, Workload
from planner.profile import DecodePoint, Profile

ROOT = Path(__file__).resolve().parents[2]
PAPER = Workload(throughput_tokens_per_s=5e6 / 60, isl=6144, osl=512, ttft_s=2.0, tpot_s=0.02)


def test_paper_like_case(paper_profile: Profile) -> None:
    # 6144 in / 512 out, TTFT 2 s, TPOT 20 ms, 5M tokens/min = 83333.33 tokens/s.
    plan = model.plan(paper_profile, PAPER)
    # TP_prefill = 40000 - 6144 / (2 - 0.1) = 40000 - 3233.684211 = 36766.315789
    assert plan.prefill_tokens_per_s == pytest.approx(36766.315789, rel=1e-9)
    # TPOT 20 ms is a measured point (batch 80): 80 / 0.02 = 4000 tokens/s
    assert plan.decode_tokens_per_s == pytest.approx(4000.0, rel=1e-9)
    # R = 6144 * 4000 / (512 * 36766.315789) = 24576000 / 18824353.68 = 1.305543
    assert plan.pd_ratio == pytest.approx(1.305543, rel=1e-6)
    # N_P = 83333.33 * 6144 / (6656 * 36766.315789) = 76923.0769 / 36766.315789 = 2.092216
    assert plan.prefill_instances_exact == pytest.approx(2.092216, rel=1e-6)
    # N_D = 83333.33 * 512 / (6656 * 4000) = 6410.25641 / 4000 = 1.602564
    assert plan.decode_instances_exact == pytest.approx(1.602564, rel=1e-6)
    assert (plan.prefill_instances, plan.decode_instances) == (3, 2)
    assert plan.request_rate == pytest.approx(83333.333333 / 6656, rel=1e-9)
    # min TTFT = 6144 / 40000 + 0.1 = 0.2536 s
    assert plan.min_ttft_s == pytest.approx(0.2536, rel=1e-12)
    # load per P = 76923.0769 / 3 = 25641.03 tok/s; M/M/1 TTFT = 0.1 + 1 / (40000/6144 - 25641.03/6144)
    assert plan.prefill_load_tokens_per_s == pytest.approx(25641.025641, rel=1e-9)
    assert plan.predicted_ttft_s == pytest.approx(0.1 + 6144 / (40000 - 25641.025641), rel=1e-9)
    # streams per D = (6410.25641 / 2) tok/s * 0.02 s = 64.1
    assert plan.decode_streams_per_instance == pytest.approx(64.102564, rel=1e-6)
    assert plan.notes == ()


def test_summary_has_the_documented_keys_in_order(paper_profile: Profile) -> None:
    """The keys and their order are those docs/configuration.md gives for ``pd-plan --json``."""
    summary = model.plan(paper_profile, PAPER).summary()
    rows = (ROOT / "docs" / "configuration.md").read_text().splitlines()
    (row,) = [r for r in rows if r.startswith("| `--json` |") and "pd_ratio" in r]
    assert list(summary) == re.findall(r'"(\w+)"', row.split("last stdout line", 1)[1])
    assert isinstance(summary["prefill_instances"], int)


def test_quadratic_fit_between_points() -> None:
    # Points (TPOT, throughput): (0.010, 100), (0.015, 533.33), (0.030, 2133.33). Lagrange weights at 0.020:
    # -0.5, 4/3, 1/6 -> -50 + 711.111 + 355.556 = 1016.667 tokens/s.
    profile = Profile(1000.0, 0.0, [DecodePoint(1, 0.010), DecodePoint(8, 0.015), DecodePoint(64, 0.030)])
    value, notes = model.decode_tokens_per_s(profile, 0.020)
    assert value == pytest.approx(1016.6667, rel=1e-5)
    assert notes == []


def test_two_points_fit_a_line() -> None:
    profile = Profile(1000.0, 0.0, [DecodePoint(1, 0.010), DecodePoint(9, 0.030)])
    # throughput 100 at 10 ms, 300 at 30 ms -> 200 at 20 ms
    assert model.decode_tokens_per_s(profile, 0.020)[0] == pytest.approx(200.0)


def test_tpot_slo_above_measured_range_is_capped_with_a_note(paper_profile: Profile) -> None:
    value, notes = model.decode_tokens_per_s(paper_profile, 0.050)
    assert value == pytest.approx(128 / 0.026)
    assert "capped" in notes[0] and "26 ms" in notes[0]


def test_md1_and_mm1_hand_cases() -> None:
    # isl 1000 at 10000 tok/s: service 0.1 s; TTFT SLO 0.3 s, no overhead.
    profile = Profile(10000.0, 0.0, [DecodePoint(1, 0.01)])
    # M/M/1: 10000 - 1000 / 0.3 = 6666.67 (check: 1 / (10 - 6.667) = 0.3 s)
    assert model.prefill_tokens_per_s(profile, 1000, 0.3, Method.MM1) == pytest.approx(6666.6667, rel=1e-6)
    # M/D/1: wait 0.2 = rho * 0.1 / (2 (1 - rho)) -> rho = 0.8 -> 8000 (check: 0.1 + 0.08 / 0.4 = 0.3 s)
    assert model.prefill_tokens_per_s(profile, 1000, 0.3, Method.MD1) == pytest.approx(8000.0, rel=1e-9)


def test_rate_matching_uses_efficiency_factors(paper_profile: Profile) -> None:
    plan = model.plan(paper_profile, PAPER, Method.RATE_MATCH)
    assert plan.prefill_tokens_per_s == pytest.approx(40000 * 0.9)
    assert plan.decode_tokens_per_s == pytest.approx(4000 * 0.92)
    custom = model.plan(
        paper_profile, PAPER, Method.RATE_MATCH, prefill_efficiency=0.5, decode_efficiency=0.5
    )
    assert (custom.prefill_tokens_per_s, custom.decode_tokens_per_s) == pytest.approx((20000, 2000))


def test_ttft_slo_below_minimum_is_infeasible_with_the_minimum(paper_profile: Profile) -> None:
    workload = Workload(83333.0, isl=6144, osl=512, ttft_s=0.25, tpot_s=0.02)
    for method in Method:
        with pytest.raises(InfeasibleError, match=r"minimum achievable TTFT 0\.2536 s"):
            model.plan(paper_profile, workload, method)


def test_ttft_slo_equal_to_minimum_is_infeasible(paper_profile: Profile) -> None:
    with pytest.raises(InfeasibleError):
        model.prefill_tokens_per_s(paper_profile, 6144, 0.2536)


def test_tpot_slo_below_fastest_decode_is_infeasible(paper_profile: Profile) -> None:
    workload = Workload(83333.0, isl=6144, osl=512, ttft_s=2.0, tpot_s=0.005)
    with pytest.raises(InfeasibleError, match=r"minimum measured TPOT 10 ms \(batch 1\)"):
        model.plan(paper_profile, workload)


@pytest.mark.parametrize("field", ["throughput_tokens_per_s", "isl", "osl", "ttft_s", "tpot_s"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_non_positive_inputs_are_rejected(paper_profile: Profile, field: str, bad: float) -> None:
    values = {"throughput_tokens_per_s": 1000.0, "isl": 100.0, "osl": 10.0, "ttft_s": 2.0, "tpot_s": 0.02}
    values[field] = bad
    with pytest.raises(ValueError, match=field):
        model.plan(paper_profile, Workload(**values))


def test_whole_rounds_up_with_tolerance() -> None:
    assert model.whole(3.0000000000004) == 3
    assert model.whole(3.01) == 4
    assert model.whole(0.2) == 1


def test_profile_measured_at_other_length_gives_a_note() -> None:
    profile = Profile(40000.0, 0.1, [DecodePoint(1, 0.01), DecodePoint(64, 0.03)], isl=1024)
    assert "re-profile" in model.plan(profile, PAPER).notes[0]
