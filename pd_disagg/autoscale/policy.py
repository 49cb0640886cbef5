"""The scaling decision for one role: a pure function of what was measured, planned and decided before.

``decide`` is called by the controller once per interval and role, with the planner's need, whether the role
missed its SLO in the window, the replicas running and starting, and the role's ``Memory`` (returned anew, never
mutated). Rules, in order (``Reason`` names the one that applied; the decision's ``why`` says it in words):

1. ``clamp``: a target above ``max`` (or below ``min`` with nothing more wanted) goes to the bound at once.
2. Up, at once: the plan wants more than the target (``plan_up``); or the SLO was missed with no replica of the
   role starting and the cooldown over: one more than the RUNNING replicas (``slo_up``). A starting replica is
   no capacity yet (the window's misses happened without it), but it is coming: the SLO rule waits for it
   rather than ordering another; the plan already looks a start time ahead (``pd_disagg.autoscale.plan``).
3. ``steady``: the target is what is wanted.
4. Down, only after the plan has wanted fewer for ``hold_s`` in a row, to the MOST it wanted meanwhile (a short
   dip does not drop replicas needed again soon), and not while the SLO is missed (``hold``), a replica of the
   role is starting (``starting``) or within ``cooldown_s`` of the role's last change (``cooldown``).

The plan's unknown need (None: no lengths recorded, or SLOs the profile cannot meet) keeps the target.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# Float time comparisons: "held for hold_s" must hold at exactly hold_s.
_EPS = 1e-9


class Reason(enum.StrEnum):
    CLAMP = "clamp"
    PLAN_UP = "plan_up"
    SLO_UP = "slo_up"
    STEADY = "steady"
    HOLD = "hold"
    STARTING = "starting"
    COOLDOWN = "cooldown"
    PLAN_DOWN = "plan_down"


@dataclass(frozen=True)
class Replicas:
    """A role's replicas as the orchestrator reports them: serving, still starting, and the ordered count."""

    running: int
    starting: int
    target: int


@dataclass(frozen=True)
class Limits:
    minimum: int
    maximum: int
    hold_s: float
    cooldown_s: float

    def clamp(self, count: int) -> int:
        return min(max(count, self.minimum), self.maximum)


@dataclass(frozen=True)
class Memory:
    """What a role's next decision needs from the earlier ones."""

    #: Since when the plan has wanted fewer than the target (None: it has not).
    below_since: float | None = None
    #: The most it wanted since then.
    most_wanted_below: int = 0
    #: When the role's target last changed.
    changed_at: float = -math.inf


@dataclass(frozen=True)
class Decision:
    role: str
    target: int
    reason: Reason
    why: str

    def changes(self, replicas: Replicas) -> bool:
        return self.target != replicas.target


def decide(
    role: str,
    planned: int | None,
    slo_missed: bool,
    replicas: Replicas,
    limits: Limits,
    memory: Memory,
    now: float,
) -> tuple[Decision, Memory]:
    """The role's new target and why, and the memory for its next decision (see the module for the rules)."""
    target = replicas.target
    cooled = now - memory.changed_at >= limits.cooldown_s - _EPS
    want = limits.clamp(target if planned is None else planned)
    shown = "unknown" if planned is None else str(planned)
    up_reason, why = Reason.PLAN_UP, f"plan {shown} > target {target}"
    if slo_missed and replicas.starting == 0 and cooled and limits.clamp(replicas.running + 1) > want:
        want = limits.clamp(replicas.running + 1)
        up_reason, why = Reason.SLO_UP, f"SLO missed with {replicas.running} running and none starting"

    def done(new: int, reason: Reason, text: str, keep: Memory | None = None) -> tuple[Decision, Memory]:
        changed = Memory(changed_at=now) if new != target else Memory(changed_at=memory.changed_at)
        return Decision(role, new, reason, f"{role}: {target} -> {new}: {text}"), keep or changed

    if target > limits.maximum:
        return done(limits.maximum, Reason.CLAMP, f"above max {limits.maximum}")
    if want > target:
        if target < limits.minimum and want == limits.minimum:
            return done(want, Reason.CLAMP, f"below min {limits.minimum}")
        return done(want, up_reason, why)
    if want == target:
        return done(target, Reason.STEADY, f"plan {shown}")
    below_since = memory.below_since if memory.below_since is not None else now
    most = max(memory.most_wanted_below, want) if memory.below_since is not None else want
    waiting = Memory(below_since, most, memory.changed_at)
    held = now - below_since
    if held < limits.hold_s - _EPS:
        return done(target, Reason.HOLD, f"plan {shown} lower for {held:.0f} of {limits.hold_s:g} s", waiting)
    if slo_missed:
        return done(target, Reason.HOLD, f"plan {shown} lower, but the SLO was missed", waiting)
    if replicas.starting:
        return done(target, Reason.STARTING, f"plan {shown} lower, {replicas.starting} starting", waiting)
    if not cooled:
        return done(
            target,
            Reason.COOLDOWN,
            f"plan {shown} lower, changed {now - memory.changed_at:.0f} s ago",
            waiting,
        )
    return done(most, Reason.PLAN_DOWN, f"plan {shown} lower for {held:.0f} s; the most it wanted meanwhile")
