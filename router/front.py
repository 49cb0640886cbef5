"""The lean HTTP/1.1 front that serves the completion endpoints; every other request goes to aiohttp.

Runs in the router process: ``front_runner.FrontRunner`` replaces aiohttp's ``AppRunner`` (``cli.py``, unit
tests), so every site of the runner accepts connections here first, one ``Connection`` each.

Why: aiohttp's server wakes a per-connection task when a request has arrived, and that task then creates
the handler's task: two event-loop turns between a request's last byte and the first line of its handler on
Python 3.11 (aiohttp starts handler tasks eagerly only on 3.12+). On a busy router one turn lasts as long as
all the work that became ready meanwhile (other streams' events), so those two turns were most of what the
router added to a request at concurrency 64 (docs/performance.md, ## router). Here the handler's task is
created in the read callback that completed the request: one turn, and none of aiohttp's per-request
objects.

- Served here: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``app.COMPLETIONS``, a query
  string is ignored), through ``app.complete`` with the same API-key check, errors and metrics as aiohttp's
  endpoints (``app.answered``). Parsing is llhttp's (``httptools``): request line, headers, Content-Length or
  chunked bodies, keep-alive; ``Expect: 100-continue`` is answered; bodies over ``server.max_body_bytes``
  get 413 and the connection is closed.
- Everything else: a request that starts a read and is not one of those is handed, with the bytes read so
  far, to aiohttp's own protocol for this connection (``transport.set_protocol``), which serves the
  connection from then on (completions too, through the same ``app.complete``).
- A request pipelined behind a completion in the same read cannot be handed over (the parser does not say
  where it starts): anything but a completion there gets 400 and the connection is closed. HTTP clients do
  not pipeline; pipelined completions are answered in order.
- A client that disconnects cancels its request's task, as aiohttp's ``handler_cancellation`` does, which
  closes both legs (vLLM aborts them). A connection idle for ``server.keepalive_s`` is closed.
- Shutdown (the runner's clean-up), as aiohttp does it: idle connections close at once, requests in flight
  get the runner's shutdown timeout (``server.shutdown_timeout_s``) to finish (their connections close after
  them), then are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import socket
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import formatdate
from typing import TYPE_CHECKING, cast

import httptools

from router.app import COMPLETIONS, answered, complete, too_large
from router.downstream import Reply, http_chunk
from router.errors import ApiError

if TYPE_CHECKING:
    from router.front_runner import Front

log = logging.getLogger("router.front")

#: Requests parsed ahead of the one being answered before reading pauses (pipelining clients only).
_MAX_QUEUED = 8
_STARTS = tuple(f"POST {path}".encode() for path in COMPLETIONS)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CLOSE = b"Connection: close\r\n"


def _served_here(head: bytes) -> bool | None:
    """Whether a request starting with ``head`` is a completion request; None: too few bytes to say."""
    undecided = False
    for start in _STARTS:
        if head.startswith(start) and len(head) > len(start):
            if head[len(start) : len(start) + 1] in (b" ", b"?"):
                return True
        elif start.startswith(head):
            undecided = True
    return None if undecided else False


def _endpoint(path: str) -> str:
    """The metrics label of a request's path: a completion endpoint or "unmatched" (bounded label values)."""
    return path if path in COMPLETIONS else "unmatched"


@dataclass
class _Request:
    """One parsed request (``reject``: the error to answer instead of serving it)."""

    path: str
    content_type: str
    body: bytes
    authorization: str
    keep_alive: bool
    http10: bool
    reject: ApiError | None


class Dates:
    """The ``Date`` header, formatted once per second (per front, not per response)."""

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._line


def _head(status: int, headers: Mapping[str, str], extra: bytes, date: bytes) -> bytes:
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = "Client Closed Request" if status == 499 else ""
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return b"HTTP/1.1 %d %s\r\n%s%s%b\r\n" % (status, reason.encode(), lines.encode(), date, extra)


class _Stream:
    """``Downstream`` of one request on a front connection: status line, headers and events, framed."""

    def __init__(self, conn: Connection, request: _Request) -> None:
        self._conn = conn
        self._keep_alive = request.keep_alive
        self.chunked = not request.http10  # an HTTP/1.0 client reads the stream until the connection closes
        self.started = False

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._conn.transport

    async def start(self, headers: Mapping[str, str]) -> None:
        if self.chunked:
            extra = b"Transfer-Encoding: chunked\r\n" + (b"" if self._keep_alive else _CLOSE)
        else:
            extra = _CLOSE
        self._conn.send(_head(200, headers, extra, self._conn.front.dates.line()))
        self.started = True

    async def write(self, data: bytes) -> None:
        self._conn.send(http_chunk(data) if self.chunked else data)
        await self._conn.drain()

    def end(self) -> bool:
        """Finish the body; returns whether the connection can serve another request."""
        if self.chunked:
            self._conn.send(b"0\r\n\r\n")
            return self._keep_alive
        return False


class Connection(asyncio.Protocol):
    """One client connection while the front serves it (until it closes or is handed to aiohttp)."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._head = b""  # the start of a request too short to tell where it goes
        self._in_message = False
        self._queue: deque[_Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future[None] | None = None
        self._write_paused = False
        self._reading_paused = False
        self._stopping = False  # the server shuts down: close after the request in flight
        self._message_reset()

    # ---- asyncio protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.front.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._closing():
            return
        if self._head:
            data, self._head = self._head + data, b""
        if not self._in_message and self._task is None and not self._queue:  # between requests
            here = _served_here(data)
            if here is None:
                self._head = data
                return
            if not here:
                self._hand_over(data)
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(ApiError(400, "protocol upgrades are not supported on this endpoint"))
        except httptools.HttpParserError as e:
            self._refuse(ApiError(400, f"malformed HTTP request: {e}"))

    def eof_received(self) -> bool | None:
        return None  # the client closed its side: close ours (an unanswered request is cancelled)

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.connections.discard(self)
        self._disarm_idle()
        if self._task is not None:
            self._task.cancel()  # the client went away: close both legs
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionError("the client closed the connection"))
        self.transport = None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # ---- llhttp callbacks (during feed_data) -----------------------------------------------------------

    def _message_reset(self) -> None:
        self._url = b""
        self._content_type = ""
        self._authorization = ""
        self._expect = False
        self._body: list[bytes] = []
        self._size = 0
        self._reject: ApiError | None = None

    def on_message_begin(self) -> None:
        self._in_message = True
        self._disarm_idle()
        self._message_reset()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.lower()
        if key == b"authorization":
            self._authorization = value.decode("latin-1")
        elif key == b"content-type":
            self._content_type = value.decode("latin-1")
        elif key == b"expect":
            self._expect = value.lower() == b"100-continue"
        elif key == b"content-length" and value.isdigit() and int(value) > self.front.max_body:
            self._too_large()

    def _path(self) -> str:
        """The current request's path (its query string dropped), from the URL parsed so far."""
        return self._url.partition(b"?")[0].decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._parser.get_method() != b"POST" or self._path() not in COMPLETIONS:
            self._reject = ApiError(
                400, "a request pipelined behind a completion request must also be one; use a new connection"
            )
        elif self._expect and self._reject is None and self._task is None and not self._queue:
            self.send(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._reject is not None:
            return
        if self._size > self.front.max_body:
            self._too_large()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        if self._closing():  # refused while parsing: nothing more is answered
            return
        self._queue.append(
            _Request(
                self._path(),
                self._content_type,
                b"".join(self._body),
                self._authorization,
                self._parser.should_keep_alive() and self._reject is None,
                self._parser.get_http_version() == "1.0",
                self._reject,
            )
        )
        self._message_reset()
        if self._task is None:
            self._next()
        elif len(self._queue) >= _MAX_QUEUED and self.transport is not None:
            self.transport.pause_reading()
            self._reading_paused = True

    def _too_large(self) -> None:
        self._reject = too_large(self.front.state)
        self._body = []
        if self._task is None and not self._queue:  # answer now rather than read a body we refuse
            self._refuse(self._reject)

    # ---- requests -----------------------------------------------------------------------------------------

    def _next(self) -> None:
        request = self._queue.popleft()
        self._task = asyncio.get_running_loop().create_task(self._serve(request))
        if self._reading_paused and self.transport is not None:
            self.transport.resume_reading()
            self._reading_paused = False

    async def _serve(self, request: _Request) -> None:
        front = self.front
        stream = _Stream(self, request)
        keep_alive = False
        try:
            if request.reject is not None:
                answer: Reply | None = request.reject.reply()
            else:
                answer = await answered(
                    front.state,
                    "POST",
                    request.path,
                    request.authorization,
                    lambda: complete(front.state, request.path, request.content_type, request.body, stream),
                )
            status = 200 if answer is None else answer.status
            front.state.metrics.responses_for(_endpoint(request.path), str(status)).inc()
            with contextlib.suppress(ConnectionError):  # the client is gone: nothing left to tell it
                if answer is None:
                    keep_alive = stream.end()
                elif not stream.started:
                    keep_alive = request.keep_alive and not self._stopping
                    self._reply(answer, keep_alive)
        finally:
            self._task = None
            if self.transport is not None:
                if not keep_alive or self._stopping:
                    self.transport.close()
                elif self._queue:
                    self._next()
                else:
                    self._arm_idle()

    def _reply(self, reply: Reply, keep_alive: bool) -> None:
        extra = b"Content-Length: %d\r\n" % len(reply.body) + (b"" if keep_alive else _CLOSE)
        self.send(_head(reply.status, reply.headers, extra, self.front.dates.line()) + reply.body)

    def _refuse(self, error: ApiError) -> None:
        """Answer ``error`` now and close: the request stream cannot be followed any further."""
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        log.info("closing the connection from %s: %d %s", peer, error.status, error.message)
        self.front.state.metrics.responses_for(_endpoint(self._path()), str(error.status)).inc()
        if self._task is None:
            with contextlib.suppress(ConnectionError):
                self._reply(error.reply(), keep_alive=False)
        if self.transport is not None:
            self.transport.close()

    # ---- writing ------------------------------------------------------------------------------------------

    def _closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionError("the client closed the connection")
        transport.write(data)

    async def drain(self) -> None:
        """Wait while the client reads slower than we write (the transport's high-water mark)."""
        if self._write_paused:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    # ---- hand-over and idle timeout ------------------------------------------------------------------

    def _hand_over(self, data: bytes) -> None:
        """Give the connection to aiohttp's protocol, with the request bytes read so far."""
        assert self.transport is not None
        self.front.connections.discard(self)
        self._disarm_idle()
        protocol = self.front.aiohttp_protocol()
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        protocol.data_received(data)
        self.transport = None

    def _arm_idle(self) -> None:
        self._idle = asyncio.get_running_loop().call_later(self.front.keepalive_s, self._close_idle)

    def _disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _close_idle(self) -> None:
        self._idle = None
        if self.transport is not None and self._task is None and not self._in_message:
            self.transport.close()

    def stop(self) -> asyncio.Task[None] | None:
        """Server shutdown begins: close now if idle, else after the request in flight (returned)."""
        self._stopping = True
        if self._task is None and self.transport is not None:
            self.transport.close()
        return self._task

    def close(self) -> None:
        """Server shutdown ends: cancel the request in progress and close."""
        if self._task is not None:
            self._task.cancel()
        if self.transport is not None:
            self.transport.close()
