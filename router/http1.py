"""A lean HTTP/1.1 client for the router's upstream legs: keep-alive connections on asyncio protocols.

Used by ``upstream.py`` in the router process for every leg to a worker and every health check.
Why not aiohttp's client: its request machinery cost ~5x the CPU of the exchange itself per request
(docs/performance-history.md, ## router), and the router makes one or two legs per client request. Parsing is
llhttp's (``httptools``, the parser uvicorn uses): status, headers, chunked transfer decoding,
Content-Length and keep-alive rules are its job; this module only moves bytes and pools connections.

- ``Pool.request`` sends one POST and returns a ``Response`` once the status line and headers arrived.
- A ``Response`` hands out decoded body bytes as they arrive (``read_some``, ``read_until``, ``read``).
  Reading is paused while more than ``_HIGH_WATER`` decoded bytes wait (backpressure towards the worker).
- ``Response.release()`` returns the connection to its pool only if the body was read to its end and the
  server keeps the connection alive; ``close()`` (or a release before the end) closes it, which is how a
  worker learns that the client went away (vLLM then aborts the request).
- A request is never re-sent here, not even on a reused connection that broke before answering (a worker
  that dies while handling it looks the same): the failure goes to the caller, whose retry policy decides.
  Idle connections are reused only for ``IDLE_S``, below common server keep-alive timeouts.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20  # decoded bytes buffered before the socket stops being read
# Idle connections older than this are not reused: servers close idle keep-alive connections (uvicorn after
# 5 s), and reusing one just as it closes costs a round trip.
IDLE_S = 4.0
MAX_IDLE_PER_HOST = 256


class HttpError(Exception):
    """A leg failed at the transport or protocol level; ``kind`` is ``connect``, ``timeout`` or ``protocol``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Connection(asyncio.Protocol):
    """One TCP connection and the response being read on it (one request at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._buf = bytearray()
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of the current response arrived
        self.error: HttpError | None = None
        self._framed = False  # Content-Length or chunked: the body's end is known without closing
        # Released before the body's end (a stream read up to its last event): called when it ends.
        self.on_complete: Callable[[], None] | None = None
        # A diverted body (``Response.divert``): body bytes go here as they arrive instead of to the buffer.
        self.sink: Callable[[bytes], None] | None = None
        self._expiry: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol (called by the event loop) ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(HttpError("protocol", "unexpected protocol upgrade"))
        except httptools.HttpParserError as e:
            self._fail(HttpError("protocol", f"malformed HTTP response: {e}"))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.on_complete = None
        self._cancel_expiry()
        if self.headers_done and not self._framed and not self.complete and self.error is None:
            self.complete = True  # a body delimited by the connection's end (no length, not chunked)
            self.keep_alive = False
        elif not self.complete and self.error is None:
            what = "before the response ended" if self.received else "before answering"
            self.error = HttpError("protocol", f"the server closed the connection {what}")
        self._wake()

    # ---- httptools callbacks (from feed_data) -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.on_complete is not None:  # released: nobody reads this body any more
            self.on_complete = None
            self.close()
            return
        if self.sink is not None:
            self.sink(body)
            return
        self._buf += body
        if len(self._buf) > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        done, self.on_complete = self.on_complete, None
        if done is not None:
            self._cancel_expiry()
            done()
        self._wake()

    # ---- used by Pool and Response --------------------------------------------------------------------------

    def _fail(self, error: HttpError) -> None:
        self.error = error
        self.close()
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        """A future done at the next parser event or the connection's end (a plain future, not a coroutine:
        the relay waits on it once per streamed event)."""
        self._waiter = self._loop.create_future()
        return self._waiter

    def send(self, data: bytes) -> None:
        """Start a new exchange on this (idle or new) connection; llhttp's parser carries over between
        keep-alive messages (a connection is reused only after a cleanly parsed one)."""
        assert self.transport is not None
        self.status = 0
        self.headers_done = self.complete = self.keep_alive = self.received = self._framed = False
        self.error = None
        self.sink = None
        self._buf.clear()
        self.transport.write(data)

    def take(self, limit: int | None = None) -> bytes:
        """Remove and return buffered body bytes (all, or the first ``limit``)."""
        if limit is None or limit >= len(self._buf):
            data = bytes(self._buf)
            self._buf.clear()
        else:
            data = bytes(self._buf[:limit])
            del self._buf[:limit]
        if self._paused and len(self._buf) <= _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    @property
    def buffer(self) -> bytearray:
        return self._buf

    def expire_draining(self, delay_s: float) -> None:
        """Close the connection if the released body has not ended within ``delay_s``."""

        def expire() -> None:
            self._expiry = None
            if self.on_complete is not None:
                self.on_complete = None
                self.close()

        self._expiry = self._loop.call_later(delay_s, expire)

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """An upstream answer whose headers arrived; the body is read from it as it comes."""

    def __init__(self, pool: Pool, key: tuple[str, int, bool], conn: _Connection) -> None:
        self._pool = pool
        self._key = key
        self._conn: _Connection | None = conn
        self.status = conn.status

    def _live(self) -> _Connection:
        if self._conn is None:
            raise HttpError("protocol", "the response was already released")
        return self._conn

    async def read_some(self) -> bytes:
        """Whatever body bytes have arrived (waits for at least one), or b"" at the body's end."""
        conn = self._live()
        while not conn.buffer:
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return b""
            await conn.wait()
        return conn.take()

    async def read_until(self, separator: bytes) -> bytes:
        """Body bytes up to and including ``separator``; at the body's end, whatever is left (maybe b"")."""
        conn = self._live()
        start = 0
        while True:
            found = conn.buffer.find(separator, start)
            if found >= 0:
                return conn.take(found + len(separator))
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return conn.take()
            if len(conn.buffer) > _HIGH_WATER:  # reading is paused: the separator would never come
                raise HttpError("protocol", f"no {separator!r} within {_HIGH_WATER} bytes")
            start = max(0, len(conn.buffer) - len(separator) + 1)
            await conn.wait()

    async def read(self) -> bytes:
        """The rest of the body; the connection goes back to the pool."""
        conn = self._live()
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            await conn.wait()
        if conn.error is not None:
            raise conn.error
        data = conn.take()
        self.release()
        return data

    def divert(self, sink: Callable[[bytes], None]) -> None:
        """Hand the rest of the body to ``sink`` as it arrives, inside the event loop's read callback (no
        task switch per chunk: the relay's hot path); bytes already buffered go first. ``sink`` must not
        raise. The caller then waits with ``wait`` and asks ``ended`` until it is done."""
        conn = self._live()
        buffered = conn.take() if conn.buffer else b""
        conn.sink = sink
        if buffered:
            sink(buffered)

    def wait(self) -> asyncio.Future[None]:
        """A future done when the body ends, the connection fails, or someone calls ``wake``."""
        return self._live().wait()

    def wake(self) -> None:
        """Finish the pending ``wait`` (a sink uses it to report what only the caller can handle)."""
        self._live()._wake()

    def ended(self) -> bool:
        """Whether the body has ended; raises the ``HttpError`` that broke it."""
        conn = self._live()
        if conn.error is not None:
            raise conn.error
        return conn.complete

    def pause_reading(self, paused: bool) -> None:
        """Stop (or resume) reading the socket: backpressure from a diverted body's slow consumer."""
        conn = self._live()
        if conn.transport is not None and not conn.closed:
            if paused:
                conn.transport.pause_reading()
            else:
                conn.transport.resume_reading()

    def release(self) -> None:
        """Done with the response: a fully read keep-alive connection is reused, anything else closed.

        A body whose end has not arrived yet (an SSE stream read up to ``[DONE]``, its terminating chunk
        still in flight) is not waited for: the connection goes back to the pool when the end arrives with
        no further data, and is closed if more data or nothing comes (``IDLE_S``).
        """
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.sink = None
        if conn.buffer or conn.error is not None or conn.closed:
            conn.close()
        elif conn.complete:
            self._pool.put_back(self._key, conn)
        else:
            key, pool = self._key, self._pool
            conn.on_complete = lambda: pool.put_back(key, conn)
            conn.expire_draining(IDLE_S)

    def close(self) -> None:
        """Abandon the response: the connection is closed (the server sees the client go away)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.sink = None
            conn.close()


class Pool:
    """Idle keep-alive connections per (host, port, tls), created on demand; one per request in flight."""

    def __init__(self, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int, bool], deque[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    @staticmethod
    def key(url: str) -> tuple[str, int, bool]:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or ""
        return host, parts.port or (443 if tls else 80), tls

    async def request(self, key: tuple[str, int, bool], head: bytes, body: bytes) -> Response:
        """Send ``head`` (request line and headers, ending in a blank line) + ``body``; wait for the headers."""
        if self._closed:
            raise HttpError("connect", "the upstream pool is closed")
        conn = self._idle_connection(key) or await self._connect(key)
        conn.send(head + body)
        try:
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            conn.close()
            raise
        return Response(self, key, conn)

    def _idle_connection(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used one: least likely to have been closed
            if not conn.closed and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> _Connection:
        host, port, tls = key
        loop = asyncio.get_running_loop()
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                transport, conn = await loop.create_connection(
                    lambda: _Connection(loop),
                    host,
                    port,
                    ssl=self._ssl if tls else None,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            raise HttpError("timeout", f"connecting to {host}:{port} timed out") from None
        except OSError as e:
            raise HttpError("connect", f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        conn.transport = transport  # uvloop calls connection_made later
        return conn

    def put_back(self, key: tuple[str, int, bool], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, deque())
        if self._closed or not conn.keep_alive or conn.closed or len(idle) >= MAX_IDLE_PER_HOST:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        """Close every idle connection; responses in flight close theirs when released."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()
