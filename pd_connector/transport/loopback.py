"""In-process transport for unit tests: ``ctypes.memmove`` between regions registered in one ``LoopbackFabric``.

It speaks the same ``Transport`` interface as UCX and TCP (descriptors, attach, futures, errors), so the
transfer engine is tested unchanged; the fabric is an explicit object shared by the endpoints of a test (no
module-level state). A descriptor is the registration id in that fabric; once the owner closes, its id is
gone and writes into it fail, which is how a test sees a dead peer.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from pd_connector.transport.base import BlockCopy, MemoryRegion, Transport, check_reachable

_DESCRIPTOR = struct.Struct(">Q")


class LoopbackFabric:
    """Registry of the regions that ``LoopbackTransport``s of one process registered, keyed by an id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._regions: dict[int, dict[int, MemoryRegion]] = {}

    def add(self, regions: Sequence[MemoryRegion]) -> int:
        with self._lock:
            key = next(self._ids)
            self._regions[key] = {r.region_id: r for r in regions}
            return key

    def lookup(self, key: int) -> dict[int, MemoryRegion]:
        """The regions registered under ``key``; ``KeyError`` when its owner closed (a dead peer)."""
        with self._lock:
            return self._regions[key]

    def remove(self, key: int) -> None:
        with self._lock:
            self._regions.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._regions)


class LoopbackTransport(Transport):
    """Writes by ``memmove`` on a one-thread executor, so completions are asynchronous as on a real wire."""

    name = "loopback"

    def __init__(self, fabric: LoopbackFabric) -> None:
        self._fabric = fabric
        self._lock = threading.Lock()
        self._key: int | None = None
        self._local: dict[int, MemoryRegion] = {}
        self._peers: dict[str, int] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-loopback")

    def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        check_reachable(self.name, self.memory_types, regions)  # memmove of host memory
        with self._lock:
            if self._key is not None:
                self._fabric.remove(self._key)
            self._local = {r.region_id: r for r in regions}
            self._key = self._fabric.add(regions)
            return _DESCRIPTOR.pack(self._key)

    def attach(self, peer_id: str, descriptor: bytes) -> Future[None]:
        future: Future[None] = Future()
        try:
            (key,) = _DESCRIPTOR.unpack(descriptor)
            self._fabric.lookup(key)
        except (struct.error, KeyError) as e:
            future.set_exception(ConnectionError(f"loopback: no registered peer memory for {peer_id}: {e!r}"))
            return future
        with self._lock:
            self._peers[peer_id] = key
        future.set_result(None)
        return future

    def write(self, peer_id: str, copies: Sequence[BlockCopy]) -> Future[int]:
        with self._lock:
            key = self._peers.get(peer_id)
            local = self._local
        if key is None:
            failed: Future[int] = Future()
            failed.set_exception(ConnectionError(f"loopback: peer {peer_id} is not attached"))
            return failed
        return self._executor.submit(self._copy, key, local, list(copies))

    def _copy(self, key: int, local: dict[int, MemoryRegion], copies: list[BlockCopy]) -> int:
        try:
            remote = self._fabric.lookup(key)
        except KeyError:
            raise ConnectionError("loopback: peer memory was deregistered (peer closed)") from None
        total = 0
        for c in copies:
            src, dst = local.get(c.region_id), remote.get(c.region_id)
            if src is None or dst is None:
                raise ValueError(f"loopback: region {c.region_id} is not registered on both sides")
            if src.block_bytes != dst.block_bytes:
                raise ValueError(f"loopback: region {c.region_id} block sizes differ")
            if c.num_blocks <= 0 or c.src_block < 0 or c.dst_block < 0:
                raise ValueError(f"loopback: invalid copy {c}")
            if c.src_block + c.num_blocks > src.num_blocks or c.dst_block + c.num_blocks > dst.num_blocks:
                raise ValueError(f"loopback: copy {c} is out of the registered regions' bounds")
            n = c.num_blocks * src.block_bytes
            ctypes.memmove(
                dst.address + c.dst_block * dst.block_bytes, src.address + c.src_block * src.block_bytes, n
            )
            total += n
        return total

    def detach(self, peer_id: str) -> None:
        with self._lock:
            self._peers.pop(peer_id, None)

    def close(self) -> None:
        with self._lock:
            if self._key is not None:
                self._fabric.remove(self._key)
            self._key = None
            self._peers.clear()
        self._executor.shutdown(wait=True)
