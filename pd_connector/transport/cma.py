"""Same-host data plane: ``process_vm_writev`` (cross-memory attach, CMA) straight into the peer's KV memory.

Why it exists next to ``ucx``: UCX's shared-memory path is the same syscall, but with error handling off (which
UCX requires for it) a put into a peer that died aborts the *sending* process, so a prefill server would die
with its decode server; and UCX's per-put cost makes small and scattered writes slower (docs/performance.md
``## transport`` has the ratios). Here a dead peer is just an errno (``ESRCH``/``EFAULT``): the write's future
fails with ``CmaError`` naming the peer and the sender goes on.

Who calls what:
- Receiver (D), engine thread: ``register`` advises the regions to huge pages (``hugepages``), allows
  writers under Yama ``ptrace_scope`` 1 and publishes a ``CmaDescriptor``: pid, boot id, pid-namespace
  inode, the region table (addresses) and a probe buffer holding a random token. The receiver's CPU is not
  involved in transfers afterwards.
- Sender (P), engine thread: ``attach`` refuses peers on another host or in another pid namespace at once;
  the I/O thread then opens a pidfd on the peer and reads back the token and writes it again (proving the pid
  is the registering process and that the kernel lets us write into it: same user, ptrace permission).
  ``write`` coalesces and checks the copies and cuts runs into ``segment_bytes`` pieces on the calling
  thread (so the next layer is planned while the I/O thread copies this one), then hands the iovecs to the
  I/O thread, which issues one syscall per at most ``segment_bytes`` / ``IOV_MAX`` pieces, continuing after
  partial writes, and resolves the future with the byte count.

The I/O thread is a ``WorkThread`` (``QueuedTransport``; it sleeps in epoll when idle). Syscalls run there
through ctypes (``cma_syscalls``), which releases the GIL, so engine threads keep running while bytes move.
Futures resolve on that thread: done-callbacks must be quick; ``detach`` from one runs inline.

The pid could be reused after the peer exits; before every syscall the I/O thread polls the peer's pidfd, so
a peer that exited is never written to (between poll and syscall its pid would have to be reaped and reused).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import select
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec
import numpy as np

from . import hugepages
from .base import BlockCopy, MemoryRegion, check_reachable
from .cma_syscalls import CmaError, Iovecs, allow_writers, build_iovecs, call_bounds, errno_error, vm_call
from .futures import fail, failed, running
from .host import boot_id, pid_namespace
from .queued import QueuedTransport
from .regions import RegionIndex, RegionInfo, plan

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
#: Bytes of the receiver's probe buffer (a random token the sender reads back and rewrites at attach).
PROBE_BYTES = 16
#: Largest ``segment_bytes``: Linux caps one call at ``MAX_RW_COUNT`` (2 GiB - 4 KiB).
_MAX_SEGMENT = 1 << 30


@dataclass(frozen=True)
class CmaConfig:
    """Settings of the same-host transport (see docs/configuration.md ``## transport``)."""

    #: Most bytes one ``process_vm_writev`` copies; longer runs are split. 16 MiB: 1-3 % faster than 8 MiB
    #: and level with larger values in interleaved runs (docs/configuration.md ``## transport``).
    segment_bytes: int = 16 << 20
    #: Advise registered regions to use transparent huge pages and collapse them (see ``hugepages``).
    huge_pages: bool = True
    #: Seconds ``attach``'s probe, ``detach`` and ``close`` wait for the I/O thread.
    call_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 4096 <= self.segment_bytes <= _MAX_SEGMENT:
            raise ValueError(
                f"cma.segment_bytes must be between 4096 and {_MAX_SEGMENT}, got {self.segment_bytes}"
            )
        if self.call_timeout_s <= 0:
            raise ValueError(f"cma.call_timeout_s must be positive, got {self.call_timeout_s}")


class CmaDescriptor(msgspec.Struct, frozen=True):
    """What ``register`` publishes: who the receiver is, where its regions are and where to probe."""

    version: int
    pid: int
    #: ``/proc/sys/kernel/random/boot_id`` of the receiver's host.
    boot_id: str
    #: Inode of the receiver's pid namespace.
    pid_namespace: int
    probe_address: int
    token: bytes
    regions: list[RegionInfo]


@dataclass
class _Peer:
    pid: int
    pidfd: int
    remote: RegionIndex
    #: Polls ``pidfd`` (readable once the peer exited); ``poll``, not ``select``: fds may exceed FD_SETSIZE.
    exited: select.poll = field(default_factory=select.poll)

    def __post_init__(self) -> None:
        self.exited.register(self.pidfd, select.POLLIN)


@dataclass(frozen=True)
class _Planned:
    """A write checked and turned into iovecs for ``peer`` (by ``write`` on the engine thread)."""

    peer: _Peer
    iovecs: Iovecs
    nbytes: int


class CmaTransport(QueuedTransport[_Peer]):
    """``Transport`` over ``process_vm_writev`` between processes of one host (one per engine worker)."""

    name = "cma"
    peer_error = CmaError

    def __init__(self, config: CmaConfig | None = None) -> None:
        self.config = config or CmaConfig()
        self._token = secrets.token_bytes(PROBE_BYTES)
        self._probe = ctypes.create_string_buffer(self._token, PROBE_BYTES)
        super().__init__(self.config.call_timeout_s)

    # -- called from engine threads -------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        check_reachable(self.name, self.memory_types, regions)  # process_vm_writev moves host memory only
        allow_writers()
        self._regions.add(regions)
        if self.config.huge_pages:
            hugepages.advise_regions(regions, "cma")
        return msgspec.msgpack.encode(
            CmaDescriptor(
                PROTOCOL_VERSION,
                os.getpid(),
                boot_id(),
                pid_namespace(),
                ctypes.addressof(self._probe),
                self._token,
                self._regions.infos(),
            )
        )

    def attach(self, peer_id: str, descriptor: bytes) -> Future[None]:
        try:
            desc = decode_descriptor(descriptor)
            check_same_host(peer_id, desc)
        except (ValueError, CmaError) as exc:
            return failed(exc)
        return self._call(lambda: self._connect(peer_id, desc))

    def write(self, peer_id: str, copies: Sequence[BlockCopy]) -> Future[int]:
        """Plan on the calling thread, copy on the I/O thread: while the I/O thread copies one layer (GIL
        released in the syscall) the engine thread already plans the next, so planning costs no copy time."""
        future: Future[int] = running()
        planned: _Planned | None = None
        if (peer := self._peers.get(peer_id)) is not None:  # safe off the I/O thread: entries are replaced
            try:
                planned = self._plan(peer, copies)
            except ValueError as exc:
                fail(future, exc)
                return future

        def run() -> None:
            try:
                self._write(peer_id, copies, planned, future)
            except Exception as exc:  # a bug must fail the write, not strand its future
                log.exception("cma transport: write to %s failed", peer_id)
                fail(future, exc)

        return self._queue_write(future, run)

    # -- the I/O thread ---------------------------------------------------------------------------------------
    def _connect(self, peer_id: str, desc: CmaDescriptor) -> None:
        self._drop(peer_id, None)
        try:
            pidfd = os.pidfd_open(desc.pid)
        except ProcessLookupError:
            raise CmaError(f"cma transport: peer {peer_id} (pid {desc.pid}) is not running") from None
        try:
            probe(peer_id, desc)
        except BaseException:
            os.close(pidfd)
            raise
        self._peers[peer_id] = _Peer(desc.pid, pidfd, RegionIndex(desc.regions))
        log.info("cma transport: attached %s (pid %d, %d regions)", peer_id, desc.pid, len(desc.regions))

    def _plan(self, peer: _Peer, copies: Sequence[BlockCopy]) -> _Planned:
        spans = plan(copies, self._regions.index(), peer.remote)
        return _Planned(peer, build_iovecs(spans, self.config.segment_bytes), spans.nbytes)

    def _write(
        self, peer_id: str, copies: Sequence[BlockCopy], planned: _Planned | None, future: Future[int]
    ) -> None:
        if self._closing:  # queued before close(): fail fast instead of copying into a peer nobody waits for
            fail(future, CmaError(f"cma transport closed before the write to {peer_id} ran"))
            return
        peer = self._peers.get(peer_id)
        if peer is None:
            fail(future, self._unattached(peer_id))
            return
        if planned is None or planned.peer is not peer:  # attached (again) after write() planned
            try:
                planned = self._plan(peer, copies)
            except ValueError as exc:
                fail(future, exc)
                return
        if planned.nbytes:
            error = self._copy(peer_id, peer, planned.iovecs)
            if error is not None:
                self._drop(peer_id, error)
                fail(future, error)
                return
        future.set_result(planned.nbytes)

    def _copy(self, peer_id: str, peer: _Peer, iovecs: Iovecs) -> CmaError | None:
        """Write every piece, call by call, continuing after partial writes; the error that stopped it."""
        for start, stop, expected in call_bounds(iovecs.local[:, 1], self.config.segment_bytes):
            while True:
                if peer.exited.poll(0):
                    return CmaError(f"cma transport: peer {peer_id} (pid {peer.pid}) exited")
                done = vm_call(True, peer.pid, iovecs, start, stop)
                if done <= 0:
                    return errno_error(peer_id, peer.pid, -done if done else errno.EFAULT)
                if done == expected:
                    break
                ends = np.cumsum(iovecs.local[start:stop, 1].astype(np.int64))
                partial = int(np.searchsorted(ends, done, side="right"))  # first piece not fully written
                iovecs.advance(start + partial, done - (int(ends[partial - 1]) if partial else 0))
                start, expected = start + partial, expected - done
        return None

    def _drop(self, peer_id: str, error: CmaError | None) -> None:
        """Forget a peer and close its pidfd (idempotent); ``error`` is kept for later writes (None: detach)."""
        peer = self._peers.pop(peer_id, None)
        self._remember(peer_id, error)
        if error is not None:
            log.warning("%s", error)
        if peer is not None:
            os.close(peer.pidfd)

    def _forget(self, peer_id: str) -> None:
        self._drop(peer_id, None)

    def _shutdown(self) -> None:
        for peer_id in list(self._peers):
            self._drop(peer_id, None)
        self._broken.clear()
        self._regions.clear()


def decode_descriptor(descriptor: bytes) -> CmaDescriptor:
    """Decode and sanity-check a peer's descriptor (``ValueError`` for anything malformed)."""
    try:
        desc = msgspec.msgpack.decode(descriptor, type=CmaDescriptor)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a cma transport descriptor: {exc}") from None
    if desc.version != PROTOCOL_VERSION:
        raise ValueError(f"peer speaks cma transport v{desc.version}, we speak v{PROTOCOL_VERSION}")
    if desc.pid <= 0 or desc.probe_address <= 0 or len(desc.token) != PROBE_BYTES:
        raise ValueError(f"cma descriptor: bad pid {desc.pid}, probe address or token")
    ids = [r.region_id for r in desc.regions]
    if len(set(ids)) != len(ids):
        raise ValueError(f"cma descriptor: repeated region ids {sorted(ids)}")
    for r in desc.regions:
        if r.block_bytes <= 0 or r.length < 0 or r.length % r.block_bytes or r.address <= 0:
            raise ValueError(f"cma descriptor: region {r.region_id} is malformed ({r})")
    return desc


def check_same_host(peer_id: str, desc: CmaDescriptor) -> None:
    """Refuse (``CmaError``) a peer whose pid does not name a process we can see: other host or namespace."""
    if desc.boot_id != boot_id():
        raise CmaError(
            f"cma transport: peer {peer_id} runs on another host (boot id {desc.boot_id or '?'}); "
            "cma only works between processes of one machine: use the tcp or ucx transport"
        )
    if desc.pid_namespace != pid_namespace():
        raise CmaError(
            f"cma transport: peer {peer_id} runs in another pid namespace (container); run prefill and decode "
            "in the same pid namespace (e.g. docker --pid=host or one pod with shareProcessNamespace) or use "
            "the tcp or ucx transport"
        )


def probe(peer_id: str, desc: CmaDescriptor) -> None:
    """Read the receiver's token back and rewrite it: proves the pid is the registering process and that the
    kernel lets us write into it (``CmaError`` saying what to configure otherwise)."""
    buffer = ctypes.create_string_buffer(PROBE_BYTES)
    iov = Iovecs(
        np.array([[ctypes.addressof(buffer), PROBE_BYTES]], dtype=np.uint64),
        np.array([[desc.probe_address, PROBE_BYTES]], dtype=np.uint64),
    )
    for write in (False, True):
        done = vm_call(write, desc.pid, iov, 0, 1)
        if done < 0:
            raise errno_error(peer_id, desc.pid, -done)
        if done != PROBE_BYTES or (not write and buffer.raw != desc.token):
            raise CmaError(f"cma transport: pid {desc.pid} is not the process that registered {peer_id}")
