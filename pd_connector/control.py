"""Side-channel plumbing: framed, heartbeated control connections, the server that accepts them and the client.

Who calls it: the transfer engine (``pd_connector.transfer``), on its I/O thread (a ``LoopThread``): P's
engine serves (``serve``), D's receiver dials (``connect``), both handshake and exchange messages over a
``Connection``. The engine owns the logic; this module only moves ``protocol`` messages and enforces the
connection-level rules: a frame that is foreign, oversized, unauthenticated or undecodable drops that one
connection with a logged error (the server keeps serving others), a peer silent for longer than the
heartbeat timeout is dead, and every wait (connect, handshake, read) has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from pd_connector.protocol import HEADER, FrameCodec, Heartbeat, Message, ProtocolError

logger = logging.getLogger(__name__)


class Connection:
    """One framed, heartbeated control connection; used only on the I/O thread.

    ``run`` reads messages until the connection ends and hands each one (heartbeats excepted) to
    ``on_message``; ``on_close(conn, reason)`` is called exactly once when it ends for any reason.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        codec: FrameCodec,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
    ) -> None:
        self.id = uuid.uuid4().hex[:8]  # names this connection's transport endpoint (peer_id) uniquely
        self._reader = reader
        self._writer = writer
        #: Replaced once the handshake agreed on a session key (``FrameCodec.session``).
        self.codec = codec
        self._interval = heartbeat_interval_s
        self._timeout = heartbeat_timeout_s
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.closed = False
        self.on_message: Callable[[Connection, Message], None] = lambda conn, msg: None
        self.on_close: Callable[[Connection, str], None] = lambda conn, reason: None
        self._heartbeat_task: asyncio.Task[None] | None = None

    def send(self, message: Message) -> bool:
        """Queue ``message`` for sending; False when the connection is already closed."""
        if self.closed:
            return False
        try:
            self._writer.write(self.codec.encode(message))
        except (ConnectionError, RuntimeError) as e:
            self.close(f"send failed: {e}")
            return False
        return True

    async def read_message(self, timeout_s: float) -> Message:
        """Read one frame within ``timeout_s``; raises ProtocolError, TimeoutError or IncompleteReadError."""
        header = await asyncio.wait_for(self._reader.readexactly(HEADER.size), timeout_s)
        length = self.codec.parse_header(header)
        payload = await asyncio.wait_for(self._reader.readexactly(length), timeout_s)
        return self.codec.decode(payload)

    async def run(self) -> None:
        """Serve the connection until it ends: heartbeats out, messages in, silence or bad bytes = close."""
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeats())
        reason = "closed"
        try:
            while not self.closed:
                message = await self.read_message(self._timeout)
                if not isinstance(message, Heartbeat):
                    self.on_message(self, message)
        except ProtocolError as e:
            logger.error("pd_connector control: dropping connection %s: %s", self.peer, e)
            reason = f"protocol error: {e}"
        except TimeoutError:
            logger.warning("pd_connector control: %s silent for %.1f s, closing", self.peer, self._timeout)
            reason = f"no heartbeat for {self._timeout} s"
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            reason = f"connection lost: {e!r}"
        self.close(reason)

    async def _heartbeats(self) -> None:
        while not self.closed:
            self.send(Heartbeat(time.monotonic()))
            await asyncio.sleep(self._interval)

    def close(self, reason: str = "closed") -> None:
        """Close the socket and report ``on_close`` once (idempotent; safe from inside callbacks)."""
        if self.closed:
            return
        self.closed = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        with contextlib.suppress(RuntimeError):
            self._writer.close()
        self.on_close(self, reason)


async def connect(
    addr: str, codec: FrameCodec, timeout_s: float, heartbeat_interval_s: float, heartbeat_timeout_s: float
) -> Connection:
    """Open a control connection to ``host:port`` within ``timeout_s`` (OSError / TimeoutError otherwise)."""
    host, port = split_addr(addr)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    return Connection(reader, writer, codec, heartbeat_interval_s, heartbeat_timeout_s)


async def serve(
    host: str,
    port: int,
    codec: FrameCodec,
    heartbeat_interval_s: float,
    heartbeat_timeout_s: float,
    handle: Callable[[Connection], Awaitable[None]],
) -> asyncio.Server:
    """Listen on ``host:port``; every accepted connection is handled by ``handle(conn)`` in its own task."""

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(reader, writer, codec, heartbeat_interval_s, heartbeat_timeout_s)
        try:
            await handle(conn)
        except Exception:  # a bug in one connection's handling must not stop the server
            logger.exception("pd_connector control: error handling %s", conn.peer)
        finally:
            conn.close("handler finished")

    return await asyncio.start_server(accepted, host, port)


def split_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``[::1]:port``) -> (host, port); ValueError with the bad text otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"control address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def rank_addr(addr: str, rank: int) -> str:
    """The side channel of P's TP rank ``rank`` when ``addr`` is rank 0's: the next ports, one per rank."""
    host, port = split_addr(addr)
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port + rank}"
