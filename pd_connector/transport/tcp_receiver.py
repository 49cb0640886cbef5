"""The receiving half of the TCP data plane: the data listener on D and the connections P's senders open to it.

Who calls it: ``tcp.TcpTransport`` on the receiving side (D), on its I/O thread: ``register`` starts the
listener once, ``close`` stops it. Every accepted connection is an ``Inbound`` ``BufferedProtocol``. The first
frame must be a ``Hello`` carrying the listener's random token (which peers learn from the descriptor);
``Put`` payloads are read straight into the registered memory, ``PutBlocks`` payloads into a staging buffer
numpy scatters into place, and a ``Flush`` is answered by an ``Ack`` once everything before it is stored (TCP
keeps order). Anything else (a foreign frame, an unknown region, an out-of-range span, an oversized frame)
drops that one connection, logged at ERROR, and leaves the others alone. Wire format: ``tcp_wire``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import Callable
from typing import cast

import msgspec
import numpy as np

from .regions import RegionTable
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
    decoder,
    encode_frame,
)

log = logging.getLogger(__name__)

#: Receive buffer for headers and small payloads (bigger payloads are read straight into place).
SCRATCH_BYTES = 256 << 10


class Listener:
    """D's data listener: accepts connections and checks every frame against the registered regions.

    ``views`` (region id -> writable bytes) and ``regions`` are the transport's, shared: ``register`` adds to
    them on the I/O thread, where every frame is checked.
    """

    def __init__(self, views: dict[int, memoryview], regions: RegionTable, max_frame_bytes: int) -> None:
        #: The token of ``register``'s descriptor (never revoked) and of each session's grant, by grant key.
        self.token = secrets.token_bytes(16)
        self._grants: dict[str, bytes] = {}
        #: Connections dropped for protocol violations (tests and metrics read it).
        self.dropped_connections = 0
        #: The listener's port (0 until ``listen``).
        self.port = 0
        self._views = views
        self._regions = regions
        self._max_frame_bytes = max_frame_bytes
        self._connections: set[Inbound] = set()
        self._server: asyncio.AbstractServer | None = None

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def connections(self) -> int:
        """Data connections open now."""
        return len(self._connections)

    async def listen(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("tcp transport: data listener on %s:%d", host, self.port)

    def close(self) -> None:
        """Stop accepting and abort every open connection."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.abort()

    def _accept(self) -> Inbound:
        conn = Inbound(self)
        self._connections.add(conn)
        return conn

    def closed(self, conn: Inbound) -> None:
        self._connections.discard(conn)

    def dropped(self, peer: str, exc: FrameError) -> None:
        self.dropped_connections += 1
        log.error("tcp transport: dropping data connection from %s: %s", peer, exc)

    def grant(self, key: str) -> bytes:
        """A fresh token for the session ``key`` (replacing any earlier one of that key)."""
        token = self._grants[key] = secrets.token_bytes(16)
        return token

    def revoke(self, key: str) -> None:
        """Forget ``key``'s token and abort every connection that presented it: bytes still on their way (in
        the kernel's buffers, in a relay) are never read into the registered memory."""
        self._grants.pop(key, None)
        for conn in [c for c in self._connections if c.grant == key]:
            conn.abort()

    def authenticate(self, hello: Hello) -> str | None:
        """The grant key ``hello``'s token belongs to (None: ``register``'s own token), or ``FrameError``."""
        if hello.version != PROTOCOL_VERSION:
            raise FrameError(f"protocol version {hello.version}, expected {PROTOCOL_VERSION}")
        if hmac.compare_digest(hello.token, self.token):
            return None
        for key, token in self._grants.items():
            if hmac.compare_digest(hello.token, token):
                return key
        raise FrameError("wrong or revoked token")

    def destination(self, put: Put) -> memoryview:
        """The registered bytes a ``Put`` fills, or ``FrameError`` if it points elsewhere."""
        view = self._views.get(put.region)
        if view is None:
            raise FrameError(f"put into unknown region {put.region}")
        if not 0 < put.length <= self._max_frame_bytes:
            raise FrameError(f"frame of {put.length} bytes (limit {self._max_frame_bytes})")
        if put.offset < 0 or put.offset + put.length > len(view):
            raise FrameError(f"put [{put.offset}, {put.offset + put.length}) outside region {put.region}")
        return view[put.offset : put.offset + put.length]

    def scatter(self, frame: PutBlocks) -> tuple[memoryview, Callable[[], None]]:
        """A staging buffer for a ``PutBlocks`` payload and the step that scatters it into place."""
        view = self._views.get(frame.region)
        region = self._regions.get(frame.region)
        if view is None or region is None:
            raise FrameError(f"blocks into unknown region {frame.region}")
        size = frame.count * (4 + frame.block_bytes)
        if frame.block_bytes != region.block_bytes or not 0 < size <= self._max_frame_bytes:
            raise FrameError(f"blocks frame {frame} does not fit region {frame.region}")
        staging = np.empty(size, dtype=np.uint8)
        blocks = np.frombuffer(view, dtype=np.uint8).reshape(-1, region.block_bytes)

        def place() -> None:
            index = staging[: 4 * frame.count].view("<i4")
            if index.size and (index.min() < 0 or index.max() >= len(blocks)):
                raise FrameError(f"block index out of range for region {frame.region}")
            blocks[index] = staging[4 * frame.count :].reshape(frame.count, frame.block_bytes)

        return staging.data, place


class Inbound(asyncio.BufferedProtocol):
    """One accepted data connection on the receiver.

    Reads go into a scratch buffer while frames are small, so one ``recv`` carries many 4 KiB frames (their
    payloads are then copied into place); once a payload is under way and nothing else is buffered, reads go
    straight into the registered destination memory, so large spans cost no extra copy.
    """

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._start = 0  # unparsed bytes are scratch[start:end]
        self._end = 0
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._authenticated = False
        #: The grant key this connection authenticated with (None: ``register``'s token, or not yet).
        self.grant: str | None = None
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
        self._listener.dropped(self._peer, exc)
        assert self._transport is not None
        self._transport.abort()

    def _handle(self, frame: Frame) -> None:
        if not self._authenticated:
            if not isinstance(frame, Hello):
                raise FrameError(f"expected hello, got {type(frame).__name__}")
            self.grant = self._listener.authenticate(frame)
            self._authenticated = True
        elif isinstance(frame, Put):
            self._payload = self._listener.destination(frame)
        elif isinstance(frame, PutBlocks):
            self._payload, self._on_payload = self._listener.scatter(frame)
        elif isinstance(frame, Flush):
            assert self._transport is not None
            self._transport.write(encode_frame(Ack(frame.seq)))
        else:
            raise FrameError(f"unexpected {type(frame).__name__} frame")

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.closed(self)
        self._payload = None

    def abort(self) -> None:
        """Close at once: from here on nothing more is read from the socket into memory."""
        if self._transport is not None:
            self._transport.abort()
        self._payload = None
