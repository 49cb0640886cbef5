"""The autoscaling loop, engine- and orchestrator-agnostic: scrape, estimate, plan, decide, apply, record.

Who calls what: an adapter (``pd_disagg.ray_serve.autoscaler`` on Ray Serve) builds a ``Controller`` with a
function returning pd-router's ``/metrics`` text, a ``Scaler`` that reports and sets each role's replicas and
the logger its decisions go to (Serve's replica log on Ray), and awaits ``run``. Every ``interval_s``, ``tick``:

1. scrapes the router and adds the scrape to the ``estimate.Window``;
2. asks the scaler for each role's replicas (running, starting, ordered);
3. plans P and D together from the same estimate (``plan.Planner``), a replica start time ahead (as measured
   by ``startup.StartTimes``, the setting until then);
4. decides each role (``policy.decide``: up at once, down after a hold, bounds, cooldown) and applies the
   targets that changed; each decision is one log line saying why and is counted in ``pd_autoscale_*``.

A failed scrape or scaler call (or anything else) skips that interval (logged and counted), never the loop: the next interval
tries again. Until the window holds two scrapes there is no estimate, and nothing is decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from pd_disagg.autoscale import prom
from pd_disagg.autoscale.estimate import Estimate, Window
from pd_disagg.autoscale.metrics import AutoscaleMetrics
from pd_disagg.autoscale.plan import Planner
from pd_disagg.autoscale.policy import Decision, Limits, Memory, Replicas, decide
from pd_disagg.autoscale.settings import ROLES, AutoscaleSettings
from pd_disagg.autoscale.startup import StartTimes
from planner.profile import Profile

log = logging.getLogger("pd_disagg.autoscale")


class Scaler(Protocol):
    """The orchestrator's side: each role's replicas, and setting a role's replica count."""

    async def replicas(self) -> dict[str, Replicas]: ...

    async def scale(self, role: str, target: int) -> None: ...


class Controller:
    """One autoscaler: its window, plan cache, per-role memory and metrics (nothing shared between two)."""

    def __init__(
        self,
        settings: AutoscaleSettings,
        profile: Profile,
        scrape: Callable[[], Awaitable[str]],
        scaler: Scaler,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.settings = settings
        self._log = logger
        self.metrics = AutoscaleMetrics()
        self._scrape, self._scaler, self._clock = scrape, scaler, clock
        self._window = Window(
            settings.window_s, settings.ttft_slo_s, settings.tpot_slo_s, settings.min_samples
        )
        self._planner = Planner(profile, settings.ttft_slo_s, settings.tpot_slo_s, settings.percentile)
        self._memory = {role: Memory() for role in ROLES}
        self.starts = StartTimes(settings.replica_start_s)
        self._failing: set[str] = set()  # steps whose last attempt failed
        self._limits = {
            role: Limits(*settings.bounds(role), settings.scale_down_hold_s, settings.cooldown_s)
            for role in ROLES
        }

    async def tick(self) -> list[Decision]:
        """One interval (see the module); the decisions taken, empty when there was nothing to decide on."""
        try:
            scrape = prom.Scrape.parse(await self._scrape())
        except Exception as e:
            return self._failed("scrape", e)
        self._worked("scrape")
        now = self._clock()
        estimate = self._window.add(now, scrape)
        if estimate is None:
            return []
        self.metrics.record(estimate)
        try:
            current = await self._scaler.replicas()
        except Exception as e:
            return self._failed("replicas", e)
        self._worked("replicas")
        self.starts.observe(current, now)
        self.metrics.started(self.starts.measured_s)
        # The planner's bisections take up to ~0.1 s per new length distribution: off the event loop.
        plans = await asyncio.to_thread(self._planner.plan, estimate, self.starts.lead_s())
        decisions = []
        for role in ROLES:
            decision, self._memory[role] = decide(
                role,
                plans[role].replicas,
                self._missed(role, estimate),
                current[role],
                self._limits[role],
                self._memory[role],
                now,
            )
            self.metrics.decided(decision, plans[role].replicas, current[role])
            level = logging.INFO if decision.changes(current[role]) else logging.DEBUG
            self._log.log(level, "%s (%s: %s)", decision.why, decision.reason.value, plans[role].why)
            decisions.append(decision)
        for decision in decisions:
            if decision.changes(current[decision.role]):
                try:
                    await self._scaler.scale(decision.role, decision.target)
                except Exception as e:
                    self._failed("scale", e)
                else:
                    self._worked("scale")
                    self.starts.ordered(decision.role, decision.target, current[decision.role], now)
        return decisions

    def _missed(self, role: str, estimate: Estimate) -> bool:
        """Whether the window shows ``role`` short of capacity: first tokens late (P; TTFT) or token gaps late
        or requests queued for a decode slot (D)."""
        q = self.settings.percentile / 100
        attainment = estimate.ttft_attainment if role == "prefill" else estimate.itl_attainment
        late = attainment is not None and attainment < q
        return late or (role == "decode" and estimate.waiting > 0)

    def _failed(self, step: str, error: Exception) -> list[Decision]:
        """Count a failed step; log it as a warning when it starts failing, then quietly until it works again
        (pd-router is not up until the first decode replica is: that is many intervals)."""
        self.metrics.errors.labels(step).inc()
        level = logging.DEBUG if step in self._failing else logging.WARNING
        self._failing.add(step)
        self._log.log(level, "autoscaler: %s failed, skipping this interval: %r", step, error)
        return []

    def _worked(self, step: str) -> None:
        if step in self._failing:
            self._failing.discard(step)
            self._log.info("autoscaler: %s works again", step)

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            began = self._clock()
            try:
                await self.tick()
            except Exception as e:  # a bug in one interval must not end the autoscaling
                self._log.exception("autoscaler: interval failed")
                self._failed("tick", e)
            left = self.settings.interval_s - (self._clock() - began)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(left, 0.0))
