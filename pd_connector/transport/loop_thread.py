"""An asyncio event loop on its own daemon thread: the I/O thread of the TCP and cma transports.

Engine threads (vLLM's forward pass) hand work over with ``submit``/``call_soon`` and get
``concurrent.futures`` results back, so they never block on the network. The loop sleeps in epoll when idle.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """Owns one event loop running forever on a named daemon thread until ``stop``."""

    def __init__(self, name: str) -> None:
        self.loop = _new_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coro`` on the loop; the returned future is safe to wait on from any other thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and join the thread (idempotent; must not be called from the loop itself)."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("I/O thread %s did not stop within %.1f s", self._thread.name, timeout_s)
