"""Dependency-free data plane over plain TCP (asyncio): the fallback when ``ucxx`` is absent or configured.

Who calls it: the transfer engine, from engine threads (``Transport`` methods), in both roles of an engine
worker process. Receiver (D): ``register`` starts the data listener (``tcp_receiver.Listener``) on the
configured host and port and publishes a ``TcpDescriptor`` with its address, a random token and the region
table. Sender (P): ``attach`` opens one connection per peer (``tcp_sender.Outbound``), ``write`` plans the copies
into byte spans (``regions.plan``) and posts them to it. All socket work runs on the transport's own I/O thread
(``LoopThread``); write futures resolve there, so their done-callbacks must be quick and non-blocking
(``detach`` from one is scheduled, not awaited). Wire format: ``tcp_wire``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from .base import BlockCopy, MemoryRegion, Transport, check_reachable
from .futures import fail, failed, running
from .host import advertised_host
from .loop_thread import LoopThread
from .regions import RegionTable, host_view, plan
from .tcp_receiver import Listener
from .tcp_sender import Job, Outbound, connect
from .tcp_wire import PROTOCOL_VERSION, TcpDescriptor

T = TypeVar("T")


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
    #: Port peers connect to, put into the descriptor; defaults to the listener's own (set it when something
    #: in between forwards another port to the listener: a NAT, or the chaos tests' fault proxy).
    advertise_port: int | None = None
    #: Largest payload per frame in bytes; longer spans are split. Receivers drop bigger frames.
    max_frame_bytes: int = 64 << 20
    #: Seconds ``attach`` may take to connect and say hello.
    connect_timeout_s: float = 10.0
    #: SO_SNDBUF of data connections in bytes (0 keeps the kernel default).
    socket_buffer_bytes: int = 4 << 20


class TcpTransport(Transport):
    """``Transport`` over asyncio TCP; one instance per engine worker process."""

    name = "tcp"

    def __init__(self, config: TcpConfig | None = None) -> None:
        self.config = config or TcpConfig()
        self._regions = RegionTable()
        self._views: dict[int, memoryview] = {}
        self._listener = Listener(self._views, self._regions, self.config.max_frame_bytes)
        self._outbound: dict[str, Outbound] = {}
        self._io = LoopThread("pd-tcp-io")

    # -- called from engine threads -------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        check_reachable(self.name, self.memory_types, regions)  # sockets read and write host memory only
        self._require_open()
        self._regions.add(regions)
        views = {r.region_id: host_view(r.address, r.length) for r in regions}
        self._io.run(self._add_views(views), self.config.connect_timeout_s)
        if not self._listener.listening:
            self._io.run(
                self._listener.listen(self.config.host, self.config.port), self.config.connect_timeout_s
            )
        host = advertised_host(self.config.host, self.config.advertise_host)
        return msgspec.msgpack.encode(
            TcpDescriptor(
                PROTOCOL_VERSION,
                host,
                self.config.advertise_port or self.port,
                self._listener.token,
                self._regions.infos(),
            )
        )

    def attach(self, peer_id: str, descriptor: bytes) -> Future[None]:
        self._require_open()
        try:
            desc = msgspec.msgpack.decode(descriptor, type=TcpDescriptor)
        except msgspec.DecodeError as exc:
            return failed(ValueError(f"not a tcp transport descriptor: {exc}"))
        if desc.version != PROTOCOL_VERSION:
            return failed(
                ValueError(f"peer speaks tcp transport v{desc.version}, we speak v{PROTOCOL_VERSION}")
            )
        return self._io.submit(self._connect(peer_id, desc))

    def write(self, peer_id: str, copies: Sequence[BlockCopy]) -> Future[int]:
        future: Future[int] = running()
        if not (self._io.running and self._io.call_soon(self._post, peer_id, copies, future)):
            fail(future, RuntimeError("tcp transport is closed"))  # possibly while we were scheduling
        return future

    def grant(self, key: str, descriptor: bytes) -> bytes:
        """``descriptor`` with a token of its own for session ``key``: the data connections that present it are
        the ones ``revoke(key)`` closes."""
        self._require_open()
        desc = msgspec.msgpack.decode(descriptor, type=TcpDescriptor)
        token = self._io.run(self._on_io(self._listener.grant, key), self.config.connect_timeout_s)
        return msgspec.msgpack.encode(msgspec.structs.replace(desc, token=token))

    def revoke(self, key: str) -> bool:
        """Refuse ``key``'s token from now on and close its data connections unread (on the I/O thread, which
        is the one that reads them into memory: once this returns True, nothing of theirs lands). False when
        the I/O thread did not confirm within ``connect_timeout_s`` (busy or stuck): the caller then keeps the
        memory as for a transport that cannot fence, instead of trusting a close that may not have happened."""
        if self._io.running:
            try:
                self._io.run(self._on_io(self._listener.revoke, key), self.config.connect_timeout_s)
            except TimeoutError:
                return False
            except CancelledError:  # the loop stopped (the transport closed): nothing reads any more
                return True
        return True  # a closed transport's listener reads nothing either

    def detach(self, peer_id: str) -> None:
        if self._io.on_loop_thread():  # from a write future's done-callback, which runs on the I/O thread
            self._io.loop.create_task(self._detach(peer_id))
        elif self._io.running:
            self._io.run(self._detach(peer_id), self.config.connect_timeout_s)

    def close(self) -> None:
        if self._io.on_loop_thread():
            raise RuntimeError("close() must not be called from the transport's own I/O thread")
        if self._io.running:
            with contextlib.suppress(Exception):
                self._io.run(self._shutdown(), self.config.connect_timeout_s)
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
        return self._listener.port

    @property
    def inbound_connections(self) -> int:
        """Data connections peers have open into us now (tests use it to know a peer's bytes were all read)."""
        return self._listener.connections

    @property
    def dropped_connections(self) -> int:
        """Data connections the listener dropped for protocol violations (tests and metrics read it)."""
        return self._listener.dropped_connections

    # -- on the I/O thread -----------------------------------------------------------------------------------
    async def _add_views(self, views: dict[int, memoryview]) -> None:
        self._views.update(views)

    @staticmethod
    async def _on_io(fn: Callable[[str], T], key: str) -> T:
        return fn(key)

    async def _connect(self, peer_id: str, desc: TcpDescriptor) -> None:
        await self._detach(peer_id)
        cfg = self.config
        self._outbound[peer_id] = await connect(
            peer_id,
            desc,
            self._views.__getitem__,
            cfg.max_frame_bytes,
            cfg.connect_timeout_s,
            cfg.socket_buffer_bytes,
        )

    def _post(self, peer_id: str, copies: Sequence[BlockCopy], future: Future[int]) -> None:
        conn = self._outbound.get(peer_id)
        if conn is None:
            fail(future, ConnectionError(f"tcp transport: peer {peer_id!r} is not attached"))
            return
        try:
            spans = plan(copies, self._regions.index(), conn.remote)
        except ValueError as exc:
            fail(future, exc)
            return
        if spans.nbytes == 0:
            future.set_result(0)
            return
        conn.post(Job(spans.table, spans.nbytes, future))

    async def _detach(self, peer_id: str) -> None:
        conn = self._outbound.pop(peer_id, None)
        if conn is not None:
            conn.fail(ConnectionError(f"tcp transport: peer {peer_id} detached"), quiet=True)

    async def _shutdown(self) -> None:
        for peer_id in list(self._outbound):
            await self._detach(peer_id)
        self._listener.close()
        self._views.clear()

    def _require_open(self) -> None:
        if not self._io.running:
            raise RuntimeError("tcp transport is closed")
