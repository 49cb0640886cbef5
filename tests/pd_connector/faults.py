"""Fault hooks for transfer-engine tests: a transport that damages what it just wrote, as a torn write or a
fault on the wire would leave it, while speaking the real ``Transport`` interface to the engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

from pd_connector.transport.base import BlockCopy, MemoryRegion, Transport


class DamagingTransport(Transport):
    """P's transport, unchanged except that once write number ``after_write`` (1-based) has landed, ``damage``
    is called with that write's copies (it flips bytes of D's memory there) before the write is reported done.

    So the damage is in D's memory before P sends ``LayerDone``/``Done``: nothing but a check of the bytes
    themselves can notice it.
    """

    def __init__(self, inner: Transport, damage: Callable[[Sequence[BlockCopy]], None], after_write: int = 1):
        self.inner = inner
        self.name = inner.name
        self._damage = damage
        self._left = after_write
        self.damaged = 0

    def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        return self.inner.register(regions)

    def attach(self, peer_id: str, descriptor: bytes) -> Future[None]:
        return self.inner.attach(peer_id, descriptor)

    def write(self, peer_id: str, copies: Sequence[BlockCopy]) -> Future[int]:
        self._left -= 1
        hit = self._left == 0
        outer: Future[int] = Future()

        def landed(inner: Future[int]) -> None:
            error = inner.exception()
            if error is not None:
                outer.set_exception(error)
                return
            if hit:
                self._damage(copies)
                self.damaged += 1
            outer.set_result(inner.result())

        self.inner.write(peer_id, copies).add_done_callback(landed)
        return outer

    def detach(self, peer_id: str) -> None:
        self.inner.detach(peer_id)

    def close(self) -> None:
        self.inner.close()
