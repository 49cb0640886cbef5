"""Dependency-free data plane over plain TCP (asyncio): the fallback when ``ucxx`` is absent or configured.

Receiver (D) side: ``register`` starts a listener on the configured host/port; every accepted connection is
a ``_Inbound`` ``BufferedProtocol``. Sender (P) side: ``attach`` opens one connection per peer; ``write``
coalesces block copies into runs and sends long runs as ``Put`` frames (read straight into the registered
memory, no intermediate copy) and short ones gathered into ``PutBlocks`` frames (scattered by numpy); a
``Flush`` after them is answered by an ``Ack`` once the receiver has stored everything before it (TCP keeps
order), which resolves the write future. Wire format: ``tcp_wire``. The first frame must be a ``Hello`` carrying the random token from the descriptor; anything else, an
unknown region, an out-of-range span or an oversized frame drops that connection (logged) and leaves the
others alone. All socket work runs on the transport's own I/O thread (``LoopThread``); write futures resolve
there, so their done-callbacks must be quick and non-blocking (``detach`` from one is scheduled, not awaited).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import cast

import msgspec
import numpy as np
import numpy.typing as npt

from .base import BlockCopy, MemoryRegion, Transport
from .futures import fail as _fail
from .futures import failed as _failed
from .futures import running
from .host import advertised_host
from .loop_thread import LoopThread
from .regions import RegionIndex, RegionTable, host_view, plan
from .tcp_wire import (
    LENGTH,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Flush,
    Frame,
    FrameError,
    Hello,
    Put,
    PutBlocks,
    TcpDescriptor,
    decoder,
    encode_frame,
)

log = logging.getLogger(__name__)

#: Receive buffer for headers and small payloads (bigger payloads are read straight into place).
SCRATCH_BYTES = 256 << 10
#: Frames are gathered into one sendmsg of up to this many bytes / buffers.
BATCH_BYTES = 1 << 20
BATCH_PARTS = 512
#: Runs at least this long are sent as ``Put`` (read straight into place); shorter ones as ``PutBlocks``.
DIRECT_MIN_BYTES = 256 << 10
#: Payload of one ``PutBlocks`` frame.
BLOCKS_FRAME_BYTES = 4 << 20
#: Blocks at least this big are handed to ``sendmsg`` one view each (the kernel gathers them); smaller ones are
#: first gathered by numpy, which was faster below this size in a loopback sender loop.
VIEW_MIN_BYTES = 32 << 10


@dataclass(frozen=True)
class TcpConfig:
    """Settings of the TCP fallback (see docs/configuration.md ``## transport``)."""

    #: Address the data listener binds to.
    host: str = "127.0.0.1"
    #: Port of the data listener; 0 picks a free one (the descriptor carries the real one).
    port: int = 0
    #: Address peers connect to; defaults to ``host``, or this host's default-route address when ``host``
    #: is a wildcard (0.0.0.0).
    advertise_host: str | None = None
    #: Largest payload per frame in bytes; longer spans are split. Receivers drop bigger frames.
    max_frame_bytes: int = 64 << 20
    #: Seconds ``attach`` may take to connect and say hello.
    connect_timeout_s: float = 10.0
    #: SO_SNDBUF of data connections in bytes (0 keeps the kernel default).
    socket_buffer_bytes: int = 4 << 20


class _Inbound(asyncio.BufferedProtocol):
    """One accepted data connection on the receiver.

    Reads go into a scratch buffer while frames are small, so one ``recv`` carries many 4 KiB frames (their
    payloads are then copied into place); once a payload is under way and nothing else is buffered, reads go
    straight into the registered destination memory, so large spans cost no extra copy.
    """

    def __init__(self, owner: TcpTransport) -> None:
        self._owner = owner
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._start = 0  # unparsed bytes are scratch[start:end]
        self._end = 0
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._authenticated = False
        self._payload: memoryview | None = None  # what remains to fill of the current Put / PutBlocks
        self._on_payload: Callable[[], None] | None = None  # run when that payload is complete
        self._direct = False  # the last get_buffer handed out the payload itself

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self._peer = str(transport.get_extra_info("peername"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._payload is not None and self._start == self._end:
            self._direct = True
            return self._payload
        self._direct = False
        if self._end == len(self._scratch):  # compact: keep only the unparsed tail
            tail = self._end - self._start
            self._scratch[:tail] = self._scratch[self._start : self._end]
            self._start, self._end = 0, tail
        return self._scratch[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct:
            assert self._payload is not None
            self._payload = self._payload[nbytes:] if nbytes < len(self._payload) else None
            if self._payload is None:
                try:
                    self._payload_done()
                except FrameError as exc:
                    self._drop(exc)
            return
        self._end += nbytes
        try:
            self._parse()
        except FrameError as exc:
            self._drop(exc)

    def _parse(self) -> None:
        """Consume every complete header and buffered payload byte in scratch."""
        buf = self._scratch
        while True:
            if self._payload is not None:
                take = min(len(self._payload), self._end - self._start)
                self._payload[:take] = buf[self._start : self._start + take]
                self._start += take
                self._payload = self._payload[take:] if take < len(self._payload) else None
                if self._payload is not None:
                    break
                self._payload_done()
                continue
            if self._end - self._start < LENGTH.size:
                break
            (size,) = LENGTH.unpack(buf[self._start : self._start + LENGTH.size])
            if not 0 < size <= MAX_HEADER_BYTES:
                raise FrameError(f"header length {size} out of range")
            if self._end - self._start < LENGTH.size + size:
                break
            header = buf[self._start + LENGTH.size : self._start + LENGTH.size + size]
            self._start += LENGTH.size + size
            try:
                frame = decoder.decode(header)
            except msgspec.DecodeError as exc:
                raise FrameError(f"undecodable header ({exc})") from None
            self._handle(frame)
        if self._start == self._end:
            self._start = self._end = 0

    def _payload_done(self) -> None:
        """Finish a completed payload (scatter a ``PutBlocks``); may raise ``FrameError``."""
        if self._on_payload is not None:
            done, self._on_payload = self._on_payload, None
            done()

    def _drop(self, exc: FrameError) -> None:
        self._owner.dropped_connections += 1
        log.error("tcp transport: dropping data connection from %s: %s", self._peer, exc)
        assert self._transport is not None
        self._transport.abort()

    def _handle(self, frame: Frame) -> None:
        if not self._authenticated:
            if not isinstance(frame, Hello):
                raise FrameError(f"expected hello, got {type(frame).__name__}")
            if frame.version != PROTOCOL_VERSION:
                raise FrameError(f"protocol version {frame.version}, expected {PROTOCOL_VERSION}")
            if not hmac.compare_digest(frame.token, self._owner.token):
                raise FrameError("wrong token")
            self._authenticated = True
        elif isinstance(frame, Put):
            self._payload = self._owner.destination(frame)
        elif isinstance(frame, PutBlocks):
            self._payload, self._on_payload = self._owner.scatter(frame)
        elif isinstance(frame, Flush):
            assert self._transport is not None
            self._transport.write(encode_frame(Ack(frame.seq)))
        else:
            raise FrameError(f"unexpected {type(frame).__name__} frame")

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner.inbound.discard(self)
        self._payload = None

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


@dataclass
class _Job:
    spans: npt.NDArray[np.int64]  # rows of (region, src offset, dst offset, bytes), see regions.plan
    nbytes: int
    future: Future[int]


class _Outbound:
    """The sender's connection to one peer: a send task draining a job queue and a task reading acks."""

    def __init__(self, owner: TcpTransport, peer_id: str, sock: socket.socket, remote: RegionIndex):
        self.peer_id = peer_id
        self.remote = remote
        self._owner = owner
        self._sock = sock
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._pending: deque[tuple[int, _Job]] = deque()
        self._seq = 0
        self._sending: _Job | None = None  # taken off the queue, not yet flushed
        self._error: Exception | None = None
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._send_loop()), loop.create_task(self._ack_loop())]

    def post(self, job: _Job) -> None:
        if self._error is not None:
            _fail(job.future, self._error)
        else:
            self._queue.put_nowait(job)

    async def _send_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                job = self._sending = await self._queue.get()
                batch: list[memoryview | bytes] = []
                batch_bytes = 0
                for part in self._frames(job):
                    batch.append(part)
                    batch_bytes += len(part)
                    if batch_bytes >= BATCH_BYTES or len(batch) >= BATCH_PARTS:
                        await _send_parts(loop, self._sock, batch)
                        batch, batch_bytes = [], 0
                self._seq += 1
                self._pending.append((self._seq, job))
                self._sending = None
                batch.append(encode_frame(Flush(self._seq)))
                await _send_parts(loop, self._sock, batch)
        except (OSError, RuntimeError) as exc:
            self.fail(ConnectionError(f"tcp transport: sending to {self.peer_id} failed: {exc}"))

    def _frames(self, job: _Job) -> Iterator[memoryview | bytes]:
        """Header and payload parts of every frame of ``job``: long runs as ``Put`` (cut at
        ``max_frame_bytes``), short ones gathered into ``PutBlocks`` frames."""
        limit = self._owner.config.max_frame_bytes
        for region in np.unique(job.spans[:, 0]).tolist():
            rows = job.spans[job.spans[:, 0] == region]
            base = self._owner.local_view(region)
            for _, src, dst, nbytes in rows[rows[:, 3] >= DIRECT_MIN_BYTES].tolist():
                for start in range(0, nbytes, limit):
                    size = min(limit, nbytes - start)
                    yield encode_frame(Put(region, dst + start, size))
                    yield base[src + start : src + start + size]
            small = rows[rows[:, 3] < DIRECT_MIN_BYTES]
            if len(small):
                yield from self._block_frames(region, small, base)

    def _block_frames(
        self, region: int, rows: npt.NDArray[np.int64], base: memoryview
    ) -> Iterator[memoryview | bytes]:
        block_bytes = self.remote.by_id[region].block_bytes
        counts = rows[:, 3] // block_bytes
        src = _expand(rows[:, 1] // block_bytes, counts)
        dst = _expand(rows[:, 2] // block_bytes, counts).astype("<i4")
        blocks = np.frombuffer(base, dtype=np.uint8).reshape(-1, block_bytes)
        per_frame = max(1, min(BLOCKS_FRAME_BYTES, self._owner.config.max_frame_bytes) // (4 + block_bytes))
        for i in range(0, len(src), per_frame):
            index = dst[i : i + per_frame]
            yield encode_frame(PutBlocks(region, block_bytes, len(index)))
            yield index.tobytes()
            if block_bytes >= VIEW_MIN_BYTES:
                for block in src[i : i + per_frame].tolist():
                    yield base[block * block_bytes : (block + 1) * block_bytes]
            else:
                yield blocks[src[i : i + per_frame]].data.cast("B")

    async def _ack_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                size = LENGTH.unpack(await _recv_exactly(loop, self._sock, LENGTH.size))[0]
                if not 0 < size <= MAX_HEADER_BYTES:
                    raise ConnectionError(f"bad ack length {size}")
                frame = decoder.decode(await _recv_exactly(loop, self._sock, size))
                if not isinstance(frame, Ack) or not self._pending or self._pending[0][0] != frame.seq:
                    raise ConnectionError(f"unexpected reply {frame!r}")
                _, job = self._pending.popleft()
                if not job.future.done():
                    job.future.set_result(job.nbytes)
        except (OSError, msgspec.DecodeError) as exc:
            self.fail(ConnectionError(f"tcp transport: connection to {self.peer_id} lost: {exc}"))

    def fail(self, error: Exception, quiet: bool = False) -> None:
        """Fail every pending and queued write, close the socket (idempotent; ``quiet`` for a detach)."""
        if self._error is None:
            self._error = error
            if not quiet:
                log.warning("%s", error)
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if self._sending is not None:
            _fail(self._sending.future, error)
        while self._pending:
            _fail(self._pending.popleft()[1].future, error)
        while not self._queue.empty():
            _fail(self._queue.get_nowait().future, error)
        self._sock.close()


class TcpTransport(Transport):
    """``Transport`` over asyncio TCP; one instance per engine worker process."""

    name = "tcp"

    def __init__(self, config: TcpConfig | None = None) -> None:
        self.config = config or TcpConfig()
        self.token = secrets.token_bytes(16)
        self.inbound: set[_Inbound] = set()
        #: Connections dropped for protocol violations (tests and metrics read it).
        self.dropped_connections = 0
        self._regions = RegionTable()
        self._views: dict[int, memoryview] = {}
        self._outbound: dict[str, _Outbound] = {}
        self._server: asyncio.AbstractServer | None = None
        self._port = 0
        self._io = LoopThread("pd-tcp-io")

    # -- called from engine threads -------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        self._require_open()
        self._regions.add(regions)
        views = {r.region_id: host_view(r.address, r.length) for r in regions}
        self._io.submit(self._add_views(views)).result(self.config.connect_timeout_s)
        if self._server is None:
            self._io.submit(self._listen()).result(self.config.connect_timeout_s)
        host = advertised_host(self.config.host, self.config.advertise_host)
        return msgspec.msgpack.encode(
            TcpDescriptor(PROTOCOL_VERSION, host, self._port, self.token, self._regions.infos())
        )

    def attach(self, peer_id: str, descriptor: bytes) -> Future[None]:
        self._require_open()
        try:
            desc = msgspec.msgpack.decode(descriptor, type=TcpDescriptor)
        except msgspec.DecodeError as exc:
            return _failed(ValueError(f"not a tcp transport descriptor: {exc}"))
        if desc.version != PROTOCOL_VERSION:
            return _failed(
                ValueError(f"peer speaks tcp transport v{desc.version}, we speak v{PROTOCOL_VERSION}")
            )
        return self._io.submit(self._connect(peer_id, desc))

    def write(self, peer_id: str, copies: Sequence[BlockCopy]) -> Future[int]:
        future: Future[int] = running()
        if not (self._io.running and self._io.call_soon(self._post, peer_id, copies, future)):
            _fail(future, RuntimeError("tcp transport is closed"))  # possibly while we were scheduling
        return future

    def detach(self, peer_id: str) -> None:
        if self._io.on_loop_thread():  # from a write future's done-callback, which runs on the I/O thread
            self._io.loop.create_task(self._detach(peer_id))
        elif self._io.running:
            self._io.submit(self._detach(peer_id)).result(self.config.connect_timeout_s)

    def close(self) -> None:
        if self._io.on_loop_thread():
            raise RuntimeError("close() must not be called from the transport's own I/O thread")
        if self._io.running:
            with contextlib.suppress(Exception):
                self._io.submit(self._shutdown()).result(self.config.connect_timeout_s)
            self._io.stop()
        self._regions.clear()

    def attached_peers(self) -> list[str]:
        """Peer ids with an open data connection (tests use it to prove nothing leaks)."""
        return list(self._outbound)

    def registered_regions(self) -> list[int]:
        """Region ids currently registered."""
        return [r.region_id for r in self._regions.all()]

    @property
    def port(self) -> int:
        """The data listener's port (0 before the first ``register``)."""
        return self._port

    # -- on the I/O thread -----------------------------------------------------------------------------------
    async def _add_views(self, views: dict[int, memoryview]) -> None:
        self._views.update(views)

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: self._accept(), self.config.host, self.config.port, reuse_address=True
        )
        self._port = self._server.sockets[0].getsockname()[1]
        log.info("tcp transport: data listener on %s:%d", self.config.host, self._port)

    def _accept(self) -> _Inbound:
        conn = _Inbound(self)
        self.inbound.add(conn)
        return conn

    def destination(self, put: Put) -> memoryview:
        """Receiver side: the registered bytes a ``Put`` fills, or ``FrameError`` if it points elsewhere."""
        view = self._views.get(put.region)
        if view is None:
            raise FrameError(f"put into unknown region {put.region}")
        if not 0 < put.length <= self.config.max_frame_bytes:
            raise FrameError(f"frame of {put.length} bytes (limit {self.config.max_frame_bytes})")
        if put.offset < 0 or put.offset + put.length > len(view):
            raise FrameError(f"put [{put.offset}, {put.offset + put.length}) outside region {put.region}")
        return view[put.offset : put.offset + put.length]

    def scatter(self, frame: PutBlocks) -> tuple[memoryview, Callable[[], None]]:
        """Receiver side: a staging buffer for a ``PutBlocks`` payload and the step that scatters it."""
        view = self._views.get(frame.region)
        region = self._regions.get(frame.region)
        if view is None or region is None:
            raise FrameError(f"blocks into unknown region {frame.region}")
        size = frame.count * (4 + frame.block_bytes)
        if frame.block_bytes != region.block_bytes or not 0 < size <= self.config.max_frame_bytes:
            raise FrameError(f"blocks frame {frame} does not fit region {frame.region}")
        staging = np.empty(size, dtype=np.uint8)
        blocks = np.frombuffer(view, dtype=np.uint8).reshape(-1, region.block_bytes)

        def place() -> None:
            index = staging[: 4 * frame.count].view("<i4")
            if index.size and (index.min() < 0 or index.max() >= len(blocks)):
                raise FrameError(f"block index out of range for region {frame.region}")
            blocks[index] = staging[4 * frame.count :].reshape(frame.count, frame.block_bytes)

        return staging.data, place

    def local_view(self, region: int) -> memoryview:
        return self._views[region]

    async def _connect(self, peer_id: str, desc: TcpDescriptor) -> None:
        await self._detach(peer_id)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in desc.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.config.socket_buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.socket_buffer_bytes)
        try:
            await asyncio.wait_for(
                loop.sock_connect(sock, (desc.host, desc.port)), self.config.connect_timeout_s
            )
            await loop.sock_sendall(sock, encode_frame(Hello(PROTOCOL_VERSION, desc.token)))
        except (TimeoutError, OSError) as exc:
            sock.close()
            raise ConnectionError(
                f"tcp transport: cannot reach {peer_id} at {desc.host}:{desc.port}: {exc}"
            ) from exc
        self._outbound[peer_id] = _Outbound(self, peer_id, sock, RegionIndex(desc.regions))
        log.info("tcp transport: attached %s at %s:%d", peer_id, desc.host, desc.port)

    def _post(self, peer_id: str, copies: Sequence[BlockCopy], future: Future[int]) -> None:
        conn = self._outbound.get(peer_id)
        if conn is None:
            _fail(future, ConnectionError(f"tcp transport: peer {peer_id!r} is not attached"))
            return
        try:
            spans = plan(copies, self._regions.index(), conn.remote)
        except ValueError as exc:
            _fail(future, exc)
            return
        if spans.nbytes == 0:
            future.set_result(0)
            return
        conn.post(_Job(spans.table, spans.nbytes, future))

    async def _detach(self, peer_id: str) -> None:
        conn = self._outbound.pop(peer_id, None)
        if conn is not None:
            conn.fail(ConnectionError(f"tcp transport: peer {peer_id} detached"), quiet=True)

    async def _shutdown(self) -> None:
        for peer_id in list(self._outbound):
            await self._detach(peer_id)
        if self._server is not None:
            self._server.close()
        for conn in list(self.inbound):
            conn.abort()
        self._views.clear()

    def _require_open(self) -> None:
        if not self._io.running:
            raise RuntimeError("tcp transport is closed")


async def _send_parts(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, parts: list[memoryview | bytes]
) -> None:
    """Gather-write ``parts`` (one ``sendmsg`` when the socket has room), awaiting writability otherwise."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:
            sent = 0
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][sent:]
            if len(views) == 1:
                await loop.sock_sendall(sock, views[0])
                return
            await _writable(loop, sock)


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def mark_ready() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(sock.fileno(), mark_ready)
    try:
        await ready
    finally:
        loop.remove_writer(sock.fileno())


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionResetError("peer closed the connection")
        got += n
    return bytes(buf)


def _expand(starts: npt.NDArray[np.int64], counts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Runs (start, count) -> every index they cover, in order (vectorised)."""
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets
