"""Data plane over UCX (``ucxx``): one-sided RMA puts into the peer's registered KV memory.

Who calls it: the transfer engine, from engine threads (``Transport`` methods), in both roles of an engine
worker process that runs ``transport = ucx`` (or ``auto`` with ``ucxx`` installed; built by ``factory``).
Hand-off to its I/O thread and the ordered close are ``queued.QueuedTransport``'s.

Why this shape:
- Endpoints are made from the peer's *worker address* (carried in the descriptor) with error handling off,
  which lets UCX pick shared memory (posix + cma) between processes on one host, and tcp or RDMA (with a
  system UCX) between hosts, as ``UCX_TLS`` allows. Listener endpoints would force tcp.
- Puts with rkeys need no receiver CPU and no per-message receive posting; coalesced spans mean a layer is a
  handful of puts. Completion is one ``ucp_ep_flush_nbx`` per ``write``: when it completes, the data is in
  the peer's memory.
- Two threads share the worker (``ucxx`` makes it thread-safe, ``UCS_THREAD_MODE_MULTI``): ``ucxx``'s C++
  progress thread progresses it, i.e. moves the bytes (on one host a put is copied during progress, one
  system call per span), without the GIL; our I/O thread plans each write, posts its puts and flush and
  watches them. So posting one layer overlaps copying the previous one, and the copy does not wait for the
  GIL while engine threads run Python. (One Python thread doing both spent a quarter of a KV-shaped
  transfer posting while nothing was copied; the figures are in docs/performance-history.md.)
- Idle costs nothing: the progress thread sleeps in epoll on the worker's event fd (a post wakes it with
  ``ucp_worker_signal``), the I/O thread on an eventfd that engine threads poke after queueing work. While
  writes are outstanding the I/O thread checks their flushes every ``completion_poll_s`` instead (their
  completion raises no event it could sleep on), and picks up queued work then without being poked.
- On one host a put is a cma ``process_vm_writev``: ``register`` advises the regions to transparent huge pages
  (``huge_pages``; 4 KiB pages halve cma throughput) and the context copies 8 MiB per call
  (``cma_segment_bytes``, UCX's default 512 KiB costs ~10 % at 16 MiB messages).
- A write that is not flushed within ``write_timeout_s`` (peer dead, link gone) fails its future with
  ``TimeoutError`` and the peer's endpoint is dropped: futures never hang. ``detach`` fails them at once.

Write futures resolve on the I/O thread: done-callbacks must be quick and must not block (hand the work to
your own loop, as the transfer engine does); ``detach`` from such a callback runs inline.

The RMA calls ``ucxx`` does not expose (mem_map, rkeys, put, flush) come from ``ucp_ffi``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from . import hugepages, ucp_ffi
from .base import CUDA, HOST, BlockCopy, MemoryRegion, check_reachable
from .coalesce import SMALL_COPIES
from .futures import fail, failed, running
from .host import host_id
from .queued import QueuedTransport
from .regions import RegionIndex, RegionInfo, Spans, plan

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
#: Seconds between checks of requests that only need freeing (of writes already failed by detach or close).
ZOMBIE_POLL_S = 0.005


@dataclass(frozen=True)
class UcxConfig:
    """Settings of the UCX transport (see docs/configuration.md ``## transport``)."""

    #: UCX_TLS for this transport's context ("" keeps UCX's default or the UCX_TLS environment variable).
    tls: str = ""
    #: UCX_NET_DEVICES ("" keeps the default / environment).
    net_devices: str = ""
    #: Further UCX options without the ``UCX_`` prefix, e.g. {"RNDV_SCHEME": "put_zcopy"}.
    options: dict[str, str] = field(default_factory=dict)
    #: Seconds a write may stay unflushed before it fails and the peer's endpoint is dropped.
    write_timeout_s: float = 30.0
    #: Seconds ``register``/``detach``/``close`` wait for the I/O thread.
    call_timeout_s: float = 10.0
    #: Seconds between two checks of outstanding writes' flushes (only while writes are outstanding): the
    #: most a completed write waits to be reported.
    completion_poll_s: float = 100e-6
    #: Bytes one shared-memory (cma) put copies per ``process_vm_writev`` and per progress step
    #: (``UCX_CMA_SEG_SIZE``; UCX's own default is 512 KiB); 0 keeps UCX's default or the environment.
    #: An explicit ``CMA_SEG_SIZE`` in ``options`` wins.
    cma_segment_bytes: int = 8 << 20
    #: Advise registered regions to use transparent huge pages and collapse them (see ``hugepages``).
    huge_pages: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.completion_poll_s <= 0.05:
            raise ValueError(
                f"ucx.completion_poll_s must be in (0, 0.05] seconds, got {self.completion_poll_s}"
            )
        if self.cma_segment_bytes != 0 and self.cma_segment_bytes < 4096:
            raise ValueError(
                f"ucx.cma_segment_bytes must be 0 (UCX default) or at least 4096, got {self.cma_segment_bytes}"
            )

    def ucx_options(self) -> dict[str, str]:
        """The options this transport's UCX context is created with (``UCX_`` prefix dropped)."""
        options = {"WARN_UNUSED_ENV_VARS": "n"}
        if self.cma_segment_bytes:
            options["CMA_SEG_SIZE"] = str(self.cma_segment_bytes)
        options.update(self.options)
        if self.tls:
            options["TLS"] = self.tls
        if self.net_devices:
            options["NET_DEVICES"] = self.net_devices
        return options


class UcxDescriptor(msgspec.Struct, frozen=True):
    """What ``register`` publishes: the worker address and, per region, base address, size and rkey."""

    version: int
    worker_address: bytes
    regions: list[RegionInfo]
    rkeys: list[bytes]
    #: Identity of the registering process, so a peer on the same host can watch it (pidfd) and stop
    #: writing the moment it exits.
    host_id: str = ""
    pid: int = 0


@dataclass
class _Peer:
    endpoint: Any  # ucxx UCXEndpoint (kept alive: its handle is what we post on)
    handle: int
    remote: RegionIndex
    rkeys: dict[int, int]
    pidfd: int | None = None


@dataclass(frozen=True)
class _Planned:
    """A write checked and grouped per region as ``put_many`` takes it (by the I/O thread's ``_post``)."""

    #: (region, local addresses, sizes, remote addresses) per region
    groups: list[tuple[int, list[int], list[int], list[int]]]
    nbytes: int

    @classmethod
    def of(cls, spans: Spans) -> _Planned:
        """Group the spans' rows (sorted by region) per region: in plain Python for a few rows (three numpy
        calls instead of eight; see ``SMALL_COPIES``), with numpy masks for many."""
        groups: list[tuple[int, list[int], list[int], list[int]]] = []
        if len(spans.table) <= SMALL_COPIES:
            rows = zip(
                spans.table.tolist(), spans.local_address.tolist(), spans.remote_address.tolist(), strict=True
            )
            for (region, _, _, size), local, remote in rows:
                if not groups or groups[-1][0] != region:
                    groups.append((region, [], [], []))
                groups[-1][1].append(local)
                groups[-1][2].append(size)
                groups[-1][3].append(remote)
            return cls(groups, spans.nbytes)
        for region in np.unique(spans.table[:, 0]).tolist():
            rows = spans.table[:, 0] == region
            groups.append(
                (
                    region,
                    spans.local_address[rows].tolist(),
                    spans.table[rows, 3].tolist(),
                    spans.remote_address[rows].tolist(),
                )
            )
        return cls(groups, spans.nbytes)


@dataclass
class _Pending:
    peer_id: str
    request: int | None
    nbytes: int
    future: Future[int]
    deadline: float


class UcxTransport(QueuedTransport[_Peer]):
    """``Transport`` over UCX RMA; one instance per engine worker process."""

    name = "ucx"
    #: Device memory too: ucxx's UCX is built with CUDA (cuda_ipc on one host, GPUDirect RDMA across hosts).
    #: Not measured on a GPU here (docs/architecture.md); a UCX without CUDA fails ``register`` with UCX's error.
    memory_types = frozenset({HOST, CUDA})

    def __init__(self, config: UcxConfig | None = None) -> None:
        from ucxx._lib import libucxx as ucx_api

        self.config = config or UcxConfig()
        self._api = ucx_api
        # ucx_options() turns UCX's unused-variable warning off: ucxx itself sets UCX_MEMTYPE_CACHE, which UCX
        # would then warn about on stdout.
        self._context = ucx_api.UCXContext(
            self.config.ucx_options(), feature_flags=(ucx_api.Feature.RMA, ucx_api.Feature.WAKEUP)
        )
        self._worker = ucx_api.UCXWorker(self._context)
        self._address = self._worker.address.tobytes()
        self._poster = ucp_ffi.Poster(int(self._worker.handle))
        self._memh: dict[int, int] = {}
        self._rkeys_packed: dict[int, bytes] = {}
        self._pending: list[_Pending] = []
        self._worker.start_progress_thread(polling_mode=False, epoll_timeout=-1)
        super().__init__(self.config.call_timeout_s, self._tick)
        log.info("ucx transport: worker up (tls=%s)", self.config.tls or os.environ.get("UCX_TLS", "default"))

    # -- called from engine threads -------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        check_reachable(self.name, self.memory_types, regions)
        self._regions.add(regions)
        if self.config.huge_pages:
            # here, not on the I/O thread: collapsing GBs takes seconds
            hugepages.advise_regions(regions, "ucx")
        try:
            self._call(lambda: self._map(regions)).result(self.config.call_timeout_s)
        except BaseException:
            self._regions.remove(r.region_id for r in regions)
            raise
        infos = self._regions.infos()
        return msgspec.msgpack.encode(
            UcxDescriptor(
                PROTOCOL_VERSION,
                self._address,
                infos,
                [self._rkeys_packed[i.region_id] for i in infos],
                host_id(),
                os.getpid(),
            )
        )

    def attach(self, peer_id: str, descriptor: bytes) -> Future[None]:
        try:
            desc = msgspec.msgpack.decode(descriptor, type=UcxDescriptor)
        except msgspec.DecodeError as exc:
            return failed(ValueError(f"not a ucx transport descriptor: {exc}"))
        if desc.version != PROTOCOL_VERSION or len(desc.rkeys) != len(desc.regions):
            return failed(
                ValueError(f"peer speaks ucx transport v{desc.version}, we speak v{PROTOCOL_VERSION}")
            )
        return self._call(lambda: self._connect(peer_id, desc))

    def write(self, peer_id: str, copies: Sequence[BlockCopy]) -> Future[int]:
        """Queue the write for the I/O thread, which plans and posts it while the progress thread copies the
        previous ones. Planning here instead would cost the engine thread its time and, worse, make it and the
        I/O thread take turns at the GIL (a KV-shaped prompt took 20 % longer)."""
        future: Future[int] = running()
        return self._queue_write(future, lambda: self._post(peer_id, copies, future))

    # -- the I/O thread ---------------------------------------------------------------------------------------
    def _tick(self) -> float | None:
        """Between batches of work: resolve what completed, then say how long the I/O thread may sleep."""
        self._reap()
        if any(not item.future.done() for item in self._pending):
            return self.config.completion_poll_s
        # only requests of failed writes left (free them when UCX is done), or nothing: sleep until woken
        return ZOMBIE_POLL_S if self._pending else None

    def _reap(self) -> None:
        """Resolve writes whose flush completed; time out the ones past their deadline."""
        now = time.monotonic()
        still: list[_Pending] = []
        for item in self._pending:
            if item.future.done():  # failed by detach/close; keep polling only to free the request
                if item.request is None:
                    continue
                if self._poster.request_status(item.request) != ucp_ffi.UCS_INPROGRESS:
                    continue
                if now < item.deadline + self.config.write_timeout_s:
                    still.append(item)
                else:  # UCX never completed it (a peer that vanished without error handling): give up on it
                    log.warning(
                        "ucx transport: abandoning a flush request to %s that never completed", item.peer_id
                    )
                continue
            status = ucp_ffi.UCS_OK if item.request is None else self._poster.request_status(item.request)
            if status == ucp_ffi.UCS_OK:
                item.future.set_result(item.nbytes)
            elif status != ucp_ffi.UCS_INPROGRESS:
                item.request = None
                self._drop(
                    item.peer_id, ConnectionError(f"ucx transport: flush to {item.peer_id} failed ({status})")
                )
                fail(
                    item.future, ConnectionError(f"ucx transport: write to {item.peer_id} failed ({status})")
                )
            elif now >= item.deadline:
                self._drop(
                    item.peer_id,
                    TimeoutError(
                        f"ucx transport: write to {item.peer_id} not completed in {self.config.write_timeout_s} s "
                        "(peer dead or unreachable); endpoint dropped"
                    ),
                )
                still.append(item)
            else:
                still.append(item)
        self._pending = still

    def _map(self, regions: Sequence[MemoryRegion]) -> None:
        """Map every region (all or nothing: a failure unmaps what this call mapped)."""
        ctx = self._context.handle
        mapped: list[int] = []
        try:
            for region in regions:
                memh = ucp_ffi.mem_map(ctx, region.address, region.length, ucp_ffi.memory_type(region.memory))
                self._memh[region.region_id] = memh
                mapped.append(region.region_id)
                self._rkeys_packed[region.region_id] = ucp_ffi.rkey_pack(ctx, memh)
        except ucp_ffi.UcpError:
            for region_id in mapped:
                self._rkeys_packed.pop(region_id, None)
                ucp_ffi.mem_unmap(ctx, self._memh.pop(region_id))
            raise

    def _connect(self, peer_id: str, desc: UcxDescriptor) -> None:
        self._drop(peer_id, ConnectionError(f"ucx transport: peer {peer_id} re-attached"), quiet=True)
        address = self._api.UCXAddress.create_from_buffer(desc.worker_address)
        endpoint = self._api.UCXEndpoint.create_from_worker_address(self._worker, address, False)
        handle = int(endpoint.handle)
        rkeys: dict[int, int] = {}
        try:
            for info, packed in zip(desc.regions, desc.rkeys, strict=True):
                rkeys[info.region_id] = ucp_ffi.rkey_unpack(handle, packed)
        except ucp_ffi.UcpError:
            for rkey in rkeys.values():
                ucp_ffi.rkey_destroy(rkey)
            endpoint.close()
            raise
        peer = _Peer(endpoint, handle, RegionIndex(desc.regions), rkeys)
        if desc.pid and desc.host_id == host_id():
            try:
                peer.pidfd = os.pidfd_open(desc.pid)
            except OSError as exc:
                log.warning("ucx transport: cannot watch %s (pid %d): %s", peer_id, desc.pid, exc)
            else:
                self._io.watch(peer.pidfd, lambda: self._exited(peer_id))
        self._peers[peer_id] = peer
        log.info("ucx transport: attached %s (%d regions)", peer_id, len(rkeys))

    def _exited(self, peer_id: str) -> None:
        self._drop(peer_id, ConnectionError(f"ucx transport: peer {peer_id} process exited"))

    def _post(self, peer_id: str, copies: Sequence[BlockCopy], future: Future[int]) -> None:
        if self._io.watching:
            self._io.poll(0)  # a same-host peer that exited since the last wait is dropped before we post
        peer = self._peers.get(peer_id)
        if peer is None:
            fail(future, self._unattached(peer_id))
            return
        try:
            planned = _Planned.of(plan(copies, self._regions.index(), peer.remote))
            missing = {group[0] for group in planned.groups} - self._memh.keys()
            if missing:
                raise ValueError(f"regions {sorted(missing)} are not registered locally")
        except ValueError as exc:
            fail(future, exc)
            return
        ep = peer.handle
        try:
            for region, local, sizes, remote in planned.groups:
                self._poster.put_many(ep, local, sizes, remote, peer.rkeys[region], self._memh[region])
            request = self._poster.flush(ep)
        except ucp_ffi.UcpError as exc:
            self._drop(peer_id, ConnectionError(f"ucx transport: posting to {peer_id} failed: {exc}"))
            fail(future, ConnectionError(f"ucx transport: posting to {peer_id} failed: {exc}"))
            return
        self._pending.append(
            _Pending(peer_id, request, planned.nbytes, future, time.monotonic() + self.config.write_timeout_s)
        )

    def _drop(self, peer_id: str, error: Exception, quiet: bool = False) -> None:
        """Fail the peer's outstanding writes, destroy its rkeys and close its endpoint (idempotent)."""
        for item in self._pending:
            if item.peer_id == peer_id:
                fail(item.future, error)
        peer = self._peers.pop(peer_id, None)
        self._remember(peer_id, None if quiet else error)
        if peer is None:
            return
        if not quiet:
            log.warning("%s", error)
        if peer.pidfd is not None:
            self._io.unwatch(peer.pidfd)
            os.close(peer.pidfd)
        for rkey in peer.rkeys.values():
            ucp_ffi.rkey_destroy(rkey)
        peer.endpoint.close()

    def _forget(self, peer_id: str) -> None:
        self._drop(peer_id, ConnectionError(f"ucx transport: peer {peer_id} detached"), quiet=True)

    def _shutdown(self) -> None:
        for peer_id in list(self._peers):
            self._drop(peer_id, ConnectionError("ucx transport closed"), quiet=True)
        for item in self._pending:
            fail(item.future, ConnectionError("ucx transport closed"))
        ctx = self._context.handle
        for region_id in list(self._memh):
            memh = self._memh.pop(region_id)
            self._poster.forget(memh)
            ucp_ffi.mem_unmap(ctx, memh)
        self._rkeys_packed.clear()
        self._regions.clear()

    def _release(self) -> None:
        self._worker.stop_progress_thread()
