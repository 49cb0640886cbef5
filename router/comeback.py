"""Waiting for workers to come back: what a request does when a pool it needs has no worker for it.

A worker restarting, stopped for a moment, or taken out by its health checks (``health.py``) leaves its pool
without a usable worker for a few seconds. A request that finds none then waits for one to come back, up to
``policy.unavailable_wait_s`` in all, instead of failing at once: the blip costs it time, not an error. One
``Comeback`` per request, in the router process, shared by the policy's REJECT before any attempt
(``proxy.Proxy._decide``), its attempts (``Proxy._attempts``) and the resumes of its stream (``resume.py``):
the bound holds for the request as a whole.

A request goes to workers that have not failed it. One that failed it counts again once its health checks
took it out and brought it back (``Worker.recoveries`` grew since). When every worker of the pool failed the
request and still passes its health checks, none is away, so none can come back: no wait, and the client
gets the failure at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from prometheus_client import Gauge

from router.balancer import Balancer, Placement, Pool, Worker


class Choice(NamedTuple):
    """The workers for one attempt; ``missing`` names the pool that had none for it ("" = none missing)."""

    decode: Worker | None
    prefill: Worker | None
    missing: str


def choose(
    balancer: Balancer,
    max_active: int,
    failed: set[Worker],
    *,
    wants_prefill: bool,
    needs_prefill: bool,
    hashes: Sequence[int] = (),
    prompt_tokens: int = 0,
    placed: Placement | None = None,
) -> Choice:
    """A decode worker (``placed``, else placed now) and, when ``wants_prefill``, a prefill worker, avoiding
    ``failed``; a missing P is missing only when ``needs_prefill`` (else D prefills itself)."""
    if placed is None:
        placed = balancer.place_decode(max_active, failed, hashes, prompt_tokens)
    decode = placed.worker
    if decode is None:
        return Choice(None, None, "decode")
    prefill = balancer.pick_prefill(failed, hashes, prompt_tokens) if wants_prefill else None
    return Choice(decode, prefill, "prefill" if prefill is None and needs_prefill else "")


class Comeback:
    """One request's wait for workers to come back, across its attempts and resumes."""

    def __init__(self, wait_s: float, waiting: Gauge) -> None:
        self._wait_s = wait_s
        self._waiting = waiting  # the router's gauge of requests waiting for a worker
        self._until: float | None = None  # set when the request first finds a pool without a worker for it
        self._failed_at: dict[Worker, int] = {}  # each failed worker's ``recoveries`` when it failed

    def until(self) -> float:
        """When the request stops waiting (``time.monotonic``): ``unavailable_wait_s`` after it first found a
        pool without a worker for it, which is now if it had not."""
        if self._until is None:
            self._until = time.monotonic() + self._wait_s
        return self._until

    def saw(self, failed: set[Worker]) -> None:
        """After an attempt or a resume: note when each worker that failed the request did."""
        for w in failed:
            self._failed_at.setdefault(w, w.recoveries)

    async def find(
        self, balancer: Balancer, failed: set[Worker], pick: Callable[[], Choice], first: Choice | None = None
    ) -> Choice:
        """``first`` (or ``pick()``), then ``pick()`` again after each wait, until nothing is missing or the
        request's wait is over; returns the last choice (``missing`` set: none came back in time)."""
        choice = first if first is not None else pick()
        while choice.missing and await self._back(balancer.pool(choice.missing), failed):
            choice = pick()
        return choice

    async def _back(self, pool: Pool, failed: set[Worker]) -> bool:
        """Wait until ``pool`` may have a worker for the request again (True), or the request's wait is over
        (False). Workers that failed it and have since come back are taken off ``failed``."""
        until = self.until()
        returned = [w for w in failed if w.recoveries != self._failed_at.get(w, w.recoveries)]
        for w in returned:
            failed.discard(w)
            del self._failed_at[w]
        if returned:
            return True
        left = until - time.monotonic()
        if left <= 0 or (pool.workers and all(w in failed and w.healthy for w in pool.workers)):
            return False
        # Woken when a leg ends or a worker changes; re-check at least every 0.5 s (circuit timers).
        self._waiting.inc()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.5)):
                    await pool.changed.wait()
        finally:
            self._waiting.dec()
        return True
