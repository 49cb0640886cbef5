"""``policy.decide`` at its boundaries: plan exactly at the target, hold time just under and at, bounds, cooldown,
and replicas still starting (no capacity yet, but coming)."""

from __future__ import annotations

import math

from pd_disagg.autoscale.policy import Limits, Memory, Reason, Replicas, decide

LIMITS = Limits(minimum=1, maximum=4, hold_s=300.0, cooldown_s=60.0)
OLD = Memory(changed_at=-1000.0)  # the last change long ago: cooldown over


def _steady(n: int) -> Replicas:
    return Replicas(running=n, starting=0, target=n)


def test_plan_equal_to_the_target_is_steady_and_one_more_scales_up_at_once() -> None:
    same, _ = decide("decode", 2, False, _steady(2), LIMITS, OLD, 0.0)
    assert (same.target, same.reason) == (2, Reason.STEADY) and not same.changes(_steady(2))
    up, memory = decide("decode", 3, False, _steady(2), LIMITS, OLD, 0.0)
    assert (up.target, up.reason) == (3, Reason.PLAN_UP) and up.changes(_steady(2))
    assert memory.changed_at == 0.0 and "decode: 2 -> 3" in up.why


def test_plan_up_is_not_held_back_by_the_cooldown() -> None:
    up, _ = decide("prefill", 3, False, _steady(2), LIMITS, Memory(changed_at=0.0), 1.0)
    assert (up.target, up.reason) == (3, Reason.PLAN_UP)


def test_scale_down_waits_exactly_the_hold_time_and_goes_to_the_most_wanted_meanwhile() -> None:
    memory, now = OLD, 0.0
    for planned, now in ((1, 0.0), (2, 100.0), (1, 299.999)):
        decision, memory = decide("decode", planned, False, _steady(3), LIMITS, memory, now)
        assert (decision.target, decision.reason) == (3, Reason.HOLD), now
    assert memory.below_since == 0.0 and memory.most_wanted_below == 2
    down, memory = decide("decode", 1, False, _steady(3), LIMITS, memory, 300.0)
    assert (down.target, down.reason) == (2, Reason.PLAN_DOWN)
    assert memory == Memory(changed_at=300.0)


def test_a_plan_back_at_the_target_restarts_the_hold() -> None:
    _, memory = decide("decode", 1, False, _steady(3), LIMITS, OLD, 0.0)
    steady, memory = decide("decode", 3, False, _steady(3), LIMITS, memory, 200.0)
    assert steady.reason is Reason.STEADY and memory.below_since is None
    held, _ = decide("decode", 1, False, _steady(3), LIMITS, memory, 350.0)
    assert held.reason is Reason.HOLD  # 0 s of the new hold, not 350


def test_no_scale_down_within_the_cooldown_of_the_last_change() -> None:
    recent = Memory(below_since=0.0, most_wanted_below=1, changed_at=300.0)
    within, _ = decide("decode", 1, False, _steady(3), LIMITS, recent, 359.999)
    assert (within.target, within.reason) == (3, Reason.COOLDOWN)
    after, _ = decide("decode", 1, False, _steady(3), LIMITS, recent, 360.0)
    assert (after.target, after.reason) == (1, Reason.PLAN_DOWN)


def test_no_scale_down_while_a_replica_starts_or_the_slo_is_missed() -> None:
    held = Memory(below_since=0.0, most_wanted_below=1, changed_at=-1000.0)
    starting = Replicas(running=2, starting=1, target=3)
    decision, _ = decide("decode", 1, False, starting, LIMITS, held, 400.0)
    assert (decision.target, decision.reason) == (3, Reason.STARTING)
    # Missed within the cooldown (no SLO-driven scale-up yet): not a moment to remove one either.
    recent = Memory(below_since=0.0, most_wanted_below=1, changed_at=350.0)
    decision, _ = decide("decode", 1, True, _steady(3), LIMITS, recent, 400.0)
    assert (decision.target, decision.reason) == (3, Reason.HOLD)


def test_a_missed_slo_adds_one_over_the_running_replicas_and_waits_for_a_starting_one() -> None:
    up, _ = decide("decode", 2, True, _steady(2), LIMITS, OLD, 0.0)
    assert (up.target, up.reason) == (3, Reason.SLO_UP)
    # The replica that was added is starting: not capacity yet, but coming; no second one for the same misses.
    starting = Replicas(running=2, starting=1, target=3)
    wait, _ = decide("decode", 2, True, starting, LIMITS, OLD, 10.0)
    assert (wait.target, wait.reason) == (3, Reason.HOLD)
    # Running now, but within the cooldown: the window still holds the misses from before it served.
    cooling, _ = decide("decode", 3, True, _steady(3), LIMITS, Memory(changed_at=0.0), 59.0)
    assert (cooling.target, cooling.reason) == (3, Reason.STEADY)
    again, _ = decide("decode", 3, True, _steady(3), LIMITS, Memory(changed_at=0.0), 60.0)
    assert (again.target, again.reason) == (4, Reason.SLO_UP)


def test_bounds_clamp_the_plan_the_slo_rule_and_a_target_outside_them() -> None:
    capped, _ = decide("decode", 9, False, _steady(3), LIMITS, OLD, 0.0)
    assert (capped.target, capped.reason) == (4, Reason.PLAN_UP)
    at_max, _ = decide("decode", 9, True, _steady(4), LIMITS, OLD, 0.0)
    assert (at_max.target, at_max.reason) == (4, Reason.STEADY)
    above, _ = decide("decode", 2, False, _steady(6), LIMITS, OLD, 0.0)
    assert (above.target, above.reason) == (4, Reason.CLAMP)
    below, _ = decide("prefill", 0, False, _steady(0), LIMITS, OLD, 0.0)
    assert (below.target, below.reason) == (1, Reason.CLAMP)
    # No load plans 0; the minimum stays, however long the hold.
    floor, _ = decide("prefill", 0, False, _steady(1), LIMITS, Memory(below_since=0.0), 1e6)
    assert (floor.target, floor.reason) == (1, Reason.STEADY)


def test_an_unknown_plan_keeps_the_target() -> None:
    kept, memory = decide("prefill", None, False, _steady(2), LIMITS, OLD, 0.0)
    assert (kept.target, kept.reason) == (2, Reason.STEADY) and memory.changed_at == -1000.0
    assert "plan unknown" in kept.why
    assert math.isinf(Memory().changed_at)
