"""When switching a replica's role beats adding one: a pure rule over one interval's per-role decisions.

Engines that serve both roles (vLLM ``kv_role`` ``kv_both``) can move between P and D without a restart
(pd-router's ``POST /admin/workers/role``: drain the old role's legs, then switch). When the traffic mix
shifts, one role needs a replica more while the other has one more than its plan wants; moving that one is
faster than starting a new replica whenever its drain is shorter than a start, and costs no replica-seconds.
``decide_switch`` is meant to be called by the controller after ``policy.decide`` for both roles. It says to
switch only when all of these hold (``why`` names the first that does not):

1. ``one_up``: exactly one role scales up this interval (its decision's target exceeds its ordered count);
2. ``over``: the other role's plan is known and below its running replicas, so one can leave it, and no
   replica of that role is starting (the plan counted them as coming);
3. ``minimum``: the other role keeps at least its minimum without it;
4. ``switchable``: the other role has a running replica that serves both roles;
5. ``faster``: its expected drain (``drain_s``: the latest drain the router measured,
   ``pd_router_role_drain_seconds``, or a guess until then) is shorter than a replica's start
   (``start_s``: ``startup.StartTimes.lead_s``). At equal times a new replica wins: it adds capacity
   without taking any away.

A switch moves ONE replica: the up role's decision then counts it as one of the replicas it asked for.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from pd_disagg.autoscale.policy import Decision, Limits, Replicas
from pd_disagg.autoscale.settings import ROLES


class SwitchReason(enum.StrEnum):
    SWITCH = "switch"
    ONE_UP = "one_up"
    OVER = "over"
    MINIMUM = "minimum"
    SWITCHABLE = "switchable"
    FASTER = "faster"


@dataclass(frozen=True)
class SwitchDecision:
    """Move one replica from ``source`` to ``target`` (only when ``reason`` is ``SWITCH``), and why."""

    reason: SwitchReason
    why: str
    source: str = ""
    target: str = ""

    @property
    def switch(self) -> bool:
        return self.reason is SwitchReason.SWITCH


def decide_switch(
    decisions: Mapping[str, Decision],
    planned: Mapping[str, int | None],
    current: Mapping[str, Replicas],
    limits: Mapping[str, Limits],
    switchable: Mapping[str, int],
    start_s: float,
    drain_s: float,
) -> SwitchDecision:
    """Whether to switch a replica instead of adding one (see the module for the rules, in order).

    ``decisions``, ``planned``, ``current``, ``limits``: each role's decision this interval, its plan (None:
    unknown), replicas and bounds; ``switchable``: each role's running replicas that serve both roles.
    """
    ups = [role for role in ROLES if decisions[role].target > current[role].target]
    if len(ups) != 1:
        return SwitchDecision(SwitchReason.ONE_UP, f"{len(ups)} roles scale up")
    target = ups[0]
    source = ROLES[1 - ROLES.index(target)]
    have, want = current[source], planned[source]
    if want is None or want >= have.running or have.starting:
        shown = "unknown" if want is None else want
        return SwitchDecision(
            SwitchReason.OVER,
            f"{source}: plan {shown} with {have.running} running, {have.starting} starting",
        )
    if have.running - 1 < limits[source].minimum:
        return SwitchDecision(
            SwitchReason.MINIMUM, f"{source}: {have.running} running, min {limits[source].minimum}"
        )
    if switchable.get(source, 0) < 1:
        return SwitchDecision(SwitchReason.SWITCHABLE, f"{source}: no running replica serves both roles")
    if drain_s >= start_s:
        return SwitchDecision(SwitchReason.FASTER, f"drain {drain_s:g} s >= start {start_s:g} s")
    return SwitchDecision(
        SwitchReason.SWITCH,
        f"{source} -> {target}: plan {want} of {have.running} {source}; drain {drain_s:g} s < start {start_s:g} s",
        source,
        target,
    )
