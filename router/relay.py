"""Relaying a decode worker's event stream to the client, and writing to a client that may be gone.

Used by ``proxy.py`` (a stream's first attempt) and ``resume.py`` (its continuations), in the router process.
``relay`` sends the first event through the downstream, then lets a ``Pump`` copy the rest inside the upstream
connection's read callback (``Response.divert``): per relayed event this is the router's hot path, and its CPU
is what delays other streams' events and new requests on a busy router (docs/router.md, Upstream
connections). The coroutine itself only waits for ``[DONE]``, an upstream error, ``idle_s`` of silence, or a
slow client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.balancer import Worker
from router.downstream import Downstream, http_chunk
from router.errors import ApiError
from router.http1 import HttpError, Response
from router.metrics import EventSeries, RouterMetrics
from router.streaming import DONE, Stitcher, StreamState, WorkerErrorEvent, strip_token_ids
from router.trace import Stamps
from router.upstream import ErrorEvent, UpstreamError, wrap_error

# A client whose socket buffer holds more than this stops the upstream from being read until it is below
# LOW_WATER again (checked every _DRAIN_POLL_S: only slow clients get there).
HIGH_WATER = 1 << 16
LOW_WATER = 1 << 14
_DRAIN_POLL_S = 0.002


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


async def write(client: Downstream, data: bytes) -> None:
    try:
        await client.write(data)
    except ConnectionError:
        raise ClientGone from None


async def write_error(client: Downstream, message: str, status: int = 502) -> None:
    """An error after the headers went out: an OpenAI error object as the last event, then [DONE]."""
    err = ApiError(status, message)
    await write(client, b"data: " + err.body() + b"\n\n")
    await write(client, DONE)


@dataclass(frozen=True)
class ClientStream:
    """One streamed request's client side, the same for its first decode leg and each resumed one: where the
    events go, what the token state records (``state``, None when the stream cannot be resumed), whether token
    ids are stripped, and the route its inter-token latency is counted under."""

    client: Downstream
    state: StreamState | None
    strip: bool
    metrics: RouterMetrics
    route: str
    idle_s: float


async def relay(
    stream: ClientStream,
    resp: Response,
    worker: Worker,
    first: bytes | asyncio.Task[bytes],
    stitcher: Stitcher | None,
    lead: bytes = b"",
    stamps: Stamps | None = None,
) -> UpstreamError | None:
    """Copy events to the client until [DONE]; returns the upstream error that broke the stream, if any.

    ``lead``: events the router wrote itself (P's first token, ``legs.Legs.opening``), sent as they are
    before ``first``: empty (every event of the worker's stream goes through the Pump), or the task reading
    the worker's first events, awaited once ``lead`` went out (its failure breaks the stream after ``lead``).
    When ``lead`` ends the stream, the worker's stream is closed unread. ``stamps`` (a seeded P/D request's)
    gets ``decode_continued`` when the first bytes of D's own stream arrive. The first event goes out through
    ``client.write``; the rest are relayed by a ``Pump`` inside the upstream connection's read callback,
    byte for byte, all complete events of one read in one write. This coroutine only waits for the end, an
    error, the idle timeout or a slow client. After ``[DONE]`` the upstream connection is released for
    reuse; the caller closes it on any other exit.
    """
    client, state, strip, idle_s = stream.client, stream.state, stream.strip, stream.idle_s

    def transform(batch: bytes) -> bytes:
        if stitcher is not None:
            return stitcher.rewrite_batch(batch)
        if state is not None:
            state.observe_batch(batch)
        return strip_token_ids(batch) if strip else batch

    if isinstance(first, asyncio.Task):
        task = first
        try:
            await write(client, lead)
            if lead.endswith(DONE):
                resp.close()
                return None
            first = await task
        except UpstreamError as e:
            return e
        finally:
            task.cancel()  # still reading when the client left or the lead ended the stream
        lead = b""
        if stamps is not None:
            stamps.mark("decode_continued")
            stamps = None
    try:
        out, failure = (lead + transform(first) if first else lead), None
    except WorkerErrorEvent as e:
        out, failure = lead + e.out, ErrorEvent(f"{worker.url} streamed an error: {e}")
    if out:
        await write(client, out)
    if failure is not None:
        return failure
    if lead.endswith(DONE):
        resp.close()  # the worker's stream is not needed: closing it makes vLLM abort its request
        return None
    if first.endswith(DONE):
        resp.release()  # keep-alive: the connection serves the next leg
        return None
    transport = client.transport
    if transport is None:
        raise ClientGone
    pump = Pump(transport, client.chunked, transform, stream.metrics.itl_for(stream.route), resp, stamps)
    resp.divert(pump.feed)
    try:
        while True:
            if isinstance(pump.failure, WorkerErrorEvent):
                return ErrorEvent(f"{worker.url} streamed an error: {pump.failure}")
            if pump.failure is not None:
                raise pump.failure
            if pump.done:
                resp.release()
                return None
            if resp.ended():
                return UpstreamError("protocol", f"{worker.url} ended the stream without [DONE]")
            if pump.paused:  # the client reads slower than the worker writes
                if transport.is_closing():
                    raise ClientGone
                if transport.get_write_buffer_size() > LOW_WATER:
                    await asyncio.sleep(_DRAIN_POLL_S)
                    pump.seen = time.monotonic()  # a slow client is not an idle worker
                    continue
                pump.resume()
            left = idle_s - (time.monotonic() - pump.seen)
            if left <= 0:
                return UpstreamError("timeout", f"{worker.url} sent nothing for about {idle_s}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(resp.wait(), left)
    except HttpError as e:
        return wrap_error(e, worker)


class Pump:
    """Relays a stream's events inside the upstream connection's read callback (``Response.divert``).

    Per event this saves the task switch, the futures and aiohttp's write coroutines of a coroutine relay
    (the relay's CPU per event is what queues other streams' events and new requests on a busy router).
    Writes go straight to the client's transport, framed as the downstream frames its body (HTTP/1.1 chunks
    or, for HTTP/1.0, raw), after the downstream has sent the headers and the first event. Never raises: a
    failure is kept for ``relay`` to raise.
    """

    def __init__(
        self,
        transport: asyncio.Transport,
        chunked: bool,
        transform: Callable[[bytes], bytes],
        itl: EventSeries,
        resp: Response,
        stamps: Stamps | None = None,
    ) -> None:
        self._transport = transport
        self._stamps = stamps
        self._chunked = chunked
        self._transform = transform
        self._itl = itl
        self._resp = resp
        self._rest = b""
        self.seen = self._sent = time.monotonic()
        self.done = False
        self.paused = False
        self.failure: BaseException | None = None

    def feed(self, data: bytes) -> None:
        if self.done or self.failure is not None:
            return
        now = self.seen = time.monotonic()
        if self._stamps is not None:
            self._stamps.mark("decode_continued", now)
            self._stamps = None
        try:
            rest = self._rest + data if self._rest else data
            cut = rest.rfind(b"\n\n")
            if cut < 0:
                self._rest = rest
                return
            batch, self._rest = rest[: cut + 2], rest[cut + 2 :]
            try:
                out = self._transform(batch)
            except WorkerErrorEvent as e:  # what came before the error goes out; relay returns the error
                out, self.failure = e.out, e
            if out:
                if self._transport.is_closing():
                    raise ClientGone
                self._transport.write(http_chunk(out) if self._chunked else out)
                self._itl.observe(now - self._sent)
                self._sent = now
            if self.failure is not None:
                self._resp.wake()
            elif batch.endswith(DONE):
                self.done = True
                self._resp.wake()
            elif not self.paused and self._transport.get_write_buffer_size() > HIGH_WATER:
                self.paused = True
                self._resp.pause_reading(True)
                self._resp.wake()
        except BaseException as e:  # kept for relay, which raises it in the handler's task
            self.failure = e
            self._resp.wake()

    def resume(self) -> None:
        self.paused = False
        self._resp.pause_reading(False)
