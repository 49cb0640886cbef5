"""The base of the transports whose I/O thread runs plain callables: ``cma`` and ``ucx``.

Who calls it: engine threads (through the ``Transport`` methods) and the transport's own ``WorkThread``. What it
does once for both: hands work from engine threads to the I/O thread (``_submit``, ``_call``: run inline when
already on it, since a write future's done-callback runs there), refuses new work once ``close`` began while
the work already queued still runs, closes in order (queued work, the subclass's ``_shutdown``, the thread),
and remembers why a peer was dropped, so a later write to it fails with that reason until ``detach`` or a new
``attach``.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from .base import Transport
from .regions import RegionTable
from .work_thread import WorkThread

#: What a subclass keeps per attached peer.
Peer = TypeVar("Peer")


class QueuedTransport(Transport, Generic[Peer]):
    """A ``Transport`` whose work runs on one ``WorkThread``; subclasses implement the I/O thread's side."""

    #: What a write to a peer that is not attached fails with.
    peer_error: type[ConnectionError] = ConnectionError

    def __init__(self, call_timeout_s: float, tick: Callable[[], float | None] | None = None) -> None:
        self._call_timeout_s = call_timeout_s
        self._regions = RegionTable()
        #: Attached peers by id (attach and detach replace entries, never mutate them).
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()
        self._closing = False
        #: Why a peer was dropped, until ``detach`` or a new ``attach`` (I/O thread only).
        self._broken: dict[str, Exception] = {}
        self._io = WorkThread(f"pd-{self.name}-io", tick)

    # -- called from engine threads -------------------------------------------------------------------------
    def attached_peers(self) -> list[str]:
        """Peer ids currently attached (tests use it to prove nothing leaks)."""
        return list(self._peers)

    def registered_regions(self) -> list[int]:
        """Region ids currently registered."""
        return [r.region_id for r in self._regions.all()]

    def detach(self, peer_id: str) -> None:
        if self._io.running:
            self._call(lambda: self._forget(peer_id)).result(self._call_timeout_s)

    def close(self) -> None:
        if self._io.on_loop_thread():
            raise RuntimeError("close() must not be called from the transport's own I/O thread")
        with self._lock:  # from now on new work is refused; what is queued runs before the shutdown
            if self._closing:
                return
            self._closing = True
        try:
            if self._io.running:
                self._call(self._shutdown, accept_while_closing=True).result(self._call_timeout_s)
            else:
                self._shutdown()
        finally:
            self._io.stop(self._call_timeout_s)
            self._release()

    # -- hand-over to the I/O thread -------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], None], accept_while_closing: bool = False) -> None:
        """Queue ``fn`` for the I/O thread; ``RuntimeError`` once the transport is closed (or closing)."""
        with self._lock:
            if (self._closing and not accept_while_closing) or not self._io.running:
                raise RuntimeError(f"{self.name} transport is closed")
            self._io.call_soon(fn)

    def _queue_write(self, future: Future[int], work: Callable[[], None]) -> Future[int]:
        """Queue ``work`` (which resolves ``future``) for the I/O thread; ``future`` fails at once when closed."""
        try:
            self._submit(work)
        except RuntimeError as exc:
            future.set_exception(exc)
        return future

    def _call(self, fn: Callable[[], Any], accept_while_closing: bool = False) -> Future[Any]:
        """Run ``fn`` on the I/O thread (inline when already there: a future's done-callback runs on it)."""
        future: Future[Any] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        if self._io.on_loop_thread():
            run()
            return future
        try:
            self._submit(run, accept_while_closing)
        except RuntimeError as exc:
            future.set_exception(exc)
        return future

    # -- on the I/O thread -----------------------------------------------------------------------------------
    def _remember(self, peer_id: str, error: Exception | None) -> None:
        """Keep ``error`` as the reason later writes to ``peer_id`` fail (None: forget it, the peer left)."""
        if error is None:
            self._broken.pop(peer_id, None)
        else:
            self._broken[peer_id] = error

    def _unattached(self, peer_id: str) -> Exception:
        """Why a write to ``peer_id`` cannot run: the reason it was dropped, else that it is not attached."""
        return self._broken.get(peer_id) or self.peer_error(
            f"{self.name} transport: peer {peer_id!r} is not attached"
        )

    @abc.abstractmethod
    def _forget(self, peer_id: str) -> None:
        """``detach`` on the I/O thread: fail the peer's outstanding writes and release what ``attach`` made."""

    @abc.abstractmethod
    def _shutdown(self) -> None:
        """``close`` on the I/O thread (or inline when it is gone): drop every peer and release all memory."""

    def _release(self) -> None:
        """Release what outlives the I/O thread, after it stopped (default: nothing)."""
