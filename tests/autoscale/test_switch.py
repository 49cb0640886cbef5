"""``switch.decide_switch`` at its boundaries: drain just under and equal to the start time, the source role
exactly at its plan and at its minimum, no switchable replica, both or neither role scaling up."""

from __future__ import annotations

from typing import Any

import pytest

from pd_disagg.autoscale.policy import Decision, Limits, Reason, Replicas
from pd_disagg.autoscale.switch import SwitchReason, decide_switch

LIMITS = {role: Limits(minimum=1, maximum=4, hold_s=300.0, cooldown_s=60.0) for role in ("prefill", "decode")}


def _decide(
    d_target: int = 3,
    p_planned: int | None = 1,
    p_running: int = 2,
    p_starting: int = 0,
    p_target: int = 2,
    switchable: int = 1,
    start_s: float = 90.0,
    drain_s: float = 10.0,
    **limits: Any,
) -> Any:
    """Decode wants one more (2 -> ``d_target``) while prefill runs ``p_running`` and plans ``p_planned``."""
    decisions = {
        "prefill": Decision("prefill", p_target, Reason.HOLD, ""),
        "decode": Decision("decode", d_target, Reason.PLAN_UP, ""),
    }
    current = {
        "prefill": Replicas(p_running, p_starting, max(p_running + p_starting, 1)),
        "decode": Replicas(2, 0, 2),
    }
    bounds = {**LIMITS, **limits}
    return decide_switch(
        decisions,
        {"prefill": p_planned, "decode": d_target},
        current,
        bounds,
        {"prefill": switchable},
        start_s,
        drain_s,
    )


def test_a_replica_the_plan_does_not_want_switches_when_its_drain_is_shorter_than_a_start() -> None:
    got = _decide()
    assert got.switch and (got.source, got.target) == ("prefill", "decode")
    assert "drain 10 s < start 90 s" in got.why


@pytest.mark.parametrize(("drain_s", "switch"), [(89.999, True), (90.0, False), (120.0, False)])
def test_a_drain_as_long_as_a_start_adds_a_replica(drain_s: float, switch: bool) -> None:
    got = _decide(drain_s=drain_s)
    assert got.switch is switch and (switch or got.reason is SwitchReason.FASTER)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"p_planned": 2}, SwitchReason.OVER),  # prefill exactly at its plan: none to spare
        ({"p_planned": None}, SwitchReason.OVER),  # prefill's need unknown
        ({"p_starting": 1}, SwitchReason.OVER),  # a prefill replica still starting
        ({"d_target": 2}, SwitchReason.ONE_UP),  # decode does not scale up
        ({"p_target": 3, "p_planned": 3}, SwitchReason.ONE_UP),  # both scale up
        ({"switchable": 0}, SwitchReason.SWITCHABLE),
        ({"prefill": Limits(minimum=2, maximum=4, hold_s=0, cooldown_s=0)}, SwitchReason.MINIMUM),
    ],
)
def test_no_switch_without_a_spare_switchable_replica_and_one_role_short(
    changes: dict[str, Any], reason: SwitchReason
) -> None:
    got = _decide(**changes)
    assert not got.switch and got.reason is reason and (got.source, got.target) == ("", "")


def test_the_source_may_go_down_to_its_minimum_and_the_rule_works_both_ways() -> None:
    assert _decide(p_running=2, p_planned=1, prefill=Limits(1, 4, 0, 0)).switch
    decisions = {
        "prefill": Decision("prefill", 2, Reason.PLAN_UP, ""),
        "decode": Decision("decode", 2, Reason.HOLD, ""),
    }
    current = {"prefill": Replicas(1, 0, 1), "decode": Replicas(2, 0, 2)}
    got = decide_switch(decisions, {"prefill": 2, "decode": 1}, current, LIMITS, {"decode": 2}, 90.0, 5.0)
    assert got.switch and (got.source, got.target) == ("decode", "prefill")
