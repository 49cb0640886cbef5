"""A thread that runs callables handed over by other threads: the I/O thread of the cma and UCX data planes.

Who uses it: ``queued.QueuedTransport`` (the base of ``cma.CmaTransport`` and ``ucx.UcxTransport``), one per
transport in an engine worker process; engine threads hand it work through ``call_soon``. Between batches of
work it asks its owner's ``tick`` (if any) how long it may sleep: ``None`` sleeps in epoll until woken (idle costs
nothing), a timeout below a millisecond (epoll counts in milliseconds) sleeps that long and looks again, a
longer one waits in epoll that long. A submitter wakes it (an eventfd write) only while it sleeps in epoll:
waking it for every piece of work would cost the submitter a GIL hand-over each time. The thread also watches
file descriptors its owner registers (``watch``: e.g. a peer's pidfd) and calls back when one is readable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Shortest timeout epoll can wait (it counts in milliseconds); shorter ones are slept instead.
EPOLL_RESOLUTION_S = 0.001


class WorkThread:
    """Runs handed-over callables in order on one daemon thread until ``stop``."""

    def __init__(self, name: str, tick: Callable[[], float | None] | None = None) -> None:
        self._tick = tick
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self._watched: dict[int, Callable[[], None]] = {}
        self._stopping = False
        #: True while the thread sleeps in epoll: only then ``call_soon`` wakes it.
        self._idle = True
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- any thread -----------------------------------------------------------------------------------------
    def call_soon(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` to run on the thread; returns at once."""
        self._inbox.put(fn)
        if self._idle:  # else it is busy or polling and finds the work without being woken
            self._wake()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float) -> None:
        """Stop after the work at hand, join the thread and close its descriptors (idempotent; not from the
        thread itself)."""
        if self._thread.is_alive():
            self._stopping = True
            self._wake()
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("I/O thread %s did not stop within %.1f s", self._thread.name, timeout_s)
                return
        if self._wake_fd >= 0:
            self._epoll.close()
            os.close(self._wake_fd)
            self._wake_fd = -1

    # -- the thread itself ----------------------------------------------------------------------------------
    def watch(self, fd: int, on_readable: Callable[[], None]) -> None:
        """Call ``on_readable`` on the thread whenever ``fd`` is readable, until ``unwatch``."""
        self._watched[fd] = on_readable
        self._epoll.register(fd, select.EPOLLIN)

    def unwatch(self, fd: int) -> None:
        if self._watched.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    @property
    def watching(self) -> bool:
        return bool(self._watched)

    def poll(self, timeout_s: float | None = 0) -> None:
        """Wait up to ``timeout_s`` (None: until woken) and call back for every watched descriptor that is ready."""
        for fd, _ in self._epoll.poll(-1 if timeout_s is None else timeout_s):
            if fd == self._wake_fd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake_fd)
            elif (on_readable := self._watched.get(fd)) is not None:
                on_readable()

    def _run(self) -> None:
        while not self._stopping:
            while True:
                try:
                    fn = self._inbox.get_nowait()
                except queue.Empty:
                    break
                try:
                    fn()
                except Exception:  # a bug in one piece of work must not stop the thread
                    log.exception("I/O thread %s: work failed", self._thread.name)
            timeout = self._tick() if self._tick is not None else None
            if timeout is not None and timeout < EPOLL_RESOLUTION_S:
                time.sleep(timeout)  # queued work waits at most this long
                self.poll(0)
                continue
            # From here on submitters must wake us. Set before looking at the inbox, so work queued after the
            # look sees the flag, and work queued before it is found.
            self._idle = True
            if self._inbox.empty():
                self.poll(timeout)
            self._idle = False

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # closed during shutdown
            os.eventfd_write(self._wake_fd, 1)
