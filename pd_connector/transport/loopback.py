"""In-process transport for unit tests: ``ctypes.memmove`` between regions registered in one ``LoopbackFabric``.

It speaks the same ``Transport`` interface as UCX and TCP (descriptors, attach, futures, errors), so the
transfer engine is tested unchanged; the fabric is an explicit object shared by the two endpoints of a test
(no module-level state).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from pd_connector.transport.base import BlockCopy, MemoryRegion, Transport


class LoopbackFabric:
    """Registry of the regions every ``LoopbackTransport`` in one process registered, keyed by an id."""


class LoopbackTransport(Transport):
    """Writes by ``memmove`` on a small worker thread, so completions are asynchronous as on a real wire."""

    name = "loopback"

    def __init__(self, fabric: LoopbackFabric) -> None:
        raise NotImplementedError

    def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        raise NotImplementedError

    def attach(self, peer_id: str, descriptor: bytes) -> Future[None]:
        raise NotImplementedError

    def write(self, peer_id: str, copies: Sequence[BlockCopy]) -> Future[int]:
        raise NotImplementedError

    def detach(self, peer_id: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
