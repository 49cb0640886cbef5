"""Wait for a condition in a test instead of sleeping a guessed time: ``wait_until`` and its async twin.

A fixed sleep is either too short on a loaded machine (the test flakes) or too long everywhere (the suite
crawls); polling a condition with a deadline is neither. Threads and subprocesses (transports, transfer
engines) and real servers (the integration tests poll their /metrics) are waited for with ``wait_until``;
code on the test's own event loop (the router and its fake engines) with ``wait_until_async``, which yields
to the loop between polls and may poll an async predicate.

The pause between polls starts at ``POLL_S`` and doubles up to ``MAX_POLL_S``: a condition met within
milliseconds (an in-process transfer) is seen within milliseconds, and one that takes seconds (a server
freeing its blocks, read over HTTP) is not polled hundreds of times a second on cores the servers need.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.005
MAX_POLL_S = 0.1


class _Deadline:
    """The clock both helpers share: how long the wait took, or the test's failure when it ran out."""

    def __init__(self, timeout_s: float, what: str) -> None:
        self.start = time.monotonic()
        self.timeout_s = timeout_s
        self.what = what
        self.pause = POLL_S / 2

    def pause_s(self) -> float:
        """How long to sleep before the next poll: doubling from ``POLL_S``, at most ``MAX_POLL_S``."""
        self.pause = min(MAX_POLL_S, self.pause * 2)
        return self.pause

    def took(self, met: bool) -> float | None:
        """Seconds since the start when ``met``, None to poll again; raises AssertionError once past due."""
        elapsed = time.monotonic() - self.start
        if met:
            return elapsed
        if elapsed > self.timeout_s:
            raise AssertionError(f"timed out after {self.timeout_s} s waiting for {self.what}")
        return None


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "the condition") -> float:
    """Poll ``predicate`` from this thread until it is true; return the seconds it took."""
    deadline = _Deadline(timeout_s, what)
    while (took := deadline.took(predicate())) is None:
        time.sleep(deadline.pause_s())
    return took


async def wait_until_async(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0, what: str = "the condition"
) -> float:
    """Poll ``predicate`` (plain or async) while the event loop runs; return the seconds it took."""

    async def met() -> bool:
        result = predicate()
        return await result if inspect.isawaitable(result) else result

    deadline = _Deadline(timeout_s, what)
    while (took := deadline.took(await met())) is None:
        await asyncio.sleep(deadline.pause_s())
    return took
