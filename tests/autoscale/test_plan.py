"""``plan.Planner``: replicas from ``planner.tails``' percentile capacities on the estimated distributions (a
long tail needs more replicas than its mean suggests), a start time ahead along the trend, and what it cannot
say."""

from __future__ import annotations

from pd_disagg.autoscale.estimate import Estimate
from pd_disagg.autoscale.plan import Planner, replicas_for
from planner import tails
from planner.profile import DecodePoint, Profile
from planner.trace import Lognormal

PROFILE = Profile(
    prefill_max_tokens_per_s=4000.0,
    ttft_overhead_s=0.05,
    decode=[DecodePoint(1, 0.02), DecodePoint(8, 0.025), DecodePoint(32, 0.04)],
)
PROMPT = Lognormal(median=500.0, sigma=0.8)
OUTPUT = Lognormal(median=100.0, sigma=0.5)


def _estimate(rate: float, prompt: Lognormal | None = PROMPT, trend: float = 0.0) -> Estimate:
    return Estimate(60.0, rate, rate, prompt, OUTPUT, None, None, 0.0, trend)


def test_replicas_for_rounds_up_and_takes_a_whole_number_as_it_is() -> None:
    assert replicas_for(0.0, 2.0) == 0
    assert replicas_for(4.0, 2.0) == 2
    assert replicas_for(4.0 + 1e-6, 2.0) == 3
    assert replicas_for(3 * 0.1, 0.1) == 3  # 0.30000000000000004 / 0.1


def test_counts_are_the_rate_over_the_tails_capacity_of_one_replica() -> None:
    planner = Planner(PROFILE, ttft_slo_s=1.0, tpot_slo_s=0.03, percentile=90.0)
    plans = planner.plan(_estimate(20.0), lead_s=0.0)
    per_p = tails.prefill_rate(PROFILE, PROMPT, 1.0, 0.9)
    per_d = tails.decode_rate(PROFILE, OUTPUT, 0.03, 0.9)
    assert plans["prefill"].replicas == replicas_for(20.0, per_p) >= 2
    assert plans["decode"].replicas == replicas_for(20.0, per_d) >= 2
    assert "per replica" in plans["prefill"].why


def test_a_long_tail_needs_more_prefill_than_the_same_mean_without_it() -> None:
    planner = Planner(PROFILE, ttft_slo_s=1.0, tpot_slo_s=0.03, percentile=90.0)
    narrow = Lognormal(
        median=PROMPT.mean, sigma=0.0
    )  # same mean prompt, no spread (what a mean-only plan sees)
    tailed = planner.plan(_estimate(20.0), 0.0)["prefill"].replicas
    mean_only = planner.plan(_estimate(20.0, prompt=narrow), 0.0)["prefill"].replicas
    assert tailed is not None and mean_only is not None and tailed > mean_only


def test_a_rising_rate_is_planned_a_start_time_ahead_and_a_falling_one_is_not() -> None:
    planner = Planner(PROFILE, ttft_slo_s=1.0, tpot_slo_s=0.03, percentile=90.0)
    now = planner.plan(_estimate(10.0), 0.0)["decode"].replicas
    ahead = planner.plan(_estimate(10.0, trend=0.1), lead_s=100.0)["decode"].replicas  # 20 req/s then
    assert ahead == planner.plan(_estimate(20.0), 0.0)["decode"].replicas
    assert now is not None and ahead is not None and ahead > now
    assert planner.plan(_estimate(10.0, trend=-0.1), lead_s=100.0)["decode"].replicas == now


def test_no_load_plans_zero_and_unknown_lengths_or_impossible_slos_plan_nothing() -> None:
    planner = Planner(PROFILE, ttft_slo_s=1.0, tpot_slo_s=0.03, percentile=90.0)
    assert planner.plan(_estimate(0.0), 0.0)["prefill"].replicas == 0
    unknown = planner.plan(_estimate(5.0, prompt=None), 0.0)["prefill"]
    assert unknown.replicas is None and "no P->D prompt lengths" in unknown.why
    impossible = Planner(PROFILE, ttft_slo_s=0.01, tpot_slo_s=0.001, percentile=90.0).plan(
        _estimate(5.0), 0.0
    )
    assert impossible["prefill"].replicas is None and "infeasible" in impossible["prefill"].why
    assert impossible["decode"].replicas is None and "infeasible" in impossible["decode"].why


def test_capacities_are_cached_per_rounded_distribution() -> None:
    planner = Planner(PROFILE, ttft_slo_s=1.0, tpot_slo_s=0.03, percentile=90.0)
    planner.plan(_estimate(5.0, prompt=Lognormal(500.01, 0.8)), 0.0)
    planner.plan(_estimate(5.0, prompt=Lognormal(500.02, 0.8)), 0.0)
    assert sum(key[0] == "prefill" for key in planner._cache) == 1
