"""An asyncio event loop on its own daemon thread: the I/O thread of the TCP data plane and of the control plane.

Who uses it: ``tcp.TcpTransport`` (socket work of the data plane) and ``transfer.context.EngineContext`` (the
transfer engine's control connections, timers and transport completions), one per transport or engine in an
engine worker process. Engine threads (vLLM's forward pass, SGLang's scheduler) hand work over with
``submit``/``run``/``call_soon`` and get ``concurrent.futures`` results back, so they never block on the
network. The loop is uvloop's where it is installed and sleeps in epoll when idle.
"""

from __future__ import annotations

import asyncio
import contextlib
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

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coro`` on the loop; the returned future is safe to wait on from any other thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the loop and wait for its result from another thread, at most ``timeout_s``."""
        return self.submit(coro).result(timeout_s)

    def call_soon(self, fn: Callable[..., object], *args: object) -> bool:
        """Run ``fn(*args)`` on the loop soon; returns at once (callable from any thread).

        False once the loop is closed: the call is dropped (a late transport completion after shutdown has
        nobody to tell; a caller holding a future fails it).
        """
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Cancel the loop's remaining tasks, stop it, join the thread and close the loop (idempotent; must not
        be called from the loop itself)."""
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self.run(_cancel_tasks(), timeout_s)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("I/O thread %s did not stop within %.1f s", self._thread.name, timeout_s)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
