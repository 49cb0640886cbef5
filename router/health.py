"""Per-worker circuit breaker and the active health checker.

Both run in the router process. The circuit breaker is fed by the request path (``record_success`` /
``record_failure`` after each upstream leg) and opens after ``failure_threshold`` consecutive failures; after
``open_s`` it lets one trial request through (half-open) and closes on its success. The health checker is one
asyncio task that polls every worker's ``GET /health`` each ``interval_s`` and flips ``Worker.healthy`` after
``unhealthy_after`` failures / ``healthy_after`` successes in a row. A worker is a routing candidate only if
both agree (see ``balancer.Worker.usable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from router.config import CircuitConfig, HealthConfig

log = logging.getLogger("router.health")
Clock = Callable[[], float]


class CircuitState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure circuit breaker with a single trial request when half-open."""

    def __init__(self, cfg: CircuitConfig, clock: Clock = time.monotonic) -> None:
        self._cfg = cfg
        self._clock = clock
        self._failures = 0
        self._opened_at = 0.0
        self._trial_in_flight = False
        self.state = CircuitState.CLOSED

    def allows(self) -> bool:
        """May a request be sent now? (Does not reserve the half-open trial; ``acquire`` does.)"""
        if self.state is CircuitState.OPEN and self._clock() - self._opened_at >= self._cfg.open_s:
            self.state = CircuitState.HALF_OPEN
        if self.state is CircuitState.HALF_OPEN:
            return not self._trial_in_flight
        return self.state is CircuitState.CLOSED

    def acquire(self) -> None:
        """Called when a request is actually sent: in half-open state that request is the one trial."""
        if self.state is CircuitState.HALF_OPEN:
            self._trial_in_flight = True

    def record_success(self) -> None:
        self._failures = 0
        self._trial_in_flight = False
        self.state = CircuitState.CLOSED

    def record_failure(self) -> None:
        self._failures += 1
        self._trial_in_flight = False
        if self.state is CircuitState.HALF_OPEN or self._failures >= self._cfg.failure_threshold:
            self.state = CircuitState.OPEN
            self._opened_at = self._clock()


class HealthTarget(Protocol):
    """What the checker needs from a worker: its URL and a place to record the verdict."""

    @property
    def url(self) -> str: ...

    healthy: bool
    health_streak: int  # > 0: consecutive successes, < 0: consecutive failures
    recoveries: int  # how often the checker brought it back after taking it out


def apply_check(target: HealthTarget, ok: bool, cfg: HealthConfig) -> bool:
    """Fold one check result into ``target``; returns True when ``healthy`` flipped."""
    if ok:
        target.health_streak = max(target.health_streak, 0) + 1
        if not target.healthy and target.health_streak >= cfg.healthy_after:
            target.healthy = True
            target.recoveries += 1
            return True
    else:
        target.health_streak = min(target.health_streak, 0) - 1
        if target.healthy and -target.health_streak >= cfg.unhealthy_after:
            target.healthy = False
            return True
    return False


class HealthChecker:
    """Polls all workers concurrently each interval until ``stop()``; ``probe(url)`` is one check
    (``upstream.check_health`` on the router's connection pool), True when the worker answered healthy."""

    def __init__(
        self,
        cfg: HealthConfig,
        probe: Callable[[str], Awaitable[bool]],
        targets: Callable[[], Iterable[HealthTarget]],
        on_change: Callable[[HealthTarget], None] = lambda t: None,
    ) -> None:
        self._cfg = cfg
        self._probe = probe
        self._targets = targets
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None

    async def run_once(self) -> None:
        targets = list(self._targets())
        results = await asyncio.gather(*(self._probe(t.url) for t in targets))
        for target, ok in zip(targets, results, strict=True):
            if apply_check(target, ok, self._cfg):
                log.warning("worker %s is now %s", target.url, "healthy" if target.healthy else "UNHEALTHY")
                self._on_change(target)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._cfg.interval_s)
            try:
                await self.run_once()
            except Exception:  # never let one bad round stop health checking
                log.exception("health check round failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="health-checker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
