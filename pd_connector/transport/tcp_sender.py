"""The sending half of the TCP data plane: P's connection to one receiver and how a write becomes frames.

Who calls it: ``tcp.TcpTransport`` on the sending side (P), on its I/O thread: ``attach`` opens one
``Outbound`` per peer with ``connect`` (which says ``Hello`` with the token from the peer's descriptor), and
``write`` posts each planned write to it as a ``Job``. Long runs go as ``Put`` frames (the receiver reads them
straight into its registered memory), short ones gathered into ``PutBlocks`` frames (numpy gathers them here
and scatters them there); a ``Flush`` after a job is answered by an ``Ack`` once the receiver stored everything
before it (TCP keeps order), which resolves the job's future. A broken connection fails every write queued or
in flight on it. Wire format: ``tcp_wire``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from .futures import fail
from .regions import RegionIndex
from .tcp_wire import (
    LENGTH,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Flush,
    Hello,
    Put,
    PutBlocks,
    TcpDescriptor,
    decoder,
    encode_frame,
)

log = logging.getLogger(__name__)

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


async def connect(
    peer_id: str,
    desc: TcpDescriptor,
    local_view: Callable[[int], memoryview],
    max_frame_bytes: int,
    timeout_s: float,
    socket_buffer_bytes: int,
) -> Outbound:
    """Connect to the listener ``desc`` names and say hello within ``timeout_s`` (``ConnectionError`` if not)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET6 if ":" in desc.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if socket_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer_bytes)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, (desc.host, desc.port)), timeout_s)
        await loop.sock_sendall(sock, encode_frame(Hello(PROTOCOL_VERSION, desc.token)))
    except (TimeoutError, OSError) as exc:
        sock.close()
        raise ConnectionError(
            f"tcp transport: cannot reach {peer_id} at {desc.host}:{desc.port}: {exc}"
        ) from exc
    log.info("tcp transport: attached %s at %s:%d", peer_id, desc.host, desc.port)
    return Outbound(peer_id, sock, RegionIndex(desc.regions), local_view, max_frame_bytes)


@dataclass
class Job:
    spans: npt.NDArray[np.int64]  # rows of (region, src offset, dst offset, bytes), see regions.plan
    nbytes: int
    future: Future[int]


class Outbound:
    """The sender's connection to one peer: a send task draining a job queue and a task reading acks."""

    def __init__(
        self,
        peer_id: str,
        sock: socket.socket,
        remote: RegionIndex,
        local_view: Callable[[int], memoryview],
        max_frame_bytes: int,
    ) -> None:
        self.peer_id = peer_id
        self.remote = remote
        self._sock = sock
        self._local_view = local_view
        self._max_frame_bytes = max_frame_bytes
        self._queue: asyncio.Queue[Job] = asyncio.Queue()
        self._pending: deque[tuple[int, Job]] = deque()
        self._seq = 0
        self._sending: Job | None = None  # taken off the queue, not yet flushed
        self._error: Exception | None = None
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._send_loop()), loop.create_task(self._ack_loop())]

    def post(self, job: Job) -> None:
        if self._error is not None:
            fail(job.future, self._error)
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

    def _frames(self, job: Job) -> Iterator[memoryview | bytes]:
        """Header and payload parts of every frame of ``job``: long runs as ``Put`` (cut at
        ``max_frame_bytes``), short ones gathered into ``PutBlocks`` frames."""
        limit = self._max_frame_bytes
        for region in np.unique(job.spans[:, 0]).tolist():
            rows = job.spans[job.spans[:, 0] == region]
            base = self._local_view(region)
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
        per_frame = max(1, min(BLOCKS_FRAME_BYTES, self._max_frame_bytes) // (4 + block_bytes))
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
            fail(self._sending.future, error)
        while self._pending:
            fail(self._pending.popleft()[1].future, error)
        while not self._queue.empty():
            fail(self._queue.get_nowait().future, error)
        self._sock.close()


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
