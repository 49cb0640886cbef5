"""The transport interface every data plane implements (UCX, TCP fallback, same-host cma, in-process test
loopback).

Who calls it: the transfer engine (``pd_connector.transfer``), from engine threads that must never block
on the network (vLLM's ``save_kv_layer`` runs inside the forward pass). So every method is thread-safe and
non-blocking; work runs on the transport's own I/O thread and completion is reported through
``concurrent.futures.Future``. An idle transport must not spin (progress is event-driven).

Model: a *push* of KV blocks. The receiver (D) registers its KV buffers and publishes a ``RemoteMemory``
descriptor (addresses, sizes and whatever keys the transport needs) through the control plane; the sender
(P) ``attach``es that descriptor once per peer and then ``write``s lists of block copies into it. The
control plane (handshake, destinations, done, abort) is not the transport's business.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, get_args

#: Where registered memory lives: host memory (CPU KV caches, pinned staging buffers) or a CUDA device.
MemoryType = Literal["host", "cuda"]
MEMORY_TYPES: tuple[MemoryType, ...] = get_args(MemoryType)
HOST: MemoryType = "host"
CUDA: MemoryType = "cuda"


@dataclass(frozen=True)
class MemoryRegion:
    """A local buffer to register: typically one layer's KV cache tensor, made of equal-sized blocks.

    ``address`` is the buffer's base pointer (``tensor.data_ptr()``), ``length`` its size in bytes and
    ``block_bytes`` the stride between consecutive blocks (granules). Blocks are indexed from 0 at
    ``address``. ``memory``: where the buffer lives; a transport registers only the memory types in its
    ``memory_types`` (``check_reachable``), anything else is staged through host memory (``staging``).
    """

    region_id: int
    address: int
    length: int
    block_bytes: int
    memory: MemoryType = HOST

    def __post_init__(self) -> None:
        if self.memory not in MEMORY_TYPES:
            raise ValueError(
                f"region {self.region_id}: memory type {self.memory!r} is not one of {MEMORY_TYPES}"
            )
        if self.block_bytes <= 0 or self.length < 0 or self.length % self.block_bytes:
            raise ValueError(
                f"region {self.region_id}: length {self.length} is not a whole number of "
                f"{self.block_bytes}-byte blocks"
            )

    @property
    def num_blocks(self) -> int:
        return self.length // self.block_bytes


class BlockCopy(NamedTuple):
    """Copy ``num_blocks`` contiguous blocks of ``region_id``: local ``src_block`` -> remote ``dst_block``.

    Callers pass one entry per block or already-coalesced runs; transports coalesce adjacent runs again
    (see ``coalesce.py``), so a 4096-token prompt is a handful of messages per layer. A named tuple (not a
    dataclass) because ``write`` turns thousands of them into one numpy table per call, which reads tuples
    at C speed.
    """

    region_id: int
    src_block: int
    dst_block: int
    num_blocks: int = 1


class Transport(abc.ABC):
    """One endpoint of the data plane, owned by one engine worker process."""

    #: Short name used in handshakes, metrics and logs ("ucx", "tcp", "loopback").
    name: str
    #: The memory types ``register`` accepts directly (the transport reads and writes them itself).
    memory_types: ClassVar[frozenset[MemoryType]] = frozenset({HOST})

    @abc.abstractmethod
    def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        """Register local buffers; return an opaque descriptor peers pass to ``attach`` to write into them.

        Called once at start-up by the receiving side (and by the sender, if it needs registered sources).
        The descriptor is carried inside the control plane's msgspec handshake, never pickled.
        """

    @abc.abstractmethod
    def attach(self, peer_id: str, descriptor: bytes) -> Future[None]:
        """Connect to a peer whose ``register`` returned ``descriptor``; resolves once writes can be posted."""

    @abc.abstractmethod
    def write(self, peer_id: str, copies: Sequence[BlockCopy]) -> Future[int]:
        """Post block copies into the attached peer's memory; resolves with bytes written once all landed.

        Fails the future (never hangs) if the peer dies or the connection breaks; the caller applies its
        own timeout on top. Remote visibility: when the future resolves, the data is in the peer's memory.
        """

    @abc.abstractmethod
    def detach(self, peer_id: str) -> None:
        """Drop a peer: close its endpoint and release what ``attach`` allocated (idempotent)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the I/O thread, close every endpoint and deregister all memory (idempotent)."""

    def grant(self, key: str, descriptor: bytes) -> bytes:
        """A descriptor (from ``register``) for one peer session named ``key``, which ``revoke(key)`` can fence.

        Called by the receiver (D) once per control session with a P, before it hands P the descriptor. The
        default hands out the shared descriptor: a transport whose writes the receiver cannot refuse (one-sided
        RDMA or shared-memory puts, ``process_vm_writev``) has nothing per session to revoke.
        """
        return descriptor

    def revoke(self, key: str) -> bool:
        """Fence the session ``key``: once this returns True, no write made under its grant lands any more
        (writes in flight are dropped unread). False: this transport cannot fence (the default), and the caller
        must keep the memory away from reuse until the writer can no longer be writing. Idempotent; an unknown
        key is already fenced. Called by D on its transfer engine's I/O thread when the session ends.
        """
        return False


def check_reachable(
    transport_name: str, reachable: frozenset[MemoryType], regions: Sequence[MemoryRegion]
) -> None:
    """Refuse, at registration and naming it, a region in memory the transport cannot read or write
    (``ValueError``): a host-only transport handed device memory would dereference a device pointer."""
    bad = sorted({r.memory for r in regions} - reachable)
    if bad:
        raise ValueError(
            f"transport {transport_name} cannot reach {', '.join(bad)} memory (it reaches "
            f"{', '.join(sorted(reachable))}); stage it through pinned host memory (pd_connector.staging)"
        )
